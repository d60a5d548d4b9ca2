"""The packing index's records and state: the arrays every index kernel reads, named.

Records (numpy structured arrays; a slot is a row index, -1 is "none"):

ITEM (64 bytes)                          NODE (88 bytes): one trie node
  handle   u64  the caller's handle        hash    u64  block hash (family key at the root)
  arrival  f64  seconds                    parent  i32  depth i32  fam i32  branch i32
  length   i32  max_new i32                chead/ctail i32  live children list
  fam      i32  node    i32                sprev/snext i32  links in the parent's list
  bucket   i32  bprev/bnext i32            ihead/itail i32  items ending here, nitems i32
  nprev/nnext i32   node item list         live    i32  has items or live children
  gen      i32  bumped when the slot frees  maxlen i32  claimed i32 (consumer+1) cls i32
  pad      i32 x2                          cprev/cnext i32  the branch list it is in (cls)
                                           affine  i32  consumer that served the branch last
                                           maxnew  i32  longest max_new under a branch

FAMILY (64 bytes)                        BUCKET (24 bytes): one (family, band)
  key u64  model i32  root i32             key u64  head/tail i32  count i32  band i32
  pending i32  maxnew i32 (longest max_new while it lived)  tokens i64
  claimed i32  gcls i32  gprev/gnext i32  generate i64 (pending max_new summed)
  base i32 (tokens under its key, the prefix every item shares; 0: not known)  pad i32

A lane bucket (BUCKET_REC too) is one (lane, input band); a lane is one (class, output band) of
every family (`lanes.py`), its input bands a bitmap as a family's are. An item's place in its lane
bucket is its LANE_LINK record (12 bytes: bucket, bprev, bnext, the names of ITEM's own bucket
links, so the list kernels of `links.py` serve both).

`State` names the arrays. A kernel called from Python takes them as a plain tuple
(`PackIndex.arrays`: numba dispatches a plain tuple faster than a named one, about a
microsecond a call) and names them on entry, `S = State(*arrays)`; every other kernel takes
`S` and reads its fields (`S.items`, `S.branch_heads`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jit import kernel
from .bands import BAND_WORDS, SUMMARY_WORDS
from .shapes import NUM_OUT_BANDS
from .tables import new_free_list, new_table

ITEM_REC = np.dtype([
    ("handle", "u8"), ("arrival", "f8"), ("length", "i4"), ("max_new", "i4"), ("fam", "i4"), ("node", "i4"),
    ("bucket", "i4"), ("bprev", "i4"), ("bnext", "i4"), ("nprev", "i4"), ("nnext", "i4"),
    ("gen", "i4"), ("pad1", "i4"), ("pad2", "i4")])
NODE_REC = np.dtype([
    ("hash", "u8"), ("parent", "i4"), ("depth", "i4"), ("fam", "i4"), ("branch", "i4"),
    ("chead", "i4"), ("ctail", "i4"), ("sprev", "i4"), ("snext", "i4"),
    ("ihead", "i4"), ("itail", "i4"), ("nitems", "i4"), ("live", "i4"),
    ("maxlen", "i4"), ("claimed", "i4"), ("cls", "i4"), ("cprev", "i4"), ("cnext", "i4"), ("affine", "i4"),
    ("maxnew", "i4")])
FAM_REC = np.dtype([
    ("key", "u8"), ("model", "i4"), ("root", "i4"), ("pending", "i4"), ("maxnew", "i4"), ("tokens", "i8"),
    ("claimed", "i4"), ("gcls", "i4"), ("gprev", "i4"), ("gnext", "i4"), ("generate", "i8"), ("base", "i4"),
    ("pad", "i4")])
BUCKET_REC = np.dtype([("key", "u8"), ("head", "i4"), ("tail", "i4"), ("count", "i4"), ("band", "i4")])
LANE_LINK = np.dtype([("bucket", "i4"), ("bprev", "i4"), ("bnext", "i4")])

# meta words
M_ITEMS_FREE, M_NODES_FREE, M_FAMS_FREE, M_BUCKETS_FREE, M_ITEMS, M_TOKENS, M_LANES_FREE = range(7)
# consumer state columns
C_FAM, C_BRANCH, C_BAND, C_MAXIN = range(4)

OVERFLOW_LEN = (1 << 31) - 1  # the max_input_len of each model's overflow class


class State(NamedTuple):
    """The index's arrays. Lists of slots hold -1 for "none"."""

    items: np.ndarray  # ITEM_REC per item slot
    nodes: np.ndarray  # NODE_REC per trie node slot
    families: np.ndarray  # FAM_REC per family slot
    buckets: np.ndarray  # BUCKET_REC per (family, band) slot
    node_keys: np.ndarray  # hash table: block hash -> node slot (tables.py)
    node_slots: np.ndarray
    family_keys: np.ndarray  # family key -> family slot
    family_slots: np.ndarray
    bucket_keys: np.ndarray  # (family slot + 1) << 16 | band -> bucket slot
    bucket_slots: np.ndarray
    band_bits: np.ndarray  # per family: its non-empty bands (bands.py)
    band_summary: np.ndarray
    branch_heads: np.ndarray  # [family, list]: lists 0..K are classes, K+1+c consumer c's (links.py)
    branch_tails: np.ndarray
    family_heads: np.ndarray  # [class]: unclaimed families by their shortest item
    family_tails: np.ndarray
    age_rings: np.ndarray  # [class]: (slot << 32 | gen) in arrival order (ages.py)
    age_cursors: np.ndarray  # [class, 0 head / 1 tail]: running counters
    free_items: np.ndarray  # free slots, stacks of height meta[M_*_FREE]
    free_nodes: np.ndarray
    free_families: np.ndarray
    free_buckets: np.ndarray
    meta: np.ndarray  # M_* words
    classes: np.ndarray  # rows (model, max_input_len), sorted; each model's last is its overflow class
    consumers: np.ndarray  # [consumer, C_*]
    hint_keys: np.ndarray  # direct-mapped: the branch key a consumer served last in each slot (listing.py)
    hint_consumers: np.ndarray  # that consumer
    lane_links: np.ndarray  # LANE_LINK per item slot: its place in its lane bucket
    lane_buckets: np.ndarray  # BUCKET_REC per (lane, input band) slot (lanes.py)
    lane_keys: np.ndarray  # lane << 16 | band -> lane bucket slot
    lane_slots: np.ndarray
    lane_bits: np.ndarray  # per lane: its non-empty input bands
    lane_summary: np.ndarray
    lane_masks: np.ndarray  # [class]: bit o set while lane (class, output band o) has items
    free_lanes: np.ndarray


