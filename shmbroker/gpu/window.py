"""The in-flight window of a GPU process over its batch ring (docs/design.md "Feeding an engine").

Records are taken from the ring in order and their items added to the engine up to the window
(`pack.feeding.window_items`: a packed engine's max_batch_size plus an eighth, in sequences: an item
asking for n samples is n of them; a record may go in in parts; a padded engine's two rectangles); each item's result is written when that item
finishes, in any order; the oldest records are released once all their items have results (a
crash redelivers what is not released; the client drops a result it has already yielded). The
bookkeeping is columnar: the window's items are id/record/row columns (`inflight.py`), not a Python object each.
A record taken and what its rows become are `taken.py`'s.

Failures:
- the deliveries (`deliveries.py`): records a dead predecessor held are taken again alone, and
  after poison_attempts deaths their items run one at a time; an item on which the process died
  poison_attempts times alone fails here, engine_error, without running;
- the deadline: the oldest record's `budget_ns` (batch_deadline_seconds, and never less than the
  engine's own `call_seconds_max`, plus batch_deadline_token_seconds per input and generated token
  of its runnable rows), counted from the last progress (work given to an idle engine, a result,
  a retry): `deadline_ns`, published in the role slot for the supervisor's watchdog, which kills
  a process that misses it (a long batch that keeps finishing items keeps moving its deadline);
- an engine that is down hands items back (engines/base.py "Failures"): they stay in the window
  (admitted, without results), nothing new goes to the engine, and after a back-off they are
  added again (`backoff.py`, which also says when the engine is dead); no deadline runs meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import numpy as np

from ..engines.base import BatchResults
from ..pack.contract import Mode
from ..pack.feeding import PADDED_BATCHES_IN
from ..ring import layout as L
from ..ring.items import Status
from ..ring.wire import batch_locations, batch_meta
from .backoff import Backoff, WindowLimits
from .core import ConsumerCore, rows_of
from .deliveries import Deliveries, poison_message, private
from .segments import BatchTokens
from .inflight import InFlight
from .taken import Taken, engine_batch, failed_results, rows_within

log = logging.getLogger("shmbroker.gpu")


WINDOW_COUNTS = ("engine_retries", "redelivered", "split_batches", "poisoned")  # stats.GPU keys the window counts


class Window:
    """The in-flight window of one GPU process over its batch ring: records are taken in ring order,
    their items added to the engine up to `limit` at once (a record may go in in parts), results
    written as items finish, and the oldest records released once all their items have results
    (a crash redelivers what is not released; the client drops a result it has already seen)."""

    PEEK_MAX = 4096  # records the window may hold

    def __init__(self, core: ConsumerCore, ring, writer, views, c: int, limit: int, *,
                 limits: WindowLimits, deliveries: Deliveries | None = None):
        self.core, self.ring, self.writer, self.views, self.c = core, ring, writer, views, c
        self.limit = limit
        self.deliveries = deliveries if deliveries is not None else private(int(ring.header[L.H_TAIL]))
        # rows of the records held (not released) with results, published for the scheduler: it keeps
        # this consumer fed by the items still to do, not by the records still held (one long item
        # holds its record, and every record behind it, long after the rest are done); a restarted
        # process runs the records it takes over again, so it counts from zero
        ring.count_done(-ring.rows_done())
        self.limits = limits
        floor = max(limits.deadline_seconds, float(getattr(core.engine, "call_seconds_max", 0.0) or 0.0))
        self.floor_ns = int(floor * 1e9)
        self.token_ns = limits.deadline_token_seconds * 1e9
        self.progress_ns = 0  # the last progress (module docstring)
        self.backoff = Backoff(c, limits.retry_min_seconds, limits.retry_max_seconds)
        self.counts = dict.fromkeys(WINDOW_COUNTS, 0)
        self.counts["split_batches"] = int(self.deliveries.first_split)
        self.events = 0  # bumped whenever `down` or `counts` change (the process publishes its statistics)
        self.on_event = None  # called at once with a redelivery: the engine it goes to may die on it
        self._end = 0  # ring position past the newest record taken
        self.padded = core.engine.mode == Mode.PADDED
        self.taken: deque[Taken] = deque()
        self.items = InFlight()  # the runnable items of the records taken
        self.num_taken = 0  # records taken so far (the next one's serial)
        self.num_released = 0  # records released so far (taken[0] is the num_released-th)
        self.admit_at = 0  # serial of the first record not all in the engine
        self.followers: dict[int, list] = {}  # item id in flight -> [(record, row)] of later copies of it
        self.positions = np.empty(self.PEEK_MAX, np.int64)
        self.num_admitted = 0  # sequences in the engine: each item's samples (its n; 1 without options)
        self.extra: dict[int, int] = {}  # item id in the engine -> its samples past the first
        self.num_batches_in = 0  # records with items in the engine (padded: at most 2)
        self.taken_ns = 0  # when the oldest open record was taken (its wait is counted then)
        self.wait_ns = 0  # batch-wait of the records taken, for the statistics

    @property
    def empty(self) -> bool:
        return not self.taken

    def take_more(self) -> int:
        """Take records from the ring while the window has room; the number taken."""
        got = 0
        while len(self.taken) < self.PEEK_MAX and self._room():
            k = len(self.taken)
            n, end = self.ring.peek_many(self.positions, k + 1)
            if n <= k:
                break
            self._take(int(self.positions[k]), int(end))
            got += 1
            self.admit()
        self.admit()
        return got

    def _room(self) -> bool:
        if self.taken and self.taken[-1].next_row < self.taken[-1].run.size:
            return False  # the newest record is not all in yet: admit it first
        if self.deliveries.holding and not self.deliveries.may_take(self._next_start()):
            return False  # records a dead predecessor held are run again alone first
        if self.padded:
            return self.num_batches_in < PADDED_BATCHES_IN
        return self.num_admitted < self.limit

    def _next_start(self) -> int:
        """The ring position of the next record to take."""
        return self._end if self.taken else int(self.ring.header[L.H_TAIL])

    def _take(self, pos: int, end: int) -> None:
        start = self._next_start()
        self._end = end
        self.deliveries.taken(end)  # before its engine sees any of it
        if self.deliveries.holding and self.deliveries.redelivered(start):
            self.counts["redelivered"] += 1
            self.events += 1
            if self.on_event is not None:
                self.on_event()
        data = self.ring.data_words
        n_run, n_failed, packed_ns = batch_meta(data, pos)
        if packed_ns:
            self.wait_ns += max(0, time.monotonic_ns() - packed_ns)
        locs = batch_locations(data, pos, n_run + n_failed)
        run = locs[:n_run]
        results = []
        runnable = np.zeros(0, np.int64)
        tokens = BatchTokens(self.views, run)
        if n_run:
            failed, runnable = self.core.take(engine_batch(self.c, run), tokens)
            if failed is not None:
                results.append((failed, np.setdiff1d(np.arange(n_run), runnable)))
        if n_failed:
            results.append((failed_results(locs[n_run:]), np.arange(n_run, n_run + n_failed)))
        ids = locs["item_id"][runnable].tolist()
        dup = None
        seen = set(ids)
        held = self.items.id_set
        if len(seen) < len(ids) or (held and not held.isdisjoint(seen)):
            # an item twice in the window: after a restart a record may hold the same item twice
            # (recovered and salvaged) and a restarted scheduler dispatches again what it had not seen
            # acked; it runs once, and the other rows get its result when it finishes
            dup = np.zeros(len(ids), bool)
            first: set[int] = set()
            for j, i in enumerate(ids):
                dup[j] = i in held or i in first
                first.add(i)
        t = Taken(self.num_taken, locs, runnable if dup is None else runnable[~dup], start, tokens)
        self.num_taken += 1
        if dup is not None:
            # an item already in flight (a restarted scheduler dispatched it again): it runs once, and
            # this row gets the same result when it finishes
            for k in runnable[dup].tolist():
                self.followers.setdefault(int(locs["item_id"][k]), []).append((t, k))
        self.taken.append(t)
        if t.run.size:
            self.items.add(locs["item_id"][t.run], t.serial, t.run)
        for res, rows in results:
            self._write(res, t, rows)

    def admit(self) -> None:
        """Add the taken records' items to the engine, in order, while the window has room."""
        taken = self.taken
        k = self.admit_at - self.num_released  # the first record not all in the engine yet
        while k < len(taken):
            if self.backoff.waiting:
                return  # the engine is down: nothing new until the retry
            t = taken[k]
            left = t.run.size - t.next_row
            if not left:
                k += 1
                self.admit_at += 1
                continue
            if self.deliveries.split:  # a dead predecessor's records: one item at a time
                if self.num_admitted:
                    return
                count = 1
                if not self.deliveries.solo(t.start, int(t.run[t.next_row])):
                    self._poison(t)
                    continue
            elif self.padded:
                if self.num_batches_in >= PADDED_BATCHES_IN:
                    return
                count = left
                self.num_batches_in += 1
                t.counted = True
            else:
                room = self.limit - self.num_admitted
                samples = t.tokens.samples() if t.tokens is not None else None
                count = min(left, room) if samples is None else \
                    rows_within(samples[t.run[t.next_row : t.next_row + left]], room, not self.num_admitted)
                if count <= 0:
                    return
            if not self.core.in_flight.size:
                self.progress_ns = time.monotonic_ns()  # work given to an idle engine
            a = t.next_row
            t.next_row += count
            t.in_engine += count
            self.num_admitted += count + self._more_samples(t, a, count)
            if t.run.size == t.locs.size or t.run[-1] - t.run[0] == t.run.size - 1:  # contiguous rows: a view
                first = int(t.run[0]) + a if t.run.size else 0
                rows = slice(first, first + count)
            else:
                rows = t.run[a : a + count]
            run = t.locs[rows]
            refused = self.core.add(run["item_id"].astype(np.uint64), t.tokens.part(rows),
                                    run["max_new_tokens"].astype(np.int64))
            if refused is not None:
                self.finished(refused)
            self._returned()

    def _more_samples(self, t: Taken, a: int, count: int) -> int:
        """The samples past the first of t's rows run[a:a + count], each a unit of the window too
        (`extra` keeps them by item id until its result)."""
        samples = t.tokens.samples() if t.tokens is not None else None
        if samples is None:
            return 0
        more = samples[t.run[a : a + count]] - 1
        for k in np.flatnonzero(more).tolist():
            self.extra[int(t.locs["item_id"][t.run[a + k]])] = int(more[k])
        return int(more.sum())

    def _poison(self, t: Taken) -> None:
        """t's next item: processes died on it alone poison_attempts times; it fails without running."""
        row = int(t.run[t.next_row])
        t.next_row += 1
        t.in_engine += 1
        self.num_admitted += 1
        item_id = int(t.locs["item_id"][row])
        text = poison_message(self.deliveries.attempts)
        log.warning("item %#x: %s; it fails (engine_error)", item_id, text)
        res = BatchResults(np.array([item_id], np.uint64), np.array([Status.ENGINE_ERROR], np.uint32),
                           np.zeros(0, np.uint32), np.zeros(2, np.int64), {0: text})
        self.core.count(res)
        self.counts["poisoned"] += 1
        self.events += 1
        self.finished(res)

    def poll(self, timeout_seconds: float) -> int:
        """Write the results of the items the engine finished; the number. Items an engine that is
        down handed back are added again when their back-off is over (module docstring)."""
        if self.backoff.waiting:
            wait = self.backoff.due_in()
            if wait > 0 and not self.core.in_flight.size:
                time.sleep(min(timeout_seconds, wait))  # nothing else to wait for
            if self.backoff.due_in() <= 0:
                self._retry()
        res = self.core.poll(timeout_seconds)
        returned = self._returned()
        if res is None:
            return 0
        if not returned and self.backoff.answered():  # the engine answers again
            self.events += 1
        self.finished(res)
        return len(res)

    def _returned(self) -> int:
        """Take what the engine handed back: to be added again after the back-off; how many."""
        if not self.core.returned.size:
            return 0
        ids, why = self.core.take_returned()
        self.counts["engine_retries"] += ids.size
        self.events += 1
        self.backoff.hand_back(ids, why)
        return ids.size

    def _retry(self) -> None:
        """Add the handed-back items again, record by record, in order."""
        ids = self.backoff.take()
        at = self.items.find(ids, "a retried item")
        recs, rows = self.items.recs[at], self.items.rows[at]
        first = self.taken[0].serial
        self.progress_ns = time.monotonic_ns()
        for serial in np.unique(recs).tolist():
            t = self.taken[serial - first]
            assert t.serial == serial, "the window's records are in serial order"
            mine = rows[recs == serial]
            locs = t.locs[mine]
            refused = self.core.add(locs["item_id"].astype(np.uint64), t.tokens.part(mine),
                                    locs["max_new_tokens"].astype(np.int64))
            if refused is not None:
                self.finished(refused)
        self._returned()

    def deadline_ns(self) -> int:
        """CLOCK_MONOTONIC by which the engine must make progress (module docstring); 0: it holds nothing."""
        if not self.taken or not self.core.in_flight.size:
            return 0
        t = self.taken[0]
        if t.budget_ns is None:
            tokens = 0
            if self.token_ns and t.run.size:
                some = t.locs if t.run.size == t.locs.size else t.locs[t.run]
                tokens = int(some["num_tokens"].sum()) + int(some["max_new_tokens"].sum())
            t.budget_ns = self.floor_ns + int(self.token_ns * tokens)
        return self.progress_ns + t.budget_ns

    def finished(self, res: BatchResults) -> None:
        """Write results of admitted items and close their rows (progress, once written)."""
        self._finished(res)
        self.progress_ns = time.monotonic_ns()
        if self.deliveries.split and not self.num_admitted:
            self.deliveries.solo_done()

    def _finished(self, res: BatchResults) -> None:
        ids = res.item_ids.astype(np.uint64)
        n = ids.size
        recs, rows = self.items.remove(ids)
        self.num_admitted -= n + (sum(self.extra.pop(i, 0) for i in ids.tolist()) if self.extra else 0)
        if self.followers:
            for k, i in enumerate(ids.tolist()):
                for t, row in self.followers.pop(i, ()):
                    self._write(rows_of(res, np.array([k], np.int64)), t, np.array([row], np.int64))
        first = self.taken[0].serial
        serials = recs[:1] if (recs == recs[0]).all() else np.unique(recs)
        if serials.size == 1:  # one record: its rows' locations directly
            t = self.taken[int(serials[0]) - first]
            assert t.serial == int(serials[0]), "the window's records are in serial order"
            self._close(t, n)
            self._write(res, t, rows)
            return
        seqs = np.empty(n, np.uint64)
        writers = np.empty(n, np.uint32)
        for serial in serials.tolist():
            t = self.taken[serial - first]
            assert t.serial == serial, "the window's records are in serial order"
            ks = np.flatnonzero(recs == serial)
            seqs[ks] = t.locs["seq"][rows[ks]]
            writers[ks] = t.locs["writer"][rows[ks]]
            self._close(t, ks.size)
            t.open -= ks.size
            assert t.open >= 0, "more results than rows"
        self.writer.write(res, seqs, writers)
        self.ring.count_done(n)

    def _close(self, t: Taken, count: int) -> None:
        """count of t's rows in the engine have their results."""
        t.in_engine -= count
        if t.counted and t.in_engine == 0 and t.next_row == t.run.size:
            t.counted = False
            self.num_batches_in -= 1

    def _write(self, res: BatchResults, t: Taken, rows: np.ndarray) -> None:
        self.writer.write(res, t.locs["seq"][rows], t.locs["writer"][rows])
        t.open -= rows.size
        assert t.open >= 0, "more results than rows"
        self.ring.count_done(rows.size)

    def in_flight_words(self) -> str:
        """What the window holds, in words (an engine death's log line)."""
        ids = self.core.in_flight
        shown = ", ".join(f"{int(i):#x}" for i in ids[:4]) + (", ..." if ids.size > 4 else "")
        return (f"{ids.size} items in the engine ({shown}), {len(self.taken)} batch records held, "
                f"{self.num_released} released by this process")

    def release_done(self) -> int:
        """Release the oldest records whose items all have results; how many."""
        k = 0
        for t in self.taken:
            if t.open:
                break
            k += 1
        if k:
            n, new_tail = self.ring.peek_many(self.positions, k)
            assert n == k, "released records are still in the ring"
            # their rows leave the done count before the records leave the ring (the scheduler reads
            # the ring's counters first: it may count a done row as undone, never the reverse)
            self.ring.count_done(-sum(self.taken[j].locs.size for j in range(k)))
            self.ring.release(new_tail, k)
            self.deliveries.released(int(new_tail))
            for _ in range(k):
                self.taken.popleft()
            self.num_released += k
            self.admit_at = max(self.admit_at, self.num_released)
        return k
