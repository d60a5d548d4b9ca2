"""Byte layout of backlog segment files and their records.

A segment file `<data_dir>/backlog/w<writer>/<first_seq:020d>.seg` holds one
writer's records with sequence numbers first_seq, first_seq+1, ... It is
preallocated to its full size (so a full disk fails at creation, never as a
SIGBUS inside a write), written through a shared mmap, and sealed when the
next record does not fit: sealing writes `<first_seq:020d>.idx`, a copy of all
record headers, so recovery reads sealed segments without touching payloads.

Segment header (64 bytes at offset 0; little-endian)

| byte | size | field        | meaning                                          |
|------|------|--------------|--------------------------------------------------|
| 0    | 8    | magic        | SEGMENT_MAGIC ("SHMBSEG1")                       |
| 8    | 4    | version      | LAYOUT_VERSION                                   |
| 12   | 4    | writer       | writer (ingest process) number                   |
| 16   | 8    | first_seq    | sequence number of the first record              |
| 24   | 8    | capacity     | file size in bytes                               |
| 32   | 8    | created_ns   | wall clock at creation                           |
| 40   | 20   | reserved     | 0                                                |
| 60   | 4    | header_crc   | crc32c of bytes 0..59                            |

Record (at 8-byte aligned offsets from 64; header 64 bytes, then tokens)

| byte | size | field          | meaning                                                      |
|------|------|----------------|--------------------------------------------------------------|
| 0    | 4    | length         | record bytes, header and padding included, multiple of 8;    |
|      |      |                | 0 = no record here (end of data). Written LAST: it commits.  |
| 4    | 4    | magic          | RECORD_MAGIC                                                 |
| 8    | 4    | crc            | crc32c of bytes 12..63, the tokens and the option words      |
| 12   | 4    | flags          | FLAG_CONT: not the first record of its write (see below);    |
|      |      |                | bits 0..10 and again 11..21: the item's option word count    |
| 16   | 8    | seq            | the record's sequence number (writer-local)                  |
| 24   | 8    | item_id        | producer_id << 40 | producer seq                             |
| 32   | 8    | prefix_key     | the shape's prefix key (block-hash family)                   |
| 40   | 4    | producer       | producer id                                                  |
| 44   | 4    | model          | model id                                                     |
| 48   | 4    | prefix_len     | declared prefix length, or NO_PREFIX                         |
| 52   | 4    | num_tokens     | payload length                                               |
| 56   | 4    | max_new_tokens |                                                              |
| 60   | 4    | shape_band     | length band the writer clustered it in                       |
| 64   | 4·n  | tokens         | uint32                                                       |
| ...  | 4·k  | option words   | the item's request options (`request/options.py`), k = flags |
|      |      |                | & OPTION_WORDS_MASK (0: none), then zero padding to 8 bytes  |

Writes and commits. The writer stages a run of records in memory and
writes it with one `pwrite` whose first record's length word is still 0,
then writes that length word (4 bytes) last: the run, all its records, is
committed by that store. Every record of a run but the first carries
FLAG_CONT, so recovery never takes the records of a run whose first length
word was never written (a zero length word followed by bytes) for committed
ones: it resynchronises only on a record without FLAG_CONT.

Index file `.idx`: a 64-byte header (IDX_MAGIC u64, count u64, segment
end offset u64, reserved, at byte 60 the crc32c of header bytes 0..59 then
all the entries)
then `count` entries of IDX_ENTRY_BYTES: the record's offset (u64) followed
by bytes 0..63 of its header.
"""

from __future__ import annotations

import numpy as np

SEGMENT_MAGIC = 0x3147455342484D53  # "SHMBSEG1"
RECORD_MAGIC = 0x52424D53  # "SMBR"
FLAG_CONT = 0x80000000  # record flags: a record after the first of its write (run)
# record flags: how many option words follow the tokens, twice (bits 0..10 and 11..21), so that a
# flipped bit there leaves a whole frame whose CRC fails (its item named corrupt), while a flipped
# length word still breaks the frame (recovery resynchronises)
OPTION_WORDS_MASK = 0x7FF
OPTION_WORDS_COPY = 11  # the shift of the second copy
IDX_MAGIC = 0x3158444942484D53  # "SHMBIDX1"
LAYOUT_VERSION = 1

