"""Ingest: drain every producer's ring, zero-copy, in batches, sleeping on one doorbell.

`RingSet` is the consumer side of all producer ingest rings. The registry gives
every ingest ring the same data doorbell, so when all rings are empty the
drainer announces a sleep in each ring's header, looks once more, and sleeps
on that one doorbell; any producer that commits a record into an announced
ring rings it. `drain_once` hands each ring's committed records to a callback
as positions into the ring's data words (no copy) and consumes them when the
callback returns, so a record is never lost to a crash inside the callback
(at-least-once).

`BacklogAppender` is the callback that makes records durable: it turns a
ring's records into one backlog append (`spill.collect`), so they are
released from the ring only once committed to the backlog. A full disk
raises `DiskFull` before anything of the batch is written: the records stay
in the ring, the ring fills, and producers wait or get `Full`
(back-pressure); `pump` backs off and retries.

A producer may write anything into its ring (a bug, or on purpose): the rings
are attached `untrusted` (`ring.ring`: the geometry is the broker's own), a
record whose fields fail their checks is refused alone (`spill.collect`:
counted, its neighbours go on), and a ring whose frame is broken (a corrupt
record: `RingCorrupt`) is closed with the reason (`closing.close_ring_for`: its
producer's next wait raises `RingClosed`) and set aside, so one producer
never stalls or crashes the loop that drains every other.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from ..control import roles
from ..control.roles import Kind
from ..control.segment import beat
from ..control.stats import StatsWriter, slot_of
from ..errors import DiskFull, Full, PeerDead
from ..frontdoor.registry import ProducerEntry, Registry
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, chain_items, count_blocks
from ..ring import layout as L
from ..ring.items import NO_PREFIX, REFUSALS
from ..ring.ring import CONSUMER, PRODUCER, Ring
from ..ring.shm import Doorbell, Segment, unlink_name
from ..ring.waits import SLEEP_SLICE_SECONDS
from ..ring.closing import close_ring, peek_closed, set_closed_tail
from ..ring.wire import new_announcement
from ..spill.collect import collect
from ..spill.layout import ITEM_DTYPE, RECORD_HEADER_BYTES
from ..spill.locate import fill_locations
from ..spill.writer import SegmentWriter
from .sources import BATCH_RECORDS, OnRecords, RingSet  # noqa: F401 (RingSet: tests drive it)

DISK_FULL_BACKOFF_SECONDS = 0.05
IDLE_SECONDS_MIN = 0.005  # a round with no producer's ring to wait on sleeps at least this
# the ingest process's statistics words (stats.INGEST), by name
I_ITEMS, I_TOKENS, I_BYTES, I_BATCHES, I_DISK_FULL = (
    slot_of(Kind.INGEST, k) for k in ("items", "tokens", "bytes", "batches", "disk_full"))
I_REFUSED = slot_of(Kind.INGEST, f"refused_{REFUSALS[0]}")  # refused_<reason>, one per REFUSALS, in order
I_RINGS_CLOSED = slot_of(Kind.INGEST, "rings_closed")
assert [slot_of(Kind.INGEST, f"refused_{r}") for r in REFUSALS] == list(range(I_REFUSED, I_REFUSED + len(REFUSALS)))


class Appended(NamedTuple):
    """What one `BacklogAppender.append` made durable, and where: the records' tokens (flat, item i at
    flat[offsets[i]:offsets[i + 1]]), their ITEM_DTYPE rows, and each one's writer sequence number,
    segment (its first_seq) and byte offset there. Views of the appender's buffers, valid until its
    next append."""

    flat: np.ndarray
    offsets: np.ndarray
    items: np.ndarray
    seqs: np.ndarray
    segments: np.ndarray
    rec_offsets: np.ndarray


class BacklogAppender:
    """`drain_once` callback: append a ring's records to this ingest process's backlog writer."""

    def __init__(self, writer: SegmentWriter, block_tokens: int = DEFAULT_BLOCK_TOKENS):
        self.writer = writer
        self.block_tokens = block_tokens
        self._flat = np.empty(0, np.uint32)
        self._offsets = np.empty(BATCH_RECORDS + 1, np.int64)
        self._items = np.empty(BATCH_RECORDS, ITEM_DTYPE)
        self.num_items = 0
        self.num_tokens = 0
        self.num_disk_full = 0
        self.refused = np.zeros(len(REFUSALS), np.int64)  # records refused, by REFUSALS
        self.refused_now = np.zeros(len(REFUSALS), np.int64)  # of the last `append`

    def __call__(self, entry: ProducerEntry, ring: Ring, positions: np.ndarray, count: int) -> None:
        self.append(entry.producer_id, ring.buf, positions, count)

    def append(self, producer_id: int, ring_buf: np.ndarray, positions: np.ndarray, count: int) -> Appended | None:
        """Append the records at `positions` of a ring (its whole segment, `ring_buf`) to the backlog,
        less those refused (`refused_now`): what was appended, and where; None when every record was
        refused."""
        data = ring_buf[L.HEADER_BYTES :]
        words = data.view(np.uint32)
        if self._flat.size < words.size:
            self._flat = np.empty(words.size, np.uint32)
        self.refused_now[:] = 0
        count, total = collect(words, data.view(np.uint64), positions, count, producer_id, self.block_tokens,
                               self._flat, self._offsets, self._items, self.refused_now)
        if count == 0:
            self.refused += self.refused_now
            return None
        flat, offsets, items = self._flat[:total], self._offsets[: count + 1], self._items[:count]
        try:
            seqs, segments, rec_offsets = self.writer.append_many(flat, offsets, items)
        except DiskFull:
            self.num_disk_full += 1
            raise  # nothing written: drain_once does not release, the ring keeps the records
        self.refused += self.refused_now
        self.num_items += count
        self.num_tokens += total - int(items["flags"].sum())  # option words are no tokens
        return Appended(flat, offsets, items, seqs, segments, rec_offsets)


def ingest_round(rings: RingSet, on_records: OnRecords, wait_seconds: float, left: LeftRings | None = None,
                 counters: np.ndarray | None = None) -> int:
    """One round of the ingest loop, the process's (`ingest_main`) and the tests' (`pump`): drain the
    producers' rings (and the rings a dead broker `left`), wait up to wait_seconds when there was
    nothing, back off on a full disk (counted in `counters`); the records drained."""
    try:
        n = rings.drain_once(on_records)
        if left:
            n += left.drain(on_records, time.monotonic())
    except DiskFull:
        if counters is not None:
            counters[I_DISK_FULL] += 1
        time.sleep(DISK_FULL_BACKOFF_SECONDS)
        return 0
    if n == 0:
        if rings.sources:
            rings.wait(wait_seconds)
        else:
            rings.bell.sleep(max(wait_seconds, IDLE_SECONDS_MIN))
    return n


def pump(rings: RingSet, registry: Registry, on_records: OnRecords, wait_seconds: float = SLEEP_SLICE_SECONDS) -> int:
    """The ingest loop's round for a broker side in a test: producers attach from a `Registry` (the
    process reads its control table instead), then `ingest_round`."""
    rings.refresh(registry)
    return ingest_round(rings, on_records, wait_seconds)


# -- the ingest process ----------------------------------------------------------------------

class Announcer:
    """`drain_once` callback of an ingest process: append a ring's records to the backlog, then tell
    the scheduler where they are (one record on the appended ring: item locations and block hashes).
    The producer's ring is released only after both, so a crash in between redelivers (at-least-once)."""

    def __init__(self, appender: BacklogAppender, appended: Ring, stopping, counters=None):
        self.appender = appender
        self.appended = appended
        self.stopping = stopping
        self.counters = counters
        self.writer = appender.writer
        self._hash_offsets = np.empty(BATCH_RECORDS + 1, np.int64)
        self._hashes = np.empty(0, np.uint64)
        self._prefixes = np.empty(BATCH_RECORDS, np.int64)

    def __call__(self, entry, ring: Ring, positions: np.ndarray, count: int) -> None:
        app = self.appender
        appended = app.append(entry.producer_id, ring.buf, positions, count)
        if self.counters is not None and app.refused_now.any():
            self.counters[I_REFUSED : I_REFUSED + len(REFUSALS)] += app.refused_now
        if appended is None:
            return
        flat, offsets, items = appended.flat, appended.offsets, appended.items
        count = items.size
        option_words = items["flags"]  # an item's payload: its tokens, then its option words
        with_options = bool(option_words.any())
        lengths = np.diff(offsets) - option_words if with_options else np.diff(offsets)
        total = int(flat.size - option_words.sum()) if with_options else flat.size
        prefixes = self._prefixes[:count]
        declared = items["prefix_len"]
        prefixes[:] = np.where(declared == NO_PREFIX, 0, declared)
        hash_offsets = self._hash_offsets[: count + 1]
        token_offsets = np.concatenate(([0], np.cumsum(lengths))) if with_options else offsets
        nh = count_blocks(token_offsets, prefixes, app.block_tokens, hash_offsets)
        if self._hashes.size < nh:
            self._hashes = np.empty(max(nh, 2 * self._hashes.size), np.uint64)
        hashes = self._hashes[:nh]
        # the family keys are collect's (`prefix_key`): hash only the blocks below them
        chain_items(flat, offsets[:-1], lengths, prefixes, np.ascontiguousarray(items["prefix_key"]),
                    app.block_tokens, hash_offsets, hashes)
        payload, locs, announced_hashes = new_announcement(count, nh)
        fill_locations(locs, items, writer=self.writer.writer, segment=appended.segments, offset=appended.rec_offsets,
                       seq=appended.seqs, length=lengths)
        locs["aux"] = np.diff(hash_offsets)
        announced_hashes[:] = hashes
        push_announcement(self.appended, payload, int(appended.seqs.max()) if count else 0, count, nh, self.stopping)
        if self.counters is not None:
            c = self.counters
            c[I_ITEMS] += count
            c[I_TOKENS] += total
            c[I_BYTES] += count * RECORD_HEADER_BYTES + 4 * flat.size + 4 * int((np.diff(offsets) & 1).sum())
            c[I_BATCHES] += 1


