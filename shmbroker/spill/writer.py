"""The backlog writer: one per ingest process, appending to its own segment files.

`append_many` writes a batch in shape order (model, prefix key, length band:
records of one shape land next to each other, so a batch is read back with
few sequential reads) and returns each item's (sequence number, segment,
offset) in input order. Records are staged in memory in runs of up to
STAGING_BYTES and each run is written with one `pwrite` whose first length
word is 0, then that word is written: the run is committed (in the page
cache) when that last 4-byte write lands (`runs.py`: two staging buffers and
one write thread); `append_many` returns when all its runs have landed. What happens next depends on `fsync`:

| fsync    | the data is on disk                        | survives                                  |
|----------|--------------------------------------------|-------------------------------------------|
| never    | when the kernel writes the page cache back | process crash, kill -9 (not power loss)   |
| interval | within `fsync_interval_ms` (a sync thread) | also power loss, except the last interval |
| always   | before `append_many` returns               | also power loss                           |

A full segment is sealed (its header index written, the file fsynced and cut
to its used length). Before writing a batch, the writer allocates every new
segment the batch can need (spare files with every block allocated), so a
full disk fails there with `DiskFull` before anything of the batch is
written (all or nothing: the ingest side keeps the batch in its ring, which
is back-pressure on the producers), and the next call tries again.

Sequence numbers are never reused, even after a power loss took records
whose results or acks reached the disk: `reservation.py` says how (the
`RESERVED` file, raised by RESERVE_SEQS past a batch before it takes numbers).

All of it goes through `disk/durable.py`, the seam the power-loss simulation
(`tests/spill/test_power_loss.py`) watches.
"""

from __future__ import annotations

import errno
import os
import threading
from pathlib import Path

import numpy as np

from ..config.broker import FSYNC_POLICIES, BrokerConfig
from ..disk import durable
from ..disk.lockfile import flock_exclusive
from .layout import (
    ITEM_DTYPE,
    MIN_SEGMENT_BYTES,
    R64_SEQ,
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    max_tokens,
    record_bytes,
)
from .records import segments_needed, write_records
from .reservation import continue_at, lower_to, raise_to
from .runs import RunLander
from .segment import CLEAN_FILE, SegmentFile, allocate_spare, idx_bytes, write_clean_marker, write_idx

PAGE_BYTES = 4096
SEAL_QUEUE_MAX = 2  # segments waiting for the sync thread to seal them; more seal inline
STAGING_BYTES = 2 << 20  # one run (pwrite) at most, unless a single record is larger
RESERVE_SEQS = 1 << 20  # a reservation reaches this far past the batch that raises it



