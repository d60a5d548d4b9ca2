"""Salvage: what a dead broker's ingest rings still hold goes to the backlog before its shm is swept.

A producer's `submit` returns once the item is in its ingest ring (shared memory). When the whole
broker dies, items not yet drained sit in rings that outlive it (until the next supervisor sweeps
the instance's names). The next supervisor, before sweeping, attaches each ingest ring listed in
the shm manifest (role `p<producer id>i`), closes it (`ring/closing.close_ring`: its producer now
sees it full and its consumer dead, so the client reconnects to the new broker), waits a moment
for a push that had reserved its room, and appends every committed record to the backlog
(writer 0), with the item ids the producer was given.

A start on a disk that the backlog has filled cannot wait for room (only a running broker frees
any): what does not fit stays in its ring, `salvage_at_start` returns those rings ("left"), the
supervisor keeps them in the shm manifest (`Owner(keep=...)`) and ingest process 0 appends them
(`LeftRings`) once its writer finds room; a stop or a later start salvages what is still there.
"""

from __future__ import annotations

import logging
import re
import time

import numpy as np

from ..disk import durable
from ..errors import DiskFull
from ..ingest.loop import BATCH_RECORDS, BacklogAppender, drain_closed
from ..ring import layout as L
from ..ring.owner import Manifest
from ..ring.shm import Segment
from ..ring.closing import close_ring

SALVAGE_GRACE_SECONDS = 0.02
log = logging.getLogger("shmbroker.supervisor.salvage")
SMALL_SEGMENT_BYTES = 64 << 10  # the smallest segment a salvage on a full disk makes
INGEST_RING_RE = re.compile(r"\.p([0-9]+)i$")


def _fitting_segment_bytes(root, segment_bytes: int) -> int | None:
    """A segment size that fits the free space now (the space reserve released), or None."""
    durable.release_reserve(root)
    free = durable.free_bytes(root)
    size = min(segment_bytes, (free * 3 // 4) // SMALL_SEGMENT_BYTES * SMALL_SEGMENT_BYTES)
    return size if size >= SMALL_SEGMENT_BYTES else None


def salvage(backlog, cfg, left: list[tuple[int, str]] | None = None) -> int:
    """Append what a dead broker's ingest rings still hold to the backlog (writer 0); how many items.
    On a full disk raise DiskFull or, given `left`, add to it (producer id, name) of each ring not
    emptied and return (what was appended is not appended again: the ring's closed tail moved)."""
    try:
        names = Manifest(cfg.data_dir).names()["segments"]
    except ValueError:
        return 0
    rings: list[tuple[int, Segment, str]] = []
    for name in names:
        m = INGEST_RING_RE.search(name)
        if m is None:
            continue
        try:
            seg = Segment.attach(name)
        except (FileNotFoundError, ValueError):
            continue
        rings.append((int(m.group(1)), seg, name))
    if not rings:
        return 0
    for _, seg, _ in rings:
        close_ring(seg.buf)
    time.sleep(SALVAGE_GRACE_SECONDS)  # a push that reserved its room before the close lands
    writer = backlog.writer(0, fsync=cfg.fsync, fsync_interval_ms=cfg.fsync_interval_ms)
    appender = BacklogAppender(writer, cfg.block_tokens)
    append = _Salvager(appender, backlog.root, cfg.segment_bytes)
    positions = np.empty(BATCH_RECORDS, np.int64)
    try:
        for k, (producer_id, seg, _) in enumerate(rings):
            h = seg.buf[: L.HEADER_BYTES].view(np.int64)
            if int(h[L.H_CLOSED_REASON]):
                continue  # closed because its producer broke it: the broker reads no more of it
            try:
                drain_closed(seg.buf, lambda pos, n, p=producer_id, b=seg.buf: append(p, b, pos, n), positions)
            except DiskFull as exc:
                if left is None:
                    raise
                log.warning("salvage: %s", exc)
                left.extend((p, name) for p, s, name in rings[k:]
                            if not int(s.buf[: L.HEADER_BYTES].view(np.int64)[L.H_CLOSED_REASON]))
                break
    finally:
        writer.close()
        for _, seg, _ in rings:
            seg.close()
    return appender.num_items


class _Salvager:
    """`drain_closed` callback of the salvage: append to writer 0; on a full disk once go on in
    segments that fit what is free (the broker cannot start to free any; the space reserve given up too)."""

    def __init__(self, appender: BacklogAppender, root, segment_bytes: int) -> None:
        self.appender = appender
        self.root = root
        self.segment_bytes = segment_bytes
        self.shrunk = False

    def __call__(self, producer_id: int, buf: np.ndarray, positions: np.ndarray, n: int) -> None:
        try:
            self.appender.append(producer_id, buf, positions, n)
            return
        except DiskFull:
            size = _fitting_segment_bytes(self.root, self.segment_bytes)
            if self.shrunk or size is None:
                raise
        self.appender.writer.shrink_segments(size)
        self.shrunk = True
        try:
            self.appender.append(producer_id, buf, positions, n)
        except ValueError:  # a record larger than the small segments: as a full disk
            raise DiskFull("no room for a segment as large as a salvaged record") from None


def salvage_at_start(backlog, cfg) -> tuple[int, list[tuple[int, str]]]:
    """`salvage` at a start, which does not wait for room: (items appended, the rings left with
    items in them for lack of room, as (producer id, name))."""
    left: list[tuple[int, str]] = []
    n = salvage(backlog, cfg, left)
    if left:
        log.warning("salvage: no room on the disk for what %d ingest rings of the last broker hold; they stay "
                    "in shared memory and ingest-0 appends them once there is room", len(left))
    return n, left


def salvage_at_stop(cfg) -> bool:
    """At a stop: what the ingest processes did not drain (one died during the stop, or the disk was
    full) goes to the backlog before the shared memory is unlinked. False when it could not: the
    shared memory must then stay (listed in the manifest) for the next start to salvage."""
    from ..spill.store import Backlog

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