def push_announcement(ring: Ring, payload: np.ndarray, seq: int, count: int, nh: int, stopping) -> None:
    """Push one record, waiting as long as it takes: the scheduler may be restarting (its ring
    persists); only a stop that has run out of time gives up (the records are on disk either way)."""
    while True:
        try:
            ring.push_wait(payload, seq, count, nh, 0, 0, SLEEP_SLICE_SECONDS * 4)
            return
        except (Full, PeerDead):
            ring.heartbeat()
            if stopping() == 2:
                return


LEFT_RETRY_SECONDS = 1.0


class LeftRings:
    """Ingest rings a dead broker left that the start could not salvage for lack of room
    (`salvage.salvage_at_start`): ingest process 0 tries them every `LEFT_RETRY_SECONDS` and
    announces their records like any producer's; a ring emptied is unlinked (the supervisor drops
    its name from the manifest at the stop)."""

    def __init__(self, left: list[tuple[int, str]], positions: np.ndarray) -> None:
        self.left = list(left)
        self.positions = positions
        self.next_try = 0.0

    def __len__(self) -> int:
        return len(self.left)

    def drain(self, announcer, now: float) -> int:
        """One try when due: how many records appended. DiskFull propagates (retried later)."""
        if not self.left or now < self.next_try:
            return 0
        self.next_try = now + LEFT_RETRY_SECONDS
        done = 0
        while self.left:
            producer_id, name = self.left[0]
            try:
                seg = Segment.attach(name)
            except (FileNotFoundError, ValueError):
                self.left.pop(0)
                continue
            try:
                entry = ProducerEntry(producer_id, name, 0, 0, None, None)
                if not int(seg.buf[: L.HEADER_BYTES].view(np.int64)[L.H_CLOSED_REASON]):
                    done += drain_closed(seg.buf, lambda pos, n, e=entry, s=seg: announcer(e, s, pos, n), self.positions)
            finally:
                seg.close()
            self.left.pop(0)
            unlink_name("segment", name)
        return done


