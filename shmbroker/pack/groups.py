"""Prefix groups of the items waiting beyond the packing index, so that a group enters it together.

The index can only order what it holds. A group whose members are farther apart in arrival than
the index holds never meets there, so what waits beyond it is kept grouped: each waiting item is a
*row* (rows are numbered in arrival order) on two lists, one per level of prefix:

- level 1, its **branch**: the hash of its first block past the family root (the index's
  branch: a conversation, a document after a declared system prompt); the family key itself for
  an item with no block past its root;
- level 2, a **deep key**: the hash of its deep block (`shapes.deep_block`: at the largest
  power-of-two depth short of its last block, where its own tail usually starts), so items that
  share a long prefix under a common branch (a document under a shared system prompt that
  declares nothing) meet even when the branch is everybody's. The index's trie gives the same
  block a node, so they are drained together there too.

Rows enter the index oldest first, each with its group (`take`): the oldest row's branch when it
fits in the room the index has, else its deep group; a group that does not fit but is no larger
than `wait_limit` waits for more room (the index is draining meanwhile), a larger one enters
oldest first as room allows. Since the oldest row always goes first, nothing waits forever.

Rows live in a ring indexed by row number (slot = row & mask): every row between the oldest live
one and the newest is live or taken, and the ring doubles when that span fills it. Lists are
doubly linked through slots (int32); a group is a record (first, last, count, table key) found by
key through one open-addressing table (`tables.py`; a deep key is xored with DEEP_SALT there), and
a row names its two records. A row costs 25 bytes (two records, four links, a flag), a group 20
and its table slots 24: tens of bytes an item, whatever its tokens. `append` and `take` are one
kernel call each, O(rows) and O(rows taken).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jit import kernel
from .shapes import deep_block
from .tables import ht_delete, ht_find, ht_put, table_size

# meta words
G_HEAD = 0  # the oldest row not taken (all rows below it are taken)
G_TAIL = 1  # the next row number
G_LIVE = 2  # rows not taken
G_FREE = 3  # top of the free list of group records
META_WORDS = 4

MIN_ROWS = 1 << 10
NONE = -1


DEEP_SALT = np.uint64(0xD1B54A32D192ED03)  # a deep key's table key: its key xor this (one table, two levels)


class GroupState(NamedTuple):
    """The arrays of the waiting groups (see the module doc)."""

    group: np.ndarray  # int32 (slots, 2): the row's group record at level 1 and at level 2
    links: np.ndarray  # int32 (slots, 4): next and previous slot at level 1, then at level 2
    taken: np.ndarray  # u8 per slot
    g_first: np.ndarray  # int32 per group record: its oldest row's slot
    g_last: np.ndarray  # int32: its newest row's slot
    g_count: np.ndarray  # int32: its rows
    g_key: np.ndarray  # u64: its table key (to rehash)
    free: np.ndarray  # int32 stack of free group records
    t_keys: np.ndarray  # table key -> group record
    t_vals: np.ndarray
    meta: np.ndarray  # int64 META_WORDS


def new_state(rows: int = MIN_ROWS, groups: int = MIN_ROWS) -> GroupState:
    rows = max(MIN_ROWS, 1 << (int(rows) - 1).bit_length())
    size = table_size(groups)
    meta = np.zeros(META_WORDS, np.int64)
    meta[G_FREE] = groups
    return GroupState(np.full((rows, 2), NONE, np.int32), np.full((rows, 4), NONE, np.int32), np.ones(rows, np.uint8),
                      np.full(groups, NONE, np.int32), np.full(groups, NONE, np.int32), np.zeros(groups, np.int32),
                      np.zeros(groups, np.uint64), np.arange(groups - 1, -1, -1, dtype=np.int32),
                      np.zeros(size, np.uint64), np.full(size, NONE, np.int32), meta)


@kernel(_nrt=False)
def _link(S, level, key, s):
    """Row slot s at the end of the group of `key` at `level` (made when new)."""
    if level == 1:
        key = key ^ DEEP_SALT
        if key == 0:
            key = np.uint64(1)
    g = ht_find(S.t_keys, S.t_vals, key)
    nxt, prv = 2 * level, 2 * level + 1
    S.links[s, nxt] = NONE
    if g == NONE:
        top = S.meta[G_FREE] - 1
        S.meta[G_FREE] = top
        g = S.free[top]
        ht_put(S.t_keys, S.t_vals, key, g)
        S.g_key[g] = key
        S.g_first[g] = s
        S.g_count[g] = 0
        S.links[s, prv] = NONE
    else:
        last = S.g_last[g]
        S.links[last, nxt] = s
        S.links[s, prv] = last
    S.g_last[g] = s
    S.g_count[g] += 1
    S.group[s, level] = g


@kernel(_nrt=False)
def _unlink(S, level, s):
    """Row slot s out of its group at `level` (the group freed when it was the last)."""
    g = S.group[s, level]
    nxt, prv = 2 * level, 2 * level + 1
    a, b = S.links[s, prv], S.links[s, nxt]
    if a == NONE:
        S.g_first[g] = b
    else:
        S.links[a, nxt] = b
    if b == NONE:
        S.g_last[g] = a
    else:
        S.links[b, prv] = a
    S.g_count[g] -= 1
    if S.g_count[g] == 0:
        S.g_first[g] = NONE
        ht_delete(S.t_keys, S.t_vals, S.g_key[g])
        S.free[S.meta[G_FREE]] = g
        S.meta[G_FREE] += 1


@kernel(_nrt=False)
def append_rows(S, key1, key2, start):
    """Rows for items start.. of these keys, after the newest, while two group records are free
    (an item may make two groups); how far it got. The caller made room in the ring (`_grow`)."""
    mask = S.taken.size - 1
    i = start
    while i < key1.size and S.meta[G_FREE] >= 2:
        s = S.meta[G_TAIL] & mask
        S.taken[s] = 0
        _link(S, 0, key1[i], s)
        _link(S, 1, key2[i], s)
        S.meta[G_TAIL] += 1
        S.meta[G_LIVE] += 1
        i += 1
    return i


@kernel(_nrt=False)
def _take_row(S, s):
    _unlink(S, 0, s)
    _unlink(S, 1, s)
    S.taken[s] = 1
    S.meta[G_LIVE] -= 1


@kernel(_nrt=False)
def _take_group(S, level, g, limit, out, k):
    """Up to `limit` rows of group g at `level`, oldest first, into out[k:]; the new k."""
    mask = S.taken.size - 1
    head = S.meta[G_HEAD]
    nxt = 2 * level
    s = S.g_first[g]
    n = 0
    while s != NONE and n < limit:
        after = S.links[s, nxt]
        out[k] = head + ((s - head) & mask)  # the slot's row number
        _take_row(S, s)
        k += 1
        n += 1
        s = after
    return k


@kernel(_nrt=False)
def take_rows(S, room, wait_limit, out):
    """Rows to enter the index, at most `room`, into `out` (row numbers); how many. Oldest row first,
    with its branch when it fits, else its deep group; a group that does not fit waits for room
    unless it is larger than `wait_limit` (then its oldest rows enter as room allows)."""
    mask = S.taken.size - 1
    k = 0
    while k < room and S.meta[G_LIVE] > 0:
        head = S.meta[G_HEAD]
        while S.taken[head & mask]:
            head += 1
        S.meta[G_HEAD] = head
        s = head & mask
        left = room - k
        g1 = S.group[s, 0]
        c1 = S.g_count[g1]
        if c1 <= left:
            k = _take_group(S, 0, g1, c1, out, k)
            continue
        if c1 <= wait_limit:
            break
        g2 = S.group[s, 1]
        c2 = S.g_count[g2]
        if c2 <= left:
            k = _take_group(S, 1, g2, c2, out, k)
        elif c2 <= wait_limit:
            break
        else:
            k = _take_group(S, 1, g2, left, out, k)
    head = S.meta[G_HEAD]
    while head < S.meta[G_TAIL] and S.taken[head & mask]:
        head += 1
    S.meta[G_HEAD] = head
    return k


@kernel(_nrt=False)
def _move_rows(old, new):
    """The live span of `old`'s ring into `new`'s (a larger power of two), links remapped."""
    om, nm = old.taken.size - 1, new.taken.size - 1
    head, tail = old.meta[G_HEAD], old.meta[G_TAIL]
    for r in range(head, tail):
        s, t = r & om, r & nm
        new.group[t, 0] = old.group[s, 0]
        new.group[t, 1] = old.group[s, 1]
        new.taken[t] = old.taken[s]
        for j in range(4):
            x = old.links[s, j]
            new.links[t, j] = NONE if x == NONE else (head + ((x - head) & om)) & nm
    for g in range(old.g_first.size):
        for arr, out in ((old.g_first, new.g_first), (old.g_last, new.g_last)):
            x = arr[g]
            out[g] = NONE if x == NONE else (head + ((x - head) & om)) & nm


@kernel
def _deep_hashes(families, hash_offsets, hashes, key1, key2):
    for i in range(families.size):
        nb = hash_offsets[i + 1] - hash_offsets[i]
        if nb == 0:
            key1[i] = families[i]
            key2[i] = families[i]
        else:
            key1[i] = hashes[hash_offsets[i]]
            key2[i] = hashes[hash_offsets[i] + deep_block(nb)]


def group_keys(families: np.ndarray, hash_offsets: np.ndarray, hashes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each item's branch key and deep key (see the module doc) from its family key and its block
    hashes past the root (item i's at hashes[hash_offsets[i]:hash_offsets[i + 1]])."""
    families = np.ascontiguousarray(families, np.uint64)
    key1, key2 = np.empty_like(families), np.empty_like(families)
    _deep_hashes(families, np.ascontiguousarray(hash_offsets, np.int64), np.ascontiguousarray(hashes, np.uint64),
                 key1, key2)
    return key1, key2


