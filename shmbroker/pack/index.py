"""The packing index: families, a prefix trie of block hashes, length bands; insert and remove.

Bounded, array-backed, written by one owner (sched). Every operation costs
O(the item's blocks) to insert or remove and O(batch + trie depth) to pack;
nothing walks the backlog. The records and the named arrays (`State`) are in
`state.py`, the trie's nodes in `trie.py`, the age queues in `ages.py`; where an unclaimed family or branch is
listed, and which consumer a branch is affine to, is the policy's
(`listing.py`), which this mechanism calls as items come and go.

- A **branch** is a depth-1 node (the first block after the family root). A
  packed consumer claims a branch and drains it depth-first (parents before
  children), so a conversation is served on one card, turn after turn.
  A consumer with no branch left to claim may take over a child of another's
  branch (`branches._take_over`): that node's `claimed` marks it (other walks
  leave it out) and its `maxlen` the longest item a taker met there and left.
- Every item is also in its lane (`lanes.py`): its class and output band, across
  families, by input band.
- Bands of a family are a two-level bitmap (`bands.py`), so the next
  non-empty band either side of a cursor is found in O(1) words; the lists
  linking records are in `links.py`.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .ages import age_push
from .links import (
    branch_list_set,
    bucket_append,
    bucket_unlink,
    child_unlink,
    family_list_set,
    nitem_unlink,
)
from .lanes import band_bucket, band_bucket_release, lane_append, lane_unlink
from .listing import class_of, family_reclass, remember_server
from .shapes import LENGTH_MAX, band_of
from .state import (
    C_BRANCH,
    C_FAM,
    M_BUCKETS_FREE,
    M_FAMS_FREE,
    M_ITEMS,
    M_ITEMS_FREE,
    M_LANES_FREE,
    M_NODES_FREE,
    M_TOKENS,
    OVERFLOW_LEN,
    State,
    new_state,
    pop_free,
    push_free,
)
from .tables import ht_delete, ht_find, ht_put
from .trie import end_node, hang_item

# insert() results
FULL_ITEMS = -1
FULL_NODES = -2
FULL_FAMILIES = -3
FULL_BUCKETS = -4


@kernel(inline="always", _nrt=False)
def _family_for(S, family_key, model):
    """The family of `family_key`, made (empty, unlisted) when new; FULL_FAMILIES when none is free."""
    fm = S.families
    meta = S.meta
    f = ht_find(S.family_keys, S.family_slots, family_key)
    if f == -1:
        if meta[M_FAMS_FREE] < 1:
            return FULL_FAMILIES
        f = pop_free(S.free_families, meta, M_FAMS_FREE)
        fm[f].key = family_key
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
        ht_put(S.family_keys, S.family_slots, family_key, f)
    return f


@kernel(inline="always", _nrt=False)
def _band_append(S, f, slot, band):
    """Append item `slot` to its length band's bucket in family f (the bucket made, and its band's
    bit set, when it is the band's first item)."""
    bkey = (np.uint64(f + 1) << np.uint64(16)) | np.uint64(band)
    b, _ = band_bucket(S.buckets, S.bucket_keys, S.bucket_slots, S.free_buckets, S.meta, M_BUCKETS_FREE, bkey, band,
                       S.band_bits, S.band_summary, f)
    bucket_append(S.items, S.buckets, b, slot)


@kernel(_nrt=False)
def insert(S, handle, arrival, length, max_new, model, family_key, hashes, base):
    """Index one item (base: tokens under its family key, 0 if not known); its slot, or a FULL_*
    code (nothing changed)."""
    it = S.items
    fm = S.families
    meta = S.meta
    if meta[M_ITEMS_FREE] < 1:
        return FULL_ITEMS
    if meta[M_NODES_FREE] < 3:
        return FULL_NODES
    if meta[M_BUCKETS_FREE] < 1 or meta[M_LANES_FREE] < 1:
        return FULL_BUCKETS
    f = _family_for(S, family_key, model)
    if f == FULL_FAMILIES:
        return FULL_FAMILIES
    x = end_node(S, f, family_key, hashes)
    slot = pop_free(S.free_items, meta, M_ITEMS_FREE)
    it[slot].handle = handle
    it[slot].arrival = arrival
    it[slot].length = length
    it[slot].max_new = max_new
    it[slot].fam = f
    hang_item(S, x, slot, length, max_new)
    band = band_of(length)
    _band_append(S, f, slot, band)
    fm[f].pending += 1
    fm[f].tokens += length
    if base > fm[f].base:
        fm[f].base = base
    fm[f].generate += max_new
    if max_new > fm[f].maxnew:
        fm[f].maxnew = max_new
    family_reclass(S, f)
    cls = class_of(S.classes, model, length)
    lane_append(S, slot, cls, band)
    age_push(S, cls, slot)
    meta[M_ITEMS] += 1
    meta[M_TOKENS] += length
    return slot


@kernel(_nrt=False)
def insert_many(arrays, handles, arrivals, lengths, max_new, models, families, hash_offsets, hashes, bases):
    """`insert` for items 0.. in order; the number indexed (stops, whole items only, when full)."""
    S = State(*arrays)
    for i in range(handles.size):
        slot = insert(S, handles[i], arrivals[i], lengths[i], max_new[i], models[i], families[i],
                      hashes[hash_offsets[i]:hash_offsets[i + 1]], bases[i])
        if slot < 0:
            return i
    return handles.size


@kernel(_nrt=False)
def insert_entry(arrays, handle, arrival, length, max_new, model, family_key, hashes, base):
    """`insert`, called from Python with the index's arrays (`PackIndex.arrays`)."""
    return insert(State(*arrays), handle, arrival, length, max_new, model, family_key, hashes, base)