def ingest_main(k: int, cfg, control, appended_ring, bell: Doorbell, stopping, left=()) -> None:
    """Ingest process k: drain the rings of producers assigned to it into backlog writer k (and, in
    process 0, the rings `left` from a dead broker that its start had no room to salvage)."""
    from ..spill.store import Backlog

    backlog, _ = Backlog.open(cfg.data_dir, segment_bytes=cfg.segment_bytes, writers={k})
    writer = backlog.writer(k, fsync=cfg.fsync, fsync_interval_ms=cfg.fsync_interval_ms)
    appended = appended_ring.attach(PRODUCER)
    role = control.roles.index(roles.ingest(k).name)
    slot = control.role(role)
    stats = StatsWriter(control, role)
    announcer = Announcer(BacklogAppender(writer, cfg.block_tokens), appended, stopping, stats.values)
    rings = RingSet(bell)
    left_rings = LeftRings(left, np.empty(BATCH_RECORDS, np.int64))
    seen_version = -1
    closed_seen = 0
    try:
        while True:
            beat(slot)
            if control.table_version != seen_version:
                seen_version = control.table_version
                table = control.producers()
                rings.retire({p.producer_id for p in table})
                known = {s.entry.producer_id for s in rings.sources} | set(rings.closed)
                for p in table:
                    if p.ingest == k and p.producer_id not in known:
                        entry = ProducerEntry(p.producer_id, p.name, 0, 0, None, None)
                        rings.add(entry, lambda p=p: Ring.attach(p.ingest_names, CONSUMER, untrusted=True))
            if stopping():
                drained = _final_drain(rings, announcer, stopping)
                if drained:
                    stats.publish()
                    break
                continue
            disk_full = int(stats.values[I_DISK_FULL])
            n = ingest_round(rings, announcer, SLEEP_SLICE_SECONDS, left_rings, stats.values)
            if rings.num_closed != closed_seen:
                stats.values[I_RINGS_CLOSED] += rings.num_closed - closed_seen
                closed_seen = rings.num_closed
                n += 1
            if n or stats.values[I_DISK_FULL] != disk_full:
                stats.publish()
    finally:
        writer.close()
        backlog.close()
        appended.close()
        rings.close()


