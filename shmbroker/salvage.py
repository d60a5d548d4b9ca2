"""Salvage: what a dead broker's ingest rings still hold goes to the backlog before its shm is swept.

A producer's `submit` returns once the item is in its ingest ring (shared memory). When the whole
broker dies, items not yet drained sit in rings that outlive it (until the next supervisor sweeps
the instance's names). The next supervisor, before sweeping, attaches each ingest ring listed in
the shm manifest (role `p<producer id>i`), closes it (`ring/wire.close_ring`: its producer now
sees it full and its consumer dead, so the client reconnects to the new broker), waits a moment
for a push that had reserved its room, and appends every committed record to the backlog
(writer 0), with the item ids the producer was given.
"""

from __future__ import annotations

import logging
import re
import time

import numpy as np

from . import durable
from .errors import DiskFull
from .ingest import BATCH_RECORDS, BacklogAppender
from .ring import layout as L
from .ring.owner import Manifest
from .ring.shm import Segment
from .ring.wire import close_ring, peek_closed, set_closed_tail

SALVAGE_GRACE_SECONDS = 0.02
SALVAGE_RETRY_SECONDS = 0.2
log = logging.getLogger("shmbroker.salvage")
SMALL_SEGMENT_BYTES = 64 << 10  # the smallest segment a salvage on a full disk makes
INGEST_RING_RE = re.compile(r"\.p([0-9]+)i$")


def _fitting_segment_bytes(root, segment_bytes: int) -> int | None:
    """A segment size that fits the free space now (the space reserve released), or None."""
    durable.release_reserve(root)
    free = durable.free_bytes(root)
    size = min(segment_bytes, (free * 3 // 4) // SMALL_SEGMENT_BYTES * SMALL_SEGMENT_BYTES)
    return size if size >= SMALL_SEGMENT_BYTES else None


def salvage(backlog, cfg) -> int:
    """Append what a dead broker's ingest rings still hold to the backlog (writer 0); how many items."""
    try:
        names = Manifest(cfg.data_dir).names()["segments"]
    except ValueError:
        return 0
    rings = []
    for name in names:
        m = INGEST_RING_RE.search(name)
        if m is None:
            continue
        try:
            seg = Segment.attach(name)
        except (FileNotFoundError, ValueError):
            continue
        rings.append((int(m.group(1)), seg))
    if not rings:
        return 0
    for _, seg in rings:
        close_ring(seg.buf)
    time.sleep(SALVAGE_GRACE_SECONDS)  # a push that reserved its room before the close lands
    writer = backlog.writer(0, fsync=cfg.fsync, fsync_interval_ms=cfg.fsync_interval_ms)
    appender = BacklogAppender(writer, cfg.block_tokens)
    positions = np.empty(BATCH_RECORDS, np.int64)
    shrunk = False
    try:
        for producer_id, seg in rings:
            h = seg.buf[: L.HEADER_BYTES].view(np.int64)
            if int(h[L.H_CLOSED_REASON]):
                continue  # closed because its producer broke it: the broker reads no more of it
            words = (seg.buf.size - L.HEADER_BYTES) // 4
            first = int(h[L.H_CLOSED_TAIL])
            while True:
                before = int(h[L.H_CLOSED_TAIL])
                n, tail = peek_closed(seg.buf, positions, positions.size)
                # a producer that rewrites its header cannot keep this loop going: at most one
                # ring's worth, always forward
                if n == 0 or int(tail) <= before or int(tail) - first > words:
                    break
                try:
                    appender.append(producer_id, seg.buf, positions, n)
                except DiskFull:
                    # no room for a whole segment: the broker cannot start to free any, so once go on
                    # in segments that fit what is free (the space reserve given up too)
                    size = _fitting_segment_bytes(backlog.root, cfg.segment_bytes)
                    if shrunk or size is None:
                        raise
                    writer.shrink_segments(size)
                    shrunk = True
                    continue
                except ValueError:  # a record larger than the small segments: wait for room as for a full disk
                    if not shrunk:
                        raise
                    raise DiskFull("no room for a segment as large as a salvaged record") from None
                set_closed_tail(seg.buf, tail)
    finally:
        writer.close()
        for _, seg in rings:
            seg.close()
    return appender.num_items


def salvage_when_room(backlog, cfg) -> int:
    """`salvage` at a start; on a full disk wait for room (the rings keep their items meanwhile,
    and what was appended is not appended again). The count is of the last try's items."""
    warned = 0.0
    while True:
        try:
            return salvage(backlog, cfg)
        except DiskFull as exc:
            now = time.monotonic()
            if now - warned > 5.0:
                log.warning("salvage: %s; waiting for room (the rings keep their items)", exc)
                warned = now
            time.sleep(SALVAGE_RETRY_SECONDS)


def salvage_at_stop(cfg) -> bool:
    """At a stop: what the ingest processes did not drain (one died during the stop, or the disk was
    full) goes to the backlog before the shared memory is unlinked. False when it could not: the
    shared memory must then stay (listed in the manifest) for the next start to salvage."""
    from .spill.store import Backlog

    try:
        backlog, _ = Backlog.open(cfg.data_dir, segment_bytes=cfg.segment_bytes)
        try:
            n = salvage(backlog, cfg)
        finally:
            backlog.close()
    except Exception as exc:  # a full disk, or worse: nothing accepted is unlinked
        log.warning("stop: the ingest rings could not be salvaged (%s); their shared memory is left for the "
                    "next start to salvage", exc)
        return False
    if n:
        log.info("stop: %d items the ingest processes left in their rings salvaged to the backlog", n)
    return True
