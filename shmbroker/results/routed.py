"""What a route of the results process (`router.py`) works on.

`Columns`: the result fields of the records being routed, by column; `groups`: those records split
by producer (or by backlog writer); `Placed`: where one producer's records go; `Taking`: the ring
record being taken, kept across a full disk that stopped its route, so that taking it again goes
on from there and writes or counts nothing twice.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..ring.ring import Ring
from .delivery import Outlet
from .replay import SCAN_MAX


class Columns(NamedTuple):
    """The result fields of the records being routed, a row per record (scratch arrays of SCAN_MAX
    rows, refilled for every ring record: `head(n)` views their first `n`)."""

    item_ids: np.ndarray
    seqs: np.ndarray
    status: np.ndarray
    writers: np.ndarray

    @classmethod
    def scratch(cls) -> Columns:
        return cls(np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint32),
                   np.empty(SCAN_MAX, np.uint32))

    def head(self, n: int) -> Columns:
        return Columns(self.item_ids[:n], self.seqs[:n], self.status[:n], self.writers[:n])


def groups(values: np.ndarray) -> list:
    """[(value, mask)] of the distinct values; one value (the usual batch) without sorting or a mask."""
    if values.size == 0:
        return []
    lo, hi = values.min(), values.max()
    if lo == hi:
        return [(int(lo), None)]
    return [(int(v), values == v) for v in np.unique(values).tolist()]


class Placed(NamedTuple):
    """Where one producer's records of a route go (`Router.place`)."""

    name: str | None  # its producer name (None: an id never given out)
    outlet: Outlet | None  # the name's connected ring, else None (parked)
    rows: np.ndarray  # positions of its records in the routed data
    offsets: np.ndarray  # their offsets in the name's log: its own while it is read far behind


class Taking(NamedTuple):
    """The ring record being taken (`Router.take`), kept across a full disk that stopped its route."""

    ring: Ring
    pos: int  # its position on the ring (released only once routed: the first record peeked again)
    at: int  # its offset in the shared log: appended once
    copied: dict  # producer id -> offsets of the copies made in that name's own log (`Router.place`)
