"""How a ring's waiters spin and sleep: briefly on the shared words, then on a doorbell with a deadline.

`Ring`'s own waits (`ring.py`) and the processes that drain many rings on one doorbell (`sleep_on`:
ingest, the scheduler, results) use the same bounds.
"""

from __future__ import annotations

import os

import numpy as np

from . import layout as L
from . import spsc
from .shm import Doorbell

SPIN_ROUNDS = 4000  # ~100-300 µs of pause-spinning before sleeping
SLEEP_SLICE_SECONDS = 0.05  # longest single doorbell sleep
STALE_SECONDS = 0.1  # a heartbeat older than this triggers a liveness check


def sleep_on(bell: Doorbell, readable: list, space: list = (), timeout_seconds: float = SLEEP_SLICE_SECONDS) -> None:
    """Sleep on one doorbell shared by several rings: announce the sleep as the consumer of each ring
    in `readable` and as the producer of each in `space`, look once more (a record in any `readable`
    ring cancels the sleep), sleep at most `timeout_seconds`, withdraw the announcements. Each ring's
    peer rings the shared doorbell when it sees the announcement."""
    flags = [(r.buf, L.H_CONSUMER_WAITING) for r in readable] + [(r.buf, L.H_PRODUCER_WAITING) for r in space]
    for buf, f in flags:
        spsc.set_waiting(buf, f)
    if not any(spsc.readable(r.buf) for r in readable):
        bell.sleep(timeout_seconds)
    for buf, f in flags:
        spsc.clear_waiting(buf, f)


def yield_until(buf: np.ndarray, rounds: int) -> bool:
    """Yield the core up to `rounds` times, looking at the ring after each; True once it is readable."""
    for _ in range(rounds):
        os.sched_yield()
        if spsc.readable(buf):
            return True
    return False
