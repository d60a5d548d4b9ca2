"""The SPSC ring's numba kernels (layout: `layout.py`; reference model: `reference.py`).

Every kernel takes the whole segment as a uint8 array `buf` and views its header (int64) and data
region (uint32, uint64) inside, so one array crosses the Python/numba boundary per call. The
producer calls `push`/`push_many`, the consumer `pop_many`/`peek_many` + `release`.

Ordering: the producer writes a record's payload and header, zeroes the commit word just past it,
then release-stores the record's commit word; the consumer acquire-loads that word, so it needs
neither the head nor a lock. `head` and `tail` are published (release) at the end of a call and
every PUBLISH_EVERY records of a batch.

Geometry comes from the array, not the header (`layout.py`): the data region is `w.size` words (a
power of two for a segment `Ring` attached) and the largest record `max_record_words(w.size)`.
Positions taken from words the peer writes are masked by that capacity, and a read walks at most
one lap, so a peer that rewrites the header or a record makes a kernel return CORRUPT (or FULL),
never read or write outside the ring. A side about to sleep sets its `*_waiting` flag with an
atomic exchange and looks again; the other side, after publishing, counts its records with a
locked add (a full barrier), checks the flag and claims it with a CAS, so exactly one doorbell ring
answers one sleep (the Dekker pattern; a missed ring is still bounded by the sleeper's deadline).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .atomics import (
    compare_and_swap,
    cpu_pause,
    exchange,
    fetch_add,
    load_acquire,
    load_relaxed,
    memcpy,
    store_release,
)
from .layout import (
    CORRUPT,
    EMPTY,
    FULL,
    H_CONSUMER_WAITING,
    H_HEAD,
    H_NEXT_KEY,
    H_NUM_FULL,
    H_NUM_POPPED,
    H_NUM_PUSHED,
    H_PRODUCER_WAITING,
    H_ROWS_DONE,
    H_TAIL,
    H_TAIL_CACHE,
    HEADER_BYTES,
    OK,
    OK_WAKE,
    RECORD_HEADER_WORDS,
    SENTINEL_WORDS,
    TOO_LARGE,
    WRAP,
    max_record_words,
)

PUBLISH_EVERY = 256
NO_SPACE = -1  # reserve: the record does not fit yet


@kernel
def claim_waiter(h, flag_index, counter_index, count):
    """After publishing: count `count` records, then True when the peer sleeps and must be woken.
    The count is a locked add on this side's own cache line: the full barrier the Dekker pattern
    needs between publishing and reading the peer's flag, cheaper than an mfence, no shared line."""
    fetch_add(h, counter_index, count)
    if load_relaxed(h, flag_index) == 0:
        return False
    return compare_and_swap(h, flag_index, 1, 0) == 1


@kernel
def reserve(h, cap, head, size):
    """Words to skip before a record of `size` words (a wrap), or NO_SPACE when it does not fit yet."""
    off = head & (cap - 1)
    skip = 0
    if off + size > cap:
        skip = cap - off
    need = head + skip + size + SENTINEL_WORDS
    if need - h[H_TAIL_CACHE] > cap:
        h[H_TAIL_CACHE] = load_acquire(h, H_TAIL)
        if need - h[H_TAIL_CACHE] > cap:
            return NO_SPACE
    return skip


@kernel
def write_record(w, w64, h, head, skip, size, tokens, src, n, key, m0, m1, m2, m3):
    """Write and commit one record at `head` (after `skip` words); return the new head."""
    return write_record_tail(w, w64, h, head, skip, size, tokens, src, n, tokens[:0], key, m0, m1, m2, m3)


@kernel
def write_record_tail(w, w64, h, head, skip, size, tokens, src, n, tail, key, m0, m1, m2, m3):
    """`write_record` of tokens[src:src + n] followed by the `tail` words (in its payload too)."""
    cap = w.size
    start = (head + skip) & (cap - 1)
    w[start + 1] = n + tail.size
    w64[(start >> 1) + 1] = key
    w[start + 4] = m0
    w[start + 5] = m1
    w[start + 6] = m2
    w[start + 7] = m3
    if n > 0:
        memcpy(w, start + RECORD_HEADER_WORDS, tokens, src, n)
    if tail.size > 0:
        memcpy(w, start + RECORD_HEADER_WORDS + n, tail, 0, tail.size)
    w[(start + size) & (cap - 1)] = 0  # sentinel: the next commit word reads "not yet"
    h[H_NEXT_KEY] = key + 1  # before the commit: a producer killed after it never reuses the key
    store_release(w, start, size)
    if skip > 0:
        store_release(w, head & (cap - 1), WRAP)
    return head + skip + size


