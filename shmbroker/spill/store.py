"""The backlog: recovery, pending records, zero-copy reads, acks and reclaim.

`Backlog.open(data_dir)` rebuilds the pending records after any stop without
reading token payloads: sealed segments come from their header index
(`.idx`), the active segment of each writer is walked header by header, with
every record's CRC checked unless that writer left a clean-shutdown marker.
A torn tail is cut (zeroed) and reported in bytes and records; a corrupt
record in the middle is quarantined (reported, skipped, counted) without
losing its neighbours; records that are done per the ack file are not
pending. Stale temp files are removed.

Damage and what recovery makes of it (`RecoveryReport`):
- a record failing its CRC whose frame is sound (length, magic, token count
  and sequence number agree) and whose item id agrees with its producer word
  still names its item: it is `corrupt()` (the scheduler answers it `corrupt`
  through a GPU process and the results process acks it), kept in the segment
  and its index until then; otherwise it names nothing, and the sequence
  numbers it held are counted (`unnamed_corrupt`) and marked done;
- a segment header with a bad magic or checksum is rewritten from the file's
  place and name (writer, first sequence number), the damaged bytes kept
  beside it (`<first>.header.corrupt`), and every record is CRC-checked (with
  the index's trusted copies naming the records that fail); a sound header this
  build cannot take (another layout version) sets the whole file aside
  (`<first>.corrupt`, its sequence numbers never reused);
- an index (`.idx`) failing its checks: the segment is scanned (CRC-checked)
  and the index written again.

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

from .. import durable
from ..ring.items import SEQ_BITS
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
    segment_name,
    writer_dir_name,
)
from .records import REC_BAD_CRC, REC_OK, SCAN_FULL, SCAN_TORN, copy_headers, gather, scan
from .segment import (
    FILE_MODE,
    HEADER_DAMAGED,
    SegmentFile,
    header_problem,
    idx_bytes,
    read_clean_marker,
    read_idx,
    rewrite_header,
    write_idx,
)
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
    corrupt_records: int = 0  # records failing their CRC that still name their item (answered `corrupt`)
    # sequence numbers among a segment's records that no record holds: lost to damage that names no item
    unnamed_corrupt: int = 0
    damaged_files: list[dict] = field(default_factory=list)  # segment headers and indexes: file, reason, action
    segment_headers_rewritten: int = 0
    segments_set_aside: int = 0
    indexes_rebuilt: int = 0
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
        self._corrupt = np.empty(0, PENDING_DTYPE)
        self._acked_at_open = 0  # sequence numbers recovery found lost and marked done (not yet in the ack file)
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
        pending_parts, corrupt_parts = [], []
        for wdir in sorted(root.glob("w[0-9][0-9][0-9]")):
            writer = int(wdir.name[1:])
            if writers is not None and writer not in writers:
                continue
            state, parts, corrupt = backlog._recover_writer(wdir, writer, report)
            backlog._writers[writer] = state
            pending_parts.extend(parts)
            corrupt_parts.extend(corrupt)
        report.writers = len(backlog._writers)
        pending = np.concatenate(pending_parts) if pending_parts else np.empty(0, PENDING_DTYPE)
        report.records = int(pending.size)
        report.tokens = int(pending["num_tokens"].sum(dtype=np.uint64)) if pending.size else 0
        backlog._pending = backlog._not_done(pending)
        report.pending_records = int(backlog._pending.size)
        report.pending_tokens = int(backlog._pending["num_tokens"].sum(dtype=np.uint64)) if backlog._pending.size else 0
        corrupt = np.concatenate(corrupt_parts) if corrupt_parts else np.empty(0, PENDING_DTYPE)
        backlog._corrupt = backlog._not_done(corrupt)
        report.corrupt_records = int(backlog._corrupt.size)
        if not readonly and writers is None:
            if backlog._acked_at_open:
                try:  # what recovery found lost is done for good: the results process starts from the file
                    backlog.save_acks()
                except OSError as exc:
                    report.ack_file += f"; not saved after recovery ({exc.strerror})"
            report.segments_reclaimed = backlog.reclaim()
        report.seconds = time.perf_counter() - t0
        return backlog, report

    def _not_done(self, recs: np.ndarray) -> np.ndarray:
        """The records of `recs` the ack file does not mark done."""
        keep = np.ones(recs.size, bool)
        for writer in self._writers:
            mine = recs["writer"] == writer
            keep[mine] = ~self.acks.done_mask(writer, recs["seq"][mine])
        return recs[keep]

    def _recover_writer(self, wdir: Path, writer: int, report: RecoveryReport):
        """(_WriterState, [pending records per segment], [corrupt records per segment]) of one writer."""
        firsts = sorted(int(p.stem) for p in wdir.glob("*.seg") if p.stem.isdigit())
        state = _WriterState(writer, list(firsts))
        for path in wdir.glob("*.corrupt"):  # set aside earlier: never reuse its sequence numbers
            if path.stem.isdigit():
                state.next_seq = max(state.next_seq, int(path.stem) + path.stat().st_size // RECORD_HEADER_BYTES + 1)
        clean = read_clean_marker(wdir)
        parts, corrupt_parts = [], []
        if clean is not None:
            report.clean_writers += 1
        if firsts:
            self.acks.set_floor(writer, firsts[0])  # older segments were reclaimed: all done
        for k, first in enumerate(firsts):
            last = k == len(firsts) - 1
            path = wdir / segment_name(first)
            report.segments += 1
            try:
                problem = header_problem(path)
            except FileNotFoundError:
                if not self.readonly:
                    raise
                state.segments.remove(first)  # reclaimed while we looked: all its records are done
                continue
            rewritten = False
            if problem is not None:
                if self.readonly:  # leave it to a recovery that may change the disk (or to its writer)
                    state.segments.remove(first)
                    continue
                if problem[0] != HEADER_DAMAGED:
                    self._set_aside(path, state, report, problem[1])
                    continue
                self._rewrite_header(path, writer, first, report, problem[1])
                rewritten = True
            idx_path = wdir / idx_name(first)
            idx = None if last else read_idx(idx_path)
            if idx is None and not last and idx_path.exists():
                report.indexes_rebuilt += not self.readonly
                report.damaged_files.append({"file": f"{wdir.name}/{idx_path.name}", "reason": "fails its checks",
                                             "action": "segment scanned with CRC checks" +
                                             ("" if self.readonly else ", index written again")})
            corrupt = np.empty(0, PENDING_DTYPE)
            if idx is not None and not rewritten:
                offsets, headers, _end = idx
                recs = _pending_from_headers(headers, writer, first, offsets)
                next_seq = first + len(recs) if len(recs) == 0 else int(recs["seq"][-1]) + 1
            else:
                report.scanned_segments += 1
                trusted_end = clean[1] if (clean is not None and last and clean[0] == first and not rewritten) else None
                try:
                    recs, corrupt, next_seq, end, offsets = self._scan_segment(path, writer, first, trusted_end, report,
                                                                               seal=not last and idx is None, known=idx)
                except FileNotFoundError:
                    if not self.readonly:
                        raise
                    state.segments.remove(first)  # reclaimed while we looked: all its records are done
                    continue
                except ValueError as exc:  # its header went bad since it was checked (or it is being created)
                    if self.readonly:
                        state.segments.remove(first)
                        continue
                    self._set_aside(path, state, report, str(exc))
                    continue
                if last:
                    state.active_end = end
                    state.active_offsets = [offsets]
            records_end = next_seq  # one past the last sequence number a record of this segment holds
            if not last:
                next_seq = max(next_seq, firsts[k + 1])
            state.next_seq = max(state.next_seq, next_seq)
            # Sequence numbers inside the segment that are not records (lost to damage; between
            # segments: skipped by a jump) are done; those among its records were lost unnamed.
            expected = np.arange(first, next_seq, dtype=np.uint64)
            live = np.concatenate([recs["seq"], corrupt["seq"]]) if corrupt.size else recs["seq"]
            missing = np.setdiff1d(expected, live) if live.size != expected.size else expected[:0]
            if missing.size:
                report.unnamed_corrupt += int((missing < np.uint64(records_end)).sum())
                self._acked_at_open += int((~self.acks.done_mask(writer, missing)).sum())
                self.acks.ack(writer, missing)
            parts.append(recs)
            corrupt_parts.append(corrupt)
        return state, parts, corrupt_parts

    def _set_aside(self, path: Path, state: _WriterState, report: RecoveryReport, reason: str) -> None:
        """A segment whose header this build cannot take: renamed `<first>.corrupt`, its sequence numbers
        never reused; what it held is lost (unnamed)."""
        first = int(path.stem)
        report.quarantined.append({"writer": state.writer, "segment": first, "offset": 0,
                                   "reason": f"segment header: {reason}"})
        report.damaged_files.append({"file": f"{path.parent.name}/{path.name}", "reason": reason,
                                     "action": f"set aside as {path.stem}.corrupt"})
        report.segments_set_aside += 1
        size = path.stat().st_size
        durable.rename(path, path.with_suffix(".corrupt"))
        state.segments.remove(first)
        # never reuse the sequence numbers that file may have held
        state.next_seq = max(state.next_seq, first + size // RECORD_HEADER_BYTES + 1)

    def _rewrite_header(self, path: Path, writer: int, first: int, report: RecoveryReport, reason: str) -> None:
        """A segment header whose bytes rotted: rewritten from the file's place and name (its records carry
        their own CRCs and sequence numbers, so the scan that follows tells which survive); the damaged bytes
        are kept beside it."""
        aside = path.with_name(f"{path.stem}.header.corrupt")
        old = rewrite_header(path, writer, first)
        durable.atomic_write(aside, old, FILE_MODE)
        report.quarantined.append({"writer": writer, "segment": first, "offset": 0,
                                   "reason": f"segment header: {reason}; rewritten"})
        report.damaged_files.append({"file": f"{path.parent.name}/{path.name}", "reason": reason,
                                     "action": f"header rewritten from the file's name (the damaged one kept in "
                                               f"{aside.name}); every record CRC-checked"})
        report.segment_headers_rewritten += 1

    def _scan_segment(self, path: Path, writer: int, first: int, trusted_end: int | None, report: RecoveryReport,
                      seal: bool = False, known=None):
        """Walk a segment's records (CRC-checked unless trusted); cut a torn tail. `known`: the segment's
        index (read_idx), whose header copies are trusted, to name the records that fail. Returns
        (pending, corrupt, next_seq, end, offsets of the records kept in the segment's index)."""
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
            good = offsets[status == REC_OK]
            recs = _headers_at(seg, good, writer, first)
            # A record failing its CRC has a sound frame (scan checked its length, magic, token count
            # and sequence number); it still names its item when its item id agrees with its producer.
            failed = _headers_at(seg, offsets[status == REC_BAD_CRC], writer, first)
            named = failed[(failed["item_id"] >> np.uint64(SEQ_BITS)) == failed["producer"].astype(np.uint64)]
            if known is not None:  # the index's copies of the headers name every record it held
                k_off, k_headers, _end = known
                held = _pending_from_headers(k_headers, writer, first, k_off)
                whole = np.isin(k_off, good)
                recs, corrupt, kept = held[whole], held[~whole], k_off
                next_seq = max(next_seq, int(held["seq"][-1]) + 1 if held.size else first)
            else:
                corrupt = named
                kept = np.sort(np.concatenate([good, named["offset"].astype(np.int64)]))
            by_offset = {int(o): int(i) for o, i in zip(corrupt["offset"], corrupt["item_id"])}
            for o, st in zip(offsets[status != REC_OK], status[status != REC_OK]):
                entry = {"writer": writer, "segment": first, "offset": int(o),
                         "reason": "crc mismatch" if st == REC_BAD_CRC else "broken frame"}
                if int(o) in by_offset:
                    entry["item_id"] = by_offset[int(o)]  # answered `corrupt`
                report.quarantined.append(entry)
            if seal and not self.readonly:
                # a segment its writer rolled away from but had not sealed (it died first):
                # write its index now, so the next recovery need not scan it again (a record
                # that names its item stays in it until its `corrupt` result acks it)
                seg.sync()  # the records before the index that lists them
                write_idx(path.parent, first, idx_bytes(seg, kept, off))
            return recs, corrupt, next_seq, off, kept
        finally:
            seg.close()

    # -- the live backlog -------------------------------------------------------------

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
        fsync: str = "interval",
        fsync_interval_ms: float = DEFAULT_FSYNC_INTERVAL_MS,
        sparse: bool = False,
    ) -> SegmentWriter:
        """The writer `writer`, continuing after its last recovered record."""
        wdir = self.root / writer_dir_name(writer)
        durable.mkdir(wdir, DIR_MODE)
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


def _headers_at(seg: SegmentFile, offsets: np.ndarray, writer: int, segment: int) -> np.ndarray:
    """PENDING_DTYPE rows of the records at `offsets` of a mapped segment."""
    headers = np.empty((offsets.size, RECORD_HEADER_BYTES), np.uint8)
    copy_headers(seg.buf, offsets, headers)
    return _pending_from_headers(headers, writer, segment, offsets)


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
