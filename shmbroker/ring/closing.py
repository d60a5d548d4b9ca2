"""Closing a ring: a stopping (or salvaging) consumer takes what is left while the producer sees
it full; or the broker stops reading a ring its producer broke, or writing one its reader broke,
and says why (`layout.CLOSE_REASONS`)."""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .atomics import store_release
from .layout import H_CLOSED, H_CLOSED_REASON, H_CLOSED_TAIL, H_HEAD, H_TAIL, H_TAIL_CACHE, HEADER_BYTES, OK
from .spsc import next_record


@kernel
def close_ring(buf):
    """Make the ring look full to its producer forever (tail and its cached copy one capacity behind
    the head), keeping the real tail for `peek_closed`. Idempotent. A producer mid-push may still
    commit the record it reserved: read after a moment."""
    h = buf[:HEADER_BYTES].view(np.int64)
    if h[H_CLOSED] == 0:
        h[H_CLOSED_TAIL] = h[H_TAIL]
        h[H_CLOSED] = 1
    low = h[H_HEAD] - (buf.size - HEADER_BYTES) // 4
    store_release(h, H_TAIL, low)
    h[H_TAIL_CACHE] = low


@kernel
def close_ring_for(buf, reason):
    """`close_ring` of an ingest ring whose producer broke it, with the reason (`layout.CLOSE_*`) that
    its next wait reports; the broker reads no more of it."""
    buf[:HEADER_BYTES].view(np.int64)[H_CLOSED_REASON] = reason
    close_ring(buf)


@kernel
def mark_closed(buf, reason):
    """Close a ring the broker writes into (a result ring) with a reason: it pushes no more into it;
    its reader takes what is there, then its wait raises RingClosed. The reason is stored first."""
    h = buf[:HEADER_BYTES].view(np.int64)
    h[H_CLOSED_REASON] = reason
    store_release(h, H_CLOSED, 1)


@kernel
def peek_closed(buf, out_positions, max_records):
    """`peek_many` of a closed ring, from its real tail: (count, new real tail)."""
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    tail = h[H_CLOSED_TAIL]
    start = tail
    n = 0
    while n < min(max_records, out_positions.size):
        off, new_tail, st = next_record(w, tail)
        if st != OK or new_tail - start > w.size:
            break
        out_positions[n] = off
        n += 1
        tail = new_tail
    return n, tail


@kernel
def set_closed_tail(buf, tail):
    buf[:HEADER_BYTES].view(np.int64)[H_CLOSED_TAIL] = tail
