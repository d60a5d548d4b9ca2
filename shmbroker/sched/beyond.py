"""What waits beyond the scheduler's index until batches free room in it, kept in prefix groups.

Two parts, in this order:
- the front, in memory: of what was read back or announced, the items the index could not take
  at once, with their block hashes (at most what one read-back or one announcement holds);
- the waiting rows on disk (`spill.waiting`): what a start recovered and what came while items
  already waited, as item locations only (their block hashes are computed again when read back);
  only a full disk keeps rows of it in memory (`rows_in_memory`, which the scheduler bounds).
  Beside them, in memory, each row's prefix groups (`pack.groups`: its branch and a deep key, from
  its block hashes, which an announcement carries and a start computes from the backlog), so the
  rows enter the index oldest first, each with the waiting members of its group however far
  apart they came: a group meets in the index, where the packer orders it.

Its gauges are statistics words it keeps current: `overflow_items` (items beyond the index held
in memory) and `waiting_items` (those on disk).
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import numpy as np

from ..pack.groups import WaitingGroups, group_keys
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


class WaitingRow(NamedTuple):
    item_id: int
    arrival_ns: int


class Unkeyed(NamedTuple):
    """Rows from `first` on, waiting to be put in their groups: by their LOC rows (`locs`, their
    block hashes to be read) or by their keys."""

    first: int
    locs: np.ndarray | None
    key1: np.ndarray | None
    key2: np.ndarray | None
    arrival_ns: int


class BeyondIndex:
    """The front (in memory) and the waiting rows (on disk) behind it, in their groups; a group no
    larger than `wait_limit` that does not fit the room the index has waits for more."""

    def __init__(self, data_dir: str, segment_bytes: int, values: np.ndarray, wait_limit: int):
        self.front: deque[Arrived] = deque()
        self.waiting = WaitingQueue(data_dir, segment_bytes)
        self.groups = WaitingGroups()
        # rows on disk not yet in their groups, in row order: a start's recovered locations (their
        # keys computed a slice at a time, `key_some`, so a restart serves before it hashed its
        # whole backlog) and, behind them, keys of rows announced meanwhile
        self.unkeyed: deque[Unkeyed] = deque()
        self.num_unkeyed = 0
        self.values = values
        self.wait_limit = wait_limit

    def __bool__(self) -> bool:
        """Whether anything waits (an item that comes now goes behind it)."""
        return bool(self.front) or len(self.groups) > 0 or self.num_unkeyed > 0

    @property
    def rows_in_memory(self) -> int:
        """Rows of the waiting queue kept in memory because the disk was full."""
        return self.waiting.in_memory

    def append(self, ann: Announcement, arrival_ns: int) -> None:
        """Announced items (their block hashes give their groups) behind all that waits."""
        key1, key2 = group_keys(ann.locs["prefix_key"], ann.hash_offsets, ann.hashes)
        first = self.waiting.append(ann.locs, arrival_ns)
        if self.unkeyed:
            self.unkeyed.append(Unkeyed(first, None, key1, key2, arrival_ns))
            self.num_unkeyed += key1.size
        else:
            self._group(first, key1, key2)
        self.count()

    def append_recovered(self, locs: np.ndarray, arrival_ns: int) -> None:
        """Items a start found in the backlog: on disk now, in their groups once `key_some` read
        their block hashes there."""
        first = self.waiting.append(locs, arrival_ns)
        self.unkeyed.append(Unkeyed(first, locs, None, None, arrival_ns))
        self.num_unkeyed += locs.size
        self.count()

    def key_some(self, max_rows: int, block_tokens: int) -> int:
        """Put up to about `max_rows` unkeyed rows in their groups, oldest first; how many."""
        done = 0
        while self.unkeyed and done < max_rows:
            first, locs, key1, key2, arrival_ns = self.unkeyed.popleft()
            if locs is not None:
                if locs.size > max_rows - done:  # the rest stays first in line
                    cut = max_rows - done
                    self.unkeyed.appendleft(Unkeyed(first + cut, locs[cut:], None, None, arrival_ns))
                    locs = locs[:cut]
                hash_offsets, hashes = self.waiting.hashes_of(locs.copy(), block_tokens)
                key1, key2 = group_keys(locs["prefix_key"], hash_offsets, hashes)
            self._group(first, key1, key2)
            self.num_unkeyed -= key1.size
            done += key1.size
        self.count()
        return done

    def _group(self, first: int, key1: np.ndarray, key2: np.ndarray) -> None:
        assert self.groups.append(key1, key2) == first, "a waiting row numbered twice"

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
        """Whether the front is empty and rows wait behind it."""
        return not self.front and len(self.groups) > 0

    def read_back(self, room: int, block_tokens: int) -> ReadBack | None:
        """The rows that enter the index now (at most `room`: the oldest with its groups), their
        block hashes computed from the backlog; None when the oldest's group waits for more room.
        Call only when `on_disk`."""
        assert not self.front, "the front goes into the index first"
        rows = self.groups.take(room, self.wait_limit)
        if rows.size == 0:
            return None
        (locs, hash_offsets, hashes, arrival_ns), gone = self.waiting.take(rows, block_tokens)
        self.waiting.forget_below(self.groups.head)
        if not self.groups and not self.unkeyed:
            self.waiting.idle()
        self.count()
        return ReadBack(Arrived(Announcement(locs, hash_offsets, hashes), arrival_ns), gone)

    def head(self) -> WaitingRow | None:
        """The oldest row in its groups: its item and when it came (None when none is)."""
        if not len(self.groups):
            return None
        row = self.waiting.gather(np.array([self.groups.head], np.int64))[0]
        return WaitingRow(int(row["item_id"]), int(row["arrival_ns"]))

    def drop_front(self, drop) -> list[np.ndarray]:
        """Take out of the front the items for whose LOC rows `drop(locs)` (a bool mask) is true;
        their rows. The rows on disk are not read: their items meet admission when read back."""
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
        head = self.waiting.head_arrival_ns(self.groups.head) if len(self.groups) else None
        if self.unkeyed:
            first = int(self.unkeyed[0].arrival_ns)
            head = first if head is None else min(first, head)
        if not self.front:
            return head
        first = int(self.front[0].arrival_ns)
        return first if head is None else min(first, head)

    def count(self) -> None:
        """Refresh the gauges of what waits."""
        in_memory = self.waiting.in_memory
        self.values[S_OVERFLOW] = sum(a.items.locs.size for a in self.front) + in_memory
        self.values[S_WAITING] = len(self.groups) + self.num_unkeyed - in_memory

    def close(self) -> None:
        """Drop what waits (the next start's scan finds it again on disk)."""
        self.front.clear()
        self.waiting.close()
        self.groups = WaitingGroups()
        self.unkeyed.clear()
        self.num_unkeyed = 0