SEGMENT_HEADER_BYTES = 64
RECORD_HEADER_BYTES = 64
RECORD_HEADER_WORDS = RECORD_HEADER_BYTES // 4
IDX_HEADER_BYTES = 64
IDX_ENTRY_BYTES = 8 + RECORD_HEADER_BYTES

MIN_SEGMENT_BYTES = 4096

# record header: uint32 word indices
R_LENGTH = 0
R_MAGIC = 1
R_CRC = 2
R_FLAGS = 3
# uint64 word indices
R64_SEQ = 2
R64_ITEM = 3
R64_PREFIX_KEY = 4
# uint32 word indices
R_PRODUCER = 10
R_MODEL = 11
R_PREFIX_LEN = 12
R_NUM_TOKENS = 13
R_MAX_NEW = 14
R_BAND = 15

# An item's metadata as a record header holds it (bytes 24..63 of the record table above, but
# num_tokens, which the payload gives), in the order appends and recovery carry it.
ITEM_META_FIELDS = [
    ("item_id", np.uint64),
    ("prefix_key", np.uint64),
    ("producer", np.uint32),
    ("model", np.uint32),
    ("prefix_len", np.uint32),
    ("max_new_tokens", np.uint32),
    ("shape_band", np.uint32),
]

# Item metadata passed to an append (one row per record; flags: its option words, the last
# `flags` words of its payload; the writer adds FLAG_CONT).
ITEM_DTYPE = np.dtype(ITEM_META_FIELDS + [("flags", np.uint32)])

# One pending record as recovery returns it: where it lies, then its header's fields
# (`pending_from_headers` decodes them).
PENDING_DTYPE = np.dtype(
    [
        ("writer", np.uint32),
        ("segment", np.uint64),  # first_seq of its segment file
        ("offset", np.uint64),  # byte offset of the record in that file
        ("seq", np.uint64),
        ("num_tokens", np.uint32),
    ]
    + ITEM_META_FIELDS
)


def record_bytes(num_words: int) -> int:
    """Bytes of a record whose payload is `num_words` words (its tokens and option words)."""
    return (RECORD_HEADER_BYTES + 4 * num_words + 7) & ~7


def max_tokens(segment_bytes: int) -> int:
    """Largest record a segment of this size can hold."""
    return (segment_bytes - SEGMENT_HEADER_BYTES - RECORD_HEADER_BYTES) // 4


def segment_name(first_seq: int) -> str:
    return f"{first_seq:020d}.seg"


def idx_name(first_seq: int) -> str:
    return f"{first_seq:020d}.idx"


def writer_dir_name(writer: int) -> str:
    return f"w{writer:03d}"


def pending_from_headers(headers: np.ndarray, writer: int, segment: int, offsets: np.ndarray) -> np.ndarray:
    """PENDING_DTYPE rows from (n, 64) record header bytes (the record table above), the records
    at `offsets` of one writer's segment."""
    n = headers.shape[0]
    out = np.empty(n, PENDING_DTYPE)
    if n == 0:
        return out
    h = np.ascontiguousarray(headers)
    w32 = h.view("<u4").reshape(n, RECORD_HEADER_WORDS)
    w64 = h.view("<u8").reshape(n, RECORD_HEADER_WORDS // 2)
    out["writer"] = writer
    out["segment"] = segment
    out["offset"] = offsets
    out["seq"] = w64[:, R64_SEQ]
    out["item_id"] = w64[:, R64_ITEM]
    out["prefix_key"] = w64[:, R64_PREFIX_KEY]
    out["producer"] = w32[:, R_PRODUCER]
    out["model"] = w32[:, R_MODEL]
    out["prefix_len"] = w32[:, R_PREFIX_LEN]
    out["num_tokens"] = w32[:, R_NUM_TOKENS]
    out["max_new_tokens"] = w32[:, R_MAX_NEW]
    out["shape_band"] = w32[:, R_BAND]
    return out
