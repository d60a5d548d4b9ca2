"""The packer's mechanism: pick a batch's items from one family, without removing them.

Two walks, one per engine mode; both stop at the first item that would break
the contract, so a decision costs O(batch + trie depth), never O(backlog). A
padded engine's batch is a rectangle: count <= max_batch_size, count x longest
<= max_batch_tokens, each item <= max_input_len. A packed engine's is an
ordered group for its in-flight window: count <= max_batch_size, each item <=
max_input_len (the engine itself keeps a step within max_batch_tokens). Items longer than every consumer of their model (`model_max`)
are collected in `failed` when the walk meets them.

- `select_padded` sweeps a family's length bands from a cursor (up for
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
  prefill padding is the smaller share. The
  walk then collects candidates of any length (still a bounded number), and
  the input band is bounded by the contract (count x longest <=
  max_batch_tokens), not by the tolerance: of the caps on input length from
  the shortest candidate up, each (1 + tol) x the last (`generation_cap`),
  the batch is the one that keeps the most rows decoding on average.
- `select_packed` takes the family root's own items, then walks the
  consumer's claimed branch depth-first (or, with no branch left to claim, a
  part of another consumer's branch it takes over: `_take_over`) (a node before its children; children in the order
  they became live, so a turn that arrived before its parent runs before it), claiming
  the next unclaimed branch of a class it fits when one is drained (of the
  first few, the one with the longest generation).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import band_next, band_prev
from .guard import check_rows
from .index import (
    C_BRANCH,
    C_FAM,
    C_MAXIN,
    S_BITS,
    S_BK,
    S_BKEYS,
    S_BVALS,
    S_CLS,
    S_CONS,
    S_FBH,
    S_FBT,
    S_FM,
    S_GH,
    S_GT,
    S_IT,
    S_ND,
    S_SUMM,
    age_head,
    branch_reclass,
    family_reclass,
    remove_quiet,
)
from .links import _branch_list_set, _family_list_set
from .shapes import LENGTH_MAX, NUM_BANDS
from .tables import ht_find


@kernel(_nrt=False)
def _fits(n, longest, length, bs, bt):
    m = max(longest, length)
    return n + 1 <= bs and (n + 1) * m <= bt


CANDIDATE_INDEX_BITS = 21  # a candidate's walk position in a sort key; buffers hold fewer than 2^21
CANDIDATE_INDEX_MASK = (1 << CANDIDATE_INDEX_BITS) - 1


@kernel(_nrt=False)
def _sift_min(keys, i, m):
    while True:
        child = 2 * i + 1
        if child >= m:
            return
        if child + 1 < m and keys[child + 1] < keys[child]:
            child += 1
        if keys[child] >= keys[i]:
            return
        keys[i], keys[child] = keys[child], keys[i]
        i = child


@kernel(_nrt=False)
def sort_descending(keys, m):
    """Heap sort keys[:m] into descending order, in place (no allocation)."""
    for i in range(m // 2 - 1, -1, -1):
        _sift_min(keys, i, m)
    for end in range(m - 1, 0, -1):
        keys[0], keys[end] = keys[end], keys[0]
        _sift_min(keys, 0, end)


@kernel(_nrt=False)
def _collect_padded(S, f, start, descending, max_in, model_max, tol, cand, failed):
    """Walk the bands from `start` and collect candidates (items within the padding tolerance of
    each other, of any lengths when tol is inf; at most cand.size) and failures. Returns (candidates,
    failures, band where the walk stopped or -1 when it ran to the far end, shortest, longest)."""
    it = S[S_IT]
    bk = S[S_BK]
    bits = S[S_BITS]
    summ = S[S_SUMM]
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
            s = bk[ht_find(S[S_BKEYS], S[S_BVALS], bkey)].head
            turn = False
            while s != -1:
                length = it[s].length
                if length > model_max:
                    if nf == failed.size:
                        return m, nf, band, lo, hi
                    failed[nf] = s
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
                    cand[m] = s
                    m += 1
                    lo = new_lo
                    hi = new_hi
                s = it[s].bnext
            if turn:
                break
            band = band_prev(bits, summ, f, band - 1) if descending else band_next(bits, summ, f, band + 1)
    return m, nf, -1, lo, hi


@kernel(_nrt=False)
def _fill(it, cand, keys, m, bs, bt, cap):
    """The batch of the candidates of length <= cap, longest max_new first, skipping those that do
    not fit (count <= bs, count x longest <= bt): (its decode work, max_new summed with at least one
    step a row; its longest max_new; the shortest candidate length above cap, or -1)."""
    n = 0
    longest = 0
    work = 0
    lead = 0
    above = -1
    for j in range(m):
        length = np.int64(it[cand[CANDIDATE_INDEX_MASK - (keys[j] & CANDIDATE_INDEX_MASK)]].length)
        if length > cap:
            if above == -1 or length < above:
                above = length
            continue
        if n == bs or not _fits(n, longest, length, bs, bt):
            continue
        steps = max(1, np.int64(it[cand[CANDIDATE_INDEX_MASK - (keys[j] & CANDIDATE_INDEX_MASK)]].max_new))
        if n == 0:
            lead = steps
        n += 1
        longest = max(longest, length)
        work += steps
    return work, lead, above


@kernel(_nrt=False)
def generation_cap(it, cand, keys, m, bs, bt, tol):
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
        work, lead, above = _fill(it, cand, keys, m, bs, bt, cap)
        if work > 0 and work / lead > most:
            most = work / lead
            best = cap
        if above == -1:
            break
        cap = max(above, np.int64(cap * (1.0 + tol)))
    return best


@kernel(_nrt=False)
def select_padded(S, f, start, descending, bs, bt, max_in, model_max, tol, out, failed, cand, keys):
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
    it = S[S_IT]
    m, nf, stop, lo, hi = _collect_padded(S, f, start, descending, max_in, model_max, tol, cand, failed)
    # a generating family whose band cannot fill the rectangle: widen the band
    generating = generates(S[S_FM], f, tol) and m < bs and (m + 1) * hi <= bt
    if generating:
        m, nf, stop, lo, hi = _collect_padded(S, f, start, descending, max_in, model_max, np.inf, cand, failed)
    if m == 0:
        return 0, nf, stop, 0, 0
    for i in range(m):
        keys[i] = (np.int64(it[cand[i]].max_new) << CANDIDATE_INDEX_BITS) | (CANDIDATE_INDEX_MASK - i)
    sort_descending(keys, m)
    cap = generation_cap(it, cand, keys, m, bs, bt, tol) if generating else np.int64(LENGTH_MAX)
    n = 0
    longest = 0
    for j in range(m):
        i = CANDIDATE_INDEX_MASK - (keys[j] & CANDIDATE_INDEX_MASK)
        s = cand[i]
        length = it[s].length
        if length > cap or n == bs or not _fits(n, longest, length, bs, bt):
            if generating:
                continue
            break
        out[n] = s
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
            return n, nf, S[S_BK][it[cand[i]].bucket].band, lo, hi
    return n, nf, stop, lo, hi


@kernel(inline="always", _nrt=False)
def generates(fm, f, tol):
    """Family f's batches are shaped by their generations (`select_padded`): it has an item of
    max_new > 1 and padding is tolerated at all."""
    return fm[f].maxnew > 1 and tol > 0.0


@kernel(_nrt=False)
def _claim(S, c, x):
    nd = S[S_ND]
    _branch_list_set(nd, S[S_FBH], S[S_FBT], x, -1)
    nd[x].claimed = c + 1
    nd[x].affine = c
    S[S_CONS][c, C_BRANCH] = x
    return x


@kernel(inline="always", _nrt=False)
def _before(a, b, longest):
    """Generation a goes before b: longer first (longest) or shorter first."""
    return a > b if longest else a < b


@kernel(_nrt=False)
def _pick_generation(nd, x, scan, longest):
    """Of the first `scan` branches of the list from x, the one with the longest (or shortest)
    max_new, the first among equals."""
    best = x
    y = nd[x].cnext
    for _ in range(scan - 1):
        if y == -1:
            break
        if _before(nd[y].maxnew, nd[best].maxnew, longest):
            best = y
        y = nd[y].cnext
    return best


@kernel(_nrt=False)
def _claim_branch(S, f, c, cls_order, scan, longest):
    """c's next branch in family f: one it served before (its cache may hold it), else from the
    class lists in c's order the longest (`longest`, else shortest) generation among the first
    `scan` of the first non-empty one, else (rather than idle) one another consumer served
    before, if c fits it."""
    nd = S[S_ND]
    fbh = S[S_FBH]
    cons = S[S_CONS]
    k1 = S[S_CLS].shape[0] + 1
    max_in = cons[c, C_MAXIN]
    x = fbh[f, k1 + c]
    if x != -1:
        return _claim(S, c, x)
    for k in range(cls_order.size):
        x = fbh[f, cls_order[k]]
        if x != -1:
            return _claim(S, c, _pick_generation(nd, x, scan, longest))
    for d in range(cons.shape[0]):
        x = fbh[f, k1 + d]
        if d != c and x != -1 and nd[x].maxlen <= max_in:
            return _claim(S, c, x)
    return -1


@kernel(_nrt=False)
def release_branch(S, c):
    x = S[S_CONS][c, C_BRANCH]
    if x == -1:
        return
    S[S_ND][x].claimed = 0
    S[S_CONS][c, C_BRANCH] = -1
    if S[S_ND][x].depth == 1:  # a part taken over from another's branch is in no list
        branch_reclass(S, x)


@kernel(inline="always", _nrt=False)
def _free_for(nd, z, c):
    """Node z is not a part another consumer took over (`_take_over`)."""
    return nd[z].claimed == 0 or nd[z].claimed == c + 1


@kernel(_nrt=False)
def _next_node(nd, y, top, c):
    """The node after y in a depth-first walk of top's subtree (a node before its children,
    children in order), leaving out the parts other consumers took over: (node or -1, whether
    it left any out)."""
    skipped = False
    z = nd[y].chead
    while z != -1 and not _free_for(nd, z, c):
        skipped = True
        z = nd[z].snext
    if z != -1:
        return z, skipped
    while y != top:
        z = nd[y].snext
        while z != -1 and not _free_for(nd, z, c):
            skipped = True
            z = nd[z].snext
        if z != -1:
            return z, skipped
        y = nd[y].parent
    return -1, skipped


@kernel(_nrt=False)
def _take_over(S, f, c, scan):
    """Rather than idle: a part of another consumer's branch in family f, the last of the first
    `scan` children of that branch not taken yet (the other consumer's walk reaches it last),
    or -1. A family whose items all share more than its first block is one branch; this is how
    two consumers share it."""
    nd = S[S_ND]
    cons = S[S_CONS]
    fbh = S[S_FBH]
    max_in = cons[c, C_MAXIN]
    for d in range(cons.shape[0]):
        x = cons[d, C_BRANCH]
        if d != c and x != -1 and nd[x].fam == f and nd[x].depth == 1:
            y = _untaken_child(nd, x, scan, max_in)
            if y != -1:
                return _claim(S, c, y)
    # branches nobody holds that c may not claim whole (they hold longer items than it takes)
    for k in range(fbh.shape[1]):
        x = fbh[f, k]
        for _ in range(scan):
            if x == -1:
                break
            y = _untaken_child(nd, x, scan, max_in)
            if y != -1:
                return _claim(S, c, y)
            x = nd[x].cnext
    return -1


@kernel(_nrt=False)
def _untaken_child(nd, x, scan, max_in):
    """The last of branch x's first `scan` children (from its end) that nobody took over and in
    which no consumer taking over met an item longer than max_in (a part's `maxlen`), or -1."""
    y = nd[x].ctail
    for _ in range(scan):
        if y == -1:
            return -1
        if nd[y].claimed == 0 and nd[y].maxlen <= max_in:
            return y
        y = nd[y].sprev
    return -1


@kernel(_nrt=False)
def select_packed(S, f, c, bs, max_in, model_max, cls_order, scan, longest, out, failed):
    """Returns (items, failed). scan, longest: which branch is claimed next (`_claim_branch`)."""
    it = S[S_IT]
    nd = S[S_ND]
    n = 0
    nf = 0
    root = S[S_FM][f].root
    if root == -1:
        return 0, 0
    s = nd[root].ihead
    while s != -1:
        length = it[s].length
        if length > model_max:
            if nf == failed.size:
                return n, nf
            failed[nf] = s
            nf += 1
        elif length <= max_in:
            if n == bs:
                return n, nf
            out[n] = s
            n += 1
        s = it[s].nnext
    for _ in range(bs + failed.size + 1):  # each round takes an item, fails one, or ends a branch
        x = S[S_CONS][c, C_BRANCH]
        if x != -1 and nd[x].fam != f:
            release_branch(S, c)
            x = -1
        if x == -1:
            x = _claim_branch(S, f, c, cls_order, scan, longest)
            if x == -1:
                x = _take_over(S, f, c, scan)
            if x == -1:
                return n, nf
        top = x
        y = x
        skipped = False
        while y != -1:
            s = nd[y].ihead
            while s != -1:
                length = it[s].length
                if length > model_max:
                    if nf == failed.size:
                        return n, nf
                    failed[nf] = s
                    nf += 1
                elif length > max_in:
                    if nd[top].depth != 1:  # a part taken over: not again (`_untaken_child`)
                        nd[top].maxlen = max(nd[top].maxlen, length)
                    release_branch(S, c)  # a longer item than this consumer takes: a bigger card's branch
                    return n, nf
                else:
                    if n == bs:
                        return n, nf
                    out[n] = s
                    n += 1
                s = it[s].nnext
            y, left_out = _next_node(nd, y, top, c)
            skipped = skipped or left_out
        if skipped:  # what is left of the branch is the parts others took over: it lives on, unclaimed
            release_branch(S, c)
        else:
            # the whole branch is in this batch: it dies when the batch is committed; it stays
            # claimed (in no list) until then, and `unclaim` puts it back if the batch is refused
            S[S_CONS][c, C_BRANCH] = -1
    return n, nf


@kernel(_nrt=False)
def oldest(S, classes, cutoff):
    """The oldest item of the given age classes that arrived before cutoff (waited longer), or -1."""
    it = S[S_IT]
    best = -1
    for k in range(classes.size):
        s = age_head(S, classes[k])
        if s != -1 and it[s].arrival < cutoff and (best == -1 or it[s].arrival < it[best].arrival):
            best = s
    return best


@kernel(_nrt=False)
def unclaim(S, slots, n):
    """Put back the branches of a refused batch's items (claimed, but no longer any consumer's)."""
    it = S[S_IT]
    nd = S[S_ND]
    cons = S[S_CONS]
    for i in range(n):
        x = nd[it[slots[i]].node].branch
        if x != -1 and nd[x].claimed != 0 and cons[nd[x].claimed - 1, C_BRANCH] != x:
            nd[x].claimed = 0
            branch_reclass(S, x)


@kernel(inline="always", _nrt=False)
def contains(values, n, x):
    for i in range(n):
        if values[i] == x:
            return True
    return False


@kernel(inline="always", _nrt=False)
def family_steps(fm, f, bs, bt):
    """The engine steps family f takes at least on a consumer of max_batch_size bs and max_batch_tokens
    bt: its longest generation, its pending tokens over bt, its pending generations over bs."""
    return max(np.int64(fm[f].maxnew), fm[f].tokens // bt, fm[f].generate // bs)


@kernel(_nrt=False)
def take_family(S, c, cls_order, skip, nskip, scan, longest, bs, bt):
    """Claim an unclaimed family not in skip[:nskip] from the first class list (in cls_order) that
    has one: of its first `scan` such families, the one that takes the most steps (`family_steps`;
    `longest`, else the fewest; the first among equals); or -1."""
    fm = S[S_FM]
    gh = S[S_GH]
    for k in range(cls_order.size):
        best = -1
        most = 0
        seen = 0
        f = gh[cls_order[k]]
        while f != -1 and seen < scan:
            if not contains(skip, nskip, f):
                seen += 1
                steps = family_steps(fm, f, bs, bt)
                if best == -1 or _before(steps, most, longest):
                    best = f
                    most = steps
            f = fm[f].gnext
        if best != -1:
            _family_list_set(fm, gh, S[S_GT], best, -1)
            fm[best].claimed = c + 1
            return best
    return -1


@kernel(_nrt=False)
def release_family(S, c):
    """c leaves its current family: unclaim it if c held it."""
    f = S[S_CONS][c, C_FAM]
    if f == -1:
        return
    S[S_CONS][c, C_FAM] = -1
    if S[S_FM][f].claimed == c + 1:
        S[S_FM][f].claimed = 0
        family_reclass(S, f)


@kernel(_nrt=False)
def claim_item_branch(S, c, s, max_in):
    """Aging, packed: make item s's branch c's current branch when nobody holds it and c fits it."""
    nd = S[S_ND]
    x = nd[S[S_IT][s].node].branch
    if x == -1 or nd[x].claimed != 0 or nd[x].maxlen > max_in:
        return
    release_branch(S, c)
    _claim(S, c, x)


@kernel(_nrt=False)
def gather(S, slots, n, rows):
    it = S[S_IT]
    fm = S[S_FM]
    for i in range(n):
        s = slots[i]
        rows[i].key = it[s].key
        rows[i].length = it[s].length
        rows[i].max_new = it[s].max_new
        rows[i].arrival = it[s].arrival
        rows[i].family = fm[it[s].fam].key
        rows[i].model = fm[it[s].fam].model


@kernel(_nrt=False)
def finish(S, out, n, failed, nf, family_key, model, length_min, length_max, tol, bs, bt, max_in, rectangle, rows,
           fail_keys):
    """Gather the batch, run the guard, then remove its items (and the failed ones) from the index.

    Returns the guard's code; on a refusal the batch's items stay indexed (their branches unclaimed)."""
    gather(S, out, n, rows)
    it = S[S_IT]
    for i in range(nf):
        fail_keys[i] = it[failed[i]].key
    code = 0
    if n:
        code = check_rows(rows, n, family_key, model, length_min, length_max, tol, bs, bt, max_in, rectangle)
        if code != 0:
            unclaim(S, out, n)
            n = 0
    alive = -1
    for i in range(n):
        alive = remove_quiet(S, out[i])
    for i in range(nf):
        alive = remove_quiet(S, failed[i])
    if alive != -1:  # every item came from one family
        family_reclass(S, alive)
    return code
