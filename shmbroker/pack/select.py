"""The packer's mechanism: pick a batch's items from one family, without removing them.

Two walks, one per engine mode; both stop at the first item that would break
the contract (count <= max_batch_size, count x longest <= max_batch_tokens,
each <= max_input_len), so a decision costs O(batch + trie depth), never
O(backlog). Items longer than every consumer of their model (`model_max`)
are collected in `failed` when the walk meets them.

- `select_padded` sweeps a family's length bands from a cursor (up for
  ascending consumers, down for the largest), within a padding tolerance: the
  batch's longest item is at most (1 + tol) x its shortest.
- `select_packed` takes the family root's own items, then walks the
  consumer's claimed branch depth-first (a node before its children; children in the order
  they became live, so a turn that arrived before its parent runs before it), claiming
  the next unclaimed branch of a class it fits when one is drained.
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
from .shapes import NUM_BANDS
from .tables import ht_find


@kernel(_nrt=False)
def _fits(n, longest, length, bs, bt):
    m = max(longest, length)
    return n + 1 <= bs and (n + 1) * m <= bt


@kernel(_nrt=False)
def select_padded(S, f, start, descending, bs, bt, max_in, model_max, tol, out, failed):
    """Returns (items, failed, band to resume from or -1 for the far end, shortest, longest).

    Two passes at most, each band visited once: from `start` to the far end, then, if nothing was
    taken, from the near end up to `start` (an ascending consumer also turns back when it meets
    items longer than its max_input_len)."""
    it = S[S_IT]
    bk = S[S_BK]
    bits = S[S_BITS]
    summ = S[S_SUMM]
    n = 0
    nf = 0
    lo = 0
    hi = 0
    top = NUM_BANDS - 1
    for second in range(2):
        if second == 0:
            band = band_prev(bits, summ, f, start) if descending else band_next(bits, summ, f, start)
        else:
            if n > 0 or (start == top if descending else start == 0):
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
                        return n, nf, band, lo, hi
                    failed[nf] = s
                    nf += 1
                elif length > max_in:
                    # only an ascending consumer meets these: everything further up is longer
                    if n == 0:
                        turn = True
                        break
                    return n, nf, band, lo, hi
                else:
                    if n == 0:
                        lo = length
                        hi = length
                    new_lo = min(lo, length)
                    new_hi = max(hi, length)
                    if not _fits(n, hi, length, bs, bt) or new_hi > new_lo * (1.0 + tol):
                        return n, nf, band, lo, hi
                    out[n] = s
                    n += 1
                    lo = new_lo
                    hi = new_hi
                s = it[s].bnext
            if turn:
                break
            band = band_prev(bits, summ, f, band - 1) if descending else band_next(bits, summ, f, band + 1)
    return n, nf, -1, lo, hi


@kernel(_nrt=False)
def _claim(S, c, x):
    nd = S[S_ND]
    _branch_list_set(nd, S[S_FBH], S[S_FBT], x, -1)
    nd[x].claimed = c + 1
    nd[x].affine = c
    S[S_CONS][c, C_BRANCH] = x
    return x


@kernel(_nrt=False)
def _claim_branch(S, f, c, cls_order):
    """c's next branch in family f: one it served before (its cache may hold it), else the class
    lists in c's order, else (rather than idle) one another consumer served before, if c fits it."""
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
            return _claim(S, c, x)
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
    branch_reclass(S, x)


@kernel(_nrt=False)
def select_packed(S, f, c, bs, bt, max_in, model_max, cls_order, out, failed):
    """Returns (items, failed)."""
    it = S[S_IT]
    nd = S[S_ND]
    n = 0
    nf = 0
    longest = 0
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
            if not _fits(n, longest, length, bs, bt):
                return n, nf
            out[n] = s
            n += 1
            longest = max(longest, length)
        s = it[s].nnext
    for _ in range(bs + failed.size + 1):  # each round takes an item, fails one, or ends a branch
        x = S[S_CONS][c, C_BRANCH]
        if x != -1 and nd[x].fam != f:
            release_branch(S, c)
            x = -1
        if x == -1:
            x = _claim_branch(S, f, c, cls_order)
            if x == -1:
                return n, nf
        top = x
        y = x
        while True:
            s = nd[y].ihead
            while s != -1:
                length = it[s].length
                if length > model_max:
                    if nf == failed.size:
                        return n, nf
                    failed[nf] = s
                    nf += 1
                elif length > max_in:
                    release_branch(S, c)  # a longer item than this consumer takes: a bigger card's branch
                    return n, nf
                else:
                    if not _fits(n, longest, length, bs, bt):
                        return n, nf
                    out[n] = s
                    n += 1
                    longest = max(longest, length)
                s = it[s].nnext
            if nd[y].chead != -1:
                y = nd[y].chead
                continue
            while y != top and nd[y].snext == -1:
                y = nd[y].parent
            if y == top:
                break
            y = nd[y].snext
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


@kernel(_nrt=False)
def take_family(S, c, cls_order, skip, nskip):
    """Claim the first unclaimed family in the class lists (in cls_order) not in skip[:nskip]; or -1."""
    fm = S[S_FM]
    gh = S[S_GH]
    for k in range(cls_order.size):
        f = gh[cls_order[k]]
        while f != -1:
            if not contains(skip, nskip, f):
                _family_list_set(fm, gh, S[S_GT], f, -1)
                fm[f].claimed = c + 1
                return f
            f = fm[f].gnext
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
def finish(S, out, n, failed, nf, family_key, model, length_min, length_max, tol, bs, bt, max_in, rows, fail_keys):
    """Gather the batch, run the guard, then remove its items (and the failed ones) from the index.

    Returns the guard's code; on a refusal the batch's items stay indexed (their branches unclaimed)."""
    gather(S, out, n, rows)
    it = S[S_IT]
    for i in range(nf):
        fail_keys[i] = it[failed[i]].key
    code = 0
    if n:
        code = check_rows(rows, n, family_key, model, length_min, length_max, tol, bs, bt, max_in)
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
