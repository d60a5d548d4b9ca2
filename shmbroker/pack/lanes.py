"""Lanes: every item of the index by class, output band and input band, across families.

A family's bands (`index.py`) hold its own items; a lane holds every item of one class
(`listing.class_of`) and one output band (`shapes.out_band`) whatever its family, in buckets
of one input band each, with a bitmap of its non-empty bands (`bands.py`) as a family has. A
padded engine's rectangle pays its longest input on every row and decodes until its longest
output, so a rectangle drawn from a lane, walking its input bands in order, is shaped in both
dimensions that cost; the policy draws from lanes the items of families whose own rectangle
would not pay for its padding (`loose.py`). Each class has a mask of its non-empty lanes, so the longest output band
with items is one bit scan.

Lane bucket key: lane << 16 | input band, lane = class x NUM_OUT_BANDS + output band. An item
is linked in its lane bucket by its LANE_LINK record (`state.py`), by the same list kernels as
its family's bucket (`links.py`).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import SUMMARY_WORDS, bit_clear, bit_set
from .links import bucket_append, bucket_unlink
from .shapes import NUM_OUT_BANDS, out_band
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
def band_bucket_release(buckets, keys, slots, free, meta, mfree, b, bits, summ, row):
    """Give bucket b back (`band_bucket`'s reverse) once it is empty: its band's bit cleared, its key
    out of the table, the slot on its free list. Returns whether it was released."""
    if buckets[b].count != 0:
        return False
    bit_clear(bits, summ, row, buckets[b].band)
    ht_delete(keys, slots, buckets[b].key)
    push_free(free, meta, mfree, b)
    return True


@kernel(_nrt=False)
def lane_append(S, slot, cls, band):
    """Link item `slot` (its max_new set; `band` its input band) at the tail of its lane bucket in
    class cls."""
    lane = lane_of(cls, S.items[slot].max_new)
    b, made = band_bucket(S.lane_buckets, S.lane_keys, S.lane_slots, S.free_lanes, S.meta, M_LANES_FREE,
                          lane_key(lane, band), band, S.lane_bits, S.lane_summary, lane)
    if made:
        S.lane_masks[cls] |= np.uint64(1) << np.uint64(lane % NUM_OUT_BANDS)
    bucket_append(S.lane_links, S.lane_buckets, b, slot)


@kernel(_nrt=False)
def lane_unlink(S, slot):
    """Unlink item `slot` from its lane bucket (released when empty, the lane's mask bit cleared
    when it has no band left)."""
    lb = S.lane_buckets
    b = bucket_unlink(S.lane_links, lb, slot)
    lane = np.int64(lb[b].key >> np.uint64(16))
    if not band_bucket_release(lb, S.lane_keys, S.lane_slots, S.free_lanes, S.meta, M_LANES_FREE, b,
                               S.lane_bits, S.lane_summary, lane):
        return
    for w in range(SUMMARY_WORDS):
        if S.lane_summary[lane, w] != np.uint64(0):
            return
    S.lane_masks[lane // NUM_OUT_BANDS] &= ~(np.uint64(1) << np.uint64(lane % NUM_OUT_BANDS))


@kernel(inline="always", _nrt=False)
def lane_head(S, lane, band):
    """The first item of lane bucket (lane, band), or -1."""
    b = ht_find(S.lane_keys, S.lane_slots, lane_key(lane, band))
    return -1 if b == -1 else S.lane_buckets[b].head
