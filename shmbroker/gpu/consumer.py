"""The GPU process: one batch in, exactly one result per item out.

`ConsumerCore.process(batch, tokens)` is what a GPU process does with each batch:

1. the shape guard again: a batch that is not shape-pure or breaks the contract is counted
   (`guard_violations`) and still served, since its results are right either way;
2. items the contract cannot take are failed back here, never searched for by the scheduler:
   `too_long` (with the lengths in the error) and `invalid` (no tokens);
3. the engine runs the rest as one batch; if it raises, each item runs alone so that an engine
   error fails only the items that cause it (`engine_error` with the message), never the batch or
   the process; an engine that returns a result for the wrong item, or none, fails that item the
   same way.

Results come back in columns (`BatchResults`), so a batch costs a handful of array operations,
not a Python object per item. `gpu_main` is the process loop: take the next batch record from
its batch ring (item locations; the ring keeps it until its results are out, so a crash
redelivers it), view each item's tokens zero-copy in the backlog's segment files, process, write
the result records to the results ring, release the batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..errors import Full, PeerDead
from ..pack.contract import BATCH_ROW, Batch, Contract, Shape
from ..pack.feeding import PADDED_BATCHES_IN, window_items
from ..pack.guard import Guard
from ..ring import layout as L
from ..ring.ring import CONSUMER, PRODUCER, SLEEP_SLICE_SECONDS
from ..ring.wire import LOC_DTYPE, LOC_WORDS, RES_HEADER_BYTES, RES_MAX_ERROR_BYTES, encode_error, encode_results
from ..spill.layout import RECORD_HEADER_BYTES, writer_dir_name
from ..spill.segment import SegmentFile
from .engines.base import (
    ENGINE_ERROR,
    INVALID,
    RUN_DEADLINE_SECONDS,
    STATUS_CODES,
    TOO_LONG,
    BatchResults,
    BatchStream,
    EngineBatch,
    ItemResult,
    engine_error,
)

# Yields before a GPU process sleeps on its batch ring: the scheduler's next batch usually lands
# within a few of its time slices.
YIELD_ROUNDS = 64
IDLE_PUBLISH_NS = 500_000_000  # an idle GPU process publishes its idle seconds this often

CODE_OK, CODE_TOO_LONG, CODE_INVALID, CODE_ENGINE_ERROR = (STATUS_CODES[s] for s in ("ok", TOO_LONG, INVALID,
                                                                                      ENGINE_ERROR))


@dataclass
class ConsumerStats:
    batches: int = 0
    items: int = 0
    ok: int = 0
    too_long: int = 0
    invalid: int = 0
    engine_errors: int = 0
    guard_violations: int = 0
    hit_blocks: int = 0
    queried_blocks: int = 0
    engine_seconds: float = 0.0
    input_tokens: int = 0
    padded_tokens: int = 0
    rect_tokens: int = 0
    reused_tokens: int = 0  # prefix tokens the engine served from a cache
    shape_switches: int = 0  # consecutive batches of different families
    families: int = 0  # distinct families served
    # switches back to a family already served: switches - (families - 1) (DESIGN.md "Words"),
    # counted as they happen so that a restarted process can continue the count
    excess_shape_switches: int = 0


class ConsumerCore:
    """What a GPU process does with each batch record, around a streaming engine (`engines/base.py`):

    - `take(batch, tokens)`: the guard and the per-batch accounting, the contract's failures
      (`too_long`, `invalid`) as results at once, the rest handed to the engine (`add`);
    - `poll(timeout_seconds)`: the results of the items the engine finished, checked and counted;
    - `process(batch, tokens)`: both, one batch at a time, results in the batch's order.

    An engine without add/poll (a batch engine with only `run`) is put behind `BatchStream`."""

    def __init__(self, contract: Contract, engine, *, tolerance: float | None = None):
        self.contract = contract
        if not callable(getattr(engine, "add", None)):
            engine = BatchStream(engine)
        self.engine = engine
        self.guard = Guard(tolerance if engine.mode == "padded" else None)
        self.stats = ConsumerStats()
        self._last_family: int | None = None
        self._families: set[int] = set()
        self.in_flight = np.zeros(0, np.uint64)  # item ids added to the engine and not answered yet

    def take(self, batch: Batch, tokens) -> tuple[BatchResults | None, np.ndarray]:
        """Account for one batch record and fail what the contract cannot take; (those results or
        None, the rows of the batch that may run). The caller adds those rows (`add`), all at once
        or in parts."""
        n = len(batch)
        assert len(tokens) == n, "one token array per item"
        stats = self.stats
        stats.batches += 1
        stats.items += n
        if n and self.guard.check_batch(batch, self.contract) is not None:
            stats.guard_violations += 1
        if n:
            family = int(batch.shape.family)
            if self._last_family is not None and family != self._last_family:
                stats.shape_switches += 1
                if family in self._families:
                    stats.excess_shape_switches += 1
            self._last_family = family
            if family not in self._families:
                self._families.add(family)
                stats.families += 1
            stats.input_tokens += int(batch.lengths.sum())
        lengths = batch.lengths
        limit = self.contract.max_input_len
        bad = (lengths == 0) | (lengths > limit)
        if not bad.any():
            return None, np.arange(n)
        rows = np.flatnonzero(bad)
        status = np.where(lengths[rows] == 0, CODE_INVALID, CODE_TOO_LONG).astype(np.uint32)
        errors = {k: ("no tokens" if lengths[r] == 0 else f"{int(lengths[r])} tokens > max_input_len {limit}")
                  for k, r in enumerate(rows.tolist())}
        failed = _empty(batch.keys[rows].astype(np.uint64), status, errors)
        self._count(failed)
        return failed, np.flatnonzero(~bad)

    def add(self, ids: np.ndarray, tokens, max_new: np.ndarray) -> BatchResults | None:
        """Hand items to the engine; those it refuses at admission come back as results (a group it
        refuses is added item by item, so only the item that causes it fails)."""
        ids = np.asarray(ids, np.uint64)
        if not ids.size:
            return None
        try:
            self.engine.add(EngineBatch(ids, tokens, np.asarray(max_new, np.int64)))
            self.in_flight = np.concatenate([self.in_flight, ids])
            return None
        except Exception as exc:  # noqa: BLE001 - isolate the item(s) that fail, below
            if ids.size == 1:
                return self._count(BatchResults.of([engine_error(ids[0], exc)]))
        refused = []
        for k in range(ids.size):
            try:
                self.engine.add(EngineBatch(ids[k : k + 1], [tokens[k]], np.asarray(max_new[k : k + 1], np.int64)))
                self.in_flight = np.concatenate([self.in_flight, ids[k : k + 1]])
            except Exception as exc:  # noqa: BLE001 - an engine error fails its item, not the process
                refused.append(engine_error(ids[k], exc))
        return self._count(BatchResults.of(refused)) if refused else None

    def poll(self, timeout_seconds: float) -> BatchResults | None:
        """Results of the items the engine finished (each once; a result for an item not in flight is
        dropped). An engine whose poll raises fails every item in flight (engine_error)."""
        if not self.in_flight.size:
            return None
        try:
            outcome = self.engine.poll(timeout_seconds)
        except Exception as exc:  # noqa: BLE001 - the engine broke: what it held fails, the process goes on
            lost = self.in_flight.tolist()
            self.in_flight = np.zeros(0, np.uint64)
            return self._count(BatchResults.of([engine_error(i, exc) for i in lost]))
        s = self.stats
        s.hit_blocks += outcome.hit_blocks
        s.queried_blocks += outcome.queried_blocks
        s.engine_seconds += outcome.engine_seconds
        s.padded_tokens += outcome.padded_tokens
        s.rect_tokens += outcome.rect_tokens
        s.reused_tokens += outcome.reused_tokens
        res = outcome.results
        if not isinstance(res, BatchResults):
            res = BatchResults.of(res)
        if not len(res):
            return None
        ids = res.item_ids.astype(np.uint64)
        n = ids.size
        if n <= self.in_flight.size and np.array_equal(self.in_flight[:n], ids):  # the oldest, in order
            self.in_flight = self.in_flight[n:]
            return self._count(res)
        mine = np.isin(ids, self.in_flight)
        _, first = np.unique(ids, return_index=True)
        if first.size < ids.size:  # an item answered twice: the first answer counts
            once = np.zeros(ids.size, bool)
            once[first] = True
            mine &= once
        if not mine.all():
            if not mine.any():
                return None
            res = rows_of(res, np.flatnonzero(mine))
            ids = res.item_ids
        self.in_flight = self.in_flight[~np.isin(self.in_flight, ids)]
        return self._count(res)

    def process(self, batch: Batch, tokens) -> BatchResults:
        """One batch at a time: results in the batch's order, one per item."""
        n = len(batch)
        failed, runnable = self.take(batch, tokens)
        parts = [p for p in (failed,) if p is not None]
        if runnable.size:
            sub = _Pick(tokens, runnable) if runnable.size < n else tokens
            refused = self.add(batch.keys[runnable], sub, batch.max_new_tokens[runnable])
            if refused is not None:
                parts.append(refused)
            want = batch.keys[runnable].astype(np.uint64)
            deadline = time.monotonic() + RUN_DEADLINE_SECONDS
            while np.isin(want, self.in_flight).any() and time.monotonic() < deadline:
                got = self.poll(0.05)
                if got is not None:
                    parts.append(got)
        return _in_order(batch.keys.astype(np.uint64), parts)

    def _count(self, res: BatchResults) -> BatchResults:
        counts = np.bincount(res.status, minlength=4)
        s = self.stats
        s.ok += int(counts[CODE_OK])
        s.too_long += int(counts[CODE_TOO_LONG])
        s.invalid += int(counts[CODE_INVALID])
        s.engine_errors += int(counts[CODE_ENGINE_ERROR])
        return res


