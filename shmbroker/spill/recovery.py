"""Recovery of one writer's backlog directory: what each segment still holds after any stop.

Sealed segments come from their header index (`.idx`), the active segment of
a writer is walked header by header, with every record's CRC checked unless
that writer left a clean-shutdown marker. A torn tail is cut (zeroed) and
reported in bytes and records; a corrupt record in the middle is quarantined
(reported, skipped, counted) without losing its neighbours; sequence numbers
no record holds are marked done.

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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..disk import durable
from ..ring.items import SEQ_BITS
from .acks import Acks
from .layout import PENDING_DTYPE, RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES, idx_name, pending_from_headers, segment_name
from .records import REC_BAD_CRC, REC_OK, SCAN_FULL, SCAN_TORN, copy_headers, scan_step
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


@dataclass(frozen=True)
class SegmentRecords:
    """What recovery found in one segment: its pending records and those failing their CRC that
    still name their item (PENDING_DTYPE rows), one past the last sequence number a record of it
    holds, where its records end, and the offsets its index lists (`kept`)."""

    pending: np.ndarray
    corrupt: np.ndarray
    next_seq: int
    end: int
    kept: np.ndarray


@dataclass
class WriterState:
    """What recovery learned about one writer: where its writer continues."""

    writer: int
    segments: list[int]  # first_seq of each segment, ascending
    next_seq: int = 0
    active_end: int = SEGMENT_HEADER_BYTES
    active_offsets: list = field(default_factory=list)


class Recovery:
    """Recovers writer directories against one ack file. `readonly`: change nothing on disk.
    `acked_at_open` counts the sequence numbers it found lost and marked done in `acks`."""

    def __init__(self, acks: Acks, readonly: bool):
        self.acks = acks
        self.readonly = readonly
        self.acked_at_open = 0

    def recover_writer(self, wdir: Path, writer: int, report: RecoveryReport):
        """(WriterState, [pending records per segment], [corrupt records per segment]) of one writer."""
        firsts = sorted(int(p.stem) for p in wdir.glob("*.seg") if p.stem.isdigit())
        state = WriterState(writer, list(firsts))
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
            found = self.recover_segment(wdir / segment_name(first), state, last, clean, report)
            if found is None:
                continue
            if last:  # the active segment: always scanned (only sealed ones have an index)
                state.active_end = found.end
                state.active_offsets = [found.kept]
            next_seq = found.next_seq if last else max(found.next_seq, firsts[k + 1])
            state.next_seq = max(state.next_seq, next_seq)
            self.mark_lost(writer, first, next_seq, found, report)
            parts.append(found.pending)
            corrupt_parts.append(found.corrupt)
        return state, parts, corrupt_parts

    def recover_segment(self, path: Path, state: WriterState, last: bool, clean, report: RecoveryReport):
        """The records of one segment (`SegmentRecords`), from its index when it has a sound one, else
        scanned; None when the segment is left out (gone, set aside, or left to a recovery that may
        change the disk). `clean`: the writer's clean-shutdown marker (None: none)."""
        writer, first = state.writer, int(path.stem)
        report.segments += 1
        rewritten = self.check_header(path, state, report)
        if rewritten is None:
            return None
        idx_path = path.with_name(idx_name(first))
        idx = None if last else read_idx(idx_path)
        if idx is None and not last and idx_path.exists():
            report.indexes_rebuilt += not self.readonly
            report.damaged_files.append({"file": f"{path.parent.name}/{idx_path.name}", "reason": "fails its checks",
                                         "action": "segment scanned with CRC checks" +
                                         ("" if self.readonly else ", index written again")})
        if idx is not None and not rewritten:
            offsets, headers, end = idx
            recs = pending_from_headers(headers, writer, first, offsets)
            next_seq = first + len(recs) if len(recs) == 0 else int(recs["seq"][-1]) + 1
            return SegmentRecords(recs, np.empty(0, PENDING_DTYPE), next_seq, end, offsets)
        report.scanned_segments += 1
        trusted_end = clean[1] if (clean is not None and last and clean[0] == first and not rewritten) else None
        try:
            return self.scan_segment(path, writer, first, trusted_end, report, seal=not last and idx is None, known=idx)
        except FileNotFoundError:
            if not self.readonly:
                raise
            state.segments.remove(first)  # reclaimed while we looked: all its records are done
        except ValueError as exc:  # its header went bad since it was checked (or it is being created)
            if self.readonly:
                state.segments.remove(first)
            else:
                self.set_aside(path, state, report, str(exc))
        return None

    def check_header(self, path: Path, state: WriterState, report: RecoveryReport) -> bool | None:
        """Whether the segment's header had to be rewritten (its records are then all CRC-checked);
        None when the segment is left out: reclaimed while we looked, set aside, or (readonly) left
        to a recovery that may change the disk, or to its writer."""
        first = int(path.stem)
        try:
            problem = header_problem(path)
        except FileNotFoundError:
            if not self.readonly:
                raise
            state.segments.remove(first)  # reclaimed while we looked: all its records are done
            return None
        if problem is None:
            return False
        if self.readonly:
            state.segments.remove(first)
            return None
        if problem[0] != HEADER_DAMAGED:
            self.set_aside(path, state, report, problem[1])
            return None
        self.rewrite_header(path, state.writer, first, report, problem[1])
        return True

    def mark_lost(self, writer: int, first: int, next_seq: int, found: SegmentRecords, report: RecoveryReport) -> None:
        """Sequence numbers inside the segment that are not records (lost to damage; between segments:
        skipped by a jump) are done; those among its records (below found.next_seq) were lost unnamed."""
        expected = np.arange(first, next_seq, dtype=np.uint64)
        recs, corrupt = found.pending, found.corrupt
        live = np.concatenate([recs["seq"], corrupt["seq"]]) if corrupt.size else recs["seq"]
        missing = np.setdiff1d(expected, live) if live.size != expected.size else expected[:0]
        if missing.size:
            report.unnamed_corrupt += int((missing < np.uint64(found.next_seq)).sum())
            self.acked_at_open += int((~self.acks.done_mask(writer, missing)).sum())
            self.acks.ack(writer, missing)

    def set_aside(self, path: Path, state: WriterState, report: RecoveryReport, reason: str) -> None:
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

    def rewrite_header(self, path: Path, writer: int, first: int, report: RecoveryReport, reason: str) -> None:
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

    def scan_segment(self, path: Path, writer: int, first: int, trusted_end: int | None, report: RecoveryReport,
                      seal: bool = False, known=None) -> SegmentRecords:
        """Walk a segment's records (CRC-checked unless trusted); cut a torn tail. `known`: the segment's
        index (read_idx), whose header copies are trusted, to name the records that fail."""
        seg = SegmentFile.open(path, writable=not self.readonly)
        try:
            end_limit = seg.size if trusted_end is None else trusted_end
            check_crc = trusted_end is None
            out_off = np.empty(SCAN_CHUNK, np.int64)
            out_status = np.empty(SCAN_CHUNK, np.int64)
            offsets_all, status_all = [], []
            off, next_seq = SEGMENT_HEADER_BYTES, first
            while True:
                step = scan_step(seg.buf, off, end_limit, next_seq, check_crc, out_off, out_status, self.readonly)
                off, next_seq = step.end, step.next_seq
                offsets_all.append(out_off[: step.count].copy())
                status_all.append(out_status[: step.count].copy())
                if step.outcome != SCAN_FULL:
                    break
            if step.outcome == SCAN_TORN and not self.readonly:
                # Bytes after the last record that form no record (one being written when
                # the writer died): zero them, so that no stale byte can ever pass for a
                # record once the writer continues here.
                report.torn_records += 1
                report.torn_bytes += int(step.cut_bytes)
                seg.buf[off : off + step.cut_bytes] = 0
                seg.sync()
            offsets = np.concatenate(offsets_all)
            status = np.concatenate(status_all)
            good = offsets[status == REC_OK]
            recs = headers_at(seg, good, writer, first)
            # A record failing its CRC has a sound frame (scan checked its length, magic, token count
            # and sequence number); it still names its item when its item id agrees with its producer.
            failed = headers_at(seg, offsets[status == REC_BAD_CRC], writer, first)
            named = failed[(failed["item_id"] >> np.uint64(SEQ_BITS)) == failed["producer"].astype(np.uint64)]
            if known is not None:  # the index's copies of the headers name every record it held
                k_off, k_headers, _end = known
                held = pending_from_headers(k_headers, writer, first, k_off)
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
            return SegmentRecords(recs, corrupt, next_seq, off, kept)
        finally:
            seg.close()

    # -- the live backlog -------------------------------------------------------------


def headers_at(seg: SegmentFile, offsets: np.ndarray, writer: int, segment: int) -> np.ndarray:
    """PENDING_DTYPE rows of the records at `offsets` of a mapped segment."""
    headers = np.empty((offsets.size, RECORD_HEADER_BYTES), np.uint8)
    copy_headers(seg.buf, offsets, headers)
    return pending_from_headers(headers, writer, segment, offsets)
