"""The in-flight window of a GPU process over its batch ring (DESIGN.md "Feeding an engine").

Records are taken from the ring in order and their items added to the engine up to the window
(`pack.feeding.window_items`: a packed engine's max_batch_size plus an eighth, a record may go in
in parts; a padded engine's two rectangles); each item's result is written when that item
finishes, in any order; the oldest records are released once all their items have results (a
crash redelivers what is not released; the client drops a result it has already yielded). The
bookkeeping is columnar: the window's items are id/record/row columns, not a Python object each.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..pack.contract import BATCH_ROW, Batch, Shape
from ..pack.feeding import PADDED_BATCHES_IN
from ..ring import layout as L
from ..ring.wire import LOC_DTYPE, LOC_WORDS
from .core import CODE_TOO_LONG, ConsumerCore, rows_of
from .engines.base import BatchResults
from .segments import BatchTokens


class Taken:
    """A batch record in the window: its item locations, how many rows the engine was given, how
    many still wait for a result. Released (in ring order) when that count is 0."""

    __slots__ = ("serial", "locs", "run", "next_row", "open", "in_engine")

    def __init__(self, serial: int, locs: np.ndarray, run: np.ndarray):
        self.serial = serial  # the how-manyth record this window took
        self.locs = locs  # every row of the record (runnable, then failed by the scheduler)
        self.run = run  # the rows the engine may run, in the scheduler's order
        self.next_row = 0  # run[:next_row] were added to the engine
        self.open = locs.size  # rows without a result yet
        self.in_engine = 0  # rows added to the engine and not answered yet


class Window:
    """The in-flight window of one GPU process over its batch ring: records are taken in ring order,
    their items added to the engine up to `limit` at once (a record may go in in parts), results
    written as items finish, and the oldest records released once all their items have results
    (a crash redelivers what is not released; the client drops a result it has already seen)."""

    PEEK_MAX = 4096  # records the window may hold

    def __init__(self, core: ConsumerCore, ring, writer, views, c: int, limit: int):
        self.core, self.ring, self.writer, self.views, self.c = core, ring, writer, views, c
        self.limit = limit
        self.padded = core.engine.mode == "padded"
        self.taken: deque[Taken] = deque()
        # the runnable items of the records taken, as columns (no Python object per item): id, the
        # serial of its record, its row there; `_order` sorts them by id (None: to be sorted again)
        self.ids = np.zeros(0, np.uint64)
        self.recs = np.zeros(0, np.int64)
        self.rows = np.zeros(0, np.int64)
        self._order: np.ndarray | None = None
        self.id_set: set[int] = set()  # the same ids, to find a record's item already in flight at once
        self.num_taken = 0  # records taken so far (the next one's serial)
        self.num_released = 0  # records released so far (taken[0] is the num_released-th)
        self.admit_at = 0  # serial of the first record not all in the engine
        self.followers: dict[int, list] = {}  # item id in flight -> [(record, row)] of later copies of it
        self.positions = np.empty(self.PEEK_MAX, np.int64)
        self.num_admitted = 0  # items in the engine
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
            n, _ = self.ring.peek_many(self.positions, k + 1)
            if n <= k:
                break
            self._take(int(self.positions[k]))
            got += 1
            self.admit()
        self.admit()
        return got

    def _room(self) -> bool:
        if self.taken and self.taken[-1].next_row < self.taken[-1].run.size:
            return False  # the newest record is not all in yet: admit it first
        if self.padded:
            return self.num_batches_in < PADDED_BATCHES_IN
        return self.num_admitted < self.limit

    def _take(self, pos: int) -> None:
        data = self.ring.data_words
        n_run, n_failed = int(data[pos + 4]), int(data[pos + 5])
        packed_ns = int(data[pos + 6]) | int(data[pos + 7]) << 32
        if packed_ns:
            self.wait_ns += max(0, time.monotonic_ns() - packed_ns)
        locs = data[pos + L.RECORD_HEADER_WORDS : pos + L.RECORD_HEADER_WORDS + (n_run + n_failed) * LOC_WORDS] \
            .view(LOC_DTYPE)
        run = locs[:n_run]
        results = []
        runnable = np.zeros(0, np.int64)
        if n_run:
            failed, runnable = self.core.take(_batch(self.c, run), BatchTokens(self.views, run))
            if failed is not None:
                results.append((failed, np.setdiff1d(np.arange(n_run), runnable)))
        if n_failed:
            results.append((_failed_results(locs[n_run:]), np.arange(n_run, n_run + n_failed)))
        ids = locs["item_id"][runnable].tolist()
        dup = None
        seen = set(ids)
        if len(seen) < len(ids) or (self.id_set and not self.id_set.isdisjoint(seen)):
            # an item twice in the window: after a restart a record may hold the same item twice
            # (recovered and salvaged) and a restarted scheduler dispatches again what it had not seen
            # acked; it runs once, and the other rows get its result when it finishes
            dup = np.zeros(len(ids), bool)
            first: set[int] = set()
            for j, i in enumerate(ids):
                dup[j] = i in self.id_set or i in first
                first.add(i)
        t = Taken(self.num_taken, locs, runnable if dup is None else runnable[~dup])
        self.num_taken += 1
        if dup is not None:
            # an item already in flight (a restarted scheduler dispatched it again): it runs once, and
            # this row gets the same result when it finishes
            for k in runnable[dup].tolist():
                self.followers.setdefault(int(locs["item_id"][k]), []).append((t, k))
        self.taken.append(t)
        if t.run.size:
            self.id_set.update(seen)
            self.ids = np.concatenate([self.ids, locs["item_id"][t.run].astype(np.uint64)])
            self.recs = np.concatenate([self.recs, np.full(t.run.size, t.serial, np.int64)])
            self.rows = np.concatenate([self.rows, t.run.astype(np.int64)])
            self._order = None
        for res, rows in results:
            self._write(res, t, rows)

    def admit(self) -> None:
        """Add the taken records' items to the engine, in order, while the window has room."""
        taken = self.taken
        k = self.admit_at - self.num_released  # the first record not all in the engine yet
        while k < len(taken):
            t = taken[k]
            left = t.run.size - t.next_row
            if not left:
                k += 1
                self.admit_at += 1
                continue
            if self.padded:
                if self.num_batches_in >= PADDED_BATCHES_IN:
                    return
                count = left
                self.num_batches_in += 1
            else:
                count = min(left, self.limit - self.num_admitted)
                if count <= 0:
                    return
            a = t.next_row
            t.next_row += count
            t.in_engine += count
            self.num_admitted += count
            if t.run.size == t.locs.size or t.run[-1] - t.run[0] == t.run.size - 1:  # contiguous rows: a view
                first = int(t.run[0]) + a if t.run.size else 0
                run = t.locs[first : first + count]
            else:
                run = t.locs[t.run[a : a + count]]
            refused = self.core.add(run["item_id"].astype(np.uint64), BatchTokens(self.views, run),
                                    run["max_new"].astype(np.int64))
            if refused is not None:
                self.finished(refused)

    def poll(self, timeout_seconds: float) -> int:
        """Write the results of the items the engine finished; the number."""
        res = self.core.poll(timeout_seconds)
        if res is None:
            return 0
        self.finished(res)
        return len(res)

    def finished(self, res: BatchResults) -> None:
        """Write results of admitted items and close their rows."""
        ids = res.item_ids.astype(np.uint64)
        n = ids.size
        if n <= self.ids.size and np.array_equal(self.ids[:n], ids):  # the oldest items, in order
            recs, rows = self.recs[:n], self.rows[:n]
            self.ids, self.recs, self.rows = self.ids[n:], self.recs[n:], self.rows[n:]
        else:
            if self._order is None:
                self._order = np.argsort(self.ids, kind="stable")
            order = self._order
            at = order[np.minimum(np.searchsorted(self.ids[order], ids), order.size - 1)]
            assert np.array_equal(self.ids[at], ids), "a result for an item the window does not hold"
            recs, rows = self.recs[at], self.rows[at]
            keep = np.ones(self.ids.size, bool)
            keep[at] = False
            self.ids, self.recs, self.rows = self.ids[keep], self.recs[keep], self.rows[keep]
        self._order = None
        self.id_set.difference_update(ids.tolist())
        self.num_admitted -= n
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

    def _close(self, t: Taken, count: int) -> None:
        """count of t's rows in the engine have their results."""
        t.in_engine -= count
        if self.padded and t.in_engine == 0 and t.next_row == t.run.size:
            self.num_batches_in -= 1

    def _write(self, res: BatchResults, t: Taken, rows: np.ndarray) -> None:
        self.writer.write(res, t.locs["seq"][rows], t.locs["writer"][rows])
        t.open -= rows.size
        assert t.open >= 0, "more results than rows"

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
            self.ring.release(new_tail, k)
            for _ in range(k):
                self.taken.popleft()
            self.num_released += k
            self.admit_at = max(self.admit_at, self.num_released)
        return k


def _batch(c: int, run: np.ndarray) -> Batch:
    rows = np.zeros(run.size, BATCH_ROW)
    rows["key"] = run["item_id"]
    rows["length"] = run["length"]
    rows["max_new"] = run["max_new"]
    rows["family"] = run["family"]
    rows["model"] = run["model"]
    return Batch(c, Shape(int(run["model"][0]), int(run["family"][0]), int(rows["length"].min()),
                          int(rows["length"].max())), rows)


def _failed_results(failed: np.ndarray) -> BatchResults:
    status = failed["aux"].astype(np.uint32)
    errors = {}
    for i, (code, length) in enumerate(zip(status.tolist(), failed["length"].tolist())):
        errors[i] = (f"{length} tokens: longer than every consumer of its model takes" if code == CODE_TOO_LONG
                     else "no consumer serves its model" if length else "no tokens")
    return BatchResults(failed["item_id"].astype(np.uint64), status, np.zeros(0, np.uint32),
                        np.zeros(failed.size + 1, np.int64), errors)