@kernel(_nrt=False)
def remove_entry(arrays, slot):
    """Take the item in `slot` out of the index (the slot is free afterwards)."""
    S = State(*arrays)
    f = remove_quiet(S, slot)
    if f != -1:
        family_reclass(S, f)


@kernel(inline="always", _nrt=False)
def remove_quiet(S, slot):
    """`remove` without re-listing the family; returns the family slot if it still has items, else -1.
    A caller removing several items of one family re-lists it once (`family_reclass`)."""
    it = S.items
    nd = S.nodes
    fm = S.families
    bk = S.buckets
    meta = S.meta
    cons = S.consumers
    f = it[slot].fam
    lane_unlink(S, slot)
    b = bucket_unlink(it, bk, slot)
    band_bucket_release(bk, S.bucket_keys, S.bucket_slots, S.free_buckets, meta, M_BUCKETS_FREE, b, S.band_bits,
                        S.band_summary, f)
    x = nitem_unlink(it, nd, slot)
    while x != -1 and nd[x].nitems == 0 and nd[x].chead == -1:
        p = nd[x].parent
        nd[x].live = 0
        if p != -1:
            child_unlink(nd, p, x)
        if nd[x].depth == 1:
            branch_list_set(nd, S.branch_heads, S.branch_tails, x, -1)
            remember_server(S, x)
        elif nd[x].depth == 0:
            fm[f].root = -1
        if nd[x].claimed != 0 and cons[nd[x].claimed - 1, C_BRANCH] == x:  # a branch, or a part taken over
            cons[nd[x].claimed - 1, C_BRANCH] = -1
        ht_delete(S.node_keys, S.node_slots, nd[x].hash)
        push_free(S.free_nodes, meta, M_NODES_FREE, x)
        x = p
    it[slot].gen += 1  # its age-queue entry is stale from now on
    fm[f].pending -= 1
    fm[f].tokens -= it[slot].length
    fm[f].generate -= it[slot].max_new
    meta[M_ITEMS] -= 1
    meta[M_TOKENS] -= it[slot].length
    if fm[f].pending == 0:
        family_list_set(fm, S.family_heads, S.family_tails, f, -1)
        for c in range(cons.shape[0]):
            if cons[c, C_FAM] == f:
                cons[c, C_FAM] = -1
        ht_delete(S.family_keys, S.family_slots, fm[f].key)
        push_free(S.free_families, meta, M_FAMS_FREE, f)
        f = -1
    push_free(S.free_items, meta, M_ITEMS_FREE, slot)
    return f



class PackIndex:
    """The index's arrays, sized once: `state` names them, `arrays` is the tuple the entry kernels take.

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
        rows = sorted(set((int(m), int(x)) for m, x in classes))
        for m in sorted(set(m for m, _ in rows)):
            rows.append((m, OVERFLOW_LEN))
        rows.sort()
        self.classes = np.array(rows, np.int64).reshape(-1, 2)
        self.state = new_state(self.classes, items, nodes, families, num_consumers)
        self.arrays = tuple(self.state)  # what the entry kernels take (state.py)
        self.items = self.state.items
        self.nodes = self.state.nodes
        self.families = self.state.families
        self.meta = self.state.meta
        self.cons = self.state.consumers
        self.capacity = items

    def insert(self, handle: int, arrival: float, length: int, max_new: int, model: int, family: int,
               hashes: np.ndarray, base: int = 0) -> int:
        """Index one item (hashes: its block hashes, uint64; base: the tokens under its family key,
        `shapes.family_bases`, 0 if not known); its slot. Raises IndexFull, or ValueError/TypeError
        for an item the index cannot hold (nothing changes then)."""
        _check_items(length, length, min(max_new, model), max(max_new, model), hashes)
        slot = insert_entry(self.arrays, np.uint64(handle), float(arrival), int(length), int(max_new), int(model),
                            np.uint64(family), hashes, int(base))
        if slot < 0:
            raise IndexFull({FULL_ITEMS: "items", FULL_NODES: "trie nodes", FULL_FAMILIES: "families",
                             FULL_BUCKETS: "band buckets"}[slot])
        return int(slot)

    def insert_many(self, handles, arrivals, lengths, max_new, models, families, hash_offsets, hashes, bases=None) -> int:
        """Index items i = 0.. in order (item i's block hashes: hashes[hash_offsets[i]:hash_offsets[i+1]])
        in one compiled call; the number indexed. Fewer than given means the index is full: the rest
        are left out, whole (they stay in the backlog). Raises ValueError/TypeError, indexing nothing,
        when any item is one the index cannot hold."""
        n = len(handles)
        cols = (np.ascontiguousarray(handles, np.uint64), np.ascontiguousarray(arrivals, np.float64),
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
        bases = np.zeros(n, np.int64) if bases is None else np.ascontiguousarray(np.broadcast_to(bases, (n,)), np.int64)
        return int(insert_many(self.arrays, *cols, hash_offsets, hashes, bases))

    def remove(self, slot: int) -> None:
        remove_entry(self.arrays, slot)

    def live(self) -> tuple[np.ndarray, np.ndarray]:
        """(slots, handles) of the items in the index now: every slot not on the free stack."""
        used = np.ones(self.capacity, bool)
        used[self.state.free_items[: int(self.meta[M_ITEMS_FREE])]] = False
        slots = np.flatnonzero(used)
        return slots, self.items["handle"][slots]

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
        return int(sum(a.nbytes for a in self.arrays))


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
