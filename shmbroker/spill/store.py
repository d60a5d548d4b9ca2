"""The backlog: recovery at open, pending records, zero-copy reads, acks and reclaim.

`Backlog.open(data_dir)` rebuilds the pending records after any stop without
reading token payloads (`recovery.py`: how each writer's segments are read
back and what damage becomes); records that are done per the ack file are not
pending. Stale temp files are removed.

Layout on disk: `<data_dir>/backlog/` (0700) holds `acks.bin` and one
directory per writer, `w<NNN>/`, with `<first_seq>.seg`, `<first_seq>.idx`
and, after a clean close, `CLEAN`.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import numpy as np

from ..config.broker import BrokerConfig
from ..disk import durable
from .acks import AckFileCorrupt, Acks
from .layout import PENDING_DTYPE, RECORD_HEADER_BYTES, idx_name, segment_name, writer_dir_name
from .records import gather
from .recovery import Recovery, RecoveryReport, WriterState
from .segment import SegmentFile
from .writer import SegmentWriter

DIR_MODE = 0o700
BACKLOG_DIR = "backlog"


class Backlog:
    """The durable backlog of one data directory."""

    def __init__(self, root: Path, segment_bytes: int):
        self.root = root
        self.segment_bytes = segment_bytes
        self.acks = Acks()
        self.readonly = False
        self._pending = np.empty(0, PENDING_DTYPE)
        self._corrupt = np.empty(0, PENDING_DTYPE)
        self._acked_at_open = 0  # sequence numbers recovery found lost and marked done (not yet in the ack file)
        self._writers: dict[int, WriterState] = {}
        self._maps: dict[tuple[int, int], SegmentFile] = {}

    # -- recovery ------------------------------------------------------------------

    @classmethod
    def open(cls, data_dir: str | os.PathLike, *, segment_bytes: int = BrokerConfig.segment_bytes,
             readonly: bool = False, writers: set[int] | None = None) -> tuple[Backlog, RecoveryReport]:
        """Recover the backlog. `readonly`: look without changing anything on disk (no tail cut, no
        index written, nothing reclaimed or set aside), as a scheduler does while ingest processes
        append: a torn or unfinished tail then ends the scan. `writers`: recover only these writers'
        directories (a restarted ingest process recovers its own)."""
        t0 = time.perf_counter()
        root = Path(data_dir) / BACKLOG_DIR
        durable.mkdir(root, DIR_MODE)  # with its parents, each name durable
        for directory in (root.parent, root):
            if directory.stat().st_uid == os.getuid():
                os.chmod(directory, DIR_MODE)
        backlog = cls(root, segment_bytes)
        backlog.readonly = readonly
        report = RecoveryReport()
        if not readonly and writers is None:
            report.temp_files_removed = _remove_temp_files(root)
        try:
            backlog.acks = Acks.load(root)
            report.ack_file = "ok" if (root / "acks.bin").exists() else "missing"
        except AckFileCorrupt as exc:
            backlog.acks = Acks()  # at-least-once: nothing counts as done, everything is redelivered
            report.ack_file = f"corrupt ({exc}); treating nothing as acked"
        backlog.recover_writers(Recovery(backlog.acks, readonly), writers, report)
        if not readonly and writers is None:
            backlog.settle(report)
        report.seconds = time.perf_counter() - t0
        return backlog, report

    def recover_writers(self, recovery: Recovery, writers: set[int] | None, report: RecoveryReport) -> None:
        """Each writer's directory (those of `writers` only, when given) recovered: its state, what it
        holds pending and what failed its CRC, less what is done."""
        pending_parts, corrupt_parts = [], []
        for wdir in sorted(self.root.glob("w[0-9][0-9][0-9]")):
            writer = int(wdir.name[1:])
            if writers is not None and writer not in writers:
                continue
            state, parts, corrupt = recovery.recover_writer(wdir, writer, report)
            self._writers[writer] = state
            pending_parts.extend(parts)
            corrupt_parts.extend(corrupt)
        self._acked_at_open = recovery.acked_at_open
        report.writers = len(self._writers)
        pending = np.concatenate(pending_parts) if pending_parts else np.empty(0, PENDING_DTYPE)
        report.records = int(pending.size)
        report.tokens = int(pending["num_tokens"].sum(dtype=np.uint64)) if pending.size else 0
        self._pending = self._not_done(pending)
        report.pending_records = int(self._pending.size)
        report.pending_tokens = int(self._pending["num_tokens"].sum(dtype=np.uint64)) if self._pending.size else 0
        corrupt = np.concatenate(corrupt_parts) if corrupt_parts else np.empty(0, PENDING_DTYPE)
        self._corrupt = self._not_done(corrupt)
        report.corrupt_records = int(self._corrupt.size)

    def settle(self, report: RecoveryReport) -> None:
        """After a whole recovery that may write: what it found lost is saved as done, and done
        segments are reclaimed."""
        if self._acked_at_open:
            try:  # what recovery found lost is done for good: the results process starts from the file
                self.save_acks()
            except OSError as exc:
                report.ack_file += f"; not saved after recovery ({exc.strerror})"
        report.segments_reclaimed = self.reclaim()

    def next_seqs(self) -> dict[int, int]:
        """Each recovered writer's next sequence number."""
        return {w: s.next_seq for w, s in self._writers.items()}

    def _not_done(self, recs: np.ndarray) -> np.ndarray:
        """The records of `recs` the ack file does not mark done."""
        keep = np.ones(recs.size, bool)
        for writer in self._writers:
            mine = recs["writer"] == writer
            keep[mine] = ~self.acks.done_mask(writer, recs["seq"][mine])
        return recs[keep]

    def pending(self) -> np.ndarray:
        """Records recovered at open that were not done (PENDING_DTYPE)."""
        return self._pending

    def corrupt(self) -> np.ndarray:
        """Records recovered at open, not done, that failed their CRC but still name their item
        (PENDING_DTYPE): each is answered `corrupt`, never run."""
        return self._corrupt

    def writer(
        self,
        writer: int,
        *,
        fsync: str = BrokerConfig.fsync,
        fsync_interval_ms: float = BrokerConfig.fsync_interval_ms,
        sparse: bool = False,
    ) -> SegmentWriter:
        """The writer `writer`, continuing after its last recovered record."""
        wdir = self.root / writer_dir_name(writer)
        durable.mkdir(wdir, DIR_MODE)
        state = self._writers.setdefault(writer, WriterState(writer, []))
        active = None
        if state.segments and not (wdir / idx_name(state.segments[-1])).exists():
            # the newest segment is unsealed: continue in it (a sealed one makes the writer start a new one)
            active = SegmentFile.open(wdir / segment_name(state.segments[-1]), writable=True)
        # Never below a number the ack file marks done (a power loss can take the last
        # records' pages but keep their acks): a new record there would vanish. Sequence
        # numbers run without gaps inside a segment, so a jump starts a new one.
        next_seq = max(state.next_seq, self.acks.high(writer))
        if active is not None and next_seq != state.next_seq:
            active.close()
            active = None
        return SegmentWriter(
            wdir,
            writer,
            next_seq=next_seq,
            active=active,
            active_end=state.active_end,
            active_offsets=list(state.active_offsets),
            segment_bytes=self.segment_bytes,
            fsync=fsync,
            fsync_interval_ms=fsync_interval_ms,
            sparse=sparse,
        )

    def segment(self, writer: int, first_seq: int) -> SegmentFile:
        """A read-only mapping of a segment (cached)."""
        where = (writer, first_seq)
        seg = self._maps.get(where)
        if seg is None or seg.fd < 0:
            seg = SegmentFile.open(self.root / writer_dir_name(writer) / segment_name(first_seq))
            self._maps[where] = seg
        return seg

    def forget_segment(self, writer: int, first_seq: int) -> None:
        """Unmap a segment `segment()` mapped (its pages leave this process's memory)."""
        seg = self._maps.pop((writer, first_seq), None)
        if seg is not None:
            seg.close()

    def tokens(self, rec) -> np.ndarray:
        """Zero-copy view of one record's tokens (rec: a PENDING_DTYPE row)."""
        seg = self.segment(int(rec["writer"]), int(rec["segment"]))
        start = int(rec["offset"]) + RECORD_HEADER_BYTES
        return seg.buf[start : start + 4 * int(rec["num_tokens"])].view(np.uint32)

    def gather(self, recs: np.ndarray, out_flat: np.ndarray, out_offsets: np.ndarray) -> int:
        """Copy the tokens of `recs` (in order) into out_flat; out_offsets[i]:out_offsets[i+1] is record i."""
        out_offsets[0] = 0
        n = recs.size
        if n == 0:
            return 0
        writers, segments = recs["writer"], recs["segment"]
        # runs of records in one segment: one kernel call each (no Python step per record)
        starts = np.flatnonzero(np.r_[True, (writers[1:] != writers[:-1]) | (segments[1:] != segments[:-1])])
        ends = np.r_[starts[1:], n]
        offsets = recs["offset"].astype(np.int64)
        slot = 0
        for i, j in zip(starts.tolist(), ends.tolist()):
            seg = self.segment(int(writers[i]), int(segments[i]))
            slot = gather(seg.buf, offsets[i:j], out_flat, out_offsets, slot)
        return int(out_offsets[n])

    def ack(self, writer: int, seqs) -> None:
        self.acks.ack(writer, seqs)

    def save_acks(self) -> None:
        self.acks.save(self.root)

    def reclaim(self) -> int:
        """Delete segments whose records are all done (never a writer's newest); returns how many."""
        removed = 0
        for wdir in sorted(self.root.glob("w[0-9][0-9][0-9]")):
            writer = int(wdir.name[1:])
            firsts = sorted(int(p.stem) for p in wdir.glob("*.seg") if p.stem.isdigit())
            remaining = list(firsts)
            for k, first in enumerate(firsts[:-1]):
                if self.acks.all_done(writer, first, firsts[k + 1]):
                    seg = self._maps.pop((writer, first), None)
                    if seg is not None:
                        seg.close()
                    (wdir / idx_name(first)).unlink(missing_ok=True)
                    (wdir / segment_name(first)).unlink(missing_ok=True)
                    remaining.remove(first)
                    removed += 1
            if remaining:
                self.acks.set_floor(writer, remaining[0])
            state = self._writers.get(writer)
            if state is not None:
                state.segments = remaining
        return removed

    def disk_bytes(self) -> int:
        """Bytes the backlog occupies on disk (allocated blocks). A file reclaimed while it is
        counted (another writer's, or a checkpoint's) counts 0."""
        total = 0
        for p in self.root.rglob("*"):
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode):
                total += st.st_blocks * 512
        return total

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


def _remove_temp_files(root: Path) -> int:
    removed = 0
    for path in list(root.glob(".*.tmp")) + list(root.glob("w[0-9][0-9][0-9]/.*.tmp")):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
