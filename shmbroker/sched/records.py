"""Batch records and the consumers' batch rings, as the scheduler fills them.

A batch record (one batch ring record, `ring.wire`) carries the LOC rows of a packed batch to run,
then up to FAILED_ROWS_MAX rows failed back (`aux` = status) that wait in `FailedRows`; a record
may hold only failed rows. A consumer's ring is kept ahead of its engine (`Feed`, `pack.feeding`):
it wants a record while it holds fewer than AHEAD unreleased or, for a packed consumer, fewer items
without results than its window needs queued (the GPU process publishes the rows of its held records
that have results in the ring's `rows_done` word). A record its full ring could not take is held and pushed first
when the ring has room again.
"""

from __future__ import annotations

import time
from collections import deque
from typing import NamedTuple

import numpy as np

from ..pack.feeding import AHEAD
from ..ring import layout as L
from ..ring.wire import batch_meta_words

FAILED_ROWS_MAX = 4096  # failed rows one batch record carries at most (a cancel fails a whole job)


class BatchRecord(NamedTuple):
    """One batch ring record: its payload and the words of its meta."""

    payload: np.ndarray  # uint32 words: the LOC rows to run, then those failed back
    n_run: int
    n_failed: int
    packed_ns: int  # when it was packed: the GPU process counts its wait from it


class FailedRows:
    """LOC rows failed back (`aux` = status), first in first out until a batch record carries them;
    a record takes at most `rows_max`, the rest ride the next ones."""

    def __init__(self, rows_max: int = FAILED_ROWS_MAX):
        assert rows_max > 0
        self.rows_max = rows_max
        self.parts: deque[np.ndarray] = deque()  # in order; none empty
        self.num_rows = 0

    def __len__(self) -> int:
        return self.num_rows

    def append(self, rows: np.ndarray) -> None:
        if rows.size:
            self.parts.append(rows)
            self.num_rows += rows.size

    def take(self) -> list[np.ndarray]:
        """The next parts, of at most `rows_max` rows in all (a part split if need be)."""
        out = []
        room = self.rows_max
        while self.parts and room:
            part = self.parts.popleft()
            if part.size > room:
                self.parts.appendleft(part[room:])
                part = part[:room]
            out.append(part)
            room -= part.size
        self.num_rows -= self.rows_max - room
        return out


def batch_record(run: np.ndarray | None, failed: FailedRows) -> BatchRecord | None:
    """A record of the rows to `run` (`aux` 0) and the next failed rows; None when there are neither."""
    rows = [] if run is None else [run]
    rows += failed.take()
    if not rows:
        return None
    locs = np.concatenate(rows) if len(rows) > 1 else rows[0]
    n_run = 0 if run is None else run.size
    return BatchRecord(locs.view(np.uint32).reshape(-1), n_run, locs.size - n_run, time.monotonic_ns())


class Feed:
    """One consumer's batch ring as the scheduler fills it: the items of each record pushed and not
    yet released (the ring's counters say how many records were released), the undone items, and a
    record the full ring could not take yet."""

    def __init__(self, ring, queued_items: int):
        self.ring = ring
        self.queued_items = queued_items  # undone items the consumer's window needs queued
        self.held: BatchRecord | None = None
        self.pushed_items: deque[int] = deque()
        self.undone_items = 0

    def wants(self) -> bool:
        """Whether the ring wants another record (counting out the records released since)."""
        sizes = self.pushed_items
        undone = self.ring.num_queued()
        while len(sizes) > undone:  # released since: their items are done
            self.undone_items -= sizes.popleft()
        # done rows of records still held (one long item holds its record, and those behind it)
        return undone < AHEAD or self.undone_items - self.ring.rows_done() < self.queued_items

    def take_held(self) -> BatchRecord | None:
        """The record held back for a full ring, if any (to push before any other)."""
        record, self.held = self.held, None
        return record

    def push(self, record: BatchRecord, key: int) -> bool:
        """Push `record` as batch number `key`; False when the ring is full (the record is held)."""
        if self.ring.push(record.payload, key, *batch_meta_words(record.n_run, record.n_failed, record.packed_ns)) != L.OK:
            self.held = record
            return False
        items = record.n_run + record.n_failed
        self.pushed_items.append(items)
        self.undone_items += items
        return True
