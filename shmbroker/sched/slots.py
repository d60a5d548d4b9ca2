"""The index slots: the scheduler's side of its packing index.

The packer knows an item by its handle, and the scheduler's handles are slots of one table of
`index_items` LOC rows: the row of each indexed item (where its record lies on disk, for the batch
record that dispatches it), a stack of the free slots, and when each indexed item arrived (for the
age of the oldest, a gauge).

    free = table.free_slots(n)          # the slots the next `fill` takes, top of the stack first
    added = packer.add_many(free, ...)  # the index may take fewer
    table.fill(free[:added], locs[:added], arrival_ns)
    rows = table.release(slots)         # their rows (a copy); the slots are free again
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..ring.wire import LOC_DTYPE

NO_ITEM_NS = np.iinfo(np.int64).max
ARRIVAL_PIECE = 4096  # items per piece of the arrival-order list the oldest-item age is read from


class Arrivals:
    """When each index slot's item came in, and the oldest of them."""

    def __init__(self, capacity: int):
        self.arrival_ns = np.full(capacity, NO_ITEM_NS, np.int64)
        # (arrival_ns, slots) in arrival order, pieces of at most ARRIVAL_PIECE: the oldest waiting
        # item is the first piece with a slot still holding its arrival (dead pieces are dropped)
        self.pieces: deque = deque()

    def add(self, slots: np.ndarray, arrival_ns: int) -> None:
        self.arrival_ns[slots] = arrival_ns
        for at in range(0, slots.size, ARRIVAL_PIECE):
            self.pieces.append((arrival_ns, slots[at : at + ARRIVAL_PIECE]))

    def drop(self, slots: np.ndarray) -> None:
        """The items of `slots` left the index."""
        self.arrival_ns[slots] = NO_ITEM_NS

    def oldest_ns(self) -> int:
        """The oldest indexed item's arrival; NO_ITEM_NS when none is indexed."""
        pieces = self.pieces
        while pieces and not (self.arrival_ns[pieces[0][1]] == pieces[0][0]).any():
            pieces.popleft()
        return int(pieces[0][0]) if pieces else NO_ITEM_NS


class SlotTable:
    """`capacity` index slots: the LOC row of each (`rows`; a free slot's row is stale), the free
    ones (a stack), the arrivals of the taken ones."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.rows = np.zeros(capacity, LOC_DTYPE)
        self._free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: _free[:num_free]
        self.num_free = capacity
        self.arrivals = Arrivals(capacity)

    def free_slots(self, n: int) -> np.ndarray:
        """The n slots (a copy) the next `fill` of n items takes, in the order it takes them."""
        assert 0 <= n <= self.num_free, "more slots asked for than are free"
        return self._free[self.num_free - n : self.num_free][::-1].copy()

    def fill(self, slots: np.ndarray, locs: np.ndarray, arrival_ns: int) -> None:
        """Take the first `slots.size` of `free_slots` for these items (one LOC row each)."""
        n = slots.size
        assert n == locs.size, "one row per slot"
        self.rows[slots] = locs
        self.num_free -= n
        self.arrivals.add(slots, arrival_ns)

    def release(self, slots: np.ndarray) -> np.ndarray:
        """The rows of `slots` (a copy), whose items left the index; the slots are free again."""
        rows = self.rows[slots]
        self.arrivals.drop(slots)
        k = slots.size
        self._free[self.num_free : self.num_free + k] = slots
        self.num_free += k
        return rows

    def oldest_ns(self) -> int:
        """The oldest indexed item's arrival; NO_ITEM_NS when none is indexed."""
        return self.arrivals.oldest_ns()
