"""An ingest process's sources: the consumer side of every producer's ingest ring (`RingSet`).

Drained in turn (`drain_once`); a ring whose frame is broken is closed with its reason and set
aside (`close_source`), rings of producers the registry retired are let go (`retire`), and
`wait` spins briefly over all of them, then sleeps on the ingest process's one doorbell.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..errors import RingCorrupt
from ..frontdoor.registry import ProducerEntry, Registry
from ..ring import layout as L
from ..ring import spsc
from ..ring.ring import CONSUMER, Ring
from ..ring.shm import Doorbell
from ..ring.waits import SLEEP_SLICE_SECONDS
from ..ring.closing import close_ring_for

BATCH_RECORDS = 4096
SPIN_ROUNDS_PER_RING = 256
SPIN_PASSES = 16

# callback(producer, ring, positions, count) -> None; records are ring.data_words[pos ...]
OnRecords = Callable[[ProducerEntry, Ring, np.ndarray, int], None]


@dataclass
class Source:
    """One producer's ingest ring, attached (its consumer side)."""

    entry: ProducerEntry
    ring: Ring


@dataclass
class RingSet:
    """The consumer side of every producer's ingest ring.

    `closed`: producer id -> why its ring is set aside (closed here for a reason, found closed for
    one, or not attachable); `num_closed`: the rings this RingSet closed itself."""

    bell: Doorbell
    sources: list[Source] = field(default_factory=list)
    closed: dict[int, str] = field(default_factory=dict)
    num_closed: int = 0
    positions: np.ndarray = field(default_factory=lambda: np.empty(BATCH_RECORDS, np.int64))  # drain_once's
    _seen_version: int = -1

    def refresh(self, registry: Registry) -> None:
        """Attach rings of producers that connected since the last call (cheap when none did)."""
        if registry.version == self._seen_version:
            return
        self._seen_version = registry.version
        known = {id(s.entry) for s in self.sources}
        for entry in registry.producers():
            if id(entry) not in known and entry.producer_id not in self.closed:
                self.add(entry, lambda entry=entry: entry.ingest.attach(CONSUMER, untrusted=True))

    def add(self, entry: ProducerEntry, attach: Callable[[], Ring]) -> None:
        """Attach one producer's ring (`attach()`: untrusted); a ring that is no ring the broker made (its
        segment resized or unlinked), or one closed for a reason already (by this process's
        predecessor), is set aside in `closed`."""
        try:
            ring = attach()
        except (RingCorrupt, FileNotFoundError, ValueError) as exc:
            self.closed[entry.producer_id] = str(exc)
            return
        reason = ring.closed_reason()
        if reason is not None:
            ring.close()
            self.closed[entry.producer_id] = reason
            return
        self.sources.append(Source(entry, ring))

    def drain_once(self, on_records: OnRecords, max_records: int = BATCH_RECORDS) -> int:
        """Give each ring's committed records (up to max_records each) to `on_records`; return the total.
        A corrupt ring is closed (`close_source`); the others are drained all the same."""
        total = 0
        positions = self.positions
        limit = min(max_records, positions.size)
        broken = None
        for src in self.sources:
            try:
                n, new_tail = src.ring.peek_many(positions, limit)
            except RingCorrupt as exc:
                broken = (broken or []) + [(src, str(exc))]
                continue
            if n:
                on_records(src.entry, src.ring, positions, n)
                src.ring.release(new_tail, n)
                total += n
        for src, why in broken or ():
            self.close_source(src, L.CLOSE_CORRUPT, why)
        return total

    def retire(self, live: set[int]) -> None:
        """Let go of the rings of producers no longer in the table (the registry retired their
        names: their rings were drained, `registry.Registry.retire_idle`)."""
        for src in [s for s in self.sources if s.entry.producer_id not in live]:
            self.sources.remove(src)
            src.ring.close()
        for producer_id in [i for i in self.closed if i not in live]:
            del self.closed[producer_id]

    def close_source(self, src: Source, reason: int, why: str) -> None:
        """Close a ring its producer broke, with `reason` (its producer's next wait raises RingClosed),
        wake the producer if it waits for space, and read no more of it."""
        close_ring_for(src.ring.buf, reason)
        src.ring.space_bell.ring()
        text = f"{L.CLOSE_REASONS[reason]}: {why}"
        self.closed[src.entry.producer_id] = text
        self.num_closed += 1
        self.sources.remove(src)
        src.ring.close()
        sys.stderr.write(f"shmbroker ingest: closed the ingest ring of producer {src.entry.name!r} "
                         f"(id {src.entry.producer_id}): {text}\n")
        sys.stderr.flush()

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

    def close(self) -> None:
        for src in self.sources:
            src.ring.close()
        self.sources.clear()
