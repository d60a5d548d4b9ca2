"""A broker node's bridge: the partitions it leases, pulled from JetStream into the local backlog,
and their results published back to each producer's results subject.

One asyncio program (the bridge process's, `node.py`; the broker's other loops stay synchronous):

- **coordinate**, every `lease_seconds / 3`: beat (with the pending tokens of the partitions held),
  renew the leases, place the partitions over the live nodes (`placement.assign`, bounded loads
  over what the owners report), take the ones placed here whose lease is free or expired, and
  drain the ones placed elsewhere (stop pulling; release once nothing of it is staged here);
- **pull**: one task per partition held fetches from its durable consumer `part-<p>` while the
  staging window (`staging_items`) has room;
- **submit** each prompt to the local broker through a local `Producer` (the ingest ring and the
  append path every producer on this host uses), its constraint's payload made local first (`payloads.py`);
- **deliver**: each local result is published to `<prefix>.results.<producer>` with message id
  `<producer>:<seq>`, and once JetStream has stored it (its PubAck) the prompt is acked.

**When a prompt is acked**: only after its result is stored in the results stream. A node that
dies for good loses nothing: its unacked prompts are redelivered (after `ack_wait_seconds`) to the
node that leases the partition next. The cost is that such an item may run twice; its second
result carries the same message id and the results stream drops it within its duplicate window
(the client also drops a repeated seq). The node's backlog is therefore a staging window, bounded
by `staging_items` here and `max_ack_pending` per partition in JetStream; a staged prompt is kept
alive with `in_progress` every `ack_wait_seconds / 3`.

**The fence**: a result is published only while its partition's lease is fresh
(`Leases.fresh`). A node paused past its lease wakes, fails to renew, and forgets what it staged
of the partitions it lost (`fenced`): their new owner runs them and answers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque

from ..errors import Full
from ..request.extras import words_of as extras_words
from . import placement, subjects
from .payloads import NodePayloads
from .publisher import AckedPublisher, PublishRefused
from .staging import Answer, Pulled, Staged, columns, decode_message, ranges

log = logging.getLogger("shmbroker.bridge")

PULL_SECONDS = 1.0  # a pull request's wait when its partition has nothing
PULL_BATCH = 256  # prompts one fetch asks for at most
ROOM_WAIT_SECONDS = 0.02  # a puller's sleep while the staging window is full
DELIVER_BATCH = 256  # local results taken per round at most
SUBMIT_BATCH = 1024  # pulled prompts submitted in one submit_many at most
DRAIN_SECONDS = 60.0  # a partition placed elsewhere is released after this at the latest (the rest nak'ed)
TOKENS_GUESS = 1.0  # a partition's mean tokens per item before any was pulled
COORDINATE_RETRY_SECONDS = 0.2  # a coordination that failed (a server going away) is tried again after this


class Bridge:
    """The node's side of the cluster (module docstring); `counts` feed the BRIDGE statistics."""

    def __init__(self, js, nc, leases, names, streams, node, local, *, clock=time.monotonic):
        self.js = js
        self.leases = leases
        self.names = names  # subjects.ClusterNames
        self.streams = streams  # subjects.StreamSettings
        self.node = node  # options.NodeSettings
        self.local = local  # the local broker's Producer
        self.clock = clock
        self.payloads = NodePayloads(js, names, local, clock=clock)  # constraints' payloads, made local
        self.pub = AckedPublisher(nc)
        self.staged: dict[int, Staged] = {}  # local item id -> staged prompt
        self.waiting: deque = deque()  # (partition, msg) pulled, not yet submitted (the local ring was full)
        self.pullers: dict[int, asyncio.Task] = {}
        self.draining: dict[int, float] = {}  # partition -> when its draining began
        self.unsent: deque = deque()  # Answers to publish (again)
        self.inflight: deque = deque()  # (Answer, its PubAck future)
        self.mean_tokens: dict[int, float] = {}  # partition -> mean tokens per item pulled
        self.stream_items: dict[int, int] = {}  # partition -> messages in the prompts stream (last looked)
        self.counts = dict.fromkeys(("pulled", "submitted", "published", "acked", "refused", "invalid", "fenced",
                                     "unknown_results", "publish_errors", "pull_errors", "in_progress", "naked"), 0)
        self._next_coordinate = 0.0
        self._next_touch = 0.0

    # -- ownership -----------------------------------------------------------------------

    def loads(self) -> dict[int, float]:
        """The pending tokens of each partition held: its messages in the stream (they include what
        is staged here) times its mean item length."""
        return {p: float(int(self.stream_items.get(p, 0) * self.mean_tokens.get(p, TOKENS_GUESS)))
                for p in self.leases.held}

    async def _look(self) -> None:
        """Messages in the prompts stream per partition (one request for all)."""
        try:
            info = await self.js.stream_info(self.names.prompts_stream, subjects_filter=self.names.prompts_subjects)
        except Exception as exc:  # a server going away: keep the last figures
            log.debug("stream info: %s", exc)
            return
        counts = {}
        for subject, n in (info.state.subjects or {}).items():
            try:
                counts[self.names.partition_of_subject(subject)] = int(n)
            except ValueError:
                continue
        self.stream_items = counts

    async def coordinate(self) -> None:
        """Beat, renew, place, take and drain (module docstring)."""
        from .streams import ensure_partition_consumer

        await self._look()
        await self.leases.beat(self.loads())
        for p in await self.leases.renew():
            log.warning("partition %d: lease lost; forgetting what is staged of it here", p)
            self._fence(p)
        nodes = self.leases.live_nodes()
        reported = self.leases.loads()
        weights = [1.0 + reported.get(p, 0.0) for p in range(self.names.num_partitions)]
        owners = self.leases.owners()
        current = [owners.get(p) for p in range(self.names.num_partitions)]
        placed = placement.assign(weights, nodes, epsilon=self.node.epsilon, current=current)
        taken, drained = [], []
        for p, owner in enumerate(placed):
            if owner == self.node.node:
                if p not in self.leases.held and await self.leases.take(p):
                    taken.append(p)
                    await ensure_partition_consumer(self.js, self.names, self.streams, p)
                    self.draining.pop(p, None)
                puller = self.pullers.get(p)
                if p in self.leases.held and p not in self.draining and (puller is None or puller.done()):
                    self.pullers[p] = asyncio.ensure_future(self._pull(p))
            elif p in self.leases.held and p not in self.draining:
                drained.append(p)
                self.draining[p] = self.clock()
                self._stop_puller(p)
        if taken or drained:
            log.info("node %s (of %d live): took partitions %s, draining %s; holds %d", self.node.node, len(nodes),
                     ranges(taken), ranges(drained), len(self.leases.held))
        now = self.clock()
        for p, since in list(self.draining.items()):
            left = [i for i, st in self.staged.items() if st.partition == p]
            if left and now - since < DRAIN_SECONDS:
                continue
            for i in left:
                await self.staged.pop(i).msg.nak()
            self.counts["naked"] += len(left)
            self._forget_waiting(p)
            await self.leases.release(p)
            del self.draining[p]

    def _stop_puller(self, p: int) -> None:
        task = self.pullers.pop(p, None)
        if task is not None:
            task.cancel()

    def _forget_waiting(self, p: int) -> int:
        kept = deque((q, m) for q, m in self.waiting if q != p)
        n = len(self.waiting) - len(kept)
        self.waiting = kept
        return n

    def _fence(self, p: int) -> None:
        """Partition p's lease is gone: stop pulling it, forget what is staged of it (no ack, no
        result from here; the local results that still come are dropped as unknown)."""
        self._stop_puller(p)
        self.draining.pop(p, None)
        gone = [i for i, st in self.staged.items() if st.partition == p]
        for i in gone:
            del self.staged[i]
        self.counts["fenced"] += len(gone) + self._forget_waiting(p)

    # -- prompts in ------------------------------------------------------------------------

    def room(self) -> int:
        return self.node.staging_items - len(self.staged) - len(self.waiting)

    async def _pull(self, p: int) -> None:
        """Fetch partition p's prompts into `waiting` while the staging window has room. Any error
        (a server going away, a consumer's leader moving) is waited out: only cancelling ends it."""
        import nats.errors

        sub = None
        try:
            while True:
                room = self.room()
                if room <= 0:
                    await asyncio.sleep(ROOM_WAIT_SECONDS)
                    continue
                try:
                    if sub is None:
                        sub = await self.js.pull_subscribe_bind(self.names.partition_consumer(p), self.names.prompts_stream)
                    msgs = await sub.fetch(min(room, PULL_BATCH), timeout=PULL_SECONDS)
                except nats.errors.TimeoutError:
                    continue
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - waited out, counted
                    self.counts["pull_errors"] += 1
                    log.debug("partition %d: pull: %s: %s", p, type(exc).__name__, exc)
                    await asyncio.sleep(PULL_SECONDS)
                    continue
                if p not in self.leases.held or p in self.draining:
                    for m in msgs:
                        await m.nak()
                    return
                self.waiting.extend((p, m) for m in msgs)
                self.counts["pulled"] += len(msgs)
        finally:
            if sub is not None:
                try:
                    await sub.unsubscribe()
                except Exception:  # the connection is gone, the subscription with it
                    pass

    async def submit(self) -> int:
        """Submit what was pulled to the local broker, in runs of one model and one kind of
        prefix (one `submit_many` each); stops at a full local ring."""
        n = 0
        while self.waiting:
            run, key = [], None
            for p, msg in itertools.islice(self.waiting, SUBMIT_BATCH):
                try:
                    d = decode_message(msg)
                except ValueError as exc:
                    if run:
                        break  # the run ends here; the bad one is refused next
                    self.waiting.popleft()
                    await self._refuse(msg, str(exc))
                    key = "refused"
                    break
                if key is not None and key != (d.model, d.prompt.prefix_len is None, d.options_header):
                    break
                key, options = (d.model, d.prompt.prefix_len is None, d.options_header), d.options
                run.append(Pulled(p, msg, d.prompt, d.producer))
            if not run:
                continue
            took = self._submit_run(run, key[0], options) if await self.payloads.prepare(options) else 0
            n += took
            if took < len(run):
                break  # the local ring is full (or a payload is not local yet): the rest waits for the next round
        self.counts["submitted"] += n
        return n

    def _submit_run(self, run: list[Pulled], model, options=None) -> int:
        """One submit_many of a run (one model, one kind of prefix, one set of request options); the
        number the local ring took (each staged, or answered `invalid` when the local broker's checks
        refuse it)."""
        cols = columns([r.prompt for r in run])
        try:
            self.payloads.check(options)  # PayloadRefused (a ValueError): over this node's max_payload_bytes
            ids = self.local.submit_many(cols.flat, cols.offsets, max_new_tokens=cols.max_new, prefix_len=cols.prefixes,
                                         model=model, block=False, options=options)
        except Full as exc:
            ids = exc.ids
        except (TypeError, ValueError) as exc:  # the local broker's own checks (a model it has no slot for)
            for r in run:
                self.waiting.popleft()
                self.counts["invalid"] += 1
                self.unsent.append(Answer(r.producer, r.prompt.seq, "invalid", (), str(exc), msg=r.msg))
            return len(run)
        now = self.clock()
        for local_id, r in zip(ids, run):
            self.waiting.popleft()
            size = r.prompt.tokens.size
            mean = self.mean_tokens.get(r.partition, float(size))
            self.mean_tokens[r.partition] = 0.99 * mean + 0.01 * size
            self.staged[int(local_id)] = Staged(r.msg, r.producer, r.prompt.seq, r.partition, int(size), now)
        return len(ids)

    async def _refuse(self, msg, why: str) -> None:
        """A prompt message that does not decode: answered `invalid` when its message id names its
        producer and seq, then terminated (delivered again it would fail again)."""
        self.counts["refused"] += 1
        log.warning("a prompt message refused: %s", why)
        try:
            producer, seq = subjects.parse_msg_id((msg.headers or {}).get(subjects.HEADER_MSG_ID, ""))
        except ValueError:
            await msg.term()
            return
        self.unsent.append(Answer(producer, seq, "invalid", (), f"malformed prompt message: {why}", msg=msg))

    # -- results out -----------------------------------------------------------------------

    async def deliver(self) -> int:
        """Publish the local results (and the answers to refused prompts), then ack each prompt
        once its result is stored; the number acked."""
        got = self.local.pop_results(DELIVER_BATCH)
        for r in got:
            st = self.staged.get(int(r.item_id))
            if st is None:
                self.counts["unknown_results"] += 1
            else:
                extras = None if r.extras is None else extras_words(r.extras)  # a vector's, logprobs and all
                self.unsent.append(Answer(st.producer, st.seq, r.status, r.tokens, r.error, local_id=int(r.item_id),
                                          extras=extras))
        if got:
            self.local.ack()  # kept here (unsent, inflight) until stored; a crash: the prompts come again
        held_back = []  # results of partitions whose lease is not fresh: published once it is renewed
        while self.unsent and self.pub.has_slot:
            a = self.unsent[0]
            if a.local_id is not None:
                st = self.staged.get(a.local_id)
                if st is None:  # fenced meanwhile
                    self.unsent.popleft()
                    continue
                if not self.leases.fresh(st.partition):
                    held_back.append(self.unsent.popleft())
                    continue
            payload = subjects.encode_result(a.seq, a.status, a.tokens, a.error)
            try:
                headers = {subjects.HEADER_MSG_ID: subjects.msg_id(a.producer, a.seq)}
                if a.extras is not None:
                    headers[subjects.HEADER_EXTRAS] = subjects.words_header(a.extras)
                future = await self.pub.publish(self.names.result_subject(a.producer), payload, headers)
            except Exception as exc:  # reconnecting: try again next round
                log.debug("result publish: %s", exc)
                break
            self.inflight.append((self.unsent.popleft(), future))
        self.unsent.extend(held_back)
        return await self._settle()

    async def _settle(self) -> int:
        """Ack the prompts whose results JetStream stored; a refused publish goes again."""
        acked = 0
        while self.inflight and self.inflight[0][1].done():
            a, future = self.inflight.popleft()
            error = None if future.cancelled() else future.exception()
            if future.cancelled() or error is not None:
                self.counts["publish_errors"] += 1
                if not isinstance(error, PublishRefused) or error.retryable:
                    self.unsent.append(a)
                else:
                    log.error("a result was refused for good: %s", error)
                continue
            self.counts["published"] += 1
            st = None if a.local_id is None else self.staged.pop(a.local_id, None)
            msg = a.msg if st is None else st.msg
            if msg is not None:
                await msg.ack()
                acked += 1
        self.counts["acked"] += acked
        return acked

    async def touch(self) -> None:
        """Keep staged prompts alive in JetStream while their results take long."""
        now = self.clock()
        if now < self._next_touch:
            return
        every = self.streams.ack_wait_seconds / 3
        self._next_touch = now + every / 2
        old = [st for st in self.staged.values() if now - st.touched_at > every]
        for st in old:
            await st.msg.in_progress()
            st.touched_at = now
        for _p, m in self.waiting:
            await m.in_progress()
        self.counts["in_progress"] += len(old) + len(self.waiting)

    # -- the loop --------------------------------------------------------------------------

    async def round(self) -> int:
        now = self.clock()
        if now >= self._next_coordinate:
            self._next_coordinate = now + self.node.lease_seconds / 3
            try:
                await self.coordinate()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - a server going away: the next round tries again
                log.warning("coordinate: %s: %s", type(exc).__name__, exc)
                self._next_coordinate = now + COORDINATE_RETRY_SECONDS
        moved = await self.submit()
        moved += await self.deliver()
        await self.touch()
        return moved

    async def stop(self, deadline_seconds: float) -> None:
        """A graceful stop: pull no more, deliver what comes until the deadline, nak the rest,
        release every lease and leave (peers take the partitions at once)."""
        for p in list(self.pullers):
            self._stop_puller(p)
        end = self.clock() + deadline_seconds
        while (self.staged or self.inflight or self.unsent) and self.clock() < end:
            if not await self.deliver():
                await asyncio.sleep(0.01)
        left = [st.msg for st in self.staged.values()] + [m for _p, m in self.waiting]
        for msg in left:
            await msg.nak()
        self.counts["naked"] += len(left)
        self.staged.clear()
        self.waiting.clear()
        await self.leases.leave()
        await self.pub.close()

    @property
    def num_draining(self) -> int:
        return len(self.draining)