class WaitingGroups:
    """The waiting rows and their groups: `append(key1, key2)` numbers rows, `take(room)` the rows
    that enter the index. Grows its arrays by doubling, in Python, between kernel calls."""

    def __init__(self, rows: int = MIN_ROWS):
        self.S = new_state(rows, MIN_ROWS)

    def __len__(self) -> int:
        return int(self.S.meta[G_LIVE])

    @property
    def head(self) -> int:
        """The oldest row not taken (the tail when none waits)."""
        return int(self.S.meta[G_HEAD])

    @property
    def tail(self) -> int:
        return int(self.S.meta[G_TAIL])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.S)

    def append(self, key1: np.ndarray, key2: np.ndarray) -> int:
        """Rows for items with these keys (a key 0, a table's empty slot, is read as 1); the first one's number."""
        key1, key2 = _nonzero(key1), _nonzero(key2)
        first = self.tail
        self._grow(key1.size, 0)
        at = 0
        while True:
            at = int(append_rows(self.S, key1, key2, at))
            if at == key1.size:
                return first
            self._grow(0, self.S.g_first.size)  # out of group records: twice as many

    def take(self, room: int, wait_limit: int) -> np.ndarray:
        """Row numbers (int64, at most `room`) that enter the index now, in the order taken."""
        out = np.empty(max(0, int(room)), np.int64)
        k = take_rows(self.S, np.int64(room), np.int64(wait_limit), out)
        if not len(self) and self.S.taken.size > MIN_ROWS:  # drained: give the memory back
            tail = self.tail
            self.S = new_state()
            self.S.meta[G_HEAD] = self.S.meta[G_TAIL] = tail
        return out[:k]

    def _grow(self, n: int, more_groups: int) -> None:
        """Room in the ring for n more rows, and `more_groups` more group records (doubling)."""
        S = self.S
        span = int(S.meta[G_TAIL] - S.meta[G_HEAD]) + n
        rows, groups = S.taken.size, S.g_first.size
        while rows < span:
            rows *= 2
        while groups < S.g_first.size + more_groups:
            groups *= 2
        if rows == S.taken.size and groups == S.g_first.size:
            return
        new = new_state(rows, groups)
        old = S.g_first.size
        new.g_count[:old] = S.g_count
        new.g_key[:old] = S.g_key
        _move_rows(S, new)
        # free records: the new ones, then the old free ones on top (handed out first)
        stack = np.concatenate([np.arange(groups - 1, old - 1, -1, dtype=np.int32), S.free[: int(S.meta[G_FREE])]])
        new.free[: stack.size] = stack
        new.meta[:] = S.meta
        new.meta[G_FREE] = stack.size
        _rehash(new)
        self.S = new


def _nonzero(keys) -> np.ndarray:
    """Keys with 0 (an empty table slot) mapped to 1."""
    keys = np.asarray(keys, np.uint64)
    return np.where(keys == 0, np.uint64(1), keys)


@kernel(_nrt=False)
def _rehash(S):
    """Every live group into S's (empty) table."""
    for g in range(S.g_first.size):
        if S.g_first[g] != NONE and S.g_count[g] > 0:
            ht_put(S.t_keys, S.t_vals, S.g_key[g], g)
