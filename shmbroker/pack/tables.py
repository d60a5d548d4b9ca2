"""Open-addressing hash tables and free lists over plain arrays (numba kernels).

A table is two arrays: keys (uint64, 0 = empty) and vals (int32), of a power
of two size at least twice the capacity of what it indexes. Linear probing;
deletion shifts the following run back (no tombstones), so a lookup's cost
depends on the load factor (<= 1/2), never on how many deletes came before.

A free list is an int32 stack of slots plus its top in a counter word.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
NOT_FOUND = -1


def table_size(capacity: int) -> int:
    size = 16
    while size < 2 * capacity:
        size <<= 1
    return size


@kernel(_nrt=False)
def _home(key, mask):
    return np.int64(((key * GOLDEN) >> np.uint64(32)) & np.uint64(mask))


@kernel(_nrt=False)
def ht_find(keys, vals, key):
    mask = keys.size - 1
    i = _home(key, mask)
    while keys[i] != np.uint64(0):
        if keys[i] == key:
            return np.int64(vals[i])
        i = (i + 1) & mask
    return np.int64(NOT_FOUND)


@kernel(_nrt=False)
def ht_put(keys, vals, key, val):
    """Insert key (absent) -> val."""
    mask = keys.size - 1
    i = _home(key, mask)
    while keys[i] != np.uint64(0):
        i = (i + 1) & mask
    keys[i] = key
    vals[i] = val


@kernel(_nrt=False)
def ht_delete(keys, vals, key):
    mask = keys.size - 1
    i = _home(key, mask)
    while keys[i] != key:
        if keys[i] == np.uint64(0):
            return False
        i = (i + 1) & mask
    j = i
    while True:
        j = (j + 1) & mask
        if keys[j] == np.uint64(0):
            break
        k = _home(keys[j], mask)
        # keys[j] may move into the hole at i unless its home lies cyclically in (i, j]
        if (j > i and (k <= i or k > j)) or (j < i and (k <= i and k > j)):
            keys[i] = keys[j]
            vals[i] = vals[j]
            i = j
    keys[i] = np.uint64(0)
    return True


def new_table(capacity: int) -> tuple[np.ndarray, np.ndarray]:
    size = table_size(capacity)
    return np.zeros(size, np.uint64), np.full(size, -1, np.int32)


def new_free_list(capacity: int) -> np.ndarray:
    """Stack of free slots, lowest slot on top (slots are handed out 0, 1, 2...)."""
    return np.arange(capacity - 1, -1, -1, dtype=np.int32)
