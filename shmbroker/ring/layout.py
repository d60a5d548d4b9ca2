"""Byte layout of an SPSC ring segment, and the kernels' named return values.

A ring is one shared-memory segment: a 512-byte header, then a data region of
`capacity_words` 32-bit words (a power of two). Header fields are int64 words;
each side's hot fields sit on their own 128-byte block (two cache lines, so the
adjacent-line prefetcher does not couple them).

Header (int64 word index: field; writer)

| word | byte | field               | written by | meaning                                        |
|------|------|---------------------|------------|------------------------------------------------|
| 0    | 0    | magic               | creator    | MAGIC                                          |
| 1    | 8    | version             | creator    | LAYOUT_VERSION                                 |
| 2    | 16   | capacity_words      | creator    | data words, power of two                       |
| 3    | 24   | max_record_words    | creator    | largest record, header included                |
| 4    | 32   | data_offset_bytes   | creator    | HEADER_BYTES                                   |
| 16   | 128  | head                | producer   | words ever pushed (incl. wrap skips)           |
| 17   | 136  | producer_pid        | producer   | 0 = none attached                              |
| 18   | 144  | producer_start      | producer   | /proc start time of that pid (ticks)           |
| 19   | 152  | producer_beat_ns    | producer   | CLOCK_MONOTONIC heartbeat                      |
| 20   | 160  | tail_cache          | producer   | last tail the producer read                    |
| 21   | 168  | next_key            | producer   | next item key: a reconnecting producer resumes |
| 22   | 176  | num_pushed          | producer   | records pushed                                 |
| 23   | 184  | num_full            | producer   | pushes refused because the ring was full       |
| 24   | 192  | session_ready       | producer   | result rings: the session the producer has set |
|      |      |                     |            | the ring up for (`results/delivery.py`)       |
| 32   | 256  | tail                | consumer   | words ever consumed                            |
| 33   | 264  | consumer_pid        | consumer   |                                                |
| 34   | 272  | consumer_start      | consumer   |                                                |
| 35   | 280  | consumer_beat_ns    | consumer   |                                                |
| 36   | 288  | num_popped          | consumer   | records consumed                               |
| 37   | 296  | num_acked           | consumer   | result rings: records the application has      |
|      |      |                     |            | acknowledged (a prefix of those popped)        |
| 38   | 304  | session             | consumer   | result rings: bumped by each attaching reader  |
| 39   | 312  | rows_done           | consumer   | batch rings: rows of records not yet released  |
|      |      |                     |            | that have their results; a record's rows are   |
|      |      |                     |            | counted out right before it is released, so a  |
|      |      |                     |            | producer reading num_popped first never counts |
|      |      |                     |            | a row of a released record; a restarted        |
|      |      |                     |            | consumer starts it from 0 (`Ring.count_done`)  |
| 40   | 320  | closed              | closer     | 1: closed (`closing.close_ring`): looks full      |
| 41   | 328  | closed_tail         | closer     | the real tail once closed                      |
| 42   | 336  | closed_reason       | closer     | why (CLOSE_REASONS): 0 a stop, else a fault    |
| 48   | 384  | consumer_waiting    | both       | 1: consumer sleeps on the data doorbell        |
| 49   | 392  | producer_waiting    | both       | 1: producer sleeps on the space doorbell       |

Record (uint32 word index from the record start; records start at even words
and never straddle the end of the data region)

| word | field      | meaning                                                              |
|------|------------|----------------------------------------------------------------------|
| 0    | commit     | record size in words, even, header included; 0 = not yet written;    |
|      |            | WRAP = the rest of the region is skipped, the next record is at 0.   |
|      |            | Written last, by a release store: it commits the record.            |
| 1    | num_tokens | payload length                                                       |
| 2-3  | key        | uint64 (item sequence number)                                        |
| 4-7  | meta[0..3] | four uint32 the ring's user defines                                  |
| 8-   | tokens     | uint32 × num_tokens, then one pad word if needed                     |

Before committing a record the producer zeroes the commit word just past it,
so the consumer never mistakes stale bytes of an earlier lap for a record;
the space check reserves those SENTINEL_WORDS too.

Geometry: every side maps the whole segment, and either side can write any
word of it. So the kernels never read the capacity or max-record words (2-3):
they take the capacity from the length of the array they are given (the
segment as the calling process mapped it: `ring.Ring` checks that length
once, at attach, against the creator's) and derive the largest record from it
(`max_record_words`). Words 2-4 are for a peer's first check (`check_header`)
and for watchers. Every position a kernel computes from a word the peer wrote
(head, tail, a commit or length word) is masked or bounded by that capacity.

Closing (`wire.py`): a ring closed at a stop has closed_reason 0; a ring the
broker closed because its peer broke the frame (a corrupt record, a tail out of
range) has a CLOSE_* reason, and the peer's next wait raises `RingClosed`.
"""

from __future__ import annotations

import numpy as np
from numba.extending import register_jitable

MAGIC = 0x474E4952424D4853  # "SHMBRING" little-endian
LAYOUT_VERSION = 1

