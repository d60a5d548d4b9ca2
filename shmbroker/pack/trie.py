"""The packing index's prefix trie (numba kernels over its node records, `state.py`).

Path-compressed: a family's root (its family key), its branches (an item's first block, depth 1),
the items' deep blocks (`shapes.deep_block`) and their end nodes (their last block, hung under
their deepest indexed ancestor) are the only nodes, so the trie holds O(items) nodes, not
O(blocks). Nodes are found by block hash
(`tables.py`); a node is live while an item hangs from it or from a live descendant. `index.py`
calls these as items come; it unlinks them as they go.
"""

from __future__ import annotations

from ..jit import kernel
from .links import child_append, nitem_append
from .listing import branch_reclass, hinted_consumer
from .shapes import deep_block
from .state import M_NODES_FREE, pop_free
from .tables import ht_find, ht_put


@kernel(inline="always", _nrt=False)
def new_node(S, block_hash, parent, depth, f):
    """A fresh node of family f for `block_hash` under `parent` at `depth` (no items, no children,
    unlisted, found by its hash from now on); a branch starts affine to its hinted consumer."""
    nd = S.nodes
    meta = S.meta
    x = pop_free(S.free_nodes, meta, M_NODES_FREE)
    nd[x].hash = block_hash
    nd[x].parent = parent
    nd[x].depth = depth
    nd[x].fam = f
    nd[x].branch = -1 if depth == 0 else (x if depth == 1 else nd[parent].branch)
    nd[x].chead = -1
    nd[x].ctail = -1
    nd[x].sprev = -1
    nd[x].snext = -1
    nd[x].ihead = -1
    nd[x].itail = -1
    nd[x].nitems = 0
    nd[x].live = 0
    nd[x].maxlen = 0
    nd[x].maxnew = 0
    nd[x].claimed = 0
    nd[x].cls = -1
    nd[x].cprev = -1
    nd[x].cnext = -1
    nd[x].affine = hinted_consumer(S, block_hash) if depth == 1 else -1
    ht_put(S.node_keys, S.node_slots, block_hash, x)
    return x


@kernel(inline="always", _nrt=False)
def end_node(S, f, family_key, hashes):
    """The trie node an item of family f with these block hashes hangs from: the family root, the
    branch (first block), then the item's own end node under its deepest indexed ancestor
    (path-compressed: only roots, branches, deep blocks and item ends are nodes, so the trie holds
    O(items) nodes, not O(blocks)). An end node made under an ancestor above the item's deep block
    (`shapes.deep_block`) gets a node there between them, while a node is left for it, so items
    sharing a long prefix under a common branch hang together and are drained together. Makes
    the nodes missing (at most 4; the caller checked there are 3, the deep one is left out short)."""
    fm = S.families
    x = fm[f].root
    if x == -1:
        x = new_node(S, family_key, -1, 0, f)
        fm[f].root = x
    br = x
    if hashes.size >= 1:
        br = ht_find(S.node_keys, S.node_slots, hashes[0])
        if br == -1:
            br = new_node(S, hashes[0], x, 1, f)
        x = br
    if hashes.size >= 2:
        last = hashes.size - 1
        y = ht_find(S.node_keys, S.node_slots, hashes[last])
        if y == -1:
            p = br
            for d in range(last - 1, 0, -1):
                a = ht_find(S.node_keys, S.node_slots, hashes[d])
                if a != -1:
                    p = a
                    break
            k = deep_block(hashes.size)
            if k >= 1 and nd_depth(S, p) < k + 1 and S.meta[M_NODES_FREE] >= 2:
                p = new_node(S, hashes[k], p, k + 1, f)  # the deep block: its items meet under it
            y = new_node(S, hashes[last], p, last + 1, f)
        x = y
    return x


@kernel(inline="always", _nrt=False)
def nd_depth(S, x):
    return S.nodes[x].depth


@kernel(inline="always", _nrt=False)
def hang_item(S, x, slot, length, max_new):
    """Put item `slot` on node x's items; x and its ancestors become live (linked into their
    parents' children), and x's branch learns the item's lengths (and is listed again)."""
    it = S.items
    nd = S.nodes
    nitem_append(it, nd, x, slot)
    y = x
    while y != -1 and nd[y].live == 0:
        nd[y].live = 1
        p = nd[y].parent
        if p != -1:
            child_append(nd, p, y)
        y = p
    br = nd[x].branch
    if br != -1:
        if length > nd[br].maxlen:
            nd[br].maxlen = length
        if max_new > nd[br].maxnew:
            nd[br].maxnew = max_new
        branch_reclass(S, br)
