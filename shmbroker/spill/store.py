"""The backlog: recovery, pending records, zero-copy reads, acks and reclaim.

`Backlog.open(data_dir)` rebuilds the pending records after any stop without
reading token payloads: sealed segments come from their header index
(`.idx`), the active segment of each writer is walked header by header, with
every record's CRC checked unless that writer left a clean-shutdown marker.
A torn tail is cut (zeroed) and reported in bytes and records; a corrupt
record in the middle is quarantined (reported, skipped, counted) without
losing its neighbours; records that are done per the ack file are not
pending. Stale temp files are removed.

Layout on disk: `<data_dir>/backlog/` (0700) holds `acks.bin` and one
directory per writer, `w<NNN>/`, with `<first_seq>.seg`, `<first_seq>.idx`
and, after a clean close, `CLEAN`.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .acks import AckFileCorrupt, Acks
from .layout import (
    DEFAULT_SEGMENT_BYTES,
    PENDING_DTYPE,
    R64_ITEM,
    R64_PREFIX_KEY,
    R64_SEQ,
    R_BAND,
    R_MAX_NEW,
    R_MODEL,
    R_NUM_TOKENS,
    R_PREFIX_LEN,
    R_PRODUCER,
    RECORD_HEADER_BYTES,
    RECORD_HEADER_WORDS,
    SEGMENT_HEADER_BYTES,
    idx_name,
    writer_dir_name,
)
from .records import REC_BAD_CRC, REC_OK, SCAN_FULL, SCAN_TORN, copy_headers, gather, scan
from .segment import SegmentFile, idx_bytes, read_clean_marker, read_idx, write_idx
from .writer import DEFAULT_FSYNC_INTERVAL_MS, SegmentWriter

DIR_MODE = 0o700
BACKLOG_DIR = "backlog"
SCAN_CHUNK = 1 << 16


@dataclass
class RecoveryReport:
    seconds: float = 0.0
    writers: int = 0
    segments: int = 0
    records: int = 0
    tokens: int = 0
    pending_records: int = 0
    pending_tokens: int = 0
    torn_bytes: int = 0
    torn_records: int = 0
    quarantined: list[dict] = field(default_factory=list)
    clean_writers: int = 0
    scanned_segments: int = 0
    ack_file: str = "missing"
    temp_files_removed: int = 0
    segments_reclaimed: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _WriterState:
    """What recovery learned about one writer: where its writer continues."""

    writer: int
    segments: list[int]  # first_seq of each segment, ascending
    next_seq: int = 0
    active_end: int = SEGMENT_HEADER_BYTES
    active_offsets: list = field(default_factory=list)


class Backlog:
    """The durable backlog of one data directory."""

    def __init__(self, root: Path, segment_bytes: int):
        self.root = root
        self.segment_bytes = segment_bytes
        self.acks = Acks()
        self.readonly = False
        self._pending = np.empty(0, PENDING_DTYPE)
        self._writers: dict[int, _WriterState] = {}
        self._maps: dict[tuple[int, int], SegmentFile] = {}

    # -- recovery ------------------------------------------------------------------

    @classmethod
    def open(cls, data_dir: str | os.PathLike, *, segment_bytes: int = DEFAULT_SEGMENT_BYTES,
             readonly: bool = False, writers: set[int] | None = None) -> tuple[Backlog, RecoveryReport]:
        """Recover the backlog. `readonly`: look without changing anything on disk (no tail cut, no
        index written, nothing reclaimed or set aside), as a scheduler does while ingest processes
        append: a torn or unfinished tail then ends the scan. `writers`: recover only these writers'
        directories (a restarted ingest process recovers its own)."""
        t0 = time.perf_counter()
        root = Path(data_dir) / BACKLOG_DIR
        root.parent.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        root.mkdir(mode=DIR_MODE, exist_ok=True)
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
        pending_parts = []
        for wdir in sorted(root.glob("w[0-9][0-9][0-9]")):
            writer = int(wdir.name[1:])
            if writers is not None and writer not in writers:
                continue
            state, parts = backlog._recover_writer(wdir, writer, report)
            backlog._writers[writer] = state
            pending_parts.extend(parts)
        report.writers = len(backlog._writers)
        pending = np.concatenate(pending_parts) if pending_parts else np.empty(0, PENDING_DTYPE)
        report.records = int(pending.size)
        report.tokens = int(pending["num_tokens"].sum(dtype=np.uint64)) if pending.size else 0
        keep = np.ones(pending.size, bool)
        for writer in backlog._writers:
            mine = pending["writer"] == writer
            keep[mine] = ~backlog.acks.done_mask(writer, pending["seq"][mine])
        backlog._pending = pending[keep]
        report.pending_records = int(backlog._pending.size)
        report.pending_tokens = int(backlog._pending["num_tokens"].sum(dtype=np.uint64)) if backlog._pending.size else 0
        if not readonly and writers is None:
            report.segments_reclaimed = backlog.reclaim()
        report.seconds = time.perf_counter() - t0
        return backlog, report

    def _recover_writer(self, wdir: Path, writer: int, report: RecoveryReport) -> tuple[_WriterState, list[np.ndarray]]:
        firsts = sorted(int(p.stem) for p in wdir.glob("*.seg") if p.stem.isdigit())
        state = _WriterState(writer, list(firsts))
        for path in wdir.glob("*.corrupt"):  # set aside earlier: never reuse its sequence numbers
            if path.stem.isdigit():
                state.next_seq = max(state.next_seq, int(path.stem) + path.stat().st_size // RECORD_HEADER_BYTES + 1)
        clean = read_clean_marker(wdir)
        parts = []
        if clean is not None:
            report.clean_writers += 1
        if firsts:
            self.acks.set_floor(writer, firsts[0])  # older segments were reclaimed: all done
        for k, first in enumerate(firsts):
            last = k == len(firsts) - 1
            path = wdir / f"{first:020d}.seg"
            report.segments += 1
            idx = None if last else read_idx(wdir / idx_name(first))
            if idx is not None:
                offsets, headers, _end = idx
                recs = _pending_from_headers(headers, writer, first, offsets)
                next_seq = first + len(recs) if len(recs) == 0 else int(recs["seq"][-1]) + 1
            else:
                report.scanned_segments += 1
                trusted_end = clean[1] if (clean is not None and last and clean[0] == first) else None
                try:
                    recs, next_seq, end, offsets = self._scan_segment(path, writer, first, trusted_end, report, seal=not last)
                except FileNotFoundError:
                    if not self.readonly:
                        raise
                    state.segments.remove(first)  # reclaimed while we looked: all its records are done
                    continue
                except ValueError as exc:  # the file's own header is bad: set the whole file aside
                    if self.readonly:  # (or a segment being created right now): leave it to its writer
                        state.segments.remove(first)
                        continue
                    report.quarantined.append({"writer": writer, "segment": first, "offset": 0, "reason": f"segment header: {exc}"})
                    size = path.stat().st_size
                    path.rename(path.with_suffix(".corrupt"))
                    state.segments.remove(first)
                    # never reuse the sequence numbers that file may have held
                    state.next_seq = max(state.next_seq, first + size // RECORD_HEADER_BYTES + 1)
                    continue
                if last:
                    state.active_end = end
                    state.active_offsets = [offsets]
            if not last:
                next_seq = max(next_seq, firsts[k + 1])
            state.next_seq = max(state.next_seq, next_seq)
            # sequence numbers inside the segment that are not live records (quarantined, cut) are done
            expected = np.arange(first, next_seq, dtype=np.uint64)
            missing = np.setdiff1d(expected, recs["seq"], assume_unique=True) if recs.size != expected.size else expected[:0]
            if missing.size:
                self.acks.ack(writer, missing)
            parts.append(recs)
        return state, parts

    def _scan_segment(self, path: Path, writer: int, first: int, trusted_end: int | None, report: RecoveryReport, seal: bool = False):
        """Walk a segment's records (CRC-checked unless trusted); cut a torn tail. Returns (pending, next_seq, end, offsets)."""
        seg = SegmentFile.open(path, writable=not self.readonly)
        try:
            end_limit = seg.size if trusted_end is None else trusted_end
            check_crc = trusted_end is None
            out_off = np.empty(SCAN_CHUNK, np.int64)
            out_status = np.empty(SCAN_CHUNK, np.int64)
            offsets_all, status_all = [], []
            off, next_seq = SEGMENT_HEADER_BYTES, first
            while True:
                n, outcome, off, next_seq, cut = scan(seg.buf, off, end_limit, next_seq, check_crc, out_off, out_status,
                                                      self.readonly)
                offsets_all.append(out_off[:n].copy())
                status_all.append(out_status[:n].copy())
                if outcome != SCAN_FULL:
                    break
            if outcome == SCAN_TORN and not self.readonly:
                # Bytes after the last record that form no record (one being written when
                # the writer died): zero them, so that no stale byte can ever pass for a
                # record once the writer continues here.
                report.torn_records += 1
                report.torn_bytes += int(cut)
                seg.buf[off : off + cut] = 0
                seg.sync()
            offsets = np.concatenate(offsets_all)
            status = np.concatenate(status_all)
            for o, st in zip(offsets[status != REC_OK], status[status != REC_OK]):
                report.quarantined.append(
                    {"writer": writer, "segment": first, "offset": int(o), "reason": "crc mismatch" if st == REC_BAD_CRC else "broken frame"}
                )
            good = offsets[status == REC_OK]
            headers = np.empty((good.size, RECORD_HEADER_BYTES), np.uint8)
            copy_headers(seg.buf, good, headers)
            recs = _pending_from_headers(headers, writer, first, good)
            if seal and not self.readonly:
                # a segment its writer rolled away from but had not sealed (it died first):
                # write its index now, so the next recovery need not scan it again
                write_idx(path.parent, first, idx_bytes(seg, good, off))
            return recs, next_seq, off, good
        finally:
            seg.close()

    # -- the live backlog -------------------------------------------------------------

    def pending(self) -> np.ndarray:
        """Records recovered at open that were not done (PENDING_DTYPE)."""
        return self._pending

    def writer(
        self,
        writer: int,
        *,
        fsync: str = "interval",
        fsync_interval_ms: float = DEFAULT_FSYNC_INTERVAL_MS,
        sparse: bool = False,
    ) -> SegmentWriter:
        """The writer `writer`, continuing after its last recovered record."""
        wdir = self.root / writer_dir_name(writer)
        wdir.mkdir(mode=DIR_MODE, exist_ok=True)
        state = self._writers.setdefault(writer, _WriterState(writer, []))
        active = None
        if state.segments and not (wdir / idx_name(state.segments[-1])).exists():
            # the newest segment is unsealed: continue in it (a sealed one makes the writer start a new one)
            active = SegmentFile.open(wdir / f"{state.segments[-1]:020d}.seg", writable=True)
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
        key = (writer, first_seq)
        seg = self._maps.get(key)
        if seg is None or seg.fd < 0:
            seg = SegmentFile.open(self.root / writer_dir_name(writer) / f"{first_seq:020d}.seg")
            self._maps[key] = seg
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
                    (wdir / f"{first:020d}.seg").unlink(missing_ok=True)
                    remaining.remove(first)
                    removed += 1
            if remaining:
                self.acks.set_floor(writer, remaining[0])
            state = self._writers.get(writer)
            if state is not None:
                state.segments = remaining
        return removed

    def disk_bytes(self) -> int:
        """Bytes the backlog occupies on disk (allocated blocks)."""
        return sum(p.stat().st_blocks * 512 for p in self.root.rglob("*") if p.is_file())

    def close(self) -> None:
        for seg in self._maps.values():
            seg.close()
        self._maps.clear()


def _pending_from_headers(headers: np.ndarray, writer: int, segment: int, offsets: np.ndarray) -> np.ndarray:
    """PENDING_DTYPE rows from (n, 64) record header bytes."""
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


def _remove_temp_files(root: Path) -> int:
    removed = 0
    for path in list(root.glob(".*.tmp")) + list(root.glob("w[0-9][0-9][0-9]/.*.tmp")):
        path.unlink(missing_ok=True)
        removed += 1
    return removed
