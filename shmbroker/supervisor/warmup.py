"""Load (or compile) every numba kernel into this process, so that forked children never compile.

`shmbroker warm` runs these to fill numba's on-disk cache; the supervisor runs them before it
forks, so every child starts with the machine code in memory.
"""

from __future__ import annotations

import numpy as np


def warm_rings() -> None:
    """The ring kernels: push, pop, peek, waits, digests."""
    from ..ring import batches, digest, items, layout, spsc

    cap = 1024
    buf = np.zeros(layout.segment_bytes(cap), np.uint8)
    layout.init_header(buf, cap)
    tok = np.arange(4, dtype=np.uint32)
    items.push_item(buf, tok, 0, 1, items.NO_PREFIX, 0)
    offs = np.array([0, 4], np.int64)
    meta = np.zeros((1, layout.META_WORDS), np.uint32)
    spsc.push_many(buf, tok, offs, 1, meta, 0, 1)
    spsc.push_many_tail(buf, tok, offs, tok[:2], 1, meta, 0, 1)
    batches.check_batch(offs, tok.size, 16)
    spsc.push(buf, tok, 2, 0, 0, 0, 0)
    out = np.empty(64, np.uint32)
    spsc.pop_many(buf, out, np.empty(3, np.int64), np.empty(2, np.uint64), np.empty((2, 4), np.uint32), 1)
    pos = np.empty(4, np.int64)
    n, tail, _ = spsc.peek_many(buf, pos, 4)
    acc = np.zeros(4, np.uint64)
    data = buf[layout.HEADER_BYTES :]
    digest.digest_records(data.view(np.uint32), data.view(np.uint64), pos, n, 1, acc)
    digest.digest_tokens(tok, acc)
    spsc.release(buf, tail, n)
    spsc.readable(buf)
    spsc.writable_words(buf)
    spsc.spin_until_readable(buf, 1)
    spsc.spin_until_writable(buf, 4, 1)
    spsc.set_waiting(buf, layout.H_CONSUMER_WAITING)
    spsc.clear_waiting(buf, layout.H_CONSUMER_WAITING)


def warm_pack() -> None:
    """Both policies on a tiny workload (aging on and off), the guard, the trace synthesis."""
    import numpy as np

    from ..pack.contract import Contract, Mode, Shape
    from ..pack.guard import Guard
    from ..pack.packer import ConsumerSpec, Packer
    from ..pack.shapes import shape_items
    from ..workloads import trace

    tokens = np.arange(2000, dtype=np.uint32)
    shapes = shape_items(tokens, np.array([0, 600, 1300, 2000], np.int64), np.array([0, 100, 0], np.int64))
    for mode in Mode:
        for wait in (None, 1.0):
            packer = Packer([ConsumerSpec("a", Contract(4, 4096, 1024), mode),
                             ConsumerSpec("b", Contract(2, 1024, 512), mode)], capacity=8, max_wait_seconds=wait)
            for i in range(len(shapes)):
                packer.add(i, 0.0, int(shapes.lengths[i]), 1, 0, int(shapes.families[i]), shapes.blocks(i),
                           int(shapes.bases[i]))
            while packer.next_batch(0, 5.0) is not None or packer.next_batch(1, 5.0) is not None:
                pass
            packer.add_many(np.arange(len(shapes), dtype=np.uint64), 0.0, shapes, 1)
    Guard(0.1).check(shapes.families, shapes.models, shapes.lengths, Shape(0, int(shapes.families[0]), 1, 700),
                     Contract(4, 4096, 1024))
    from ..pack.groups import WaitingGroups, group_keys

    waiting = WaitingGroups()
    waiting.append(*group_keys(shapes.families, shapes.hash_offsets, shapes.hashes))
    waiting.take(2, 1)
    waiting.append(np.arange(2000, dtype=np.uint64), np.arange(2000, dtype=np.uint64))  # grows
    waiting.take(4000, 1)
    out = np.empty(600, np.uint32)
    trace.synthesise(np.array([1, 2], np.int64), np.array([0, 2], np.int64), np.array([600], np.int64), 512, 100,
                     out, np.array([0, 600], np.int64))


