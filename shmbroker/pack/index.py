"""The packing index: families, a prefix trie of block hashes, length bands.

Bounded, array-backed, written by one owner (sched). Every operation costs
O(the item's blocks) to insert or remove and O(batch + trie depth) to pack;
nothing walks the backlog.

Records (numpy structured arrays; a slot is a row index, -1 is "none"):

ITEM (64 bytes)                          NODE (88 bytes): one trie node
  key      u64  caller's handle            key     u64  block hash (family key at the root)
  arrival  f64  seconds                    parent  i32  depth i32  fam i32  branch i32
  length   i32  max_new i32                chead/ctail i32  live children list
  fam      i32  node    i32                sprev/snext i32  links in the parent's list
  bucket   i32  bprev/bnext i32            ihead/itail i32  items ending here, nitems i32
  nprev/nnext i32   node item list         live    i32  has items or live children
  gen      i32  bumped when the slot frees  maxlen i32  claimed i32 (consumer+1) cls i32
  pad      i32 x2                          cprev/cnext i32  the branch list it is in (cls)
                                           affine  i32  consumer that served the branch last
                                           maxnew  i32  longest max_new under a branch

FAMILY (56 bytes)                        BUCKET (24 bytes): one (family, band)
  key u64  model i32  root i32             key u64  head/tail i32  count i32  band i32
  pending i32  maxnew i32 (longest max_new while it lived)  tokens i64
  claimed i32  gcls i32  gprev/gnext i32  generate i64 (pending max_new summed)

- A **branch** is a depth-1 node (the first block after the family root). A
  packed consumer claims a branch and drains it depth-first (parents before
  children), so a conversation is served on one card, turn after turn.
  A consumer with no branch left to claim may take over a child of another's
  branch (`select._take_over`): that node's `claimed` marks it (other walks
  leave it out) and its `maxlen` the longest item a taker met there and left.
- Bands of a family are a two-level bitmap (`bands.py`), so the next
  non-empty band either side of a cursor is found in O(1) words; the lists
  linking records are in `links.py`.
- **Classes**: consumers' distinct `max_input_len` values, ascending, plus an
  overflow class for items no consumer can take. Branches (by their longest
  item) and families (by their shortest) sit in per-class lists; items sit in
  per-class age lists in arrival order.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .bands import BAND_WORDS, SUMMARY_WORDS, band_next, bit_clear, bit_set
from .links import (
    _branch_list_set,
    _bucket_append,
    _bucket_unlink,
    _child_append,
    _child_unlink,
    _family_list_set,
    _nitem_append,
    _nitem_unlink,
)
from .shapes import LENGTH_MAX, band_floor, band_of
from .tables import ht_delete, ht_find, ht_put, new_free_list, new_table

ITEM_REC = np.dtype([
    ("key", "u8"), ("arrival", "f8"), ("length", "i4"), ("max_new", "i4"), ("fam", "i4"), ("node", "i4"),
    ("bucket", "i4"), ("bprev", "i4"), ("bnext", "i4"), ("nprev", "i4"), ("nnext", "i4"),
    ("gen", "i4"), ("pad1", "i4"), ("pad2", "i4")])
NODE_REC = np.dtype([
    ("key", "u8"), ("parent", "i4"), ("depth", "i4"), ("fam", "i4"), ("branch", "i4"),
    ("chead", "i4"), ("ctail", "i4"), ("sprev", "i4"), ("snext", "i4"),
    ("ihead", "i4"), ("itail", "i4"), ("nitems", "i4"), ("live", "i4"),
    ("maxlen", "i4"), ("claimed", "i4"), ("cls", "i4"), ("cprev", "i4"), ("cnext", "i4"), ("affine", "i4"),
    ("maxnew", "i4")])
FAM_REC = np.dtype([
    ("key", "u8"), ("model", "i4"), ("root", "i4"), ("pending", "i4"), ("maxnew", "i4"), ("tokens", "i8"),
    ("claimed", "i4"), ("gcls", "i4"), ("gprev", "i4"), ("gnext", "i4"), ("generate", "i8")])
BUCKET_REC = np.dtype([("key", "u8"), ("head", "i4"), ("tail", "i4"), ("count", "i4"), ("band", "i4")])


# insert() results
FULL_ITEMS = -1
FULL_NODES = -2
FULL_FAMILIES = -3
FULL_BUCKETS = -4

# meta words
M_ITEMS_FREE, M_NODES_FREE, M_FAMS_FREE, M_BUCKETS_FREE, M_ITEMS, M_TOKENS = range(6)
# consumer state columns
C_FAM, C_BRANCH, C_BAND, C_MAXIN = range(4)

# S: the state tuple every kernel takes, in this order
(S_IT, S_ND, S_FM, S_BK, S_NKEYS, S_NVALS, S_FKEYS, S_FVALS, S_BKEYS, S_BVALS, S_BITS, S_SUMM,
 S_FBH, S_FBT, S_GH, S_GT, S_AH, S_AT, S_IFREE, S_NFREE, S_FFREE, S_BFREE, S_META, S_CLS, S_CONS,
 S_HKEYS, S_HCONS) = range(27)


# ---- classes -------------------------------------------------------------------------------

@kernel(_nrt=False)
def class_of(cls, model, length):
    """First class (rows of cls: model, max_input_len; sorted) of `model` that fits `length`.

    Each model's last class is its overflow class (items no consumer of it can take);
    cls.shape[0] is the class of models that no consumer serves.
    """
    for k in range(cls.shape[0]):
        if cls[k, 0] == model and length <= cls[k, 1]:
            return k
    return cls.shape[0]


# ---- free lists: a stack of free slots, its height in meta[k] ---------------------------------

@kernel(inline="always", _nrt=False)
def _pop_free(free, meta, k):
    meta[k] -= 1
    return free[meta[k]]


@kernel(inline="always", _nrt=False)
def _push_free(free, meta, k, x):
    free[meta[k]] = x
    meta[k] += 1


# ---- age queues ---------------------------------------------------------------------------
# One FIFO ring per class of (slot << 32 | gen) entries in arrival order, positions as running
# counters (S_AT[c] = head, tail). Removing an item only bumps its slot's gen: its entry goes stale
# and is dropped when it reaches the head, so a removal touches no other item's record.

@kernel(_nrt=False)
def _age_entry_live(it, e):
    return it[np.int64(e >> 32)].gen == np.int32(e & 0xFFFFFFFF)


@kernel(_nrt=False)
def age_push(S, c, s):
    it = S[S_IT]
    ring = S[S_AH]
    pos = S[S_AT]
    size = ring.shape[1]
    while pos[c, 1] - pos[c, 0] >= size:  # full: the head is stale (live items <= capacity < size)
        pos[c, 0] += 1
    ring[c, pos[c, 1] % size] = (np.int64(s) << 32) | np.int64(np.uint32(it[s].gen))
    pos[c, 1] += 1


@kernel(_nrt=False)
def age_head(S, c):
    """The oldest live item of class c (dropping stale entries), or -1."""
    it = S[S_IT]
    ring = S[S_AH]
    pos = S[S_AT]
    size = ring.shape[1]
    while pos[c, 0] < pos[c, 1]:
        e = ring[c, pos[c, 0] % size]
        if _age_entry_live(it, e):
            return np.int64(e >> 32)
        pos[c, 0] += 1
    return -1


# ---- insert and remove ---------------------------------------------------------------------

@kernel(inline="always", _nrt=False)
def family_reclass(S, f):
    """Put an unclaimed family in the class list of its shortest pending item."""
    fm = S[S_FM]
    if fm[f].claimed != 0 or fm[f].pending == 0:
        _family_list_set(fm, S[S_GH], S[S_GT], f, -1)
        return
    b = band_next(S[S_BITS], S[S_SUMM], f, 0)
    _family_list_set(fm, S[S_GH], S[S_GT], f, class_of(S[S_CLS], fm[f].model, band_floor(b)))


@kernel(inline="always", _nrt=False)
def branch_reclass(S, x):
    """List an unclaimed live branch: in its affine consumer's list when that consumer fits it,
    else in the class list of its longest item. Lists 0..K are classes, K+1+c consumer c's."""
    nd = S[S_ND]
    if nd[x].claimed != 0 or nd[x].live == 0:
        _branch_list_set(nd, S[S_FBH], S[S_FBT], x, -1)
        return
    a = nd[x].affine
    if a != -1 and nd[x].maxlen <= S[S_CONS][a, C_MAXIN]:
        _branch_list_set(nd, S[S_FBH], S[S_FBT], x, S[S_CLS].shape[0] + 1 + a)
    else:
        _branch_list_set(nd, S[S_FBH], S[S_FBT], x, class_of(S[S_CLS], S[S_FM][nd[x].fam].model, nd[x].maxlen))