def hint_slots(capacity: int) -> int:
    """Slots of the branch hint table for an item capacity."""
    return 1 << max(16, (2 * capacity - 1).bit_length())


def new_state(classes: np.ndarray, items: int, nodes: int, families: int, num_consumers: int) -> State:
    """Empty arrays for the given capacities (buckets: one per item at most)."""
    buckets = items
    k1 = classes.shape[0] + 1  # the classes and the class of models nobody serves
    meta = np.zeros(8, np.int64)
    meta[M_ITEMS_FREE] = items
    meta[M_NODES_FREE] = nodes
    meta[M_FAMS_FREE] = families
    meta[M_BUCKETS_FREE] = buckets
    meta[M_LANES_FREE] = items
    lanes = k1 * NUM_OUT_BANDS
    return State(
        np.zeros(items, ITEM_REC), np.zeros(nodes, NODE_REC), np.zeros(families, FAM_REC),
        np.zeros(buckets, BUCKET_REC), *new_table(nodes), *new_table(families), *new_table(buckets),
        np.zeros((families, BAND_WORDS), np.uint64), np.zeros((families, SUMMARY_WORDS), np.uint64),
        np.full((families, k1 + num_consumers), -1, np.int32), np.full((families, k1 + num_consumers), -1, np.int32),
        np.full(k1, -1, np.int32), np.full(k1, -1, np.int32),
        np.zeros((k1, items + 1), np.int64), np.zeros((k1, 2), np.int64),
        new_free_list(items), new_free_list(nodes), new_free_list(families), new_free_list(buckets),
        meta, classes, np.full((num_consumers, 4), -1, np.int64),
        np.zeros(hint_slots(items), np.uint64), np.full(hint_slots(items), -1, np.int32),
        np.zeros(items, LANE_LINK), np.zeros(items, BUCKET_REC), *new_table(items), np.zeros((lanes, BAND_WORDS), np.uint64),
        np.zeros((lanes, SUMMARY_WORDS), np.uint64), np.zeros(k1, np.uint64), new_free_list(items))


# ---- free lists: a stack of free slots, its height in meta[k] ---------------------------------

@kernel(inline="always", _nrt=False)
def pop_free(free, meta, k):
    meta[k] -= 1
    return free[meta[k]]


@kernel(inline="always", _nrt=False)
def push_free(free, meta, k, slot):
    free[meta[k]] = slot
    meta[k] += 1