def warm_spill() -> None:
    """A tiny backlog round trip: append, recover (scan and index), gather, collect from a ring."""
    import tempfile

    import numpy as np

    from ..ring import crc, layout
    from ..spill import collect
    from ..spill.layout import ITEM_DTYPE
    from ..spill.store import Backlog

    with tempfile.TemporaryDirectory(prefix="shmb-warm-") as d:
        backlog, _ = Backlog.open(d, segment_bytes=8192)
        with backlog.writer(0, fsync="never") as writer:
            items = np.zeros(3, ITEM_DTYPE)
            writer.append_many(np.arange(1500, dtype=np.uint32), np.array([0, 500, 1000, 1500], np.int64), items)
        backlog.close()
        backlog, _ = Backlog.open(d, segment_bytes=8192)
        rows = backlog.pending()
        backlog.gather(rows, np.empty(1500, np.uint32), np.empty(rows.size + 1, np.int64))
        backlog.close()
    cap = 1024
    buf = np.zeros(layout.segment_bytes(cap), np.uint8)
    layout.init_header(buf, cap)
    data = buf[layout.HEADER_BYTES :]
    collect.collect(data.view(np.uint32), data.view(np.uint64), np.zeros(1, np.int64), 1, 1, 512,
                    np.empty(cap, np.uint32), np.empty(2, np.int64), np.zeros(1, ITEM_DTYPE),
                    np.zeros(len(collect.REFUSALS), np.int64))
    crc.crc32c(np.zeros(16, np.uint8))


def warm_broker() -> None:
    """The kernels of the broker's processes: wire records, closing rings, block hashes of recovered items."""
    from ..ring import closing, layout, wire

    cap = 4096
    ring = np.zeros(layout.segment_bytes(cap), np.uint8)
    layout.init_header(ring, cap)
    out = np.zeros(1024, np.uint8)
    ids = np.arange(2, dtype=np.uint64)
    flat = np.arange(3, dtype=np.uint32)
    offs = np.array([0, 1, 3], np.int64)
    u32 = np.zeros(2, np.uint32)
    _, at = wire.encode_results(out, 0, ids, ids, u32, u32, flat, offs, 0, 2)
    _, at = wire.encode_results_extras(out, at, ids, ids, u32, u32, flat, offs, flat, offs, 0, 2)
    at = wire.encode_error(out, at, np.uint64(5), np.uint64(5), np.uint32(3), np.uint32(0), np.frombuffer(b"x", np.uint8))
    at = wire.encode_one(out, at, np.uint64(6), np.uint64(6), np.uint32(0), np.uint32(0), flat[:2], flat[:3],
                         np.frombuffer(b"", np.uint8))
    pos = np.zeros(8, np.int64)
    n, _, _ = wire.scan_results(out, 0, at, pos, True)
    wire.result_fields(out, pos, n, np.empty(n, np.uint64), np.empty(n, np.uint64), np.empty(n, np.uint32),
                       np.empty(n, np.uint32))
    wire.push_results(ring, out, pos[:n], 0, n)
    closing.close_ring(ring)
    closing.close_ring_for(ring, layout.CLOSE_STOP)
    closing.mark_closed(ring, layout.CLOSE_STOP)
    _, tail = closing.peek_closed(ring, pos, 8)
    closing.set_closed_tail(ring, tail)
    from ..pack.shapes import chain_items

    hash_offsets = np.array([0, 1], np.int64)
    lengths = np.array([600], np.int64)
    zero = np.zeros(1, np.int64)
    families = np.ones(1, np.uint64)
    out = np.zeros(1, np.uint64)
    flat = np.zeros(600, np.uint32)
    readonly = np.frombuffer(bytes(2400), np.uint8).view(np.uint32)  # a read-only segment mapping
    for words in (flat, readonly):
        chain_items(words, zero, lengths, zero, families, 512, hash_offsets, out)


def warm_cluster() -> None:
    """An item's partition (a remote producer's per-item call), writable and read-only tokens."""
    from ..cluster import partition

    tokens = np.arange(1100, dtype=np.uint32)
    partition.partition_of(tokens, None, 0, 8)
    tokens.flags.writeable = False
    partition.partition_of(tokens, 600, 0, 8)
    partition.partitions_of(tokens, np.array([0, 600, 1100], np.int64), num_partitions=8)


def warm_all() -> None:
    from ..ring import seqlock

    seqlock.warm()
    warm_rings()
    warm_spill()
    warm_pack()
    warm_cluster()
    warm_broker()
