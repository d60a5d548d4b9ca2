"""Band bitmaps of a family: two levels, so the next non-empty band either side is O(1) words.

bits[f, w] bit i: band 64w + i of family f has items.
summ[f, s] bit i: bits[f, 64s + i] is not zero.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .shapes import NUM_BANDS

BAND_WORDS = (NUM_BANDS + 63) // 64
SUMMARY_WORDS = (BAND_WORDS + 63) // 64


@kernel(_nrt=False)
def _lowbit(w):
    n = 0
    while (w >> np.uint64(n)) & np.uint64(1) == np.uint64(0):
        n += 1
    return n


@kernel(_nrt=False)
def _highbit(w):
    n = 63
    while (w >> np.uint64(n)) & np.uint64(1) == np.uint64(0):
        n -= 1
    return n


@kernel(_nrt=False)
def bit_set(bits, summ, f, b):
    w = b >> 6
    bits[f, w] |= np.uint64(1) << np.uint64(b & 63)
    summ[f, w >> 6] |= np.uint64(1) << np.uint64(w & 63)


@kernel(_nrt=False)
def bit_clear(bits, summ, f, b):
    w = b >> 6
    bits[f, w] &= ~(np.uint64(1) << np.uint64(b & 63))
    if bits[f, w] == np.uint64(0):
        summ[f, w >> 6] &= ~(np.uint64(1) << np.uint64(w & 63))


@kernel(_nrt=False)
def band_next(bits, summ, f, b):
    """Lowest non-empty band >= b, or -1."""
    if b < 0:
        b = 0
    if b >= NUM_BANDS:
        return -1
    w = b >> 6
    m = bits[f, w] & (~np.uint64(0) << np.uint64(b & 63))
    if m != np.uint64(0):
        return (w << 6) + _lowbit(m)
    w += 1
    if w >= BAND_WORDS:
        return -1
    s = w >> 6
    sm = summ[f, s] & (~np.uint64(0) << np.uint64(w & 63))
    while sm == np.uint64(0):
        s += 1
        if s >= SUMMARY_WORDS:
            return -1
        sm = summ[f, s]
    w = (s << 6) + _lowbit(sm)
    return (w << 6) + _lowbit(bits[f, w])


@kernel(_nrt=False)
def band_prev(bits, summ, f, b):
    """Highest non-empty band <= b, or -1."""
    if b >= NUM_BANDS:
        b = NUM_BANDS - 1
    if b < 0:
        return -1
    w = b >> 6
    sh = 63 - (b & 63)
    m = bits[f, w] & (~np.uint64(0) >> np.uint64(sh))
    if m != np.uint64(0):
        return (w << 6) + _highbit(m)
    w -= 1
    if w < 0:
        return -1
    s = w >> 6
    sm = summ[f, s] & (~np.uint64(0) >> np.uint64(63 - (w & 63)))
    while sm == np.uint64(0):
        s -= 1
        if s < 0:
            return -1
        sm = summ[f, s]
    w = (s << 6) + _highbit(sm)
    return (w << 6) + _highbit(bits[f, w])
