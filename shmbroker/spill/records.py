"""Record kernels over a mapped segment (layout: `layout.py`): write, scan, gather.

`write_records` lays out a run of records in a buffer in a given order (the
writer clusters by shape and stages runs in memory), computing each record's
CRC32C in the same pass and storing each length word after the rest of its
record; every record after the first of the run is flagged FLAG_CONT (the
writer commits the run by writing the first length word last). `scan`
walks records from an offset and checks each one right after reading it
(magic, length, sequence, optionally the CRC): it stops at the end of the
data, skips (quarantines) a record whose frame is sound but whose CRC fails,
resynchronises past a broken frame when a valid record follows (only on a
run's first record after an uncommitted run), and otherwise reports the torn
tail it cut. `check_records` is the reader's check (a GPU process, before it
runs an item): the record at a location is whole and is the one the location
names (length, magic, sequence number, item id, token count, CRC, which covers the option
words after the tokens: `layout.py`).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jit import kernel
from ..ring.atomics import load_acquire, memcpy, store_release
from ..ring.crc import crc32c_final, crc32c_init, crc32c_update
from .layout import (
    FLAG_CONT,
    OPTION_WORDS_COPY,
    OPTION_WORDS_MASK,
    R64_ITEM,
    R64_PREFIX_KEY,
    R64_SEQ,
    R_BAND,
    R_CRC,
    R_FLAGS,
    R_LENGTH,
    R_MAGIC,
    R_MAX_NEW,
    R_MODEL,
    R_NUM_TOKENS,
    R_PREFIX_LEN,
    R_PRODUCER,
    RECORD_HEADER_BYTES,
    RECORD_HEADER_WORDS,
    RECORD_MAGIC,
    SEGMENT_HEADER_BYTES,
)

# scan outcomes per record (out_status) and for the scan as a whole
REC_OK = 0
REC_BAD_CRC = 1  # frame sound, checksum wrong: quarantined, skipped by its length
REC_BAD_FRAME = 2  # header unusable; skipped up to the next valid record (resync)

SCAN_END = 0  # reached a zero length word: clean end of data
SCAN_TORN = 1  # bytes after the last valid record that form no valid record: cut
SCAN_FULL = 2  # output arrays full; call again from the returned offset

# check_records outcomes per location
CHECK_OK = 0
CHECK_FRAME = 1  # the bytes there are not the record the location names (length, magic, seq, item id, token count)
CHECK_CRC = 2  # the record the location names, failing its checksum: its tokens cannot be trusted
CHECK_GONE = 3  # its segment cannot be mapped (missing, or its header fails its checks); set by the caller


@kernel
def record_crc(seg, off, length):
    """CRC32C of a record's bytes 12..length (everything after the crc word)."""
    return crc32c_final(crc32c_update(crc32c_init(), seg, off + 12, off + length))


@kernel
def write_records(seg, offset, end_limit, flat, offsets, items, order, first, seq0, out_seq, out_offset):
    """Write records order[first], order[first+1], ... at `offset` until one does not fit.

    Record order[k] gets sequence number seq0 + (k - first); every record but
    the first carries FLAG_CONT (they form one run, committed together by the
    caller). Fills out_seq/out_offset at the input index. Returns (records
    written, new offset).
    """
    words = seg.view(np.uint32)
    words64 = seg.view(np.uint64)
    k = first
    while k < order.size:
        i = order[k]
        lo = offsets[i]
        n = offsets[i + 1] - lo
        length = (RECORD_HEADER_BYTES + 4 * n + 7) & ~7
        if offset + length > end_limit:
            break
        w = offset >> 2
        words[w + R_MAGIC] = RECORD_MAGIC
        k_opt = items[i].flags & OPTION_WORDS_MASK  # the payload's last words are the item's options
        words[w + R_FLAGS] = k_opt | (k_opt << OPTION_WORDS_COPY) | (FLAG_CONT if k > first else 0)
        words64[(offset >> 3) + R64_SEQ] = seq0 + (k - first)
        words64[(offset >> 3) + R64_ITEM] = items[i].item_id
        words64[(offset >> 3) + R64_PREFIX_KEY] = items[i].prefix_key
        words[w + R_PRODUCER] = items[i].producer
        words[w + R_MODEL] = items[i].model
        words[w + R_PREFIX_LEN] = items[i].prefix_len
        words[w + R_NUM_TOKENS] = n - k_opt
        words[w + R_MAX_NEW] = items[i].max_new_tokens
        words[w + R_BAND] = items[i].shape_band
        if n > 0:
            memcpy(words, w + RECORD_HEADER_WORDS, flat, lo, n)
        if n & 1:
            words[w + RECORD_HEADER_WORDS + n] = 0  # padding
        words[w + R_CRC] = record_crc(seg, offset, length)
        store_release(words, w + R_LENGTH, length)  # commit
        out_seq[i] = seq0 + (k - first)
        out_offset[i] = offset
        offset += length
        k += 1
    return k - first, offset


