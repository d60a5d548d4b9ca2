"""The scheduler process: the single owner of the packing index; keeps every consumer's batch ring full.

At start it rebuilds the index from the backlog on disk (`Backlog.open(readonly=True)`: sealed
segments from their header index, the active ones walked header by header, minus what the ack
file marks done) while the ingest processes keep appending: records announced on the appended
rings that the scan already saw (sequence numbers below its end, per writer) are skipped. Block
hashes of a recovered item are read from the record's tokens past its family root only (the
family key is in the header), so an item within one block reads no payload at all.

Then one loop: take announcements (item locations and block hashes) from the appended rings into
the index; for each consumer whose batch ring holds fewer than AHEAD undone batches, ask the
packer for its next batch and push its item locations. Items no consumer can ever take (no
consumer serves their model, no tokens, longer than every contract of their model) ride the next
batch record as failed rows, so a GPU process writes their result. When nothing is to be done it
sleeps on one doorbell that both the appended rings (data) and the batch rings (space) ring. Its
statistics words and gauges (pending items per model, the oldest item's age) are `pending.py`'s.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..control import roles
from ..control.segment import beat
from ..control.stats import SCHED
from ..errors import PeerDead
from ..jobs.cancels import CancelWatch
from ..pack.feeding import AHEAD, queued_items
from ..pack.packer import ConsumerSpec, Packer
from ..pack.shapes import ItemShapes
from ..ring import layout as L
from ..ring.items import Status
from ..ring.ring import CONSUMER, PRODUCER
from ..ring.waits import SLEEP_SLICE_SECONDS, sleep_on
from ..ring.wire import LOC_DTYPE, announced_subset, batch_meta_words, read_announcement
from ..spill.locate import record_locations
from ..spill.store import Backlog
from ..spill.waiting import WaitingQueue
from .admission import Admission
from .pending import (
    GAUGES,
    NO_ITEM_NS,
    S_BATCHES,
    S_FAMILIES,
    S_HELD_BACK,
    S_INDEXED_ITEMS,
    S_INDEXED_TOKENS,
    S_ITEMS,
    S_OLDEST,
    S_OVERFLOW,
    S_RECOVERED_CORRUPT,
    S_RECOVERED_UNNAMED,
    S_WAITING,
    Arrivals,
    Pending,
)

POP_RECORDS = 64
GAUGE_SECONDS = 0.25  # the oldest-item age and the index's families are refreshed this often
REFILL_ROWS = 1 << 16  # waiting items read back from disk (and hashed) at a time
FAILED_ROWS_MAX = 4096  # failed rows one batch record carries at most (a cancel fails a whole job)

class Scheduler(Admission):
    def __init__(self, cfg, modes: list[str], appended, batch_rings, bell, values=None):
        self.cfg = cfg
        specs = [ConsumerSpec(c.name, c.contract, m) for c, m in zip(cfg.consumers, modes)]
        self.capacity = cfg.index_items
        self.packer = Packer(specs, capacity=self.capacity, max_wait_seconds=cfg.max_wait_seconds,
                             tolerance=cfg.padding_tolerance)
        # per model: the longest item some consumer takes; longer ones are failed at admission
        # (`_unservable`), so the packer's walks never meet one (its `batch.failed` stays empty)
        self.model_max: dict[int, int] = self.packer.model_max
        self.appended = appended
        self.batches = batch_rings
        self.bell = bell
        # statistics (stats.SCHED): the StatsWriter's values in the process, a private array in tests
        self.values = values if values is not None else np.zeros(len(SCHED), np.int64)
        self.pending = Pending(cfg, self.values)
        self.arrivals = Arrivals(self.capacity)
        self.slots = np.zeros(self.capacity, LOC_DTYPE)
        self.free = np.arange(self.capacity - 1, -1, -1, dtype=np.int64)  # a stack: free[:num_free]
        self.num_free = self.capacity
        # beyond the index: what a start recovered and what came while the index was full waits on
        # disk in arrival order (`spill.waiting`), indexed as batches free room; `front` holds, in
        # memory and ahead of it, the (locs, hash_offsets, hashes, arrival_ns) the index could not
        # take of what was read back (at most REFILL_ROWS items)
        self.front: deque = deque()
        self.waiting = WaitingQueue(cfg.data_dir, cfg.segment_bytes)
        self.failed: list[np.ndarray] = []  # LOC rows with aux = status, waiting for a batch record
        self.high: dict[int, int] = {}  # per writer: sequence numbers below were seen by the start scan
        self.t0 = time.monotonic()
        self._pop = (np.empty(max(r.max_tokens for r in appended) if appended else 1, np.uint32),
                     np.empty(POP_RECORDS + 1, np.int64), np.empty(POP_RECORDS, np.uint64),
                     np.empty((POP_RECORDS, L.META_WORDS), np.uint32))
        self.held: list = [None] * len(batch_rings)  # a packed batch its full ring could not take yet
        # per consumer: the items of each record pushed and not yet released (the ring's counters say
        # how many records were released), and the undone items the consumer's window needs queued
        self.pushed_items: list[deque] = [deque() for _ in batch_rings]
        self.undone_items = [0] * len(batch_rings)
        self.queued_items = [queued_items(c.contract.max_batch_size, m) for c, m in zip(cfg.consumers, modes)]
        self.num_batches = 0
        self.cancels = CancelWatch(cfg.data_dir)  # cancelled jobs (`jobs/cancels.py`), read before any item
        self.cancelled = np.array(sorted(self.cancels.poll() or ()), np.uint64)  # their producer ids, sorted

    # -- taking items in --------------------------------------------------------------------

    def recover(self, data_dir: str) -> dict:
        """Index what the backlog on disk holds and is not done. A record that failed its CRC but names
        its item (`Backlog.corrupt`) rides the next batch record as a failed row (`corrupt`), so a GPU
        process writes its result and the results process acks it, as for any item no consumer can
        take; damage that names no item is counted (`recovered_unnamed_corrupt`)."""
        t0 = time.perf_counter()
        backlog, report = Backlog.open(data_dir, segment_bytes=self.cfg.segment_bytes, readonly=True)
        try:
            self.high = {w: s.next_seq for w, s in backlog._writers.items()}
            pending = backlog.pending()
            corrupt = record_locations(backlog.corrupt())
        finally:
            backlog.close()
        if corrupt.size:
            corrupt["aux"] = Status.CORRUPT
            self.failed.append(corrupt)
        self.values[S_RECOVERED_CORRUPT] = corrupt.size
        self.values[S_RECOVERED_UNNAMED] = report.unnamed_corrupt
        items, tokens = int(pending.size), int(pending["num_tokens"].sum()) if pending.size else 0
        # every recovered record counts as pending now; they wait on disk and are read back, their
        # block hashes computed, as the index has room (`_refill`)
        self.pending.count(pending["model"], pending["num_tokens"], 1)
        for at in range(0, pending.size, REFILL_ROWS):
            self.waiting.append(record_locations(pending[at : at + REFILL_ROWS]), time.monotonic_ns())
        del pending
        self._waited()
        self._refill()
        return {"seconds": time.perf_counter() - t0, "items": items, "tokens": tokens, "corrupt": int(corrupt.size),
                "unnamed_corrupt": report.unnamed_corrupt, "on_disk": self.waiting.in_memory == 0, "scan": report.as_dict()}

    def _behind(self) -> bool:
        """Whether items wait beyond the index (a new one goes behind them)."""
        return bool(self.front) or len(self.waiting) > 0

    def _in_memory(self) -> int:
        """Items beyond the index held in memory: `front`, and those waiting while the disk was full."""
        return sum(e[0].size for e in self.front) + self.waiting.in_memory

    def _waited(self) -> None:
        """Refresh the gauges of what waits beyond the index."""
        self.values[S_OVERFLOW] = self._in_memory()
        self.values[S_WAITING] = len(self.waiting) - self.waiting.in_memory

    def take_announcements(self) -> int:
        """Take what ingest appended. Beyond a full index items wait on disk; only when the disk is
        full do they wait in memory, and past `overflow_items` of those announcements wait in their
        rings (back-pressure: ingest, then producers, wait), so the scheduler's memory is bounded by
        the index and that (plus one announcement: up to ingest.BATCH_RECORDS items)."""
        tokens, offsets, keys, meta = self._pop
        total = 0
        for ring in self.appended:
            held = self.waiting.in_memory
            if held >= self.cfg.overflow_items:
                self.values[S_HELD_BACK] += 1
                break
            # with items held in memory, one announcement at a time: the bound holds to one announcement
            n = ring.pop_many(tokens, offsets, keys, meta, 1 if held else POP_RECORDS)
            for r in range(n):
                count, nh = int(meta[r, 0]), int(meta[r, 1])
                locs, hash_offsets, hashes = read_announcement(tokens[offsets[r] : offsets[r + 1]], count, nh)
                if self.high:
                    hw = self.high.get(int(locs["writer"][0]))
                    if hw is not None and int(locs["seq"].min()) < hw:
                        keep = locs["seq"] >= hw  # the start scan saw these already
                        locs, hash_offsets, hashes = announced_subset(locs, hash_offsets, hashes, keep)
                self.add(locs, hash_offsets, hashes)
                total += count
        return total

    def add(self, locs: np.ndarray, hash_offsets: np.ndarray, hashes: np.ndarray) -> None:
        if locs.size == 0:
            return
        locs, hash_offsets, hashes = self._servable(locs, hash_offsets, hashes)
        if locs.size == 0:
            return
        self.pending.count_locs(locs, 1)
        now_ns = time.monotonic_ns()
        if self._behind():  # behind what is older; its block hashes are computed again when read back
            self.waiting.append(locs, now_ns)
            self._waited()
            return
        self._index(locs, hash_offsets, hashes, now_ns)

    def _index(self, locs, hash_offsets, hashes, arrival_ns: int) -> int:
        n = min(locs.size, self.num_free)
        if n:
            slots = self.free[self.num_free - n : self.num_free][::-1].copy()
            self.slots[slots] = locs[:n]
            lengths = locs["num_tokens"][:n].astype(np.int64)
            models = locs["model"][:n].astype(np.int64)
            # the index reads families, lengths, models and block hashes (no bases: those are the
            # cache models')
            shapes = ItemShapes(locs["prefix_key"][:n].copy(), hash_offsets[: n + 1] - hash_offsets[0],
                                hashes[hash_offsets[0] :], lengths, models, None, self.cfg.block_tokens)
            added = self.packer.add_many(slots.astype(np.uint64), time.monotonic() - self.t0, shapes,
                                         locs["max_new_tokens"][:n].astype(np.int64))
            self.num_free -= added
            self.arrivals.add(slots[:added], arrival_ns)
            self.values[S_INDEXED_ITEMS] += added
            self.values[S_INDEXED_TOKENS] += int(lengths[:added].sum())
            n = added
        if n < locs.size:  # ahead of what waits on disk
            self.front.appendleft((*announced_subset(locs, hash_offsets, hashes, np.arange(locs.size) >= n), arrival_ns))
            self._waited()
        return n

    def _refill(self) -> None:
        """Move what waits beyond the index into it (`front`, then the disk) as batches free room."""
        while self.num_free and self.front:
            entry = self.front.popleft()
            if self._index(*entry) == 0:
                break
        while self.num_free and not self.front and len(self.waiting):
            (locs, hash_offsets, hashes, arrival_ns), gone = self.waiting.take(
                min(self.num_free, REFILL_ROWS), self.cfg.block_tokens)
            self.pending.count(gone["model"], gone["num_tokens"], -1)  # done meanwhile
            locs, hash_offsets, hashes = self._servable(locs, hash_offsets, hashes, counted=True)
            if locs.size:
                self._index(locs, hash_offsets, hashes, arrival_ns)
        self._waited()

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(self) -> int:
        """Top up every consumer's batch ring, one record per consumer a round (so a consumer with
        a deep window does not take a small backlog from the others); the number of records pushed."""
        pushed = 0
        now = time.monotonic() - self.t0
        active = list(range(len(self.batches)))
        while active:
            active = [c for c in active if self._push_one(c, now)]
            pushed += len(active)
        if self._behind():
            self._refill()
        return pushed

    def _push_one(self, c: int, now: float) -> bool:
        """Push consumer c's next record if its ring wants one; False when it wants none, there is
        none, or the ring is full."""
        ring = self.batches[c]
        sizes = self.pushed_items[c]
        undone = ring.num_queued()
        while len(sizes) > undone:  # released since: their items are done
            self.undone_items[c] -= sizes.popleft()
        if undone >= AHEAD and self.undone_items[c] >= self.queued_items[c]:
            return False
        record = self.held[c]
        if record is None:
            record = self._next_record(c, now)
            if record is None:
                return False
        payload, n_run, n_failed, packed_ns = record  # the GPU process counts its wait from packed_ns
        if ring.push(payload, self.num_batches, *batch_meta_words(n_run, n_failed, packed_ns)) != L.OK:
            self.held[c] = record
            return False
        self.held[c] = None
        sizes.append(n_run + n_failed)
        self.undone_items[c] += n_run + n_failed
        self.num_batches += 1
        self.values[S_BATCHES] += 1
        self.values[S_ITEMS] += n_run
        return True

    def _next_record(self, c: int, now: float):
        batch = self.packer.next_batch(c, now)
        rows = []
        n_run = 0
        if batch is not None:
            slots = batch.handles.astype(np.int64)
            run = self.slots[slots].copy()
            run["aux"] = 0
            rows.append(run)
            n_run = run.size
            self._free(slots)
            if n_run:
                self.pending.count_locs(run, -1)
            assert not batch.failed, "too-long items are failed at admission (`_unservable`), not by the packer"
        room = FAILED_ROWS_MAX
        while self.failed and room:  # a bounded record: the rest rides the next ones
            part = self.failed.pop(0)
            if part.size > room:
                self.failed.insert(0, part[room:])
                part = part[:room]
            rows.append(part)
            room -= part.size
        if not rows:
            return None
        locs = np.concatenate(rows) if len(rows) > 1 else rows[0]
        return locs.view(np.uint32).reshape(-1), n_run, locs.size - n_run, time.monotonic_ns()

    def _free(self, slots: np.ndarray) -> None:
        self.arrivals.drop(slots)
        k = slots.size
        self.free[self.num_free : self.num_free + k] = slots
        self.num_free += k

    def close(self) -> None:
        """Drop what waits on disk (the next start's scan finds it again)."""
        self.waiting.close()

    def refresh_gauges(self) -> None:
        """The gauges a loop round does not keep: families in the index, the oldest waiting item."""
        v = self.values
        v[S_FAMILIES] = self.packer.index.num_families
        oldest = self.arrivals.oldest_ns()
        if self.front:
            oldest = min(oldest, int(self.front[0][3]))
        head = self.waiting.head_arrival_ns()
        if head is not None:
            oldest = min(oldest, head)
        v[S_OLDEST] = 0 if oldest == NO_ITEM_NS else oldest

    # -- waiting ------------------------------------------------------------------------------

    def wait(self, timeout_seconds: float) -> None:
        """Sleep on the shared doorbell until an announcement or a batch ring's space, or the timeout."""
        sleep_on(self.bell, self.appended, self.batches, timeout_seconds)


def sched_main(cfg, modes, control, appended_rings, batch_rings, bell, stopping) -> None:
    from ..control.stats import StatsWriter

    role = control.roles.index(roles.SCHED.name)
    slot = control.role(role)
    stats = StatsWriter(control, role)
    stats.values[list(GAUGES)] = 0  # this incarnation's own view: it rebuilds the index from disk
    appended = [r.attach(CONSUMER) for r in appended_rings]
    batches = [r.attach(PRODUCER) for r in batch_rings]
    sched = Scheduler(cfg, modes, appended, batches, bell, stats.values)
    next_gauges = 0.0
    try:
        sched.recover(cfg.data_dir)
        while not stopping():
            beat(slot)
            got = sched.take_announcements()
            sent = sched.dispatch()
            now = time.monotonic()
            if now >= next_gauges:
                cancelled = sched.cancels.poll()
                if cancelled:
                    sched.cancel(cancelled)
                sched.refresh_gauges()
                next_gauges = now + GAUGE_SECONDS
                stats.publish()
            elif got or sent:
                stats.publish()
            if got == 0 and sent == 0:
                try:
                    sched.wait(SLEEP_SLICE_SECONDS)
                except PeerDead:
                    pass
    finally:
        sched.close()
        for r in appended + batches:
            r.close()
