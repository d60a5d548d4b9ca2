"""The owner's side of a ring: create its segment and doorbells (only the supervisor's processes do),
hand out names for peers to attach, and attach in the owner's own process.

The owner unlinks what it made through its `Owner` (`owner.py`); peers attach by `RingNames`
(`ring.Ring.attach`).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import layout as L
from .owner import Owner
from .ring import Ring, RingNames
from .shm import Doorbell, Segment


@dataclass
class OwnedRing:
    """The owner's objects for one ring (it unlinks them through its `Owner`)."""

    names: RingNames
    segment: Segment
    data_bell: Doorbell
    space_bell: Doorbell

    def attach(self, side: str, *, untrusted: bool = False) -> Ring:
        """A side's handle in the owner's process, sharing the owner's mapping."""
        return Ring(self.segment, self.data_bell, self.space_bell, side, owns_handles=False, untrusted=untrusted)


def create_ring(owner: Owner, role: str, data_bytes: int, data_bell: Doorbell | None = None,
                space_bell: Doorbell | None = None) -> OwnedRing:
    """Create a ring of at least `data_bytes` of data (rounded up to a power of two).

    A consumer that drains many rings passes one shared `data_bell` for all of
    them, so it can sleep on one doorbell (see `ingest.RingSet`); a producer that feeds many
    rings (the scheduler) passes one shared `space_bell` the same way.
    """
    cap = L.capacity_for_bytes(data_bytes)
    segment = owner.segment(role, L.segment_bytes(cap))
    own_bell = data_bell is None
    try:
        L.init_header(segment.buf, cap)
        if own_bell:
            data_bell = owner.doorbell(role + "-d")
        try:
            if space_bell is None:
                space_bell = owner.doorbell(role + "-s")
        except BaseException:
            if own_bell:
                owner.release(data_bell)
            raise
    except BaseException:
        owner.release(segment)
        raise
    return OwnedRing(RingNames(segment.name, data_bell.name, space_bell.name), segment, data_bell, space_bell)
