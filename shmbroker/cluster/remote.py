"""The remote producer: `Producer`'s API over NATS JetStream, from any host.

    from shmbroker.cluster.remote import RemoteProducer
    with RemoteProducer("my-app", servers=["nats://10.0.0.5:4222"]) as p:
        seq = p.submit(tokens, max_new_tokens=64)
        seqs = p.submit_many(flat, offsets, max_new_tokens=64)
        for result in p.results(timeout_seconds=1.0):
            ...

An item is checked as `Producer` checks it (the same TypeError/ValueError, before anything is
published), then published to the prompts stream on the subject of its partition with message id
`<producer>:<seq>`, and `submit` returns once JetStream acknowledged it stored (a publish retried
after a timeout is dropped by the server as a duplicate). Item ids are the producer's sequence
numbers, reserved in blocks in the leases bucket (`seqs`), never reused by a later producer of
the same name. A full prompts stream is back-pressure: the producer retries with a short back-off
until its timeout, then raises `Full` (`submitted`, `ids`: the items that went in). Results come
from the durable consumer `res-<name>`, each once per RemoteProducer, acknowledged to JetStream
after they are handed out. A constraint's payload (a JSON schema, ...) is published once to the
cluster's payloads bucket before the first item that names it (`payloads.py`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

import numpy as np

from ..client.checks import as_offsets, batch_fields, check_prefix_len, check_u32, option_words
from ..client.producer import CONNECT_TIMEOUT_SECONDS, SUBMIT_TIMEOUT_SECONDS
from ..client.reader import RESULT_BATCH, Result, ResultBatch
from ..client.seen import SeenSet
from ..errors import BrokerError, Full
from ..request.extras import decode_extras
from ..ring.items import as_tokens, model_id
from .nats_loop import NatsLoop, require_nats
from .options import DEFAULT_SERVERS, NatsOptions
from .partition import partition_of, partitions_of
from .payloads import PayloadPublisher, options_and_payload
from .permissions import inbox_prefix
from .publisher import PUBACK_GRACE_SECONDS, AckedPublisher, PublishRefused, publish_all
from .seqs import SeqBlocks
from .subjects import (
    HEADER_EXTRAS,
    HEADER_MSG_ID,
    HEADER_OPTIONS,
    PROMPT_HEADER,
    ClusterNames,
    StreamSettings,
    check_producer_name,
    decode_result,
    encode_prompt,
    header_words,
    parse_msg_id,
    prompt_headers,
    words_header,
)

HEADER_ROOM_BYTES = 1024  # a message's headers count against the servers' max_payload
MAX_MODEL_NAME_BYTES = 256
DEFAULT_MAX_PENDING = 1024  # publishes in flight (awaiting their PubAck) at most
MIN_FETCH_SECONDS = 0.05  # a fetch of results needs a round trip to the server
CALL_MARGIN_SECONDS = 5.0

PartitionFn = Callable[[np.ndarray, "int | None", int, int], int]


class _Prompts:
    """The messages of one submit_many, each built when the publisher first asks for it (on the
    client's loop: building the next overlaps the servers' work on the last), then kept for a retry."""

    def __init__(self, producer, flat, offs, parts, max_new, prefixes, shared, first, model, options=None):
        self.p, self.flat, self.offs, self.parts = producer, flat, offs, parts
        self.max_new, self.prefixes, self.shared, self.first, self.model = max_new, prefixes, shared, first, model
        self.options = options  # the options header every message carries (None: none)
        self.built: list = [None] * len(parts)

    def __len__(self) -> int:
        return len(self.built)

    def __getitem__(self, i: int) -> tuple:
        msg = self.built[i]
        if msg is None:
            k = 0 if self.shared else i
            prefix = None if self.prefixes is None else int(self.prefixes[k])
            seq = self.first + i
            tokens = self.flat[int(self.offs[i]) : int(self.offs[i + 1])]
            msg = self.built[i] = (self.p.names.prompt_subject(self.parts[i]),
                                   encode_prompt(tokens, seq, int(self.max_new[k]), prefix),
                                   prompt_headers(self.p.name, seq, self.model, self.options))
        return msg


class RemoteProducer:
    """A producer that publishes to a cluster's prompts stream and reads its results subject.

    `partition_fn(tokens, prefix_len, model_id, num_partitions) -> partition` places an item
    (default: `shmbroker.cluster.partition.partition_of`). Use one RemoteProducer per thread.
    """

    def __init__(
        self,
        name: str,
        *,
        servers=DEFAULT_SERVERS,
        options: NatsOptions | None = None,
        names: ClusterNames | None = None,
        settings: StreamSettings | None = None,
        partition_fn: PartitionFn | None = None,
        timeout_seconds: float = SUBMIT_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
        max_pending: int = DEFAULT_MAX_PENDING,
        create_streams: bool = True,
    ):
        self.name = check_producer_name(name)
        require_nats()  # the missing extra is named before anything else
        self.names = names or ClusterNames()
        self.settings = settings or StreamSettings()
        self._partition_fn = partition_of if partition_fn is None else partition_fn
        self.timeout_seconds = float(timeout_seconds)
        self._max_pending = int(max_pending)
        self._models: dict[str | None, int] = {None: 0}
        self._pending: deque[tuple[object, Result]] = deque()  # fetched, not handed out
        self._handed: list = []  # messages handed out (or dropped as duplicates), not acked yet
        self._auto_ack = True
        self._seen = SeenSet()
        self.num_duplicate_results = 0
        self.num_malformed_results = 0
        self.last_malformed: str | None = None
        opts = options or NatsOptions(servers=(servers,) if isinstance(servers, str) else tuple(servers), name=f"shmb-producer-{self.name}",
                                      inbox_prefix=inbox_prefix(self.name),
                                      connect_timeout_seconds=connect_timeout_seconds)
        self._loop = NatsLoop(opts)
        try:
            self._loop.call(self._setup, create_streams, timeout_seconds=connect_timeout_seconds + CALL_MARGIN_SECONDS)
        except BaseException:
            self._loop.close()
            raise

    async def _setup(self, create_streams: bool) -> None:
        from . import streams

        js, nc = self._loop.js, self._loop.nc
        if create_streams:
            await streams.ensure_streams(js, self.names, self.settings, update=False)
        await streams.ensure_results_consumer(js, self.names, self.settings, self.name)
        self._seqs = SeqBlocks(await js.key_value(self.names.leases_bucket), self.names.seq_key(self.name))
        self._sub = await js.pull_subscribe_bind(durable=self.names.results_consumer(self.name),
                                                 stream=self.names.results_stream)
        self._pub = AckedPublisher(nc, self._max_pending)
        self.max_tokens = (nc.max_payload - PROMPT_HEADER.size - HEADER_ROOM_BYTES) // 4
        self._payloads = PayloadPublisher(self.names, nc.max_payload - HEADER_ROOM_BYTES)

    # -- submit ----------------------------------------------------------------------

    def submit(self, tokens, *, max_new_tokens: int, prefix_len: int | None = None, model: str | None = None,
               block: bool = True, timeout_seconds: float | None = None, options=None) -> int:
        """Submit one prompt; returns its item id (its sequence number) once JetStream stored it.
        `options`: its request options (`Producer.submit`'s), carried in the message's headers."""
        self._check_open()
        max_new = check_u32(max_new_tokens, "max_new_tokens")
        header, payload = options_and_payload(options, max_new)
        arr = as_tokens(tokens)
        limit = self._token_limit(header)
        if arr.size > limit:
            raise ValueError(f"item of {arr.size} tokens exceeds the servers' message limit of {limit} tokens")
        prefix = None if prefix_len is None else check_prefix_len(prefix_len, arr)
        mid = self._model_id(model)
        subject = self.names.prompt_subject(self._partition_fn(arr, prefix, mid, self.names.num_partitions))
        if payload is not None:  # stored before the first item that names it
            self.put_payload(payload, timeout_seconds)
        seq = self._take_seqs(1, timeout_seconds)
        msg = (subject, encode_prompt(arr, seq, max_new, prefix), prompt_headers(self.name, seq, model, header))
        self._publish([msg], np.array([seq], np.uint64), block, timeout_seconds)
        return seq

    def submit_many(self, flat_tokens, offsets, *, max_new_tokens, prefix_len=None, model: str | None = None,
                    block: bool = True, timeout_seconds: float | None = None, options=None) -> np.ndarray:
        """Submit many prompts: item i is flat_tokens[offsets[i]:offsets[i+1]].

        `max_new_tokens` and `prefix_len` are one value for all or one per item. Every item is
        checked before any is published. Returns the item ids (uint64). Past the deadline a
        full stream raises Full whose `submitted` and `ids` say which items went in (the first
        ones, unless the stream took a later item in flight while it refused an earlier one).
        `options`: every item's request options, carried in each message's headers.
        """
        self._check_open()
        flat = as_tokens(flat_tokens, "flat_tokens")
        header, payload = options_and_payload(options, max_new_tokens)
        offs = as_offsets(offsets, flat.size, self._token_limit(header))
        count = offs.size - 1
        mid = self._model_id(model)
        max_new, prefixes, shared = batch_fields(max_new_tokens, prefix_len, offs)
        if payload is not None:  # stored before the first item that names it
            self.put_payload(payload, timeout_seconds)
        first = self._take_seqs(count, timeout_seconds)
        ids = np.arange(first, first + count, dtype=np.uint64)
        num_partitions = self.names.num_partitions
        if self._partition_fn is partition_of:  # the default: one kernel call for all items
            per_item = None if prefixes is None else np.broadcast_to(prefixes, (count,))
            parts = partitions_of(flat, offs, per_item, np.full(count, mid, np.int64), num_partitions).tolist()
        else:
            parts = [self._partition_fn(flat[a:b], None if prefixes is None else int(prefixes[0 if shared else i]), mid,
                                        num_partitions) for i, (a, b) in enumerate(zip(offs[:-1].tolist(), offs[1:].tolist()))]
        msgs = _Prompts(self, flat, offs, parts, max_new, prefixes, shared, first, model, header)
        self._publish(msgs, ids, block, timeout_seconds)
        return ids

    def put_payload(self, payload: bytes, timeout_seconds: float | None = None) -> bytes:
        """Publish a request payload (a constraint's schema, regex, grammar or choices) to the cluster's
        payloads bucket, once however many items name it; its digest. `submit` does this itself for a
        constraint it is given with its payload. PayloadRefused: one message cannot carry it."""
        self._check_open()
        digest = self._payloads.check(payload)
        if digest not in self._payloads.published:
            wait = self.timeout_seconds if timeout_seconds is None else float(timeout_seconds)
            self._loop.call(self._payloads.publish, self._loop.js, payload, digest, wait,
                            timeout_seconds=wait + CALL_MARGIN_SECONDS)
        return digest

    def _token_limit(self, header: str | None) -> int:
        """The tokens an item may have: the servers' limit, less what its options header takes."""
        return self.max_tokens - (0 if header is None else (len(header) + len(HEADER_OPTIONS) + 7) // 4)

    def _take_seqs(self, num_seqs: int, timeout_seconds: float | None) -> int:
        first = self._seqs.take_reserved(num_seqs)
        if first is None:  # a new block from the bucket, within the submit's timeout
            wait = self.timeout_seconds if timeout_seconds is None else float(timeout_seconds)
            first = self._loop.call(self._seqs.take, num_seqs, time.monotonic() + wait,
                                    timeout_seconds=wait + CALL_MARGIN_SECONDS)
        return first

    def _model_id(self, model) -> int:
        mid = self._models.get(model)
        if mid is None:
            mid = model_id(model)  # TypeError for what is not a model name, as Producer
            if len(model.encode()) > MAX_MODEL_NAME_BYTES or not model.isprintable():
                raise ValueError(f"a cluster model name is a message header: printable, at most {MAX_MODEL_NAME_BYTES} bytes; got {model!r}")
            self._models[model] = mid
        return mid

    def _publish(self, msgs: list, ids: np.ndarray, block: bool, timeout_seconds: float | None) -> None:
        timeout = self.timeout_seconds if timeout_seconds is None else float(timeout_seconds)
        deadline = time.monotonic() + (timeout if block else 0.0)
        stored = np.zeros(len(msgs), bool)
        try:
            error = self._loop.call(publish_all, self._pub, msgs, stored, deadline,
                                    timeout_seconds=max(0.0, deadline - time.monotonic()) + PUBACK_GRACE_SECONDS + CALL_MARGIN_SECONDS)
        except TimeoutError as exc:
            error = exc
        if error is None:
            return
        num = int(stored.sum())
        if isinstance(error, PublishRefused) and not error.retryable:
            raise BrokerError(f"the servers refused an item ({error}); {num} of {len(msgs)} went in")
        why = (f"the prompts stream {self.names.prompts_stream} stayed full" if isinstance(error, PublishRefused) and error.full
               else f"items were not stored ({type(error).__name__}: {error})")
        raise Full(f"{why} for {timeout:g} s; {num} of {len(msgs)} items went in", submitted=num, ids=ids[stored])

    # -- results ---------------------------------------------------------------------

    def results(self, timeout_seconds: float = 0.0, *, auto_ack: bool = True) -> Iterator[Result]:
        """Yield results as they arrive; stops once none has come for `timeout_seconds`.

        Each item's result is yielded once by this RemoteProducer (duplicates are dropped by item
        id). With `auto_ack` the results handed out are acknowledged to JetStream when the caller
        asks for more than were fetched (or closes); with `auto_ack=False` only `ack()` does. What
        was not acknowledged comes again to the next RemoteProducer of this name (at once after a
        close, after the consumer's ack_wait after a crash)."""
        self._check_open()
        while True:
            while self._pending:
                yield self._hand_out(auto_ack)
            if auto_ack:
                self.ack()
            if self._fetch(timeout_seconds) == 0:
                return

    def take_results(self, timeout_seconds: float = 0.0, *, auto_ack: bool = True) -> ResultBatch:
        """The results that arrived (up to RESULT_BATCH, waiting up to `timeout_seconds` for the
        first), in columns and without duplicates. With `auto_ack` the previous call's results are
        acknowledged when this one is made; otherwise call `ack()`."""
        self._check_open()
        if auto_ack:
            self.ack()
        self._auto_ack = auto_ack
        if not self._pending:
            self._fetch(timeout_seconds)
        return ResultBatch.of([self._hand_out(auto_ack) for _ in range(min(len(self._pending), RESULT_BATCH))])

    def ack(self) -> None:
        """Acknowledge to JetStream every result handed out so far (and the duplicates dropped meanwhile)."""
        if self._loop.closed or not self._handed:
            return
        msgs, self._handed = self._handed, []
        try:
            self._loop.call(self._ack_all, msgs, "ack", timeout_seconds=self._loop.options.connect_timeout_seconds)
        except BaseException:
            self._handed = msgs + self._handed  # acknowledged at the next ack(), or redelivered
            raise

    def _hand_out(self, auto_ack: bool) -> Result:
        self._auto_ack = auto_ack
        msg, result = self._pending.popleft()
        self._handed.append(msg)
        return result

    def _fetch(self, timeout_seconds: float) -> int:
        """Fetch results (up to RESULT_BATCH) into the pending queue; returns the messages fetched."""
        wait = max(MIN_FETCH_SECONDS, float(timeout_seconds))
        msgs = self._loop.call(self._fetch_msgs, wait, timeout_seconds=wait + CALL_MARGIN_SECONDS)
        fresh = []
        for msg in msgs:
            try:
                r = decode_result(msg.data)
                headers = msg.headers or {}
                if HEADER_MSG_ID in headers and parse_msg_id(headers[HEADER_MSG_ID]) != (self.name, r.seq):
                    raise ValueError(f"message id {headers[HEADER_MSG_ID]!r} is not {self.name}:{r.seq}")
                extras = None
                if HEADER_EXTRAS in headers:
                    extras = decode_extras(header_words(headers[HEADER_EXTRAS], "extras"), r.tokens.size)
            except ValueError as exc:  # torn or foreign: counted and dropped, never redelivered
                self.num_malformed_results += 1
                self.last_malformed = str(exc)
                self._loop.call(self._ack_all, [msg], "term", timeout_seconds=self._loop.options.connect_timeout_seconds)
                continue
            fresh.append((msg, r, extras))
        if fresh:
            keep = self._seen.add(np.array([r.seq for _, r, _ in fresh], np.int64))
            for (msg, r, extras), new in zip(fresh, keep.tolist()):
                if new:
                    self._pending.append((msg, Result(r.seq, r.status, r.tokens, r.error, extras)))
                else:
                    self.num_duplicate_results += 1
                    self._handed.append(msg)
        return len(msgs)

    async def _fetch_msgs(self, wait_seconds: float) -> list:
        try:
            return await self._sub.fetch(RESULT_BATCH, timeout=wait_seconds)
        except TimeoutError:
            return []
        except self._loop.nats.errors.Error:
            if self._loop.nc.is_closed:
                raise
            return []  # reconnecting: nothing this time

    async def _ack_all(self, msgs: list, how: str) -> None:
        for msg in msgs:
            await getattr(msg, how)()
        await self._loop.nc.flush(self._loop.options.connect_timeout_seconds)

    # -- lifetime --------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._loop.closed:
            raise BrokerError("producer is closed")

    def close(self) -> None:
        """Close (idempotent). With auto_ack the results handed out are acknowledged; what was
        fetched but not acknowledged is handed back to JetStream (nak), for the next reader."""
        if self._loop.closed:
            return
        try:
            if self._auto_ack:
                self.ack()
            back = self._handed + [msg for msg, _ in self._pending]
            self._handed, self._pending = [], deque()
            if back:
                self._loop.call(self._ack_all, back, "nak", timeout_seconds=self._loop.options.connect_timeout_seconds)
        except Exception:
            pass  # the servers are gone: JetStream redelivers after ack_wait
        finally:
            try:
                self._loop.call(self._unsubscribe, timeout_seconds=2.0)
            except Exception:
                pass
            self._loop.close()

    async def _unsubscribe(self) -> None:
        await self._pub.close()
        await self._sub.unsubscribe()  # a pull subscription left subscribed keeps the connection's drain waiting

    def __enter__(self) -> RemoteProducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def options_header(options, max_new_tokens) -> str | None:
    """The options header of a submit's request options (checked as `Producer.submit` checks them),
    or None for none."""
    words = option_words(options, max_new_tokens)
    return None if words is None else words_header(words)