@kernel(inline="always", _nrt=False)
def _new_node(S, key, parent, depth, f):
    nd = S[S_ND]
    meta = S[S_META]
    x = _pop_free(S[S_NFREE], meta, M_NODES_FREE)
    nd[x].key = key
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
    nd[x].affine = -1
    if depth == 1:
        h = np.int64(key & np.uint64(S[S_HKEYS].size - 1))
        if S[S_HKEYS][h] == key:
            nd[x].affine = S[S_HCONS][h]
    ht_put(S[S_NKEYS], S[S_NVALS], key, x)
    return x


@kernel(_nrt=False)
def insert(S, key, arrival, length, max_new, model, famkey, hashes):
    """Index one item; its slot, or a FULL_* code (nothing changed)."""
    it = S[S_IT]
    nd = S[S_ND]
    fm = S[S_FM]
    bk = S[S_BK]
    meta = S[S_META]
    if meta[M_ITEMS_FREE] < 1:
        return FULL_ITEMS
    if meta[M_NODES_FREE] < 3:
        return FULL_NODES
    if meta[M_BUCKETS_FREE] < 1:
        return FULL_BUCKETS
    f = ht_find(S[S_FKEYS], S[S_FVALS], famkey)
    if f == -1:
        if meta[M_FAMS_FREE] < 1:
            return FULL_FAMILIES
        f = _pop_free(S[S_FFREE], meta, M_FAMS_FREE)
        fm[f].key = famkey
        fm[f].model = model
        fm[f].root = -1
        fm[f].pending = 0
        fm[f].tokens = 0
        fm[f].generate = 0
        fm[f].maxnew = 0
        fm[f].claimed = 0
        fm[f].gcls = -1
        fm[f].gprev = -1
        fm[f].gnext = -1
        ht_put(S[S_FKEYS], S[S_FVALS], famkey, f)
    # the trie: the family root, the branch (first block), then the item's own end node hung
    # under its deepest indexed ancestor (path-compressed: only roots, branches and item ends
    # are nodes, so the trie holds O(items) nodes, not O(blocks))
    x = fm[f].root
    if x == -1:
        x = _new_node(S, famkey, -1, 0, f)
        fm[f].root = x
    if hashes.size >= 1:
        br = ht_find(S[S_NKEYS], S[S_NVALS], hashes[0])
        if br == -1:
            br = _new_node(S, hashes[0], x, 1, f)
        x = br
    if hashes.size >= 2:
        last = hashes.size - 1
        y = ht_find(S[S_NKEYS], S[S_NVALS], hashes[last])
        if y == -1:
            p = br
            for d in range(last - 1, 0, -1):
                a = ht_find(S[S_NKEYS], S[S_NVALS], hashes[d])
                if a != -1:
                    p = a
                    break
            y = _new_node(S, hashes[last], p, last + 1, f)
        x = y
    # the item
    s = _pop_free(S[S_IFREE], meta, M_ITEMS_FREE)
    it[s].key = key
    it[s].arrival = arrival
    it[s].length = length
    it[s].max_new = max_new
    it[s].fam = f
    _nitem_append(it, nd, x, s)
    y = x
    while y != -1 and nd[y].live == 0:
        nd[y].live = 1
        p = nd[y].parent
        if p != -1:
            _child_append(nd, p, y)
        y = p
    br = nd[x].branch
    if br != -1:
        if length > nd[br].maxlen:
            nd[br].maxlen = length
        if max_new > nd[br].maxnew:
            nd[br].maxnew = max_new
        branch_reclass(S, br)
    # the band
    band = band_of(length)
    bkey = (np.uint64(f + 1) << np.uint64(16)) | np.uint64(band)
    b = ht_find(S[S_BKEYS], S[S_BVALS], bkey)
    if b == -1:
        b = _pop_free(S[S_BFREE], meta, M_BUCKETS_FREE)
        bk[b].key = bkey
        bk[b].head = -1
        bk[b].tail = -1
        bk[b].count = 0
        bk[b].band = band
        ht_put(S[S_BKEYS], S[S_BVALS], bkey, b)
        bit_set(S[S_BITS], S[S_SUMM], f, band)
    _bucket_append(it, bk, b, s)
    fm[f].pending += 1
    fm[f].tokens += length
    fm[f].generate += max_new
    if max_new > fm[f].maxnew:
        fm[f].maxnew = max_new
    family_reclass(S, f)
    age_push(S, class_of(S[S_CLS], model, length), s)
    meta[M_ITEMS] += 1
    meta[M_TOKENS] += length
    return s


