"""What waits beyond the scheduler's index, first in first out, until batches free room in it.

Two parts, in this order:
- the front, in memory: of what was read back or announced, the items the index could not take
  at once, with their block hashes (at most what one read-back or one announcement holds);
- the waiting queue on disk (`spill.waiting`): what a start recovered and what came while items
  already waited, as item locations only (their block hashes are computed again when read back);
  only a full disk keeps rows of it in memory (`rows_in_memory`, which the scheduler bounds).

Its gauges are statistics words it keeps current: `overflow_items` (items beyond the index held
in memory) and `waiting_items` (those on disk).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from ..ring.wire import Announcement
from ..spill.waiting import WaitingQueue
from .pending import S_OVERFLOW, S_WAITING


class Arrived(NamedTuple):
    """Items that came in together, and when (for the age of the oldest)."""

    items: Announcement
    arrival_ns: int


class ReadBack(NamedTuple):
    """Items read back from the disk, and the rows found done meanwhile (their segment is gone)."""

    arrived: Arrived
    gone: np.ndarray


class BeyondIndex:
    """The front (in memory) and the waiting queue (on disk) behind it."""

    def __init__(self, data_dir: str, segment_bytes: int, values: np.ndarray):
        self.front: deque[Arrived] = deque()
        self.waiting = WaitingQueue(data_dir, segment_bytes)
        self.values = values

    def __bool__(self) -> bool:
        """Whether anything waits (an item that comes now goes behind it)."""
        return bool(self.front) or len(self.waiting) > 0

    @property
    def rows_in_memory(self) -> int:
        """Rows of the waiting queue kept in memory because the disk was full."""
        return self.waiting.in_memory

    def append(self, locs: np.ndarray, arrival_ns: int) -> None:
        """Items (locations only) behind all that waits."""
        self.waiting.append(locs, arrival_ns)
        self.count()

    def put_front(self, arrived: Arrived) -> None:
        """Items the index could not take, ahead of all that waits."""
        self.front.appendleft(arrived)
        self.count()

    def pop_front(self) -> Arrived | None:
        """The first items of the front; None when it is empty."""
        if not self.front:
            return None
        arrived = self.front.popleft()
        self.count()
        return arrived

    def on_disk(self) -> bool:
        """Whether the front is empty and items wait in the queue behind it."""
        return not self.front and len(self.waiting) > 0

    def read_back(self, n: int, block_tokens: int) -> ReadBack:
        """The next `n` (at most) items of the waiting queue, their block hashes computed from the
        backlog; call only when `on_disk`."""
        assert not self.front, "the front goes into the index first"
        (locs, hash_offsets, hashes, arrival_ns), gone = self.waiting.take(n, block_tokens)
        self.count()
        return ReadBack(Arrived(Announcement(locs, hash_offsets, hashes), arrival_ns), gone)

    def drop_front(self, drop) -> list[np.ndarray]:
        """Take out of the front the items for whose LOC rows `drop(locs)` (a bool mask) is true;
        their rows. The queue on disk is not read: its items meet admission when read back."""
        out = []
        for _ in range(len(self.front)):
            arrived = self.front.popleft()
            gone = drop(arrived.items.locs)
            out.append(arrived.items.locs[gone])
            if not gone.all():
                self.front.append(Arrived(arrived.items.subset(~gone), arrived.arrival_ns))
        self.count()
        return out

    def oldest_ns(self) -> int | None:
        """When the oldest waiting item came; None when none waits."""
        head = self.waiting.head_arrival_ns()
        if not self.front:
            return head
        first = int(self.front[0].arrival_ns)
        return first if head is None else min(first, head)

    def count(self) -> None:
        """Refresh the gauges of what waits."""
        in_memory = self.waiting.in_memory
        self.values[S_OVERFLOW] = sum(a.items.locs.size for a in self.front) + in_memory
        self.values[S_WAITING] = len(self.waiting) - in_memory

    def close(self) -> None:
        """Drop what waits (the next start's scan finds it again on disk)."""
        self.front.clear()
        self.waiting.close()