def _in_order(ids: np.ndarray, parts: list) -> BatchResults:
    """The results of `parts` in the order of `ids`, one per id (a missing one: engine_error)."""
    by_id = {}
    for p in parts:
        for r in p.items():
            by_id[r.item_id] = r
    return BatchResults.of([by_id.get(int(i)) or ItemResult(int(i), ENGINE_ERROR, error="the engine returned no result")
                            for i in ids])


class _Pick:
    """tokens[rows[i]] as a sequence, without touching the tokens."""

    def __init__(self, tokens, rows):
        self.tokens, self.rows = tokens, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.tokens[int(r)] for r in self.rows[i]]
        return self.tokens[int(self.rows[i])]


def _empty(ids, status, errors) -> BatchResults:
    return BatchResults(ids, status.copy(), np.zeros(0, np.uint32), np.zeros(ids.size + 1, np.int64), dict(errors))


# -- the process -----------------------------------------------------------------------------

class SegmentViews:
    """Read-only mappings of backlog segment files, kept while batches use them."""

    MAX_OPEN = 64

    def __init__(self, root):
        self.root = root
        self.maps: dict[tuple[int, int], SegmentFile] = {}

    def tokens(self, writer: int, segment: int, offset: int, length: int) -> np.ndarray:
        key = (writer, segment)
        seg = self.maps.get(key)
        if seg is None:
            if len(self.maps) >= self.MAX_OPEN:
                old = next(iter(self.maps))
                self.maps.pop(old).close()
            seg = SegmentFile.open(self.root / writer_dir_name(writer) / f"{segment:020d}.seg")
            self.maps[key] = seg
        start = offset + RECORD_HEADER_BYTES
        return seg.buf[start : start + 4 * length].view(np.uint32)

    def close(self) -> None:
        for seg in self.maps.values():
            seg.close()
        self.maps.clear()


