"""The index's intrusive doubly-linked lists (numba kernels over its record arrays).

Each list keeps head/tail slots in its owner and prev/next slots in its members;
-1 is "none". Appends go to the tail (FIFO order); unlinks are O(1).

| list                  | owner (head, tail)       | members (prev, next)  |
|-----------------------|--------------------------|-----------------------|
| a band's items        | BUCKET head, tail        | ITEM bprev, bnext     |
| a node's items        | NODE ihead, itail        | ITEM nprev, nnext     |
| a node's live children| NODE chead, ctail        | NODE sprev, snext     |
| a family's branch list| branch_heads/tails[f, k] | NODE cprev, cnext     |
| a family class list   | family_heads/tails[c]    | FAMILY gprev, gnext   |
"""

from __future__ import annotations

from ..jit import kernel


@kernel(_nrt=False)
def bucket_append(it, bk, b, slot):
    it[slot].bucket = b
    it[slot].bnext = -1
    it[slot].bprev = bk[b].tail
    if bk[b].tail != -1:
        it[bk[b].tail].bnext = slot
    else:
        bk[b].head = slot
    bk[b].tail = slot
    bk[b].count += 1


@kernel(_nrt=False)
def bucket_unlink(it, bk, slot):
    b = it[slot].bucket
    p = it[slot].bprev
    n = it[slot].bnext
    if p != -1:
        it[p].bnext = n
    else:
        bk[b].head = n
    if n != -1:
        it[n].bprev = p
    else:
        bk[b].tail = p
    bk[b].count -= 1
    return b


@kernel(_nrt=False)
def nitem_append(it, nd, x, slot):
    it[slot].node = x
    it[slot].nnext = -1
    it[slot].nprev = nd[x].itail
    if nd[x].itail != -1:
        it[nd[x].itail].nnext = slot
    else:
        nd[x].ihead = slot
    nd[x].itail = slot
    nd[x].nitems += 1


@kernel(_nrt=False)
def nitem_unlink(it, nd, slot):
    x = it[slot].node
    p = it[slot].nprev
    n = it[slot].nnext
    if p != -1:
        it[p].nnext = n
    else:
        nd[x].ihead = n
    if n != -1:
        it[n].nprev = p
    else:
        nd[x].itail = p
    nd[x].nitems -= 1
    return x


@kernel(_nrt=False)
def child_append(nd, p, x):
    nd[x].snext = -1
    nd[x].sprev = nd[p].ctail
    if nd[p].ctail != -1:
        nd[nd[p].ctail].snext = x
    else:
        nd[p].chead = x
    nd[p].ctail = x


@kernel(_nrt=False)
def child_unlink(nd, p, x):
    a = nd[x].sprev
    b = nd[x].snext
    if a != -1:
        nd[a].snext = b
    else:
        nd[p].chead = b
    if b != -1:
        nd[b].sprev = a
    else:
        nd[p].ctail = a
    nd[x].sprev = -1
    nd[x].snext = -1


@kernel(_nrt=False)
def branch_list_set(nd, fbh, fbt, x, c):
    """Move branch x to its family's class list c (-1: out of every list)."""
    old = nd[x].cls
    if old == c:
        return
    f = nd[x].fam
    if old != -1:
        a = nd[x].cprev
        b = nd[x].cnext
        if a != -1:
            nd[a].cnext = b
        else:
            fbh[f, old] = b
        if b != -1:
            nd[b].cprev = a
        else:
            fbt[f, old] = a
    nd[x].cls = c
    nd[x].cprev = -1
    nd[x].cnext = -1
    if c != -1:
        nd[x].cprev = fbt[f, c]
        if fbt[f, c] != -1:
            nd[fbt[f, c]].cnext = x
        else:
            fbh[f, c] = x
        fbt[f, c] = x


@kernel(_nrt=False)
def family_list_set(fm, gh, gt, f, c):
    """Move family f to the global class list c (-1: out of every list)."""
    old = fm[f].gcls
    if old == c:
        return
    if old != -1:
        a = fm[f].gprev
        b = fm[f].gnext
        if a != -1:
            fm[a].gnext = b
        else:
            gh[old] = b
        if b != -1:
            fm[b].gprev = a
        else:
            gt[old] = a
    fm[f].gcls = c
    fm[f].gprev = -1
    fm[f].gnext = -1
    if c != -1:
        fm[f].gprev = gt[c]
        if gt[c] != -1:
            fm[gt[c]].gnext = f
        else:
            gh[c] = f
        gt[c] = f
