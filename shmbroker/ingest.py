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
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .errors import DiskFull
from .pack.shapes import DEFAULT_BLOCK_TOKENS
from .registry import ProducerEntry, Registry
from .ring import layout as L
from .ring import spsc
from .ring.ring import CONSUMER, SLEEP_SLICE_SECONDS, Ring
from .ring.shm import Doorbell
from .spill.collect import collect
from .spill.layout import ITEM_DTYPE
from .spill.writer import SegmentWriter

BATCH_RECORDS = 4096
SPIN_ROUNDS_PER_RING = 256
SPIN_PASSES = 16

# callback(producer, ring, positions, count) -> None; records are ring.data_words[pos ...]
OnRecords = Callable[[ProducerEntry, Ring, np.ndarray, int], None]


@dataclass
class _Source:
    entry: ProducerEntry
    ring: Ring


@dataclass
class RingSet:
    """The consumer side of every producer's ingest ring."""

    bell: Doorbell
    sources: list[_Source] = field(default_factory=list)
    _positions: np.ndarray = field(default_factory=lambda: np.empty(BATCH_RECORDS, np.int64))
    _seen_version: int = -1

    def refresh(self, registry: Registry) -> None:
        """Attach rings of producers that connected since the last call (cheap when none did)."""
        if registry.version == self._seen_version:
            return
        self._seen_version = registry.version
        known = {id(s.entry) for s in self.sources}
        for entry in registry.producers():
            if id(entry) not in known:
                self.sources.append(_Source(entry, entry.ingest.attach(CONSUMER)))

    def drain_once(self, on_records: OnRecords, max_records: int = BATCH_RECORDS) -> int:
        """Give each ring's committed records (up to max_records each) to `on_records`; return the total."""
        total = 0
        positions = self._positions
        limit = min(max_records, positions.size)
        for src in self.sources:
            n, new_tail = src.ring.peek_many(positions, limit)
            if n:
                on_records(src.entry, src.ring, positions, n)
                src.ring.release(new_tail, n)
                total += n
        return total

    def wait(self, timeout_seconds: float) -> bool:
        """Spin briefly over all rings, then sleep on the shared doorbell; True when one is readable."""
        bufs = [s.ring.buf for s in self.sources]
        for _ in range(SPIN_PASSES):
            for buf in bufs:
                if spsc.spin_until_readable(buf, SPIN_ROUNDS_PER_RING):
                    return True
        deadline = time.monotonic() + timeout_seconds
        while True:
            for buf in bufs:
                spsc.set_waiting(buf, L.H_CONSUMER_WAITING)
            ready = any(spsc.readable(buf) for buf in bufs)
            remaining = deadline - time.monotonic()
            if not ready and remaining > 0:
                for src in self.sources:
                    src.ring.heartbeat()
                self.bell.sleep(min(remaining, SLEEP_SLICE_SECONDS))
                ready = any(spsc.readable(buf) for buf in bufs)
            for buf in bufs:
                spsc.clear_waiting(buf, L.H_CONSUMER_WAITING)
            if ready:
                return True
            if time.monotonic() >= deadline:
                return False

    def dead_producers(self) -> list[ProducerEntry]:
        """Producers whose process is gone and whose ring is drained."""
        return [s.entry for s in self.sources if not s.ring.peer_alive() and not spsc.readable(s.ring.buf)]

    def close(self) -> None:
        for src in self.sources:
            src.ring.close()
        self.sources.clear()


DISK_FULL_BACKOFF_SECONDS = 0.05


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

    def __call__(self, entry: ProducerEntry, ring: Ring, positions: np.ndarray, count: int) -> None:
        if self._flat.size < ring.capacity_words:
            self._flat = np.empty(ring.capacity_words, np.uint32)
        data = ring.buf[L.HEADER_BYTES :]
        total = collect(
            data.view(np.uint32), data.view(np.uint64), positions, count, entry.producer_id,
            self.block_tokens, self._flat, self._offsets, self._items,
        )
        try:
            self.writer.append_many(self._flat[:total], self._offsets[: count + 1], self._items[:count])
        except DiskFull:
            self.num_disk_full += 1
            raise  # nothing written: drain_once does not release, the ring keeps the records
        self.num_items += count
        self.num_tokens += total


def pump(rings: RingSet, registry: Registry, on_records: OnRecords, wait_seconds: float = SLEEP_SLICE_SECONDS) -> int:
    """One round of the ingest loop: attach new producers, drain, wait when idle, back off on a full disk."""
    rings.refresh(registry)
    try:
        n = rings.drain_once(on_records)
    except DiskFull:
        time.sleep(DISK_FULL_BACKOFF_SECONDS)
        return 0
    if n == 0:
        if rings.sources:
            rings.wait(wait_seconds)
        else:
            time.sleep(0.005)
    return n