@kernel
def _frame_ok(seg, off, end, expect_seq):
    """Is there a plausible record frame at `off` (magic, length, sequence)?"""
    words = seg.view(np.uint32)
    w = off >> 2
    length = load_acquire(words, w + R_LENGTH)
    if length < RECORD_HEADER_BYTES or length & 7 or off + length > end:
        return False
    if words[w + R_MAGIC] != RECORD_MAGIC:
        return False
    # the length holds the tokens and the option words by either copy of their count (a flipped
    # flags bit is a damaged record whose CRC fails, not a broken frame: layout.py)
    n = np.int64(words[w + R_NUM_TOKENS])
    flags = words[w + R_FLAGS]
    k1 = np.int64(flags & OPTION_WORDS_MASK)
    k2 = np.int64((flags >> OPTION_WORDS_COPY) & OPTION_WORDS_MASK)
    if (RECORD_HEADER_BYTES + 4 * (n + k1) + 7) & ~7 != length and (RECORD_HEADER_BYTES + 4 * (n + k2) + 7) & ~7 != length:
        return False
    if expect_seq >= 0 and np.int64(seg.view(np.uint64)[(off >> 3) + R64_SEQ]) != expect_seq:
        return False
    return True


@kernel
def last_nonzero(seg, start, end):
    """One past the last nonzero byte of seg[start:end], or `start` when all are zero."""
    words = seg[: end & ~7].view(np.uint64)
    p = end
    while p > start and p & 7:  # an unaligned end, byte by byte
        if seg[p - 1] != 0:
            return p
        p -= 1
    while p - 8 >= start:  # whole words
        if words[(p - 8) >> 3] != 0:
            break
        p -= 8
    while p > start:
        if seg[p - 1] != 0:
            return p
        p -= 1
    return start


@kernel
def scan(seg, start, end, next_seq, check_crc, out_offset, out_status, live=False):
    """Walk records from `start` (8-aligned) up to `end`.

    `live`: a writer may be appending right now (a read-only look), so a zero length word is the
    end of what is committed, whatever follows it (the run being written), never a broken frame
    to resynchronise past: what lies beyond may be committed while we look.

    Records found go to out_offset/out_status (REC_OK, REC_BAD_CRC,
    REC_BAD_FRAME for the first offset of a skipped broken region).
    Returns (count, outcome, offset after the last record taken, next_seq,
    cut_bytes): outcome SCAN_END, SCAN_TORN (cut_bytes = nonzero bytes after
    that offset that form no record) or SCAN_FULL.
    """
    words = seg.view(np.uint32)
    off = start
    count = 0
    while True:
        if count >= out_offset.size:
            return count, SCAN_FULL, off, next_seq, 0
        if off + RECORD_HEADER_BYTES > end:
            return count, SCAN_END, off, next_seq, 0
        length = load_acquire(words, (off >> 2) + R_LENGTH)
        if length == 0 and (live or last_nonzero(seg, off, end) == off):
            return count, SCAN_END, off, next_seq, 0
        if length != 0 and _frame_ok(seg, off, end, next_seq):
            status = REC_OK
            if check_crc and record_crc(seg, off, length) != words[(off >> 2) + R_CRC]:
                status = REC_BAD_CRC
            out_offset[count] = off
            out_status[count] = status
            count += 1
            off += length
            next_seq += 1
            continue
        # A broken frame: look for the next valid record (sequence next_seq + j). After a
        # run's first record with a zero length word (a run whose commit word was never
        # written), only the first record of a later run can start committed data again.
        heads_only = length == 0 and (words[(off >> 2) + R_FLAGS] & FLAG_CONT) == 0
        probe = off + 8
        found = -1
        while probe + RECORD_HEADER_BYTES <= end and found < 0:
            if words[(probe >> 2) + R_MAGIC] == RECORD_MAGIC:
                seq = np.int64(seg.view(np.uint64)[(probe >> 3) + R64_SEQ])
                head_ok = not heads_only or (words[(probe >> 2) + R_FLAGS] & FLAG_CONT) == 0
                if head_ok and seq > next_seq and seq - next_seq < 1 << 20 and _frame_ok(seg, probe, end, seq):
                    ln = words[(probe >> 2) + R_LENGTH]
                    if record_crc(seg, probe, ln) == words[(probe >> 2) + R_CRC]:
                        found = probe
                        next_seq = seq
            probe += 8
        if found < 0:
            return count, SCAN_TORN, off, next_seq, last_nonzero(seg, off, end) - off
        out_offset[count] = off
        out_status[count] = REC_BAD_FRAME
        count += 1
        off = found