STOP_QUIET_SECONDS = 0.1


def _final_drain(rings: RingSet, announcer, stopping) -> bool:
    """Graceful stop: drain until every ring stayed empty for a moment, then close each ring (producers
    now see it full and their broker gone) and take what landed meanwhile. True when done."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < STOP_QUIET_SECONDS:
        if rings.drain_once(announcer):
            quiet_since = time.monotonic()
        elif stopping() == 2:
            break
        else:
            time.sleep(0.005)
    for src in rings.sources:
        close_ring(src.ring.buf)
    time.sleep(0.005)
    for src in rings.sources:
        drain_closed(src.ring.buf, lambda pos, n, src=src: announcer(src.entry, src.ring, pos, n), rings.positions)
    return True


def drain_closed(buf: np.ndarray, on_records, positions: np.ndarray) -> int:
    """Hand the records a closed ring (`closing.close_ring`) still holds to `on_records(positions, n)`,
    moving its closed tail past each batch once the callback returns; how many records. A producer
    that rewrites its header cannot keep this going: at most one ring's worth, always forward."""
    h = buf[: L.HEADER_BYTES].view(np.int64)
    words = (buf.size - L.HEADER_BYTES) // 4
    first = int(h[L.H_CLOSED_TAIL])
    total = 0
    while True:
        before = int(h[L.H_CLOSED_TAIL])
        n, tail = peek_closed(buf, positions, positions.size)
        if n == 0 or int(tail) <= before or int(tail) - first > words:
            return total
        on_records(positions, n)
        set_closed_tail(buf, tail)
        total += n
