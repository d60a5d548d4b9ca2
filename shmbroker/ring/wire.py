"""What the broker's processes send each other over their rings, and the kernels that move it.

Item locations (`LOC_DTYPE`, 64 bytes) travel ingest -> scheduler (one ring
record per appended batch: `meta[0]` locations, then `meta[1]` uint64 block
hashes) and scheduler -> GPU (one ring record per batch: `meta[0]` rows to
run, then `meta[1]` rows failed back, their status code in `aux`):

| byte | size | field      | meaning                                                     |
|------|------|------------|-------------------------------------------------------------|
| 0    | 4    | writer     | backlog writer (ingest process) that holds the record       |
| 4    | 4    | length     | input tokens                                                |
| 8    | 8    | segment    | first_seq of its segment file                               |
| 16   | 8    | offset     | byte offset of the record in that file                      |
| 24   | 8    | seq        | the record's writer sequence number                         |
| 32   | 8    | item_id    | producer_id << 40 | producer seq                            |
| 40   | 8    | family     | family key (pack/shapes.py)                                 |
| 48   | 4    | max_new    | max_new_tokens                                              |
| 52   | 4    | model      | model id                                                    |
| 56   | 4    | prefix_len | declared prefix length, or NO_PREFIX                        |
| 60   | 4    | aux        | ingest: block hashes that follow; batch: 0 run, else status |

Result records (GPU -> results process, one ring record per chunk of a batch;
the results log on disk holds the same bytes):

| byte | size | field       | meaning                                                   |
|------|------|-------------|-----------------------------------------------------------|
| 0    | 4    | length      | record bytes, multiple of 8                               |
| 4    | 4    | crc         | crc32c of bytes 8..length                                 |
| 8    | 8    | item_id     |                                                           |
| 16   | 8    | seq         | the item's backlog sequence number (to ack it)            |
| 24   | 4    | status      | ring.items.STATUS_CODES                                   |
| 28   | 4    | writer      | the item's backlog writer                                 |
| 32   | 4    | num_tokens  | generated tokens                                          |
| 36   | 2    | error_bytes | UTF-8 error text after the tokens and extras              |
| 38   | 2    | extras      | words after the tokens: samples, finishes, cached tokens  |
|      |      |             | (`request/extras.py`; 0: none)                            |
| 40   | ...  | tokens, extras words, error text, zero padding to 8 bytes               |

The ring records that carry them (`layout.py` frames each: key, meta[0..3], payload):

| ring (writer -> reader) | key              | meta[0]         | meta[1]     | meta[2]      | meta[3]       | payload                |
|-------------------------|------------------|-----------------|-------------|--------------|---------------|------------------------|
| appended (ingest->sched) | highest seq     | locations       | hashes      | 0            | 0             | LOC rows, uint64 hashes |
| batch (sched->GPU)      | batch number     | rows to run     | rows failed | packed_ns lo | packed_ns hi  | LOC rows               |
| results (GPU->results)  | 0                | payload bytes   | 0           | 0            | 0             | result records         |

`new_announcement` / `read_announcement`, `batch_meta_words` / `batch_meta` and `chunk_meta_words` /
`chunk_bytes` are their encoders and decoders.

A producer's result ring record: key = item id, meta[0] = status, meta[1] =
generated tokens, meta[2] = extras words, meta[3] = error bytes; payload = tokens, the extras
words, then the error text.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..jit import kernel
from .atomics import load_acquire, memcpy, store_release
from .crc import crc32c_final, crc32c_init, crc32c_update
from .layout import (
    CLOSE_BAD_TAIL,
    H_CLOSED,
    H_CONSUMER_WAITING,
    H_HEAD,
    H_NUM_PUSHED,
    H_TAIL,
    H_TAIL_CACHE,
    HEADER_BYTES,
    RECORD_HEADER_WORDS,
    RW_META,
    max_record_words,
)
from .closing import mark_closed
from .spsc import NO_SPACE, claim_waiter, reserve, write_record

LOC_DTYPE = np.dtype([("writer", "<u4"), ("num_tokens", "<u4"), ("segment", "<u8"), ("offset", "<u8"), ("seq", "<u8"),
                      ("item_id", "<u8"), ("prefix_key", "<u8"), ("max_new_tokens", "<u4"), ("model", "<u4"),
                      ("prefix_len", "<u4"), ("aux", "<u4")])
LOC_WORDS = LOC_DTYPE.itemsize // 4
assert LOC_DTYPE.itemsize == 64

class MetaWords(NamedTuple):
    """meta[0..3] of a ring record (the table above says what each ring puts there); spread into
    `Ring.push(payload, key, *meta)`."""

    m0: int
    m1: int
    m2: int
    m3: int


def batch_meta_words(n_run: int, n_failed: int, packed_ns: int) -> MetaWords:
    """meta[0..3] of a batch ring record."""
    return MetaWords(n_run, n_failed, packed_ns & 0xFFFFFFFF, packed_ns >> 32)


def batch_meta(data: np.ndarray, pos: int) -> tuple[int, int, int]:
    """(rows to run, rows failed back, packed_ns) of the batch ring record at word `pos` of `data`."""
    m = pos + RW_META
    return int(data[m]), int(data[m + 1]), int(data[m + 2]) | int(data[m + 3]) << 32


def batch_locations(data: np.ndarray, pos: int, count: int) -> np.ndarray:
    """The `count` LOC rows (a view) of the batch ring record at word `pos` of `data`."""
    start = pos + RECORD_HEADER_WORDS
    return data[start : start + count * LOC_WORDS].view(LOC_DTYPE)


def new_announcement(count: int, nh: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An appended ring record's payload for `count` locations and `nh` block hashes, and its two
    parts as views to fill: (payload words, LOC rows, hashes). Its meta words are (count, nh, 0, 0)."""
    payload = np.empty(count * LOC_WORDS + 2 * nh, np.uint32)
    return payload, payload[: count * LOC_WORDS].view(LOC_DTYPE), payload[count * LOC_WORDS :].view(np.uint64)


