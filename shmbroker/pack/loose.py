"""The loose walk: a padded engine's rectangle drawn from lanes (`lanes.py`), across families.

A family whose own rectangle would not pay for its padding (`family_pays`) gains nothing from
a batch of its own: a rectangle engine decodes every row until the batch's longest output, one
step costing about the same for one row or a full batch, and a one-off prompt's family is one
item. Such items batch loose: the shape's family is `LOOSE_FAMILY` (no prefix computed once), and the rectangle
is cut from the lanes in the order that minimises its two paddings, as the sorted cut of the
padded bound does (`bench/pack_bound.py`): the longest output band of the consumer's first
class that has one, its input bands walked from one end (the largest consumer of a model from
the longest down, so each rectangle is as long as its first item allows; the others from the
shortest up), then, while the rectangle has rows left, the next shorter output bands, whose
rows decode within the steps the batch pays anyway (a descending walk enters each from the
longest item a next row may be: max_batch_tokens / (rows + 1)). The walk stops once no item can
join (count == max_batch_size, or count x longest == max_batch_tokens); a descending walk passes
over an item longer than a next row may be, an ascending one goes to the next output band.

Items of families that pay for their own rectangle, or that another consumer holds, are passed
over (their prefix is computed once in a family batch), and so, by a descending walk, are items
longer than a next row may be, at most SKIP_PER_SLOT x max_batch_size of them a
walk, so a decision stays O(batch). An aged item (`ages.py`) is taken first and the walk starts
at its lane and band.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import band_next, band_prev
from .lanes import lane_head
from .listing import class_of
from .shapes import LENGTH_MAX, NUM_BANDS, NUM_OUT_BANDS, band_of, out_band

SKIP_PER_SLOT = 4


@kernel(inline="always", _nrt=False)
def family_pays(fm, f, bs, bt, step_tokens):
    """Family f's own rectangle is worth its padding on a consumer of max_batch_size bs and
    max_batch_tokens bt: the family fills one (its pending items are at least the rows that bs and
    bt allow at their mean length: else its rectangles would be thinner than loose ones, each
    paying a whole decode), and the prefix it computes once for the rows past the first (its base
    tokens each) saves at least what its outputs' spread costs, its longest max_new less their
    mean, in decode steps of `step_tokens` prefill tokens each."""
    pending = fm[f].pending
    if pending < 2 or fm[f].base == 0:
        return False
    rows = min(np.int64(bs), max(np.int64(1), bt * pending // max(fm[f].tokens, 1)))
    if pending < rows:
        return False
    spread = fm[f].maxnew - fm[f].generate / pending
    return (rows - 1) * np.float64(fm[f].base) >= step_tokens * spread


@kernel(_nrt=False)
def _highest_lane(mask, below):
    """The highest output band >= 1 set in `mask` and < below, or 0."""
    o = below - 1
    while o >= 1:
        if (mask >> np.uint64(o)) & np.uint64(1):
            return o
        o -= 1
    return 0


@kernel(_nrt=False)
def _lowest_lane(mask):
    """The lowest output band >= 1 set in `mask`, or 0."""
    for o in range(1, NUM_OUT_BANDS):
        if (mask >> np.uint64(o)) & np.uint64(1):
            return o
    return 0


TAKEN, PASSED, FULL, LONGER = 1, 0, -1, -2  # `_take`'s answers


@kernel(_nrt=False)
def _take(S, c, slot, n, hi, bs, bt, step_tokens, out):
    """Whether item `slot` joins the rectangle out[:n] (longest hi): TAKEN; PASSED (its family pays
    for its own rectangle or another consumer holds it); FULL (no item fits: count or count x
    longest); LONGER (a shorter item could still fit)."""
    it = S.items
    fm = S.families
    f = it[slot].fam
    claimed = fm[f].claimed
    if (claimed != 0 and claimed != c + 1) or family_pays(fm, f, bs, bt, step_tokens):
        return PASSED
    if n + 1 > bs or (n + 1) * hi > bt:
        return FULL
    if (n + 1) * np.int64(it[slot].length) > bt:
        return LONGER
    out[n] = slot
    return TAKEN


@kernel(_nrt=False)
def _first_lane(S, cls_order, descending, max_in, out, aged):
    """(class, output band, rows taken) the walk starts from: the aged item's (taken first), else the
    first of c's classes with a generating lane and its highest (descending) or lowest output
    band; class -1 when there is none."""
    it = S.items
    if aged != -1:
        top = out_band(it[aged].max_new)
        if it[aged].length > max_in or top == 0:
            return -1, 0, 0
        out[0] = aged
        return class_of(S.classes, S.families[it[aged].fam].model, it[aged].length), top, 1
    for k in range(cls_order.size):
        mask = S.lane_masks[cls_order[k]]
        top = _highest_lane(mask, NUM_OUT_BANDS) if descending else _lowest_lane(mask)
        if top != 0:
            return cls_order[k], top, 0
    return -1, 0, 0


@kernel(_nrt=False)
def _walk_bucket(S, c, slot, aged, descending, bs, bt, max_in, model_max, step_tokens, out, failed, n, nf, lo, hi,
                 skips):
    """Walk one lane bucket from item `slot` on, for `select_loose`, whose state it takes and gives
    back: (rows, failures, shortest, longest, passes left, whether the walk is over)."""
    it = S.items
    while slot != -1:
        if slot != aged:
            length = np.int64(it[slot].length)
            if length > model_max:
                if nf == failed.size:
                    return n, nf, lo, hi, skips, True
                failed[nf] = slot
                nf += 1
            elif length > max_in:
                return n, nf, lo, hi, skips, not descending  # an ascending walk meets only longer items from here
            else:
                took = _take(S, c, slot, n, hi, bs, bt, step_tokens, out)
                if took == TAKEN:
                    lo = length if n == 0 else min(lo, length)
                    hi = max(hi, length)
                    n += 1
                elif took == FULL or (took == LONGER and not descending):  # ascending: only longer ones follow
                    return n, nf, lo, hi, skips, True
                else:  # passed over
                    skips -= 1
                    if skips == 0:
                        return n, nf, lo, hi, skips, True
        slot = S.lane_links[slot].bnext
    return n, nf, lo, hi, skips, False


@kernel(_nrt=False)
def select_loose(S, c, cls_order, descending, bs, bt, max_in, model_max, step_tokens, out, failed, aged):
    """A loose rectangle for consumer c: (items, failures, shortest, longest); (0, 0, 0, 0) when no
    lane of its classes generates. Failures (items longer than model_max, met in an overflow
    class's lanes) are collected as `sweep.select_padded` does, at most failed.size."""
    cls, top, n = _first_lane(S, cls_order, descending, max_in, out, aged)
    if cls == -1:
        return 0, 0, 0, 0
    nf = 0
    lo = np.int64(S.items[aged].length) if n else np.int64(0)
    hi = lo
    skips = SKIP_PER_SLOT * bs
    o = top
    while o != 0 and n < bs:
        lane = cls * NUM_OUT_BANDS + o
        if descending:  # from the longest a next row may be
            band = band_prev(S.lane_bits, S.lane_summary, lane,
                             band_of(min(bt // (n + 1), LENGTH_MAX)) if n else NUM_BANDS - 1)
        else:
            band = band_next(S.lane_bits, S.lane_summary, lane, 0)
        while band != -1:
            n, nf, lo, hi, skips, over = _walk_bucket(S, c, lane_head(S, lane, band), aged, descending, bs, bt, max_in,
                                                      model_max, step_tokens, out, failed, n, nf, lo, hi, skips)
            if over:
                return n, nf, lo, hi
            band = band_prev(S.lane_bits, S.lane_summary, lane, band - 1) if descending else \
                band_next(S.lane_bits, S.lane_summary, lane, band + 1)
        if not descending:  # a smaller consumer's rectangle is its lowest output band's
            break
        o = _highest_lane(S.lane_masks[cls], o)
    return n, nf, lo, hi
