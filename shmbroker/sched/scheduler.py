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
consumer serves their model, no tokens, longer than every contract of their model) and items of
cancelled jobs ride the next batch record as failed rows (`admission.py`), so a GPU process writes
their result. When nothing is to be done it sleeps on one doorbell that both the appended rings
(data) and the batch rings (space) ring. Its statistics words and gauges (pending items per
model, the oldest item's age) are `pending.py`'s.

The `Scheduler` is the loop's decisions; what it decides over are objects of their own: the index
slots (`slots.py`), admission (`admission.py`), what waits beyond the index (`beyond.py`), the
failed rows and the consumers' batch rings (`records.py`).
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from ..control import roles
from ..control.segment import beat
from ..control.stats import SCHED
from ..errors import PeerDead
from ..jobs.cancels import CancelWatch
from ..pack.feeding import queued_items
from ..pack.packer import ConsumerSpec, Packer
from ..pack.shapes import ItemShapes, family_bases
from ..ring import layout as L
from ..ring.items import Status
from ..ring.ring import CONSUMER, PRODUCER
from ..ring.waits import SLEEP_SLICE_SECONDS, sleep_on
from ..ring.wire import Announcement, read_announcement
from ..spill.locate import record_locations
from ..spill.store import Backlog
from .admission import Admission
from .beyond import Arrived, BeyondIndex
from .hold import JobHold
from .pending import (
    GAUGES,
    S_BATCHES,
    S_FAMILIES,
    S_HELD_BACK,
    S_INDEXED_ITEMS,
    S_INDEXED_TOKENS,
    S_ITEMS,
    S_OLDEST,
    S_RECOVERED_CORRUPT,
    S_RECOVERED_UNNAMED,
    Pending,
)
from .records import BatchRecord, FailedRows, Feed, batch_record
from .slots import NO_ITEM_NS, SlotTable

POP_RECORDS = 64
GAUGE_SECONDS = 0.25  # the oldest-item age and the index's families are refreshed this often
REFILL_ROWS = 1 << 16  # waiting items read back from disk (and hashed) at a time
KEY_ROWS = 1 << 13  # recovered items put in their prefix groups a loop round (their block hashes read)


class PopBuffers(NamedTuple):
    """Where `Ring.pop_many` copies the appended rings' records: payload words, record offsets,
    keys, meta words (POP_RECORDS records at a time)."""

    tokens: np.ndarray
    offsets: np.ndarray
    keys: np.ndarray
    meta: np.ndarray

    @classmethod
    def for_rings(cls, rings) -> PopBuffers:
        return cls(np.empty(max(r.max_tokens for r in rings) if rings else 1, np.uint32),
                   np.empty(POP_RECORDS + 1, np.int64), np.empty(POP_RECORDS, np.uint64),
                   np.empty((POP_RECORDS, L.META_WORDS), np.uint32))


class Scheduler:
    """The packing index and what feeds it and drains it. It owns
    - `packer`: the index and the policies that pick each consumer's next batch (`pack/`);
    - `table`: the index slots, the packer's handles (`slots.SlotTable`);
    - `admission`: which items some consumer can take (`admission.Admission`);
    - `beyond`: what waits for room in the index, in memory and on disk (`beyond.BeyondIndex`);
    - `failed`: the rows failed back, waiting for a batch record (`records.FailedRows`);
    - `feeds`: each consumer's batch ring and the record held for it (`records.Feed`);
    - `pending`: the pending gauges in the statistics words `values` (`pending.Pending`)."""

    def __init__(self, cfg, modes: list[str], appended, batch_rings, bell, values=None):
        self.cfg = cfg
        specs = [ConsumerSpec(c.name, c.contract, m) for c, m in zip(cfg.consumers, modes)]
        self.packer = Packer(specs, capacity=cfg.index_items, max_wait_seconds=cfg.max_wait_seconds,
                             tolerance=cfg.padding_tolerance, step_tokens=cfg.decode_step_tokens)
        self.appended = appended
        self.batches = batch_rings
        self.bell = bell
        # statistics (stats.SCHED): the StatsWriter's values in the process, a private array in tests
        self.values = values if values is not None else np.zeros(len(SCHED), np.int64)
        self.pending = Pending(cfg, self.values)
        self.table = SlotTable(cfg.index_items)
        self.cancels = CancelWatch(cfg.data_dir)  # cancelled jobs (`jobs/cancels.py`), read before any item
        self.hold = JobHold(cfg.data_dir, cfg.job_hold_seconds)  # jobs still arriving (`hold.py`)
        # items longer than every contract of their model are refused here against the packer's
        # model_max, so its walks never meet one (its `batch.failed` stays empty)
        self.admission = Admission(self.packer.model_max, self.cancels.poll() or (), self.values)
        # a group up to a quarter of the index (and of one read-back) waits for room to enter whole
        self.beyond = BeyondIndex(cfg.data_dir, cfg.segment_bytes, self.values,
                                  max(1, min(cfg.index_items // 4, REFILL_ROWS)))
        self.failed = FailedRows()
        self.feeds = [Feed(r, queued_items(c.contract.max_batch_size, m))
                      for r, c, m in zip(batch_rings, cfg.consumers, modes)]
        self.high: dict[int, int] = {}  # per writer: sequence numbers below were seen by the start scan
        self.t0 = time.monotonic()
        self._pop = PopBuffers.for_rings(appended)
        self.num_batches = 0

    @property
    def slots(self) -> np.ndarray:
        """The LOC row of each index slot (a free slot's row is stale)."""
        return self.table.rows

    # -- taking items in --------------------------------------------------------------------

    def recover(self, data_dir: str) -> dict:
        """Index what the backlog on disk holds and is not done. A record that failed its CRC but names
        its item (`Backlog.corrupt`) rides the next batch record as a failed row (`corrupt`), so a GPU
        process writes its result and the results process acks it, as for any item no consumer can
        take; damage that names no item is counted (`recovered_unnamed_corrupt`)."""
        t0 = time.perf_counter()
        backlog, report = Backlog.open(data_dir, segment_bytes=self.cfg.segment_bytes, readonly=True)
        try:
            self.high = backlog.next_seqs()
            pending = backlog.pending()
            corrupt = record_locations(backlog.corrupt())
        finally:
            backlog.close()
        corrupt["aux"] = Status.CORRUPT
        self.failed.append(corrupt)
        self.values[S_RECOVERED_CORRUPT] = corrupt.size
        self.values[S_RECOVERED_UNNAMED] = report.unnamed_corrupt
        items, tokens = int(pending.size), int(pending["num_tokens"].sum()) if pending.size else 0
        # every recovered record counts as pending now; they wait on disk, in their prefix groups
        # (block hashes read from the backlog), and enter the index as it has room (`_refill`)
        self.pending.count(pending["model"], pending["num_tokens"], 1)
        for at in range(0, pending.size, REFILL_ROWS):
            self.beyond.append_recovered(record_locations(pending[at : at + REFILL_ROWS]), time.monotonic_ns())
        self.beyond.key_some(REFILL_ROWS, self.cfg.block_tokens)  # enough to fill the index; the rest a slice a round
        del pending
        self.beyond.count()
        self._refill()
        return {"seconds": time.perf_counter() - t0, "items": items, "tokens": tokens, "corrupt": int(corrupt.size),
                "unnamed_corrupt": report.unnamed_corrupt, "on_disk": self.beyond.rows_in_memory == 0,
                "scan": report.as_dict()}

    def take_announcements(self) -> int:
        """Take what ingest appended. Beyond a full index items wait on disk; only when the disk is
        full do they wait in memory, and past `overflow_items` of those announcements wait in their
        rings (back-pressure: ingest, then producers, wait), so the scheduler's memory is bounded by
        the index and that (plus one announcement: up to ingest.BATCH_RECORDS items)."""
        tokens, offsets, keys, meta = self._pop
        total = 0
        for ring in self.appended:
            held = self.beyond.rows_in_memory
            if held >= self.cfg.overflow_items:
                self.values[S_HELD_BACK] += 1
                break
            # with items held in memory, one announcement at a time: the bound holds to one announcement
            n = ring.pop_many(tokens, offsets, keys, meta, 1 if held else POP_RECORDS)
            for r in range(n):
                count, nh = int(meta[r, 0]), int(meta[r, 1])
                self.add(self._unseen(read_announcement(tokens[offsets[r] : offsets[r + 1]], count, nh)))
                total += count
        return total

    def _unseen(self, ann: Announcement) -> Announcement:
        """The items of `ann` the start scan did not see (sequence numbers from its end on, per writer)."""
        if self.high and ann.locs.size:
            hw = self.high.get(int(ann.locs["writer"][0]))
            if hw is not None and int(ann.locs["seq"].min()) < hw:
                return ann.subset(ann.locs["seq"] >= hw)
        return ann

    def add(self, ann: Announcement) -> None:
        """Take announced items: refused ones to the failed rows, the others into the index, or behind
        what waits beyond it."""
        if ann.locs.size == 0:
            return
        ann = self._admit(ann)
        if ann.locs.size == 0:
            return
        self.pending.count_locs(ann.locs, 1)
        now_ns = time.monotonic_ns()
        # behind what waits, in its groups (hashed again when read back); a job still arriving waits too
        if self.beyond or self.hold.holds(ann.locs, len(self.packer)):
            self.beyond.append(ann, now_ns)
            return
        self._index(Arrived(ann, now_ns))

    def watch_jobs(self) -> None:
        """Obey the cancels and the jobs still arriving, as their files say now."""
        cancelled = self.cancels.poll()
        if cancelled:
            self.cancel(cancelled)
        self.hold.poll()

    def _admit(self, ann: Announcement, counted: bool = False) -> Announcement:
        """The items of `ann` some consumer can take; the others go to the failed rows (and, `counted`:
        already counted pending, out of the gauges)."""
        servable, refused = self.admission.split(ann)
        if refused.size:
            self.failed.append(refused)
            if counted:
                self.pending.count_locs(refused, -1)
        return servable

    def _index(self, arrived: Arrived) -> int:
        """Put items into the index; those it has no room for go to the front of what waits beyond it.
        The number indexed."""
        locs, hash_offsets, hashes = arrived.items
        n = min(locs.size, self.table.num_free)
        if n:
            slots = self.table.free_slots(n)
            lengths = locs["num_tokens"][:n].astype(np.int64)
            models = locs["model"][:n].astype(np.int64)
            # the index reads families, lengths, models, block hashes and the tokens under each family key
            shapes = ItemShapes(locs["prefix_key"][:n].copy(), hash_offsets[: n + 1] - hash_offsets[0],
                                hashes[hash_offsets[0] :], lengths, models,
                                family_bases(locs["prefix_len"][:n], lengths, self.cfg.block_tokens),
                                self.cfg.block_tokens)
            n = self.packer.add_many(slots.astype(np.uint64), time.monotonic() - self.t0, shapes,
                                     locs["max_new_tokens"][:n].astype(np.int64))
            self.table.fill(slots[:n], locs[:n], arrived.arrival_ns)
            self.values[S_INDEXED_ITEMS] += n
            self.values[S_INDEXED_TOKENS] += int(lengths[:n].sum())
        if n < locs.size:  # ahead of what waits on disk
            self.beyond.put_front(Arrived(arrived.items.subset(np.arange(locs.size) >= n), arrived.arrival_ns))
        return n

    def _refill(self) -> None:
        """Move what waits beyond the index into it (the front, then the disk) as batches free room."""
        while self.table.num_free:
            arrived = self.beyond.pop_front()
            if arrived is None or self._index(arrived) == 0:
                break
        while self.table.num_free and self.beyond.on_disk() and not self.hold.head_held(self.beyond, len(self.packer)):
            back = self.beyond.read_back(min(self.table.num_free, REFILL_ROWS), self.cfg.block_tokens)
            if back is None:  # the oldest row's group waits for more room
                break
            self.pending.count(back.gone["model"], back.gone["num_tokens"], -1)  # done meanwhile
            items = self._admit(back.arrived.items, counted=True)
            if items.locs.size:
                self._index(Arrived(items, back.arrived.arrival_ns))

    def cancel(self, producer_ids) -> int:
        """Answer `cancelled` for every item of these producers not yet dispatched: those in the index
        and in the front now, those on disk and those still to come as admission meets them. The items
        in batch records already pushed (or held for a full ring) run. The number answered now."""
        self.admission.cancel(producer_ids)
        slots, handles = self.packer.index.live()
        handles = handles.astype(np.int64)
        gone = self.admission.is_cancelled(self.table.rows[handles])
        for slot in slots[gone].tolist():
            self.packer.index.remove(slot)
        out = [self.table.release(handles[gone])]
        out += self.beyond.drop_front(self.admission.is_cancelled)
        failed = np.concatenate(out)
        failed["aux"] = Status.CANCELLED
        self.pending.count_locs(failed, -1)
        self.failed.append(failed)
        self.admission.count_cancelled(failed.size)
        return int(failed.size)

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(self) -> int:
        """Top up every consumer's batch ring, one record per consumer a round (so a consumer with
        a deep window does not take a small backlog from the others); the number of records pushed."""
        pushed = 0
        now = time.monotonic() - self.t0
        active = list(range(len(self.feeds)))
        while active:
            active = [c for c in active if self._push_one(c, now)]
            pushed += len(active)
        if self.beyond:
            self._refill()
        return pushed

    def key_backlog(self) -> int:
        """Put a slice of what a start recovered in its prefix groups (a loop round's worth, so
        dispatch is never held up long); the rows put."""
        return self.beyond.key_some(KEY_ROWS, self.cfg.block_tokens) if self.beyond.unkeyed else 0

    def _push_one(self, c: int, now: float) -> bool:
        """Push consumer c's next record if its ring wants one; False when it wants none, there is
        none, or the ring is full (the record is held for it)."""
        feed = self.feeds[c]
        if not feed.wants():
            return False
        record = feed.take_held()
        if record is None:
            record = self._next_record(c, now)
        if record is None or not feed.push(record, self.num_batches):
            return False
        self.num_batches += 1
        self.values[S_BATCHES] += 1
        self.values[S_ITEMS] += record.n_run
        return True

    def _next_record(self, c: int, now: float) -> BatchRecord | None:
        """Consumer c's next batch, with the next failed rows; None when there are neither."""
        batch = self.packer.next_batch(c, now)
        run = None
        if batch is not None:
            assert not batch.failed, "too-long items are refused at admission, not failed by the packer"
            run = self.table.release(batch.handles.astype(np.int64))
            run["aux"] = 0
            if run.size:
                self.pending.count_locs(run, -1)
        return batch_record(run, self.failed)

    def close(self) -> None:
        """Drop what waits beyond the index (the next start's scan finds it again on disk)."""
        self.beyond.close()

    def refresh_gauges(self) -> None:
        """The gauges a loop round does not keep: families in the index, the oldest waiting item."""
        v = self.values
        v[S_FAMILIES] = self.packer.index.num_families
        oldest = self.table.oldest_ns()
        beyond = self.beyond.oldest_ns()
        if beyond is not None:
            oldest = min(oldest, beyond)
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
            keyed = sched.key_backlog()
            now = time.monotonic()
            if now >= next_gauges:
                sched.watch_jobs()
                sched.refresh_gauges()
                next_gauges = now + GAUGE_SECONDS
                stats.publish()
            elif got or sent or keyed:
                stats.publish()
            if got == 0 and sent == 0 and keyed == 0:
                try:
                    sched.wait(SLEEP_SLICE_SECONDS)
                except PeerDead:
                    pass
    finally:
        sched.close()
        for r in appended + batches:
            r.close()
