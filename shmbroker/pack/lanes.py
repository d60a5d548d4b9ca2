"""Lanes: every item of the index by class, output band and input band, across families.

A family's bands (`index.py`) hold its own items; a lane holds every item of one class
(`listing.class_of`) and one output band (`shapes.out_band`) whatever its family, in buckets
of one input band each, with a bitmap of its non-empty bands (`bands.py`) as a family has. A
padded engine's rectangle pays its longest input on every row and decodes until its longest
output, so a rectangle drawn from a lane, walking its input bands in order, is shaped in both
dimensions that cost; the policy draws from lanes the families too small to fill a rectangle
alone (`loose.py`). Each class has a mask of its non-empty lanes, so the longest output band
with items is one bit scan.

Lane bucket key: lane << 16 | input band, lane = class x NUM_OUT_BANDS + output band. An item
is linked in its lane bucket by lprev/lnext; its bucket is found again from its length,
max_new and class, so the item record needs no more words.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import SUMMARY_WORDS, bit_clear, bit_set
from .shapes import NUM_OUT_BANDS, band_of, out_band
from .state import M_LANES_FREE, pop_free, push_free
from .tables import ht_delete, ht_find, ht_put


@kernel(inline="always", _nrt=False)
def lane_of(cls, max_new):
    return cls * NUM_OUT_BANDS + out_band(max_new)


@kernel(inline="always", _nrt=False)
def lane_key(lane, band):
    return (np.uint64(lane) << np.uint64(16)) | np.uint64(band)


@kernel(_nrt=False)
def band_bucket(buckets, keys, slots, free, meta, mfree, key, band, bits, summ, row):
    """The bucket of `key` (a family's or a lane's band) in `buckets`: found in its table, else taken
    from its free list (meta[mfree] its height), empty, with band `band` set in row `row` of the
    bitmap (bits, summ). Returns (bucket, made)."""
    b = ht_find(keys, slots, key)
    if b != -1:
        return b, False
    b = pop_free(free, meta, mfree)
    buckets[b].key = key
    buckets[b].head = -1
    buckets[b].tail = -1
    buckets[b].count = 0
    buckets[b].band = band
    ht_put(keys, slots, key, b)
    bit_set(bits, summ, row, band)
    return b, True


@kernel(_nrt=False)
def lane_append(S, slot, cls):
    """Link item `slot` (its length and max_new set) at the tail of its lane bucket in class cls."""
    it = S.items
    lb = S.lane_buckets
    lane = lane_of(cls, it[slot].max_new)
    band = band_of(it[slot].length)
    b, made = band_bucket(lb, S.lane_keys, S.lane_slots, S.free_lanes, S.meta, M_LANES_FREE, lane_key(lane, band),
                          band, S.lane_bits, S.lane_summary, lane)
    if made:
        S.lane_masks[cls] |= np.uint64(1) << np.uint64(lane % NUM_OUT_BANDS)
    it[slot].lnext = -1
    it[slot].lprev = lb[b].tail
    if lb[b].tail != -1:
        it[lb[b].tail].lnext = slot
    else:
        lb[b].head = slot
    lb[b].tail = slot
    lb[b].count += 1


@kernel(_nrt=False)
def lane_unlink(S, slot, cls):
    """Unlink item `slot` from its lane bucket (freed when empty, the lane's mask bit cleared when
    it has no band left)."""
    it = S.items
    lb = S.lane_buckets
    lane = lane_of(cls, it[slot].max_new)
    b = ht_find(S.lane_keys, S.lane_slots, lane_key(lane, band_of(it[slot].length)))
    p = it[slot].lprev
    n = it[slot].lnext
    if p != -1:
        it[p].lnext = n
    else:
        lb[b].head = n
    if n != -1:
        it[n].lprev = p
    else:
        lb[b].tail = p
    lb[b].count -= 1
    if lb[b].count == 0:
        bit_clear(S.lane_bits, S.lane_summary, lane, lb[b].band)
        ht_delete(S.lane_keys, S.lane_slots, lb[b].key)
        push_free(S.free_lanes, S.meta, M_LANES_FREE, b)
        empty = True
        for w in range(SUMMARY_WORDS):
            if S.lane_summary[lane, w] != np.uint64(0):
                empty = False
        if empty:
            S.lane_masks[cls] &= ~(np.uint64(1) << np.uint64(lane % NUM_OUT_BANDS))


@kernel(inline="always", _nrt=False)
def lane_head(S, lane, band):
    """The first item of lane bucket (lane, band), or -1."""
    b = ht_find(S.lane_keys, S.lane_slots, lane_key(lane, band))
    return -1 if b == -1 else S.lane_buckets[b].head