@kernel
def push(buf, tokens, key, m0, m1, m2, m3):
    """Push one record; return OK, OK_WAKE (ring the consumer's doorbell), FULL or TOO_LARGE."""
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    w64 = buf[HEADER_BYTES:].view(np.uint64)
    n = tokens.size
    size = (RECORD_HEADER_WORDS + n + 1) & ~1
    if size > max_record_words(w.size):
        return TOO_LARGE
    head = h[H_HEAD]
    skip = reserve(h, w.size, head, size)
    if skip == NO_SPACE:
        h[H_NUM_FULL] += 1
        return FULL
    head = write_record(w, w64, h, head, skip, size, tokens, 0, n, key, m0, m1, m2, m3)
    store_release(h, H_HEAD, head)
    if claim_waiter(h, H_CONSUMER_WAITING, H_NUM_PUSHED, 1):
        return OK_WAKE
    return OK


@kernel
def push_many(buf, flat, offsets, key0, meta, first, last):
    """Push records first..last-1 (tokens flat[offsets[i]:offsets[i+1]], key key0+i, meta[i]).

    `meta` has one row per record, or a single row shared by all of them.

    Returns (records pushed, status, wake): status is OK when all went, FULL
    when the ring filled first, TOO_LARGE when record first+pushed cannot fit.
    """
    return push_many_tail(buf, flat, offsets, flat[:0], key0, meta, first, last)


@kernel
def push_many_tail(buf, flat, offsets, tail, key0, meta, first, last):
    """`push_many` with the same `tail` words after each record's tokens (its request options:
    written in place, not copied into a new flat first)."""
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    w64 = buf[HEADER_BYTES:].view(np.uint64)
    head = h[H_HEAD]
    cap = w.size
    max_record = max_record_words(cap)
    wake = False
    status = OK
    i = first
    while i < last:
        lo = offsets[i]
        n = offsets[i + 1] - lo
        size = (RECORD_HEADER_WORDS + n + tail.size + 1) & ~1
        if size > max_record:
            status = TOO_LARGE
            break
        skip = reserve(h, cap, head, size)
        if skip == NO_SPACE:
            h[H_NUM_FULL] += 1
            status = FULL
            break
        r = i if meta.shape[0] > 1 else 0
        head = write_record_tail(w, w64, h, head, skip, size, flat, lo, n, tail, key0 + i, meta[r, 0], meta[r, 1],
                                 meta[r, 2], meta[r, 3])
        i += 1
        if (i - first) % PUBLISH_EVERY == 0:
            store_release(h, H_HEAD, head)
            if claim_waiter(h, H_CONSUMER_WAITING, H_NUM_PUSHED, PUBLISH_EVERY):
                wake = True
    store_release(h, H_HEAD, head)
    if claim_waiter(h, H_CONSUMER_WAITING, H_NUM_PUSHED, (i - first) % PUBLISH_EVERY):
        wake = True
    return i - first, status, wake


@kernel
def next_record(w, tail):
    """(word offset, new tail, status) of the committed record at `tail`, following a wrap."""
    cap = w.size
    off = tail & (cap - 1)
    c = load_acquire(w, off)
    if c == 0:
        return off, tail, EMPTY
    if c == WRAP:
        tail += cap - off
        off = 0
        c = load_acquire(w, 0)
        if c == 0 or c == WRAP:
            return off, tail, CORRUPT
    # Check the record right after reading it: a torn or foreign record stops here (an odd offset
    # is a tail word no consumer wrote).
    if (c | off) & 1 or c < RECORD_HEADER_WORDS or c > max_record_words(cap) or off + c > cap:
        return off, tail, CORRUPT
    if RECORD_HEADER_WORDS + w[off + 1] > c:
        return off, tail, CORRUPT
    return off, tail + c, OK


@kernel
def pop_many(buf, out_tokens, out_offsets, out_keys, out_meta, max_records):
    """Copy up to `max_records` records out and consume them.

    out_offsets[i]:out_offsets[i+1] delimit record i in out_tokens (out_offsets[0]
    is set to 0); stops early when out_tokens cannot take the next record.
    Returns (records, status, wake): status OK, EMPTY (ring drained) or CORRUPT.
    """
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    w64 = buf[HEADER_BYTES:].view(np.uint64)
    cap = w.size
    tail = h[H_TAIL]
    published = tail  # the producer writes at most one lap past the tail it has seen
    limit = min(max_records, out_keys.size, out_meta.shape[0], out_offsets.size - 1)
    used = 0
    n = 0
    status = OK
    out_offsets[0] = 0
    while n < limit:
        off, new_tail, st = next_record(w, tail)
        if st != OK:
            status = st
            break
        ntok = w[off + 1]  # read once: checked here, then used
        if new_tail - published > cap or off + RECORD_HEADER_WORDS + ntok > cap:
            status = CORRUPT
            break
        if used + ntok > out_tokens.size:
            break
        if ntok > 0:
            memcpy(out_tokens, used, w, off + RECORD_HEADER_WORDS, ntok)
        out_keys[n] = w64[(off >> 1) + 1]
        for j in range(4):
            out_meta[n, j] = w[off + 4 + j]
        used += ntok
        n += 1
        out_offsets[n] = used
        tail = new_tail
        if n % PUBLISH_EVERY == 0:
            store_release(h, H_TAIL, tail)
            published = tail
    store_release(h, H_TAIL, tail)
    return n, status, claim_waiter(h, H_PRODUCER_WAITING, H_NUM_POPPED, n)


