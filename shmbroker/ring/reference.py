"""A plain-Python model of the SPSC ring, the oracle the numba kernels are tested against.

`ReferenceRing` keeps the committed records in a deque and the same two
absolute word counters as the segment header (`head`: words ever pushed, wrap
skips included; `tail`: words ever consumed), so it reproduces the kernels'
observable behaviour without any byte layout: which push is refused (FULL,
TOO_LARGE), which records a pop returns and where it stops, what `readable`
and `writable_words` say, and the header counters after every call.
`tests/ring/test_ring_model.py` drives it side by side with `spsc.py`.

Space accounting (as `spsc.reserve`): a record of n tokens takes
`layout.record_words(n)` words; a record larger than
`layout.max_record_words(capacity)` is TOO_LARGE; a record that would run past
the end of the data region is preceded by a skip to word 0 (the wrap); a push
fits when `head + skip + size + SENTINEL_WORDS - tail <= capacity`.

Not modelled: the wake flags (OK_WAKE reads as OK), `tail_cache` (a stale
cache only delays the fresh load the kernel then makes, so the answer is the
same), ordering between processes, and corrupt data (the model holds only
well-formed records; CORRUPT is tested against the kernels directly).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from . import layout

KEY_MASK = (1 << 64) - 1
META_MASK = (1 << 32) - 1


class Record(NamedTuple):
    """One record as a pop returns it."""

    key: int
    meta: tuple[int, int, int, int]
    tokens: np.ndarray  # uint32


class Peek(NamedTuple):
    """What `peek_many` sees: records, their word offsets in the data region, the tail after them."""

    records: list[Record]
    offsets_words: list[int]
    new_tail_words: int
    status: int


@dataclass(frozen=True)
class _Slot:
    record: Record
    offset_words: int  # where the record's commit word sits in the data region
    end_words: int  # absolute word count just past the record: the tail after consuming it


class ReferenceRing:
    def __init__(self, capacity_words: int) -> None:
        if capacity_words < layout.MIN_CAPACITY_WORDS or capacity_words & (capacity_words - 1):
            raise ValueError(f"ring capacity must be a power of two >= {layout.MIN_CAPACITY_WORDS} words, got {capacity_words}")
        self.capacity_words = capacity_words
        self.max_record_words = layout.max_record_words(capacity_words)
        self.head_words = 0
        self.tail_words = 0
        self.num_pushed = 0
        self.num_popped = 0
        self.num_full = 0
        self._slots: deque[_Slot] = deque()

    # -- producer ---------------------------------------------------------

    def push(self, tokens, key: int, m0: int, m1: int, m2: int, m3: int) -> int:
        """Push one record; return layout.OK, FULL or TOO_LARGE."""
        tokens = np.asarray(tokens, dtype=np.uint32)
        size = layout.record_words(tokens.size)
        if size > self.max_record_words:
            return layout.TOO_LARGE
        offset = self.head_words % self.capacity_words
        skip = self.capacity_words - offset if offset + size > self.capacity_words else 0
        need = self.head_words + skip + size + layout.SENTINEL_WORDS
        if need - self.tail_words > self.capacity_words:
            self.num_full += 1
            return layout.FULL
        meta = (m0 & META_MASK, m1 & META_MASK, m2 & META_MASK, m3 & META_MASK)
        record = Record(key & KEY_MASK, meta, tokens.copy())
        self.head_words += skip + size
        self._slots.append(_Slot(record, (offset + skip) % self.capacity_words, self.head_words))
        self.num_pushed += 1
        self._check()
        return layout.OK

    def push_many(self, flat, offsets, key0: int, meta, first: int, last: int) -> tuple[int, int]:
        """Push records first..last-1 as `spsc.push_many`; return (records pushed, status)."""
        status = layout.OK
        i = first
        while i < last:
            lo, hi = int(offsets[i]), int(offsets[i + 1])
            m0, m1, m2, m3 = (int(v) for v in meta[i if len(meta) > 1 else 0])
            code = self.push(flat[lo:hi], int(key0) + i, m0, m1, m2, m3)
            if code != layout.OK:
                status = code
                break
            i += 1
        return i - first, status

    def free_words(self) -> int:
        """Free words as `spsc.writable_words` counts them (sentinel reserved)."""
        return self.capacity_words - (self.head_words - self.tail_words) - layout.SENTINEL_WORDS

    # -- consumer ---------------------------------------------------------

    def pop_many(self, max_records: int, max_tokens: int) -> tuple[list[Record], int]:
        """Consume up to `max_records` records whose tokens fit in `max_tokens`; return (records, status).

        status is EMPTY when the ring ran dry before `max_records`, else OK
        (also when the next record's tokens would not fit: it stays queued).
        """
        records: list[Record] = []
        used = 0
        status = layout.OK
        while len(records) < max_records:
            if not self._slots:
                status = layout.EMPTY
                break
            slot = self._slots[0]
            if used + slot.record.tokens.size > max_tokens:
                break
            self._slots.popleft()
            used += slot.record.tokens.size
            records.append(slot.record)
            self.tail_words = slot.end_words
        self.num_popped += len(records)
        self._check()
        return records, status

    def peek_many(self, max_records: int) -> Peek:
        """Records `spsc.peek_many` would see, consuming nothing."""
        slots = list(self._slots)[: max(max_records, 0)]
        status = layout.EMPTY if len(slots) < max_records else layout.OK
        new_tail = slots[-1].end_words if slots else self.tail_words
        return Peek([s.record for s in slots], [s.offset_words for s in slots], new_tail, status)

    def release(self, new_tail_words: int, count: int) -> None:
        """Consume the first `count` records, which must end at `new_tail_words` (from `peek_many`)."""
        if not 0 <= count <= len(self._slots):
            raise ValueError(f"release of {count} records, {len(self._slots)} queued")
        end = self._slots[count - 1].end_words if count else self.tail_words
        if new_tail_words != end:
            raise ValueError(f"release to tail {new_tail_words}, the {count} records end at {end}")
        for _ in range(count):
            self._slots.popleft()
        self.tail_words = end
        self.num_popped += count
        self._check()

    def readable(self) -> bool:
        """True when a record waits (the kernel sees a commit word or a wrap marker at the tail)."""
        return bool(self._slots)

    def __len__(self) -> int:
        return len(self._slots)

    def _check(self) -> None:
        assert 0 <= self.tail_words <= self.head_words
        assert self.head_words - self.tail_words <= self.capacity_words - layout.SENTINEL_WORDS
        assert self.num_pushed - self.num_popped == len(self._slots)
        assert not self._slots or self._slots[-1].end_words == self.head_words
        assert self._slots or self.tail_words == self.head_words
