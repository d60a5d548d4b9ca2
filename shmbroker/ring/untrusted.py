"""A ring whose peer may have written anything (a producer's own ingest and result rings, as the
broker attaches them): its capacity from the segment's size, never from its header."""

from __future__ import annotations

from ..errors import RingCorrupt
from . import layout as L
from . import closing
from .shm import Segment


def untrusted_capacity(segment: Segment, consumer: bool) -> int:
    """The capacity of a ring whose peer may have written anything: from the segment's size, which
    must be one the registry makes (`layout.segment_bytes` of a power of two). Otherwise the ring is
    closed (CLOSE_BAD_SEGMENT, as far as the mapping holds a header) and RingCorrupt raised."""
    size = segment.buf.size
    cap = (size - L.HEADER_BYTES) // 4
    if cap >= L.MIN_CAPACITY_WORDS and not cap & (cap - 1) and L.segment_bytes(cap) == size:
        return cap
    if size >= L.HEADER_BYTES:  # the closing kernels touch the header words only
        if consumer:
            closing.close_ring_for(segment.buf, L.CLOSE_BAD_SEGMENT)
        else:
            closing.mark_closed(segment.buf, L.CLOSE_BAD_SEGMENT)
    raise RingCorrupt(f"ring {segment.name}: a segment of {size} bytes is no ring the broker made")