class BatchTokens:
    """Item i's tokens as a zero-copy view into its segment file, made when first asked for."""

    def __init__(self, views: SegmentViews, locs: np.ndarray):
        self.views, self.locs = views, locs

    def __len__(self):
        return self.locs.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        r = self.locs[i]
        return self.views.tokens(int(r["writer"]), int(r["segment"]), int(r["offset"]), int(r["length"]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class ResultWriter:
    """Encodes a batch's results as result records and pushes them to the results ring (in chunks
    that fit its largest record)."""

    def __init__(self, ring, stopping):
        self.ring = ring
        self.stopping = stopping
        self.max_bytes = ring.max_tokens * 4
        self.buf = np.zeros(min(self.max_bytes, 1 << 20), np.uint8)

    def write(self, res: BatchResults, seqs: np.ndarray, writers: np.ndarray) -> None:
        """Runs of plain records in one kernel call each; a failed item with an error text alone."""
        n = len(res)
        texts = sorted(k for k in res.errors if res.status[k] != CODE_OK)
        i = at = 0
        for stop in texts + [n]:
            while i < stop:
                j, at = encode_results(self.buf, at, res.item_ids, seqs, writers, res.status, res.flat, res.offsets,
                                       i, stop)
                if j == i:  # the next record does not fit what is left
                    at = self._flush(at, RES_HEADER_BYTES + 4 * int(res.offsets[i + 1] - res.offsets[i]) + 8)
                i = j
            if stop < n:
                text = res.errors[stop].encode("utf-8", "replace")[:RES_MAX_ERROR_BYTES]
                need = RES_HEADER_BYTES + len(text) + 8
                if at + need > self.buf.size:
                    at = self._flush(at, need)
                at = encode_error(self.buf, at, res.item_ids[stop], seqs[stop], res.status[stop], writers[stop],
                                  np.frombuffer(text, np.uint8))
                i = stop + 1
        self._flush(at, 0)

    def _flush(self, at: int, need: int) -> int:
        if at:
            payload = self.buf[:at].view(np.uint32)
            while True:
                try:
                    self.ring.push_wait(payload, 0, at, 0, 0, 0, SLEEP_SLICE_SECONDS * 4)
                    break
                except (Full, PeerDead):  # the results process may be restarting: its ring stays
                    self.ring.heartbeat()
                    if self.stopping() == 2:
                        raise
        if need > self.buf.size:
            if need > self.max_bytes:
                raise ValueError(f"a result of {need} bytes exceeds the results ring's largest record")
            self.buf = np.zeros(need, np.uint8)
        return 0


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

    def __init__(self, core: ConsumerCore, ring, writer: ResultWriter, views, c: int, limit: int):
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


def rows_of(res: BatchResults, ks: np.ndarray) -> BatchResults:
    """Rows ks of res, as columns."""
    ks = np.asarray(ks, np.int64)
    counts = np.diff(res.offsets)[ks]
    offsets = np.zeros(ks.size + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    take = np.repeat(res.offsets[ks] - offsets[:-1], counts) + np.arange(int(offsets[-1]), dtype=np.int64)
    errors = {j: res.errors[k] for j, k in enumerate(ks.tolist()) if k in res.errors} if res.errors else {}
    return BatchResults(res.item_ids[ks], res.status[ks], res.flat[take], offsets, errors)


POLL_SHORT_SECONDS = 0.002  # the engine's poll while the window has room and the ring may bring more


def gpu_main(c: int, cfg, control, batch_ring, results_ring, stopping) -> None:
    """GPU process c: keep consumer c's engine full from its batch ring and write every item's result."""
    if cfg.consumers[c].device is not None:  # pinned to its card (tiers.py) before any engine import
        import os

        os.environ.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(cfg.consumers[c].device))
    from pathlib import Path

    from ..spill.store import BACKLOG_DIR
    from ..stats import StatsWriter
    from .engines.registry import load_engine

    consumer = cfg.consumers[c]
    role = control.roles.index(f"gpu-{consumer.name}")
    slot = control.role(role)
    stats = StatsWriter(control, role)
    engine = load_engine(consumer.engine, consumer.engine_settings, block_tokens=cfg.block_tokens,
                         contract=consumer.contract)
    core = ConsumerCore(consumer.contract, engine, tolerance=cfg.padding_tolerance)
    counting = GpuCounting(stats, core)
    ring = batch_ring.attach(CONSUMER)
    out = results_ring.attach(PRODUCER)
    views = SegmentViews(Path(cfg.data_dir) / BACKLOG_DIR)
    window = Window(core, ring, ResultWriter(out, stopping), views, c,
                    window_items(consumer.contract.max_batch_size, engine.mode))
    mark = time.monotonic_ns()  # busy (window not empty) or idle time is counted from here
    idle_from = mark
    try:
        while True:
            slot[2] = time.monotonic_ns()
            was_empty = window.empty
            window.take_more()
            if window.empty:
                if stopping():
                    break
                try:
                    ring.wait_readable(SLEEP_SLICE_SECONDS, YIELD_ROUNDS)
                except PeerDead:
                    pass  # the scheduler is restarting; its ring and our batches stay
                now = time.monotonic_ns()
                if now - idle_from >= IDLE_PUBLISH_NS:  # a long idle shows as it happens, not at the next batch
                    counting.idle(now - idle_from)
                    idle_from = mark = now
                continue
            if was_empty:  # the window just filled: what went before was idle
                now = time.monotonic_ns()
                counting.idle(now - idle_from)
                mark = now
            room = window.num_admitted < window.limit and not window.padded
            done = window.poll(POLL_SHORT_SECONDS if room else SLEEP_SLICE_SECONDS)
            if done or window.taken[0].open == 0:
                window.admit()
                now = time.monotonic_ns()
                # counted before the release: a crash in between re-runs those items and counts them
                # again (the engine did run them twice), but a record is never released uncounted
                counting.batch(now - mark, 0, window.wait_ns)
                window.wait_ns = 0
                mark = now
                window.release_done()
                if window.empty:
                    idle_from = time.monotonic_ns()
    finally:
        views.close()
        ring.close()
        out.close()
        engine.close()


U64_MASK = (1 << 64) - 1


class GpuCounting:
    """A GPU process's statistics (`stats.GPU`): the core's counts of this incarnation on top of
    what its predecessors published, plus the process's own clocks."""

    KEYS = ("batches", "items", "ok", "too_long", "invalid", "engine_errors", "guard_violations", "hit_blocks",
            "queried_blocks", "padded_tokens", "rect_tokens", "reused_tokens", "shape_switches", "excess_shape_switches",
            "families")

    def __init__(self, stats, core: ConsumerCore):
        self.stats = stats
        self.core = core
        v = stats.values
        self.base = v.copy()
        self.at = {k: stats.index[k] for k in (*self.KEYS, "tokens", "busy_ns", "idle_ns", "batch_wait_ns",
                                                "engine_own_ns", "last_family")}
        if stats["batches"]:  # a restart continues the predecessor's run: its last family is served
            core._last_family = stats["last_family"] & U64_MASK
            core._families.add(core._last_family)

    def idle(self, idle_ns: int) -> None:
        self.stats.values[self.at["idle_ns"]] += idle_ns
        self.stats.publish()

    def batch(self, busy_ns: int, idle_ns: int, wait_ns: int) -> None:
        s, v, base, at = self.core.stats, self.stats.values, self.base, self.at
        for k in self.KEYS:
            v[at[k]] = base[at[k]] + getattr(s, k)
        v[at["tokens"]] = base[at["tokens"]] + s.input_tokens
        v[at["engine_own_ns"]] = base[at["engine_own_ns"]] + int(s.engine_seconds * 1e9)
        v[at["busy_ns"]] += busy_ns
        v[at["idle_ns"]] += idle_ns
        v[at["batch_wait_ns"]] += wait_ns
        family = self.core._last_family
        if family is not None:
            v[at["last_family"]] = family - (1 << 64) if family >= 1 << 63 else family
        self.stats.publish()


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


def _concat(a: BatchResults, b: BatchResults) -> BatchResults:
    offsets = np.concatenate([a.offsets, a.offsets[-1] + b.offsets[1:]])
    errors = dict(a.errors)
    errors.update({len(a) + k: v for k, v in b.errors.items()})
    return BatchResults(np.concatenate([a.item_ids, b.item_ids]), np.concatenate([a.status, b.status]),
                        np.concatenate([a.flat, b.flat]), offsets, errors)