@kernel(_nrt=False)
def insert_many(S, keys, arrivals, lengths, max_new, models, families, hash_offsets, hashes):
    """`insert` for items 0.. in order; the number indexed (stops, whole items only, when full)."""
    for i in range(keys.size):
        s = insert(S, keys[i], arrivals[i], lengths[i], max_new[i], models[i], families[i],
                   hashes[hash_offsets[i]:hash_offsets[i + 1]])
        if s < 0:
            return i
    return keys.size


@kernel(_nrt=False)
def remove(S, s):
    """Take item s out of the index (its slot is free afterwards)."""
    f = remove_quiet(S, s)
    if f != -1:
        family_reclass(S, f)


@kernel(inline="always", _nrt=False)
def remove_quiet(S, s):
    """`remove` without re-listing the family; returns the family slot if it still has items, else -1.
    A caller removing several items of one family re-lists it once (`family_reclass`)."""
    it = S[S_IT]
    nd = S[S_ND]
    fm = S[S_FM]
    bk = S[S_BK]
    meta = S[S_META]
    cons = S[S_CONS]
    f = it[s].fam
    b = _bucket_unlink(it, bk, s)
    if bk[b].count == 0:
        bit_clear(S[S_BITS], S[S_SUMM], f, bk[b].band)
        ht_delete(S[S_BKEYS], S[S_BVALS], bk[b].key)
        _push_free(S[S_BFREE], meta, M_BUCKETS_FREE, b)
    x = _nitem_unlink(it, nd, s)
    while x != -1 and nd[x].nitems == 0 and nd[x].chead == -1:
        p = nd[x].parent
        nd[x].live = 0
        if p != -1:
            _child_unlink(nd, p, x)
        if nd[x].depth == 1:
            _branch_list_set(nd, S[S_FBH], S[S_FBT], x, -1)
            served = nd[x].claimed - 1 if nd[x].claimed != 0 else nd[x].affine
            if served != -1:  # remember who holds this conversation's prefix, for its next turn
                h = np.int64(nd[x].key & np.uint64(S[S_HKEYS].size - 1))
                S[S_HKEYS][h] = nd[x].key
                S[S_HCONS][h] = served
        elif nd[x].depth == 0:
            fm[f].root = -1
        if nd[x].claimed != 0 and cons[nd[x].claimed - 1, C_BRANCH] == x:  # a branch, or a part taken over
            cons[nd[x].claimed - 1, C_BRANCH] = -1
        ht_delete(S[S_NKEYS], S[S_NVALS], nd[x].key)
        _push_free(S[S_NFREE], meta, M_NODES_FREE, x)
        x = p
    it[s].gen += 1  # its age-queue entry is stale from now on
    fm[f].pending -= 1
    fm[f].tokens -= it[s].length
    fm[f].generate -= it[s].max_new
    meta[M_ITEMS] -= 1
    meta[M_TOKENS] -= it[s].length
    if fm[f].pending == 0:
        _family_list_set(fm, S[S_GH], S[S_GT], f, -1)
        for c in range(cons.shape[0]):
            if cons[c, C_FAM] == f:
                cons[c, C_FAM] = -1
        ht_delete(S[S_FKEYS], S[S_FVALS], fm[f].key)
        _push_free(S[S_FFREE], meta, M_FAMS_FREE, f)
        f = -1
    _push_free(S[S_IFREE], meta, M_ITEMS_FREE, s)
    return f