class Announcement(NamedTuple):
    """Items as an appended ring record announces them: their LOC rows and block hashes, item i's
    hashes being hashes[hash_offsets[i]:hash_offsets[i + 1]] (the rows' `aux` counts them). Items
    read back from disk take the same form."""

    locs: np.ndarray  # LOC_DTYPE rows
    hash_offsets: np.ndarray  # int64, one more than the rows
    hashes: np.ndarray  # uint64

    def subset(self, keep: np.ndarray) -> Announcement:
        """The items where `keep` (a bool mask over the rows), with their hashes, in the same form."""
        idx = np.flatnonzero(keep)
        counts = np.diff(self.hash_offsets)[idx]
        new_offsets = np.zeros(idx.size + 1, np.int64)
        np.cumsum(counts, out=new_offsets[1:])
        pick = (np.repeat(self.hash_offsets[idx], counts) + np.arange(int(new_offsets[-1]))
                - np.repeat(new_offsets[:-1], counts))
        return Announcement(self.locs[idx], new_offsets, self.hashes[pick])


def read_announcement(words: np.ndarray, count: int, nh: int) -> Announcement:
    """The items, copied, of an appended ring record's payload of `count` locations and `nh` hashes."""
    locs = words[: count * LOC_WORDS].view(LOC_DTYPE).copy()
    hashes = words[count * LOC_WORDS : count * LOC_WORDS + 2 * nh].view(np.uint64).copy()
    hash_offsets = np.zeros(count + 1, np.int64)
    np.cumsum(locs["aux"], out=hash_offsets[1:])
    return Announcement(locs, hash_offsets, hashes)


def chunk_meta_words(nbytes: int) -> MetaWords:
    """meta[0..3] of a results ring record of `nbytes` payload bytes."""
    return MetaWords(nbytes, 0, 0, 0)


def chunk_bytes(data: np.ndarray, pos: int) -> int:
    """Payload bytes of the results ring record at word `pos` of `data`."""
    return int(data[pos + RW_META])


RES_HEADER_BYTES = 40
RES_MAX_ERROR_BYTES = 4096
RES_OK, RES_END, RES_BAD = 0, 1, 2  # scan_results outcomes


def res_bytes(num_tokens: int, error_bytes: int = 0, extras_words: int = 0) -> int:
    return (RES_HEADER_BYTES + 4 * (num_tokens + extras_words) + error_bytes + 7) & ~7


