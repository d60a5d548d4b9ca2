"""The items a GPU process's window holds (`window.py`), as columns: no Python object per item.

Each runnable item of the records taken has its id, the serial of its record and its row there,
kept in the order taken (results mostly come back oldest first, which is a slice) and sorted by id
on demand to find any other. `id_set` holds the same ids, to see at once whether a record's item is
already in flight.
"""

from __future__ import annotations

import numpy as np


class InFlight:
    def __init__(self):
        self.ids = np.zeros(0, np.uint64)
        self.recs = np.zeros(0, np.int64)
        self.rows = np.zeros(0, np.int64)
        self._order: np.ndarray | None = None  # sorts them by id (None: to be sorted again)
        self.id_set: set[int] = set()

    def add(self, ids: np.ndarray, serial: int, rows: np.ndarray) -> None:
        """Record `serial`'s items `ids` at its rows `rows`."""
        self.id_set.update(ids.tolist())
        self.ids = np.concatenate([self.ids, ids.astype(np.uint64)])
        self.recs = np.concatenate([self.recs, np.full(rows.size, serial, np.int64)])
        self.rows = np.concatenate([self.rows, rows.astype(np.int64)])
        self._order = None

    def find(self, ids: np.ndarray, what: str) -> np.ndarray:
        """The columns' positions of these ids (each must be held: `what` says whose they are)."""
        if self._order is None:
            self._order = np.argsort(self.ids, kind="stable")
        order = self._order
        at = order[np.minimum(np.searchsorted(self.ids[order], ids), order.size - 1)]
        assert np.array_equal(self.ids[at], ids), f"{what} the window does not hold"
        return at

    def remove(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(records, rows) of these ids, which leave the columns."""
        n = ids.size
        if n <= self.ids.size and np.array_equal(self.ids[:n], ids):  # the oldest items, in order
            recs, rows = self.recs[:n], self.rows[:n]
            self.ids, self.recs, self.rows = self.ids[n:], self.recs[n:], self.rows[n:]
        else:
            at = self.find(ids, "a result for an item")
            recs, rows = self.recs[at], self.rows[at]
            keep = np.ones(self.ids.size, bool)
            keep[at] = False
            self.ids, self.recs, self.rows = self.ids[keep], self.recs[keep], self.rows[keep]
        self._order = None
        self.id_set.difference_update(ids.tolist())
        return recs, rows