@kernel
def peek_many(buf, out_positions, max_records):
    """Zero-copy read: word positions of up to `max_records` committed records after the tail.

    Record i's tokens are data[pos + 8 : pos + 8 + data[pos + 1]]. Nothing is
    consumed until `release(buf, new_tail, count)`. Returns (records, new_tail, status).
    """
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    tail = h[H_TAIL]
    start = tail
    limit = min(max_records, out_positions.size)
    n = 0
    status = OK
    while n < limit:
        off, new_tail, st = next_record(w, tail)
        if st != OK:
            status = st
            break
        if new_tail - start > w.size:  # past one lap: records no producer could have made
            status = CORRUPT
            break
        out_positions[n] = off
        n += 1
        tail = new_tail
    return n, tail, status


@kernel
def release(buf, new_tail, count):
    """Consume through `new_tail` (from `peek_many`); True when the producer must be woken."""
    h = buf[:HEADER_BYTES].view(np.int64)
    store_release(h, H_TAIL, new_tail)
    return claim_waiter(h, H_PRODUCER_WAITING, H_NUM_POPPED, count)


@kernel
def count_done(buf, rows):
    """Batch ring consumer: `rows` more done rows (layout.py `rows_done`); True: wake the producer.
    Fewer (records about to be released) wake nobody: claiming the flag would lose the release's ring."""
    h = buf[:HEADER_BYTES].view(np.int64)
    if rows <= 0:
        fetch_add(h, H_ROWS_DONE, rows)
        return False
    return claim_waiter(h, H_PRODUCER_WAITING, H_ROWS_DONE, rows)


@kernel
def set_waiting(buf, flag_index):
    """Announce a sleep (atomic exchange: a full barrier); the caller then looks once more."""
    h = buf[:HEADER_BYTES].view(np.int64)
    exchange(h, flag_index, 1)


@kernel
def clear_waiting(buf, flag_index):
    h = buf[:HEADER_BYTES].view(np.int64)
    exchange(h, flag_index, 0)


@kernel
def readable(buf):
    """True when a committed record (or a wrap marker) waits at the tail."""
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    return load_acquire(w, h[H_TAIL] & (w.size - 1)) != 0


@kernel
def writable_words(buf):
    """Free words from the producer's point of view (fresh tail, sentinel reserved)."""
    h = buf[:HEADER_BYTES].view(np.int64)
    h[H_TAIL_CACHE] = load_acquire(h, H_TAIL)
    return (buf.size - HEADER_BYTES) // 4 - (h[H_HEAD] - h[H_TAIL_CACHE]) - SENTINEL_WORDS


@kernel
def spin_until_readable(buf, spins):
    """Spin (with pause) up to `spins` times for a record; True when one is there."""
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    mask = w.size - 1
    for _ in range(spins):
        if load_acquire(w, load_relaxed(h, H_TAIL) & mask) != 0:
            return True
        cpu_pause()
    return False


@kernel
def spin_until_writable(buf, num_tokens, spins):
    """Spin (with pause) up to `spins` times until a record of `num_tokens` fits; True when it does."""
    h = buf[:HEADER_BYTES].view(np.int64)
    cap = (buf.size - HEADER_BYTES) // 4
    size = (RECORD_HEADER_WORDS + num_tokens + 1) & ~1
    for _ in range(spins):
        if reserve(h, cap, h[H_HEAD], size) != NO_SPACE:
            return True
        cpu_pause()
    return False


@kernel
def recover_head(buf):
    """A (re)attaching producer: move `head` past every committed record and return it.

    A producer killed inside a batch may have committed records it had not yet
    published in `head` (and the consumer may already have read them): the
    walk from max(head, tail) to the first zero commit word finds the true
    end, so the new producer neither overwrites nor re-sends them. Bounded by
    one lap.
    """
    h = buf[:HEADER_BYTES].view(np.int64)
    w = buf[HEADER_BYTES:].view(np.uint32)
    cap = w.size
    tail = load_acquire(h, H_TAIL)
    pos = max(h[H_HEAD], tail)
    for _ in range(cap // RECORD_HEADER_WORDS + 1):
        off, new_pos, status = next_record(w, pos)
        if status != OK or new_pos - tail > cap:
            break
        pos = new_pos
    h[H_TAIL_CACHE] = tail
    store_release(h, H_HEAD, pos)
    return pos


@kernel
def claim_word(buf, index, expected, desired):
    """Compare-and-swap header word `index` from `expected` to `desired`; returns the value seen."""
    h = buf[:HEADER_BYTES].view(np.int64)
    return compare_and_swap(h, index, expected, desired)