@kernel
def _put_res(out, at, item_id, seq, status, writer, tokens, t0, n, err, e0, ne, extras, x0, nx):
    """Write one result record at out[at:] (its extras words extras[x0:x0+nx]); returns its length."""
    size = (RES_HEADER_BYTES + 4 * (n + nx) + ne + 7) & ~7
    out[at : at + size] = 0
    w32 = out[at : at + RES_HEADER_BYTES].view(np.uint32)
    w64 = out[at : at + RES_HEADER_BYTES].view(np.uint64)
    w32[0] = size
    w64[1] = item_id
    w64[2] = seq
    w32[6] = status
    w32[7] = writer
    w32[8] = n
    w32[9] = ne | (nx << 16)
    if n > 0:
        memcpy(out[at + RES_HEADER_BYTES : at + RES_HEADER_BYTES + 4 * n].view(np.uint32), 0, tokens, t0, n)
    if nx > 0:
        memcpy(out[at + RES_HEADER_BYTES + 4 * n : at + RES_HEADER_BYTES + 4 * (n + nx)].view(np.uint32), 0, extras, x0, nx)
    for i in range(ne):
        out[at + RES_HEADER_BYTES + 4 * (n + nx) + i] = err[e0 + i]
    crc = crc32c_update(crc32c_init(), out, at + 8, at + size)
    w32[1] = crc32c_final(crc)
    return size


@kernel
def encode_results(out, at, item_ids, seqs, writers, status, flat, offsets, first, last):
    """Result records for items first..last-1 (tokens flat[offsets[i]:offsets[i+1]]) from out[at:];
    stops before a record that would not fit. Returns (next item, next byte)."""
    return encode_results_extras(out, at, item_ids, seqs, writers, status, flat, offsets, np.zeros(0, np.uint32),
                                 np.zeros(offsets.size, np.int64), first, last)


@kernel
def encode_results_extras(out, at, item_ids, seqs, writers, status, flat, offsets, xflat, xoffsets, first, last):
    """`encode_results` with each item's extras words xflat[xoffsets[i]:xoffsets[i+1]] (none: equal offsets)."""
    empty = np.zeros(0, np.uint8)
    i = first
    while i < last:
        n = offsets[i + 1] - offsets[i]
        nx = xoffsets[i + 1] - xoffsets[i]
        size = (RES_HEADER_BYTES + 4 * (n + nx) + 7) & ~7
        if at + size > out.size:
            break
        at += _put_res(out, at, item_ids[i], seqs[i], status[i], writers[i], flat, offsets[i], n, empty, 0, 0, xflat,
                       xoffsets[i], nx)
        i += 1
    return i, at


@kernel
def encode_error(out, at, item_id, seq, status, writer, err):
    """One result record with no tokens and an error text (uint8); returns the next byte."""
    tokens = np.zeros(0, np.uint32)
    return at + _put_res(out, at, item_id, seq, status, writer, tokens, 0, 0, err, 0, err.size, tokens, 0, 0)


@kernel
def encode_one(out, at, item_id, seq, status, writer, tokens, extras, err):
    """One result record with its tokens, its extras words and an error text (uint8, may be empty);
    returns the next byte."""
    return at + _put_res(out, at, item_id, seq, status, writer, tokens, 0, tokens.size, err, 0, err.size, extras, 0,
                         extras.size)


@kernel
def _res_valid(buf, at, end, check_crc):
    """Does a whole, well-formed result record (with a matching CRC, when checked) start at buf[at]?"""
    h = buf[at : at + RES_HEADER_BYTES].view(np.uint32)
    size = np.int64(h[0])
    if size % 8 or size < RES_HEADER_BYTES or at + size > end or \
            RES_HEADER_BYTES + 4 * (np.int64(h[8]) + (h[9] >> 16)) + (h[9] & 0xFFFF) > size:
        return False
    return not check_crc or crc32c_final(crc32c_update(crc32c_init(), buf, at + 8, at + size)) == h[1]


@kernel
def scan_results(buf, start, end, out_pos, check_crc):
    """Positions of the result records in buf[start:end]; returns (count, next byte, outcome):
    RES_END at a clean end (zeros or the end), RES_BAD at a torn or corrupt record (see
    `resync_results`), RES_OK when out_pos is full."""
    at = start
    n = 0
    outcome = RES_END
    while at + RES_HEADER_BYTES <= end and n < out_pos.size:
        if buf[at : at + RES_HEADER_BYTES].view(np.uint32)[0] == 0:
            break
        if not _res_valid(buf, at, end, check_crc):
            outcome = RES_BAD
            break
        out_pos[n] = at
        n += 1
        at += buf[at : at + RES_HEADER_BYTES].view(np.uint32)[0]
    if n == out_pos.size:
        outcome = RES_OK
    return n, at, outcome


