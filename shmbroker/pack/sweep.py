"""The padded walk: a rectangle batch's items from one family's length bands, without removing them.

The walk stops at the first item that would break the contract, so a
decision costs O(batch + trie depth), never O(backlog). A padded engine's
batch is a rectangle: count <= max_batch_size, count x longest <=
max_batch_tokens, each item <= max_input_len. The scheduler fails items
longer than every consumer of their model at admission, so in the broker they
never reach the index; the standalone `Packer` (tests, `bench pack`,
`workloads.packsim`) takes them, and a walk collects those it meets (longer
than `model_max`) in `failed`, at most failed.size a decision.

`select_padded` sweeps a family's length bands from a cursor (up for
ascending consumers, down for the largest), within a padding tolerance: the
batch's longest item is at most (1 + tol) x its shortest. Of the items the
sweep meets within the tolerance (a bounded number), the batch takes the
longest generations first, so outputs of similar length share a batch.
A family that generates (an item of max_new > 1; tol > 0), when the items
within the tolerance cannot fill the rectangle (fewer than max_batch_size,
and one more of the longest's length would fit max_batch_tokens: a small
family's thin band), is batched by its generations instead: a rectangle
engine decodes every row until the batch's longest max_new, each decode
step costing about the same for one row or a full batch, so the batch's
longest generation and how many rows decode under it set its cost, and the
prefill padding is the smaller share. The walk then collects candidates of
any length (still a bounded number), and the input band is bounded by the
contract (count x longest <= max_batch_tokens), not by the tolerance: of the
caps on input length from the shortest candidate up, each (1 + tol) x the
last (`generation_cap`), the batch is the one that keeps the most rows
decoding on average.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import band_next, band_prev
from .shapes import LENGTH_MAX, NUM_BANDS
from .tables import ht_find


@kernel(_nrt=False)
def _fits(n, longest, length, bs, bt):
    m = max(longest, length)
    return n + 1 <= bs and (n + 1) * m <= bt


CANDIDATE_INDEX_BITS = 21  # a candidate's walk position in a sort key; buffers hold fewer than 2^21
CANDIDATE_INDEX_MASK = (1 << CANDIDATE_INDEX_BITS) - 1


@kernel(_nrt=False)
def _sift_min(sort_keys, i, m):
    while True:
        child = 2 * i + 1
        if child >= m:
            return
        if child + 1 < m and sort_keys[child + 1] < sort_keys[child]:
            child += 1
        if sort_keys[child] >= sort_keys[i]:
            return
        sort_keys[i], sort_keys[child] = sort_keys[child], sort_keys[i]
        i = child


@kernel(_nrt=False)
def sort_descending(sort_keys, m):
    """Heap sort sort_keys[:m] into descending order, in place (no allocation)."""
    for i in range(m // 2 - 1, -1, -1):
        _sift_min(sort_keys, i, m)
    for end in range(m - 1, 0, -1):
        sort_keys[0], sort_keys[end] = sort_keys[end], sort_keys[0]
        _sift_min(sort_keys, 0, end)


@kernel(_nrt=False)
def _collect_padded(S, f, start, descending, max_in, model_max, tol, cand, failed):
    """Walk the bands from `start` and collect candidates (items within the padding tolerance of
    each other, of any lengths when tol is inf; at most cand.size) and failures. Returns (candidates,
    failures, band where the walk stopped or -1 when it ran to the far end, shortest, longest)."""
    it = S.items
    bk = S.buckets
    bits = S.band_bits
    summ = S.band_summary
    m = 0
    nf = 0
    lo = 0
    hi = 0
    top = NUM_BANDS - 1
    for second in range(2):
        if second == 0:
            band = band_prev(bits, summ, f, start) if descending else band_next(bits, summ, f, start)
        else:
            if m > 0 or (start == top if descending else start == 0):
                break
            band = band_prev(bits, summ, f, top) if descending else band_next(bits, summ, f, 0)
        while band != -1 and (second == 0 or (band > start if descending else band < start)):
            bkey = (np.uint64(f + 1) << np.uint64(16)) | np.uint64(band)
            slot = bk[ht_find(S.bucket_keys, S.bucket_slots, bkey)].head
            turn = False
            while slot != -1:
                length = it[slot].length
                if length > model_max:
                    if nf == failed.size:
                        return m, nf, band, lo, hi
                    failed[nf] = slot
                    nf += 1
                elif length > max_in:
                    # only an ascending consumer meets these: everything further up is longer
                    if m == 0:
                        turn = True
                        break
                    return m, nf, band, lo, hi
                else:
                    if m == 0:
                        lo = length
                        hi = length
                    new_lo = min(lo, length)
                    new_hi = max(hi, length)
                    if m == cand.size or new_hi > new_lo * (1.0 + tol):
                        return m, nf, band, lo, hi
                    cand[m] = slot
                    m += 1
                    lo = new_lo
                    hi = new_hi
                slot = it[slot].bnext
            if turn:
                break
            band = band_prev(bits, summ, f, band - 1) if descending else band_next(bits, summ, f, band + 1)
    return m, nf, -1, lo, hi


@kernel(_nrt=False)
def _fill(it, cand, sort_keys, m, bs, bt, cap):
    """The batch of the candidates of length <= cap, longest max_new first, skipping those that do
    not fit (count <= bs, count x longest <= bt): (its decode work, max_new summed with at least one
    step a row; its longest max_new; the shortest candidate length above cap, or -1)."""
    n = 0
    longest = 0
    work = 0
    lead = 0
    above = -1
    for j in range(m):
        length = np.int64(it[cand[CANDIDATE_INDEX_MASK - (sort_keys[j] & CANDIDATE_INDEX_MASK)]].length)
        if length > cap:
            if above == -1 or length < above:
                above = length
            continue
        if n == bs or not _fits(n, longest, length, bs, bt):
            continue
        steps = max(1, np.int64(it[cand[CANDIDATE_INDEX_MASK - (sort_keys[j] & CANDIDATE_INDEX_MASK)]].max_new))
        if n == 0:
            lead = steps
        n += 1
        longest = max(longest, length)
        work += steps
    return work, lead, above


@kernel(_nrt=False)
def generation_cap(it, cand, sort_keys, m, bs, bt, tol):
    """The input-length cap of a generating batch: of the caps from the shortest candidate's length
    up, each (1 + tol) x the last (at least the next candidate length), the one whose batch
    (`_fill`) keeps the most rows decoding on average (decode work over its longest max_new: a
    rectangle decodes every row until then), the smallest among equals."""
    cap = np.int64(it[cand[0]].length)
    for j in range(m):
        cap = min(cap, np.int64(it[cand[j]].length))
    best = cap
    most = -1.0
    while cap != -1:
        work, lead, above = _fill(it, cand, sort_keys, m, bs, bt, cap)
        if work > 0 and work / lead > most:
            most = work / lead
            best = cap
        if above == -1:
            break
        cap = max(above, np.int64(cap * (1.0 + tol)))
    return best


@kernel(_nrt=False)
def select_padded(S, f, start, descending, bs, bt, max_in, model_max, tol, out, failed, cand, sort_keys):
    """Returns (items, failed, band to resume from or -1 for the far end, shortest, longest).

    The walk (`_collect_padded`): from `start` to the far end, then, if it found nothing, from the
    near end up to `start` (an ascending consumer also turns back when it meets items longer than
    its max_input_len); it collects up to cand.size candidates within the padding tolerance. The
    batch takes them longest max_new first (walk order among equals), so items of similar output
    length share a batch (a padded engine decodes every row for its longest), and stops at the first
    that would break count <= bs or count x longest <= bt. A generating family (`generates`) whose
    candidates could not fill the rectangle (m < bs and (m + 1) x longest <= bt): the walk is run
    again, collecting candidates of any length, and the batch takes, longest max_new first, those of
    length <= `generation_cap`, skipping (not stopping at) those that do not fit. The sweep resumes
    at the band of the first candidate (in walk order) not taken, else where the walk stopped."""
    it = S.items
    m, nf, stop, lo, hi = _collect_padded(S, f, start, descending, max_in, model_max, tol, cand, failed)
    # a generating family whose band cannot fill the rectangle: widen the band
    generating = generates(S.families, f, tol) and m < bs and (m + 1) * hi <= bt
    if generating:
        m, nf, stop, lo, hi = _collect_padded(S, f, start, descending, max_in, model_max, np.inf, cand, failed)
    if m == 0:
        return 0, nf, stop, 0, 0
    for i in range(m):
        sort_keys[i] = (np.int64(it[cand[i]].max_new) << CANDIDATE_INDEX_BITS) | (CANDIDATE_INDEX_MASK - i)
    sort_descending(sort_keys, m)
    cap = generation_cap(it, cand, sort_keys, m, bs, bt, tol) if generating else np.int64(LENGTH_MAX)
    n = 0
    longest = 0
    for j in range(m):
        i = CANDIDATE_INDEX_MASK - (sort_keys[j] & CANDIDATE_INDEX_MASK)
        slot = cand[i]
        length = it[slot].length
        if length > cap or n == bs or not _fits(n, longest, length, bs, bt):
            if generating:
                continue
            break
        out[n] = slot
        n += 1
        if n == 1:
            lo = length
            hi = length
        lo = min(lo, length)
        hi = max(hi, length)
        longest = max(longest, length)
        cand[i] = -1
    for i in range(m):
        if cand[i] != -1:
            return n, nf, S.buckets[it[cand[i]].bucket].band, lo, hi
    return n, nf, stop, lo, hi


@kernel(inline="always", _nrt=False)
def generates(fm, f, tol):
    """Family f's batches are shaped by their generations (`select_padded`): it has an item of
    max_new > 1 and padding is tolerated at all."""
    return fm[f].maxnew > 1 and tol > 0.0
