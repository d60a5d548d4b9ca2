"""The packed walk: an ordered group's items from one family's trie, branch by branch, without removing them.

A packed engine's batch is an ordered group for its in-flight window: count
<= max_batch_size, each item <= max_input_len (the engine itself keeps a step
within max_batch_tokens). The walk stops at the first item that would break
that, so a decision costs O(batch + trie depth). Items longer than every
consumer of their model (`model_max`) reach the index only through the
standalone `Packer` (the scheduler fails them at admission); the walk
collects those it meets in `failed`.

`select_packed` takes the family root's own items, then walks the consumer's
claimed branch depth-first (or, with no branch left to claim, a part of
another consumer's branch it takes over: `_take_over`) (a node before its
children; children in the order they became live, so a turn that arrived
before its parent runs before it), claiming the next unclaimed branch of a
class it fits when one is drained (of the first few, the one with the longest
generation: `_claim_branch`).
"""

from __future__ import annotations

from ..jit import kernel
from .links import branch_list_set
from .listing import branch_reclass
from .state import C_BRANCH, C_MAXIN


@kernel(_nrt=False)
def _claim(S, c, x):
    nd = S.nodes
    branch_list_set(nd, S.branch_heads, S.branch_tails, x, -1)
    nd[x].claimed = c + 1
    nd[x].affine = c
    S.consumers[c, C_BRANCH] = x
    return x


@kernel(inline="always", _nrt=False)
def goes_before(a, b, longest):
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
        if goes_before(nd[y].maxnew, nd[best].maxnew, longest):
            best = y
        y = nd[y].cnext
    return best


@kernel(_nrt=False)
def _claim_branch(S, f, c, cls_order, scan, longest):
    """c's next branch in family f: one it served before (its cache may hold it), else from the
    class lists in c's order the longest (`longest`, else shortest) generation among the first
    `scan` of the first non-empty one, else (rather than idle) one another consumer served
    before, if c fits it."""
    nd = S.nodes
    fbh = S.branch_heads
    cons = S.consumers
    k1 = S.classes.shape[0] + 1
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
    x = S.consumers[c, C_BRANCH]
    if x == -1:
        return
    S.nodes[x].claimed = 0
    S.consumers[c, C_BRANCH] = -1
    if S.nodes[x].depth == 1:  # a part taken over from another's branch is in no list
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
    z, skipped = _free_sibling(nd, nd[y].chead, c)
    if z != -1:
        return z, skipped
    while y != top:
        z, passed = _free_sibling(nd, nd[y].snext, c)
        skipped = skipped or passed
        if z != -1:
            return z, skipped
        y = nd[y].parent
    return -1, skipped


@kernel(_nrt=False)
def _free_sibling(nd, z, c):
    """z, or the first sibling after it that no other consumer took over: (node or -1, whether it
    passed any taken over)."""
    skipped = False
    while z != -1 and not _free_for(nd, z, c):
        skipped = True
        z = nd[z].snext
    return z, skipped


@kernel(_nrt=False)
def _take_over(S, f, c, scan):
    """Rather than idle: a part of another consumer's branch in family f, the last of the first
    `scan` children of that branch not taken yet (the other consumer's walk reaches it last),
    or -1. A family whose items all share more than its first block is one branch; this is how
    two consumers share it."""
    nd = S.nodes
    cons = S.consumers
    fbh = S.branch_heads
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


FAILED_FULL = -1  # _fail: `failed` holds no more


@kernel(_nrt=False)
def _fail(failed, nf, slot):
    """Fail item slot back (too long for every consumer of its model, standalone Packer only): the
    new count, or FAILED_FULL when `failed` is full."""
    if nf == failed.size:
        return FAILED_FULL
    failed[nf] = slot
    return nf + 1


@kernel(_nrt=False)
def select_packed(S, f, c, bs, max_in, model_max, cls_order, scan, longest, out, failed):
    """Returns (items, failed). scan, longest: which branch is claimed next (`_claim_branch`)."""
    it = S.items
    nd = S.nodes
    n = 0
    nf = 0
    root = S.families[f].root
    if root == -1:
        return 0, 0
    slot = nd[root].ihead
    while slot != -1:
        length = it[slot].length
        if length <= max_in:  # (max_in <= model_max)
            if n == bs:
                return n, nf
            out[n] = slot
            n += 1
        elif length > model_max:
            nf = _fail(failed, nf, slot)
            if nf == FAILED_FULL:
                return n, failed.size
        slot = it[slot].nnext
    for _ in range(bs + failed.size + 1):  # each round takes an item, fails one, or ends a branch
        x = S.consumers[c, C_BRANCH]
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
            slot = nd[y].ihead
            while slot != -1:
                length = it[slot].length
                if length > model_max:
                    nf = _fail(failed, nf, slot)
                    if nf == FAILED_FULL:
                        return n, failed.size
                elif length > max_in:
                    if nd[top].depth != 1:  # a part taken over: not again (`_untaken_child`)
                        nd[top].maxlen = max(nd[top].maxlen, length)
                    release_branch(S, c)  # a longer item than this consumer takes: a bigger card's branch
                    return n, nf
                else:
                    if n == bs:
                        return n, nf
                    out[n] = slot
                    n += 1
                slot = it[slot].nnext
            y, left_out = _next_node(nd, y, top, c)
            skipped = skipped or left_out
        if skipped:  # what is left of the branch is the parts others took over: it lives on, unclaimed
            release_branch(S, c)
        else:
            # the whole branch is in this batch: it dies when the batch is committed; it stays
            # claimed (in no list) until then, and `unclaim` puts it back if the batch is refused
            S.consumers[c, C_BRANCH] = -1
    return n, nf


@kernel(_nrt=False)
def claim_item_branch(S, c, slot, max_in):
    """Aging, packed: make item slot's branch c's current branch when nobody holds it and c fits it."""
    nd = S.nodes
    x = nd[S.items[slot].node].branch
    if x == -1 or nd[x].claimed != 0 or nd[x].maxlen > max_in:
        return
    release_branch(S, c)
    _claim(S, c, x)