@kernel
def resync_results(buf, start, end):
    """The first 8-aligned position after `start` where a valid result record (CRC checked)
    begins, or `end` when none does: where a scan goes on past a damaged record."""
    at = start + 8
    while at + RES_HEADER_BYTES <= end:
        if _res_valid(buf, at, end, True):
            return at
        at += 8
    return end


class ResultHead(NamedTuple):
    """The fields of a result record's header that name its item (the result records' table above)."""

    length: int
    item_id: int
    seq: int
    status: int
    writer: int


def result_head(buf: np.ndarray, at: int) -> ResultHead:
    """The header of the result record at buf[at:] (unchecked: a damaged record's header is read
    too, `scan_results` says whether it is whole)."""
    h = buf[at : at + RES_HEADER_BYTES].view(np.uint32)
    h64 = buf[at : at + RES_HEADER_BYTES].view(np.uint64)
    return ResultHead(int(h[0]), int(h64[1]), int(h64[2]), int(h[6]), int(h[7]))


def result_num_tokens(buf: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """Generated tokens (`num_tokens`, bytes 32..35 of the header table above) of the result records
    at buf[pos[i]]: numpy, for the job tally, outside the kernels."""
    at = np.asarray(pos, np.int64) + 32
    return np.ascontiguousarray(buf[at[:, None] + np.arange(4)]).view(np.uint32).ravel()


@kernel
def result_fields(buf, pos, count, item_ids, seqs, writers, status):
    """Columns of the result records at buf[pos[i]]."""
    for i in range(count):
        at = pos[i]
        h = buf[at : at + RES_HEADER_BYTES].view(np.uint32)
        h64 = buf[at : at + RES_HEADER_BYTES].view(np.uint64)
        item_ids[i] = h64[1]
        seqs[i] = h64[2]
        status[i] = h[6]
        writers[i] = h[7]


@kernel
def push_results(ring, buf, pos, first, count):
    """Push result records buf[pos[i]] (i = first..count-1) into a producer's result ring, without
    waiting; returns (records pushed, wake): stops at the first that does not fit yet.

    The producer reads this ring and writes its tail word: a tail no reader could have written (ahead
    of the head, more than a lap behind it, odd) closes the ring (`mark_closed`, CLOSE_BAD_TAIL: the
    producer's next wait raises RingClosed, so wake is True) and pushes nothing. Nothing is pushed
    into a closed ring. The geometry is the ring array's own (`layout.py`), so no header word a
    producer rewrote moves a write outside the ring."""
    h = ring[:HEADER_BYTES].view(np.int64)
    w = ring[HEADER_BYTES:].view(np.uint32)
    w64 = ring[HEADER_BYTES:].view(np.uint64)
    cap = w.size
    max_record = max_record_words(cap)
    if h[H_CLOSED] != 0:
        return 0, False
    head = h[H_HEAD]
    tail = load_acquire(h, H_TAIL)
    if (head | tail) & 1 or tail > head or head - tail > cap:
        mark_closed(ring, CLOSE_BAD_TAIL)
        return 0, True
    h[H_TAIL_CACHE] = tail
    words = buf.view(np.uint32)
    i = first
    while i < count:
        at = pos[i]
        r = buf[at : at + RES_HEADER_BYTES].view(np.uint32)
        r64 = buf[at : at + RES_HEADER_BYTES].view(np.uint64)
        ntok = r[8]
        nerr = r[9] & 0xFFFF
        nx = r[9] >> 16
        payload = ntok + nx + (nerr + 3) // 4
        size = (RECORD_HEADER_WORDS + payload + 1) & ~1
        if size > max_record:
            break
        skip = reserve(h, cap, head, size)
        if skip == NO_SPACE:
            break
        head = write_record(w, w64, h, head, skip, size, words, (at + RES_HEADER_BYTES) // 4, payload, r64[1],
                             r[6], ntok, nx, nerr)
        i += 1
    store_release(h, H_HEAD, head)
    return i - first, claim_waiter(h, H_CONSUMER_WAITING, H_NUM_PUSHED, i - first)