class SegmentWriter:
    """Appends records for one writer; continue where recovery left off (`Backlog.writer`)."""

    def __init__(
        self,
        directory: Path,
        writer: int,
        *,
        next_seq: int,
        active: SegmentFile | None,
        active_end: int,
        active_offsets: list[np.ndarray],
        segment_bytes: int = BrokerConfig.segment_bytes,
        fsync: str = BrokerConfig.fsync,
        fsync_interval_ms: float = BrokerConfig.fsync_interval_ms,
        sparse: bool = False,
    ):
        if fsync not in FSYNC_POLICIES:
            raise ValueError(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        if segment_bytes < MIN_SEGMENT_BYTES or segment_bytes % PAGE_BYTES:
            raise ValueError(f"segment_bytes must be a multiple of {PAGE_BYTES} and >= {MIN_SEGMENT_BYTES}, got {segment_bytes}")
        if fsync_interval_ms <= 0:
            raise ValueError(f"fsync_interval_ms must be > 0, got {fsync_interval_ms}")
        self.directory = Path(directory)
        self.writer = writer
        self._lock_fd = _lock_writer_dir(self.directory, writer)
        self.segment_bytes = segment_bytes
        self.max_tokens = max_tokens(segment_bytes)
        self.fsync = fsync
        self.sparse = sparse
        self.next_seq = next_seq
        self._active = active
        self._end = active_end
        self._offsets = active_offsets  # record offsets of the active segment, for its seal index
        self._lock = threading.Lock()
        self._error: OSError | None = None
        self._stop = threading.Event()
        self._thread = None
        self.num_segments_created = 0
        self.num_unindexed_seals = 0  # seals whose index did not fit on a full disk
        self.num_seq_jumps = 0  # starts above a reservation of an earlier boot (or a damaged one)
        # a recovered segment is dirty: a killed writer's unsynced pages get synced too
        self._runs = RunLander(writer, dirty=active is not None)
        self._sealing: list[tuple[SegmentFile, np.ndarray, int]] = []  # rolled away from, not yet sealed
        self._spares: list[Path] = []  # allocated, unnamed segment files for the batch being written
        self._reserved = self._continue_above_reservation()
        durable.unlink(self.directory / CLEAN_FILE, missing_ok=True)  # from here on, only a scan can be trusted
        durable.fsync_dir(self.directory)
        if fsync == "interval":
            self._interval_seconds = fsync_interval_ms / 1000.0
            self._thread = threading.Thread(target=self._sync_loop, name=f"fsync-w{writer}", daemon=True)
            self._thread.start()

    def _continue_above_reservation(self) -> int:
        """Where to start, from RESERVED (sets next_seq and the boot's floor); returns the reservation in force."""
        recovered = self.next_seq
        start, self._floor, reserved = continue_at(self.directory, recovered, RESERVE_SEQS)
        self.num_seq_jumps += start != recovered
        if self._active is not None and start != self._active_next():
            # numbers of the active segment's lost tail may have results or acks on disk (or recovery
            # started above its last record): a new segment above them, as sequence numbers run
            # without gaps inside a segment
            offsets = np.concatenate(self._offsets) if self._offsets else np.empty(0, np.int64)
            self._seal(self._active, offsets, self._end)
            self._active, self._end, self._offsets = None, SEGMENT_HEADER_BYTES, []
        self.next_seq = start
        return max(reserved, start)

    def _active_next(self) -> int:
        """The sequence number the active segment's next record must have: one past its last."""
        offsets = [o for o in self._offsets if o.size]
        if not offsets:
            return self._active.first_seq
        last = int(max(int(o.max()) for o in offsets))
        return int(self._active.buf[last : last + RECORD_HEADER_BYTES].view(np.uint64)[R64_SEQ]) + 1

    def _raise_reservation(self, top: int) -> None:
        """Make `top` and everything below it usable: RESERVED says so on disk first."""
        reserved = top + RESERVE_SEQS
        raise_to(self.directory, self._floor, reserved)
        self._reserved = reserved

    # -- appending -----------------------------------------------------------------

    def append_many(self, flat: np.ndarray, offsets: np.ndarray, items: np.ndarray, *, cluster: bool = True):
        """Append records (item i = flat[offsets[i]:offsets[i+1]], metadata items[i]).

        Returns (seqs, segments, record_offsets), uint64/uint64/int64 arrays in
        input order. Raises ValueError for a record larger than a segment (before
        writing anything), DiskFull when a new segment cannot be allocated.
        """
        self._raise_sync_error()
        count = offsets.size - 1
        if items.dtype != ITEM_DTYPE or items.shape != (count,):
            raise TypeError(f"items must be a ({count},) array of spill.layout.ITEM_DTYPE")
        sizes = np.diff(offsets)
        if count and int(sizes.max()) > self.max_tokens:
            raise ValueError(f"record {int(np.argmax(sizes > self.max_tokens))} of {int(sizes.max())} tokens exceeds a segment ({self.max_tokens} tokens)")
        if cluster:
            order = np.lexsort((items["shape_band"], items["prefix_key"], items["model"])).astype(np.int64)
        else:
            order = np.arange(count, dtype=np.int64)
        if count:
            self._reserve(sizes, order)  # all or nothing: DiskFull here writes nothing
            if self.next_seq + count > self._reserved:
                self._raise_reservation(self.next_seq + count)
        seqs = np.empty(count, np.uint64)
        rec_offsets = np.empty(count, np.int64)
        segments = np.empty(count, np.uint64)
        done = 0
        try:
            while done < count:
                if self._active is None or self._end + record_bytes(int(sizes[order[done]])) > self._active.size:
                    self._wait_writes()  # the runs in flight go to the segment being sealed
                    self._roll()
                seg = self._active
                n, end = self._write_run(seg, flat, offsets, items, order, done, sizes, seqs, rec_offsets)
                assert n > 0
                written = order[done : done + n]
                segments[written] = seg.first_seq
                self._offsets.append(rec_offsets[written].copy())
                self._end = end
                self.next_seq += n
                done += n
        finally:
            self._wait_writes()  # committed when this returns
        if self.fsync == "always":
            self.sync()
        return seqs, segments, rec_offsets

    def _write_run(self, seg, flat, offsets, items, order, done, sizes, seqs, rec_offsets) -> tuple[int, int]:
        """Stage records in memory, pwrite them with the run's first length word 0, then write it.

        Writing through the shared mapping instead costs a write fault and an
        mtime update (a journal handle) per page, which contend with the sync
        thread's fdatasync; one pwrite per run does that once.
        """
        room = seg.size - self._end
        want = min(room, max(STAGING_BYTES, record_bytes(int(sizes[order[done]]))))
        slot, staging = self._runs.buffer(want)
        n, used = write_records(staging, 0, want, flat, offsets, items, order, done, self.next_seq, seqs, rec_offsets)
        self._runs.submit(slot, seg.fd, staging[:used], self._end)
        rec_offsets[order[done : done + n]] += self._end
        return n, self._end + used

    def _wait_writes(self) -> None:
        """Wait for the runs in flight. A failed write (EIO) leaves a hole behind the writer's
        position: the writer refuses further appends (recovery resynchronises past it)."""
        try:
            self._runs.wait()
        except OSError as exc:
            self._error = exc
            raise

    def _reserve(self, sizes: np.ndarray, order: np.ndarray) -> None:
        """Allocate, before writing, every new segment this batch will need (spare files).

        The count replays the roll decision exactly (same order, same fit rule),
        so a full disk fails here or never, and no spare outlives the batch.
        """
        if self._active is None:
            end, size = self.segment_bytes, self.segment_bytes  # the first record rolls
        else:
            end, size = self._end, self._active.size
        need = segments_needed(sizes[order], end, size, self.segment_bytes)
        while len(self._spares) < need:
            self._spares.append(allocate_spare(self.directory, self.segment_bytes, sparse=self.sparse))

    def _roll(self) -> None:
        """Seal the active segment (if any) and start a new one at next_seq (from a spare)."""
        with self._lock:
            if self._active is not None:
                offsets = np.concatenate(self._offsets) if self._offsets else np.empty(0, np.int64)
                if self._thread is not None and len(self._sealing) < SEAL_QUEUE_MAX:
                    # interval: the sync thread seals it within the interval, off the append path
                    self._sealing.append((self._active, offsets, self._end))
                else:
                    self._seal(self._active, offsets, self._end)
                self._active = None
            spare = self._spares.pop() if self._spares else None
            seg = SegmentFile.create(self.directory, self.writer, self.next_seq, self.segment_bytes, sparse=self.sparse, spare=spare)
            if self.fsync != "never":
                durable.fsync_dir(self.directory)
            self._active, self._end, self._offsets = seg, SEGMENT_HEADER_BYTES, []
            self.num_segments_created += 1

    def _seal(self, seg: SegmentFile, offsets: np.ndarray, end: int) -> None:
        """Sync, cut the file to its used length, write its header index.

        The index is an optimisation: when the disk is too full to write it,
        the segment stays sealed without one and recovery scans it.
        """
        if self.fsync != "never":
            seg.sync()
        index = idx_bytes(seg, offsets, end)
        # keep at least one zero word after the last record inside the file: a reader that looks
        # (read-only, while we write) at the length word past the end finds 0, never past EOF (SIGBUS)
        used = min(seg.size, -(-(end + 8) // PAGE_BYTES) * PAGE_BYTES)
        fd = os.dup(seg.fd)
        seg.close()
        try:
            durable.ftruncate(fd, used)  # give back the preallocated tail (first: it makes room for the index)
        finally:
            os.close(fd)
        if not seg.path.exists():
            return  # reclaimed (all done) before its seal came round
        try:
            idx = write_idx(self.directory, seg.first_seq, index)
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self.num_unindexed_seals += 1
            return
        if not seg.path.exists():
            idx.unlink(missing_ok=True)  # reclaimed meanwhile: no index without its segment

    # -- durability ----------------------------------------------------------------

    def _drain_seals(self) -> None:
        """Seal the segments the writer rolled away from (interval mode: on the sync thread)."""
        while True:
            with self._lock:
                if not self._sealing:
                    return
                seg, offsets, end = self._sealing.pop(0)
            self._seal(seg, offsets, end)

    def sync(self) -> None:
        """Make everything appended so far durable now."""
        self._drain_seals()
        with self._lock:  # held only to pick the file: appends never wait for a flush
            if self._active is None or not self._runs.dirty:
                return
            self._runs.dirty = False
            fd = os.dup(self._active.fd)  # stays valid if the segment is sealed meanwhile
        try:
            durable.fdatasync(fd)
        finally:
            os.close(fd)

    def _sync_loop(self) -> None:
        while not self._stop.wait(self._interval_seconds):
            try:
                self.sync()
            except OSError as exc:  # surfaced on the next append
                self._error = exc
                return

    def _raise_sync_error(self) -> None:
        if self._error is not None:
            raise OSError(self._error.errno, f"backlog write or fsync failed: {self._error.strerror}")

    @property
    def active_segment(self) -> int | None:
        return None if self._active is None else self._active.first_seq

    @property
    def end_offset(self) -> int:
        return self._end

    def shrink_segments(self, segment_bytes: int) -> None:
        """Make the segments this writer starts from now on `segment_bytes` (smaller: a full disk
        that has no room for a whole one, as the salvage at a start may meet), its spares freed.
        Recovery reads each segment's size from its header: segments of mixed sizes are sound."""
        for spare in self._spares:
            durable.unlink(spare, missing_ok=True)
        self._spares.clear()
        self.segment_bytes = segment_bytes
        self.max_tokens = max_tokens(segment_bytes)

    def close(self, clean: bool = True) -> None:
        """Stop the sync thread, make everything durable, leave a clean-shutdown marker (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._wait_writes()
        self._runs.close()
        self._drain_seals()
        for spare in self._spares:
            durable.unlink(spare, missing_ok=True)
        self._spares.clear()
        if self._lock_fd < 0:
            return
        if self._active is None:
            self._lower_reservation()
            self._unlock()
            return
        with self._lock:
            if self.fsync != "never" or clean:
                self._active.sync()
            first = self._active.first_seq
            self._active.close()
            self._active = None
        self._lower_reservation()
        if clean:
            write_clean_marker(self.directory, first, self._end, self.next_seq)
        self._unlock()

    def _lower_reservation(self) -> None:
        """On close: nothing at or above next_seq was handed out (a full disk keeps the higher one)."""
        if self._reserved != self.next_seq and lower_to(self.directory, self._floor, self.next_seq):
            self._reserved = self.next_seq

    def _unlock(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = -1

    def __enter__(self) -> SegmentWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _lock_writer_dir(directory: Path, writer: int) -> int:
    """One live writer per directory: an flock held for the writer's life (a dead process's is released)."""
    fd = flock_exclusive(directory / "LOCK")
    if fd is None:
        raise RuntimeError(f"backlog writer {writer} ({directory}) is held by another live process")
    return fd
