"""Holding a batch job's items back while its file is still arriving.

A job's file arrives over seconds or minutes; the engine would take a prefix group's first member
before the others are even submitted, and compute the group's prefix again for them later. While
a job is still arriving (its submitter lists its producer id in `jobs/arriving.json`,
`jobs/arriving.py`), its items wait beyond the index with what already waits there, in their
prefix groups, instead of entering it; they are read back once the job is all in, or once the
oldest waiting row has waited `job_hold_seconds`. Only while the index has other work: a card
that would idle never waits for a job's next lines, and producers that are not jobs are never
held themselves (they only queue behind what waits, as ever).
"""

from __future__ import annotations

import time

import numpy as np

from ..jobs import arriving
from ..ring.items import SEQ_BITS


class JobHold:
    """Which producer ids are jobs still arriving (`poll`), and whether to hold now."""

    def __init__(self, data_dir: str, hold_seconds: float):
        self.watch = arriving.watch(data_dir)
        self.holding: frozenset[int] = self.watch.poll() or frozenset()
        self.hold_ns = int(hold_seconds * 1e9)

    def poll(self) -> None:
        ids = self.watch.poll()
        if ids is not None:
            self.holding = ids

    def active(self, indexed: int) -> bool:
        return bool(self.hold_ns and self.holding and indexed > 0)

    def holds(self, locs: np.ndarray, indexed: int) -> bool:
        """Whether these announced items wait beyond the index: some are of a job still arriving, and
        the index holds `indexed` > 0 items of other work."""
        if not self.active(indexed):
            return False
        return not self.holding.isdisjoint(np.unique(locs["item_id"] >> np.uint64(SEQ_BITS)).tolist())

    def head_held(self, beyond, indexed: int) -> bool:
        """Whether the oldest row waiting `beyond` the index is a held job's and younger than the hold,
        while the index has other work: then nothing is read back yet."""
        if not self.active(indexed):
            return False
        head = beyond.head()
        return head is not None and head.item_id >> SEQ_BITS in self.holding and time.monotonic_ns() - head.arrival_ns < self.hold_ns
