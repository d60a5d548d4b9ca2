"""The index's age queues: each class's items in arrival order, for aging (`max_wait_seconds`).

One FIFO ring per class of (slot << 32 | gen) entries in arrival order, positions as running
counters (`S.age_cursors[c]` = head, tail). Removing an item only bumps its slot's gen: its
entry goes stale and is dropped when it reaches the head, so a removal touches no other item's
record.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .state import State


@kernel(_nrt=False)
def _age_entry_live(it, e):
    return it[np.int64(e >> 32)].gen == np.int32(e & 0xFFFFFFFF)


@kernel(_nrt=False)
def age_push(S, c, slot):
    it = S.items
    ring = S.age_rings
    pos = S.age_cursors
    size = ring.shape[1]
    while pos[c, 1] - pos[c, 0] >= size:  # full: the head is stale (live items <= capacity < size)
        pos[c, 0] += 1
    ring[c, pos[c, 1] % size] = (np.int64(slot) << 32) | np.int64(np.uint32(it[slot].gen))
    pos[c, 1] += 1


@kernel(_nrt=False)
def age_head(S, c):
    """The oldest live item of class c (dropping stale entries), or -1."""
    it = S.items
    ring = S.age_rings
    pos = S.age_cursors
    size = ring.shape[1]
    while pos[c, 0] < pos[c, 1]:
        e = ring[c, pos[c, 0] % size]
        if _age_entry_live(it, e):
            return np.int64(e >> 32)
        pos[c, 0] += 1
    return -1


@kernel(_nrt=False)
def oldest(S, classes, cutoff):
    """The oldest item of the given age classes that arrived before cutoff (waited longer), or -1."""
    it = S.items
    best = -1
    for k in range(classes.size):
        slot = age_head(S, classes[k])
        if slot != -1 and it[slot].arrival < cutoff and (best == -1 or it[slot].arrival < it[best].arrival):
            best = slot
    return best


@kernel(_nrt=False)
def oldest_entry(arrays, classes, cutoff):
    """`oldest`, called from Python with the index's arrays (`PackIndex.arrays`)."""
    return oldest(State(*arrays), classes, cutoff)