OVERFLOW_LEN = (1 << 31) - 1


class PackIndex:
    """The index's arrays, sized once; `S` is the tuple every kernel takes.

    classes: the consumers' (model, max_input_len) pairs; each model gets an
    overflow class above its largest. Capacities bound everything: items,
    trie nodes (distinct blocks pending), families, (family, band) buckets.
    """

    def __init__(self, classes, *, items: int, nodes: int | None = None, families: int | None = None,
                 num_consumers: int = 1):
        if items < 1:
            raise ValueError(f"items capacity must be positive, got {items}")
        nodes = nodes if nodes is not None else 3 * items + 16  # an item needs at most root, branch, end
        families = families if families is not None else max(16, items // 4)
        buckets = items
        rows = sorted(set((int(m), int(x)) for m, x in classes))
        for m in sorted(set(m for m, _ in rows)):
            rows.append((m, OVERFLOW_LEN))
        rows.sort()
        self.classes = np.array(rows, np.int64).reshape(-1, 2)
        k1 = len(rows) + 1
        it = np.zeros(items, ITEM_REC)
        nd = np.zeros(nodes, NODE_REC)
        fm = np.zeros(families, FAM_REC)
        bk = np.zeros(buckets, BUCKET_REC)
        nkeys, nvals = new_table(nodes)
        fkeys, fvals = new_table(families)
        bkeys, bvals = new_table(buckets)
        bits = np.zeros((families, BAND_WORDS), np.uint64)
        summ = np.zeros((families, SUMMARY_WORDS), np.uint64)
        fbh = np.full((families, k1 + num_consumers), -1, np.int32)
        fbt = np.full((families, k1 + num_consumers), -1, np.int32)
        gh = np.full(k1, -1, np.int32)
        gt = np.full(k1, -1, np.int32)
        ah = np.zeros((k1, items + 1), np.int64)  # age rings
        at = np.zeros((k1, 2), np.int64)  # their head and tail counters
        meta = np.zeros(8, np.int64)
        meta[M_ITEMS_FREE] = items
        meta[M_NODES_FREE] = nodes
        meta[M_FAMS_FREE] = families
        meta[M_BUCKETS_FREE] = buckets
        cons = np.full((num_consumers, 4), -1, np.int64)
        hint_size = 1 << max(16, (2 * items - 1).bit_length())
        hkeys = np.zeros(hint_size, np.uint64)
        hcons = np.full(hint_size, -1, np.int32)
        self.S = (it, nd, fm, bk, nkeys, nvals, fkeys, fvals, bkeys, bvals, bits, summ, fbh, fbt, gh, gt,
                  ah, at, new_free_list(items), new_free_list(nodes), new_free_list(families),
                  new_free_list(buckets), meta, self.classes, cons, hkeys, hcons)
        self.items = it
        self.nodes = nd
        self.families = fm
        self.meta = meta
        self.cons = cons
        self.capacity = items

    def insert(self, key: int, arrival: float, length: int, max_new: int, model: int, family: int,
               hashes: np.ndarray) -> int:
        """Index one item (hashes: its block hashes, uint64); its slot. Raises IndexFull, or
        ValueError/TypeError for an item the index cannot hold (nothing changes then)."""
        _check_items(length, length, min(max_new, model), max(max_new, model), hashes)
        s = insert(self.S, np.uint64(key), float(arrival), int(length), int(max_new), int(model),
                   np.uint64(family), hashes)
        if s < 0:
            raise IndexFull({FULL_ITEMS: "items", FULL_NODES: "trie nodes", FULL_FAMILIES: "families",
                             FULL_BUCKETS: "band buckets"}[s])
        return int(s)

    def insert_many(self, keys, arrivals, lengths, max_new, models, families, hash_offsets, hashes) -> int:
        """Index items i = 0.. in order (item i's block hashes: hashes[hash_offsets[i]:hash_offsets[i+1]])
        in one compiled call; the number indexed. Fewer than given means the index is full: the rest
        are left out, whole (they stay in the backlog). Raises ValueError/TypeError, indexing nothing,
        when any item is one the index cannot hold."""
        n = len(keys)
        cols = (np.ascontiguousarray(keys, np.uint64), np.ascontiguousarray(arrivals, np.float64),
                np.ascontiguousarray(lengths, np.int64), np.ascontiguousarray(max_new, np.int64),
                np.ascontiguousarray(models, np.int64), np.ascontiguousarray(families, np.uint64))
        if any(c.shape != (n,) for c in cols):
            raise ValueError(f"every column must hold {n} items")
        if n:
            _check_items(cols[2].min(), cols[2].max(), min(cols[3].min(), cols[4].min()),
                         max(cols[3].max(), cols[4].max()), hashes)
        hash_offsets = np.ascontiguousarray(hash_offsets, np.int64)
        if hash_offsets.shape != (n + 1,) or (n and (hash_offsets[0] < 0 or hash_offsets[-1] > hashes.size
                                                      or (np.diff(hash_offsets) < 0).any())):
            raise ValueError("hash_offsets must be non-decreasing, n + 1 long, within hashes")
        return int(insert_many(self.S, *cols, hash_offsets, hashes))

    def remove(self, slot: int) -> None:
        remove(self.S, slot)

    def __len__(self) -> int:
        return int(self.meta[M_ITEMS])

    @property
    def tokens(self) -> int:
        return int(self.meta[M_TOKENS])

    @property
    def num_families(self) -> int:
        return self.families.size - int(self.meta[M_FAMS_FREE])

    @property
    def num_nodes(self) -> int:
        return self.nodes.size - int(self.meta[M_NODES_FREE])

    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self.S))


def _check_items(shortest, longest, smallest, largest, hashes) -> None:
    """Items the index can hold: lengths 1..LENGTH_MAX, max_new and model in 0..2^31-1, uint64 hashes."""
    if not (1 <= shortest and longest <= LENGTH_MAX):
        raise ValueError(f"item lengths must be in 1..{LENGTH_MAX}, got {shortest}..{longest}")
    if smallest < 0 or largest >= 1 << 31:
        raise ValueError(f"max_new and model must be in 0..2^31-1, got {smallest}..{largest}")
    if not isinstance(hashes, np.ndarray) or hashes.dtype != np.uint64 or hashes.ndim != 1:
        raise TypeError("hashes must be a 1-D uint64 array (shapes.ItemShapes)")


class IndexFull(Exception):
    """The index has no room for one more item (the backlog keeps it; sched indexes it later)."""

    def __init__(self, what: str):
        super().__init__(f"packing index full: no free {what}")
        self.what = what