class ScanStep(NamedTuple):
    """What one `scan` call walked (its docstring): records found, SCAN_END / SCAN_TORN / SCAN_FULL,
    the offset after the last record taken, the next sequence number, and (SCAN_TORN) the bytes
    after that offset that form no record."""

    count: int
    outcome: int
    end: int
    next_seq: int
    cut_bytes: int


def scan_step(seg, start, end, next_seq, check_crc, out_offset, out_status, live=False) -> ScanStep:
    """`scan`, its result named (one call per SCAN_CHUNK records)."""
    return ScanStep(*scan(seg, start, end, next_seq, check_crc, out_offset, out_status, live))


@kernel
def gather(seg, offsets, out_flat, out_offsets, first_out):
    """Copy the tokens of the records at `offsets` into out_flat (a batch), starting at slot first_out.

    out_offsets[first_out] must hold the start; returns the next free slot.
    """
    words = seg.view(np.uint32)
    pos = out_offsets[first_out]
    for r in range(offsets.size):
        w = offsets[r] >> 2
        n = words[w + R_NUM_TOKENS]
        memcpy(out_flat, pos, words, w + RECORD_HEADER_WORDS, n)
        pos += n
        out_offsets[first_out + r + 1] = pos
    return first_out + offsets.size


@kernel
def check_records(seg, offsets, seqs, item_ids, num_tokens, out, out_words):
    """out[r] = CHECK_OK when the record at offsets[r] is whole (its CRC) and is the one named by
    seqs[r], item_ids[r] and num_tokens[r]; else CHECK_FRAME or CHECK_CRC. out_words[r]: its option
    words (0 unless CHECK_OK). Reads only inside the segment."""
    words = seg.view(np.uint32)
    words64 = seg[: seg.size & ~7].view(np.uint64)
    for r in range(offsets.size):
        off = np.int64(offsets[r])
        n = np.int64(num_tokens[r])
        if off < SEGMENT_HEADER_BYTES or off & 7 or off + RECORD_HEADER_BYTES > seg.size:
            out[r] = CHECK_FRAME
            continue
        w = off >> 2
        flags = words[w + R_FLAGS]
        k_opt = np.int64(flags & OPTION_WORDS_MASK)
        length = (RECORD_HEADER_BYTES + 4 * (n + k_opt) + 7) & ~7
        if off + length > seg.size:
            out[r] = CHECK_FRAME
            continue
        if k_opt != np.int64((flags >> OPTION_WORDS_COPY) & OPTION_WORDS_MASK):
            out[r] = CHECK_CRC  # its two option word counts differ: a damaged header
            continue
        if (load_acquire(words, w + R_LENGTH) != length or words[w + R_MAGIC] != RECORD_MAGIC
                or words[w + R_NUM_TOKENS] != n or words64[(off >> 3) + R64_SEQ] != seqs[r]
                or words64[(off >> 3) + R64_ITEM] != item_ids[r]):
            out[r] = CHECK_FRAME
            continue
        out[r] = CHECK_OK if record_crc(seg, off, length) == words[w + R_CRC] else CHECK_CRC
        out_words[r] = k_opt if out[r] == CHECK_OK else 0


@kernel
def copy_headers(seg, offsets, out):
    """out[i] = the 64 header bytes of the record at offsets[i] (for seal indexes and recovery)."""
    for i in range(offsets.size):
        memcpy(out[i], 0, seg, offsets[i], RECORD_HEADER_BYTES)


@kernel
def segments_needed(sizes_in_order, end, size, segment_bytes):
    """New segments a batch needs: replays the writer's roll rule (a record that does not fit rolls)."""
    count = 0
    for n in sizes_in_order:
        length = (RECORD_HEADER_BYTES + 4 * n + 7) & ~7
        if end + length > size:
            count += 1
            end = SEGMENT_HEADER_BYTES
            size = segment_bytes
        end += length
    return count