HEADER_BYTES = 512
HEADER_WORDS64 = HEADER_BYTES // 8

H_MAGIC = 0
H_VERSION = 1
H_CAPACITY = 2
H_MAX_RECORD = 3
H_DATA_OFFSET = 4

H_HEAD = 16
H_PRODUCER_PID = 17
H_PRODUCER_START = 18
H_PRODUCER_BEAT = 19
H_TAIL_CACHE = 20
H_NEXT_KEY = 21
H_NUM_PUSHED = 22
H_NUM_FULL = 23
H_SESSION_READY = 24

H_TAIL = 32
H_CONSUMER_PID = 33
H_CONSUMER_START = 34
H_CONSUMER_BEAT = 35
H_NUM_POPPED = 36
H_NUM_ACKED = 37
H_SESSION = 38
H_ROWS_DONE = 39
H_CLOSED = 40
H_CLOSED_TAIL = 41
H_CLOSED_REASON = 42

H_CONSUMER_WAITING = 48
H_PRODUCER_WAITING = 49

RECORD_HEADER_WORDS = 8
META_WORDS = 4
# a record's header words, as the record table above gives them (uint32 index; RW64_: uint64 index)
RW_COMMIT = 0
RW_NUM_TOKENS = 1
RW64_KEY = 1
RW_META = 4
SENTINEL_WORDS = 2
WRAP = 0xFFFFFFFF

# Kernel return values (named, never -1 in Python APIs).
OK = 0
OK_WAKE = 1  # pushed/popped, and the peer was asleep: ring its doorbell
FULL = 2
TOO_LARGE = 3
EMPTY = 4
CORRUPT = 5

MIN_CAPACITY_WORDS = 64

# Why a ring was closed (header word 42); the peer's `RingClosed` says the text.
CLOSE_STOP = 0  # a stopping or salvaging broker took what was left (not a fault)
CLOSE_CORRUPT = 1
CLOSE_BAD_TAIL = 2
CLOSE_BAD_SEGMENT = 3
CLOSE_REASONS = {
    CLOSE_STOP: "the broker stopped",
    CLOSE_CORRUPT: "a corrupt record or tail word (one no producer writes)",
    CLOSE_BAD_TAIL: "its reader's tail word is out of range (ahead of the head, or more than a lap behind)",
    CLOSE_BAD_SEGMENT: "its segment is not the size the broker created",
}


def record_words(num_tokens: int) -> int:
    """Words a record of `num_tokens` occupies, header and padding included."""
    return (RECORD_HEADER_WORDS + num_tokens + 1) & ~1


@register_jitable
def max_record_words(capacity_words: int) -> int:
    """Largest record that always fits once the ring drains, whatever the offset."""
    return (capacity_words // 2 - SENTINEL_WORDS) & ~1


def max_tokens(capacity_words: int) -> int:
    return max_record_words(capacity_words) - RECORD_HEADER_WORDS


def segment_bytes(capacity_words: int) -> int:
    return HEADER_BYTES + 4 * capacity_words


def capacity_for_bytes(data_bytes: int) -> int:
    """Smallest power-of-two word capacity holding at least `data_bytes`."""
    words = max(MIN_CAPACITY_WORDS, (int(data_bytes) + 3) // 4)
    return 1 << (words - 1).bit_length()


def init_header(buf: np.ndarray, capacity_words: int) -> None:
    """Write the creator's fields of a fresh (zero-filled) segment."""
    if capacity_words < MIN_CAPACITY_WORDS or capacity_words & (capacity_words - 1):
        raise ValueError(f"ring capacity must be a power of two >= {MIN_CAPACITY_WORDS} words, got {capacity_words}")
    h = buf[:HEADER_BYTES].view(np.int64)
    h[H_CAPACITY] = capacity_words
    h[H_MAX_RECORD] = max_record_words(capacity_words)
    h[H_DATA_OFFSET] = HEADER_BYTES
    h[H_VERSION] = LAYOUT_VERSION
    h[H_MAGIC] = MAGIC  # last: a reader that sees the magic sees the rest


def check_header(buf: np.ndarray) -> int:
    """Validate an attached segment's header; return its capacity in words."""
    if buf.size < HEADER_BYTES:
        raise ValueError(f"ring segment of {buf.size} bytes is smaller than its header")
    h = buf[:HEADER_BYTES].view(np.int64)
    if int(h[H_MAGIC]) != MAGIC:
        raise ValueError("not a shmbroker ring (bad magic)")
    if int(h[H_VERSION]) != LAYOUT_VERSION:
        raise ValueError(f"ring layout version {int(h[H_VERSION])}, this build reads {LAYOUT_VERSION}")
    cap = int(h[H_CAPACITY])
    if cap < MIN_CAPACITY_WORDS or cap & (cap - 1) or buf.size < segment_bytes(cap):
        raise ValueError(f"ring header claims {cap} words in a {buf.size}-byte segment")
    if int(h[H_MAX_RECORD]) != max_record_words(cap) or int(h[H_DATA_OFFSET]) != HEADER_BYTES:
        raise ValueError("ring header fields are inconsistent")
    return cap
