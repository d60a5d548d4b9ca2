"""Seeded fault injection on the backlog's files: torn tails, bit flips, a full disk, bad states.

Faults are injected into copies of a backlog built by a real writer, then
`Backlog.open` must say what happened (torn bytes and records, quarantined
records with their offsets) without losing any intact neighbour, and a writer
must be able to continue after the damage. A full disk is simulated twice: a
size-limited tmpfs mounted by the test itself (skipped, with the reason, where
mounting is impossible) and an injected `posix_fallocate` error.

Record layout (`spill/layout.py`): bytes 0..3 length (written last: it
commits), 4..7 magic, 8..11 crc32c of bytes 12.. and the tokens, 16..23 seq,
52..55 num_tokens; the other header fields and the tokens are covered by the
CRC only. Records start at byte 64 of a segment, 8-byte aligned.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
from pathlib import Path

import crc32c
import numpy as np
import pytest
from support.smallfs import fill, mounted_tmpfs

from shmbroker.errors import DiskFull
from shmbroker.spill import segment as segment_mod
from shmbroker.spill.layout import ITEM_DTYPE, RECORD_HEADER_BYTES, RECORD_MAGIC, SEGMENT_HEADER_BYTES, max_tokens, record_bytes
from shmbroker.spill.store import Backlog

pytestmark = pytest.mark.timeout(120)

SEGMENT_BYTES = 64 << 10
MAX_TOKENS = max_tokens(SEGMENT_BYTES)
SEED = 7100
PAGE = 4096

# byte ranges of a record header, by what recovery must make of a flipped bit there
FRAME_FIELDS = [(0, 4, "length"), (4, 8, "magic"), (16, 24, "seq"), (52, 56, "num_tokens")]
CRC_FIELDS = [(8, 12, "crc"), (12, 16, "flags"), (24, 52, "item/prefix/producer/model/prefix_len"), (56, 64, "max_new/band")]
# the header bytes that tell whether a record failing its CRC still names its item: the item id's
# producer bits must agree with the producer word; a flip in its sequence bits cannot be seen
ITEM_LOW, ITEM_HIGH, PRODUCER_WORD = (24, 29), (29, 32), (40, 44)


# --- items and backlogs ------------------------------------------------------------------------


def item_tokens(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Tokens of items `ids`, concatenated: a function of (item id, position), never all zero."""
    counts = np.asarray(counts, np.int64)
    starts = np.cumsum(counts) - counts
    rep = np.repeat(np.asarray(ids, np.uint64), counts)
    pos = (np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(starts, counts)).astype(np.uint64)
    return ((rep * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0x2545F4914F6CDD1D)) >> np.uint64(17)).astype(np.uint32) | np.uint32(1)


def make_batch(ids, counts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids = np.asarray(ids, np.uint64)
    counts = np.asarray(counts, np.int64)
    offsets = np.zeros(ids.size + 1, np.int64)
    offsets[1:] = np.cumsum(counts)
    items = np.zeros(ids.size, ITEM_DTYPE)
    items["item_id"] = ids
    items["producer"] = ids >> np.uint64(40)
    items["model"] = ids % np.uint64(3)
    items["prefix_key"] = (ids % np.uint64(5) + np.uint64(1)) * np.uint64(0x100000001B3)
    items["prefix_len"] = ids % np.uint64(11)
    items["max_new_tokens"] = ids % np.uint64(90) + np.uint64(1)
    items["shape_band"] = counts // 1024
    return item_tokens(ids, counts), offsets, items


def write_backlog(data_dir: Path, counts, *, first_id: int = 0, segment_bytes: int = SEGMENT_BYTES, clean: bool = False):
    """A backlog with one writer's records (input order kept). Returns (ids, counts, seqs, segments, offsets)."""
    counts = np.asarray(counts, np.int64)
    ids = (np.uint64(5) << np.uint64(40)) | (np.uint64(first_id) + np.arange(counts.size, dtype=np.uint64))
    backlog, _ = Backlog.open(data_dir, segment_bytes=segment_bytes)
    w = backlog.writer(0, fsync="never")
    try:
        seqs, segs, offs = w.append_many(*make_batch(ids, counts), cluster=False)
    finally:
        w.close(clean=clean)
        backlog.close()
    return ids, counts, seqs, segs, offs


def append_more(data_dir: Path, ids, counts, *, segment_bytes: int = SEGMENT_BYTES) -> None:
    backlog, _ = Backlog.open(data_dir, segment_bytes=segment_bytes)
    w = backlog.writer(0, fsync="never")
    try:
        w.append_many(*make_batch(ids, counts), cluster=False)
    finally:
        w.close(clean=False)
        backlog.close()


def check_pending(backlog: Backlog, want_ids, want_counts) -> None:
    """Pending holds exactly these items, once each, with their tokens and metadata."""
    pend = backlog.pending()
    got = pend["item_id"].tolist()
    assert len(got) == len(set(got)), "an item recovered twice"
    want = dict(zip(np.asarray(want_ids, np.uint64).tolist(), np.asarray(want_counts).tolist()))
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"missing {[hex(i) for i in missing[:5]]} extra {[hex(i) for i in extra[:5]]}"
    if not pend.size:
        return
    counts = np.array([want[i] for i in got], np.int64)
    assert np.array_equal(pend["num_tokens"].astype(np.int64), counts)
    _flat, _offsets, items = make_batch(pend["item_id"], counts)
    for name in ("producer", "model", "prefix_key", "prefix_len", "max_new_tokens", "shape_band"):
        assert np.array_equal(pend[name], items[name]), name
    recs = pend[np.lexsort((pend["offset"], pend["segment"], pend["writer"]))]
    flat = np.empty(int(counts.sum()), np.uint32)
    out_offsets = np.empty(recs.size + 1, np.int64)
    backlog.gather(recs, flat, out_offsets)
    assert np.array_equal(flat, item_tokens(recs["item_id"], recs["num_tokens"].astype(np.int64))), "tokens differ"


def seg_path(data_dir: Path, first: int = 0, writer: int = 0) -> Path:
    return data_dir / "backlog" / f"w{writer:03d}" / f"{first:020d}.seg"


def flip_bit(path: Path, byte: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        old = f.read(1)[0]
        f.seek(byte)
        f.write(bytes([old ^ (1 << bit)]))


def poke(path: Path, byte: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(byte)
        f.write(data)


def reopen(data_dir: Path, segment_bytes: int = SEGMENT_BYTES):
    return Backlog.open(data_dir, segment_bytes=segment_bytes)


# --- 1. torn tails --------------------------------------------------------------------------------

TORN_COUNTS = [3, 1, 250, 16, 90, 1, 400, 33, 5, 120, 61, 300]


@pytest.fixture(scope="module")
def torn_base(tmp_path_factory):
    base = tmp_path_factory.mktemp("torn_base")
    return base, write_backlog(base, TORN_COUNTS)


def _uncommitted_image(data_dir: Path, at: int, seq: int, num_tokens: int) -> bytes:
    """The bytes a writer killed just before its commit leaves: a whole record, length word 0."""
    other = data_dir.parent / (data_dir.name + "-image")
    ids, counts, _seqs, _segs, offs = write_backlog(other, [num_tokens], first_id=900)
    raw = seg_path(other).read_bytes()[int(offs[0]) : int(offs[0]) + record_bytes(num_tokens)]
    image = bytearray(raw)
    image[0:4] = b"\0\0\0\0"  # never committed
    image[16:24] = struct.pack("<Q", seq)  # the sequence number the writer would have given it
    return bytes(image)


def _torn(variant: str, data_dir: Path, offs, counts, end: int) -> str:
    """Damage the tail of the copy; return what recovery must report ("torn" or "torn or quarantined")."""
    path = seg_path(data_dir)
    rng = np.random.default_rng([SEED, len(variant)])
    last = int(offs[-1])
    last_len = record_bytes(int(counts[-1]))
    if variant == "length_committed_payload_garbage":
        poke(path, last + RECORD_HEADER_BYTES, rng.integers(1, 256, last_len - RECORD_HEADER_BYTES, dtype=np.uint8).tobytes())
        return "dropped"
    if variant == "length_committed_payload_zeroed":
        half = last + last_len // 2
        poke(path, half, bytes(last + last_len - half))
        return "dropped"
    if variant == "header_half_written":  # magic, crc, flags and seq of a next record; no length word
        image = _uncommitted_image(data_dir, end, len(counts), 40)
        poke(path, end, image[:32])
        return "torn_extra"
    if variant == "uncommitted_whole_record":  # all but the length word
        poke(path, end, _uncommitted_image(data_dir, end, len(counts), 40))
        return "torn_extra"
    if variant == "trailing_garbage":
        garbage = rng.integers(1, 256, 100, dtype=np.uint8).tobytes()
        poke(path, end, garbage)
        return "torn_extra"
    if variant == "garbage_after_zero_word":
        poke(path, end + 4, rng.integers(1, 256, 60, dtype=np.uint8).tobytes())
        return "torn_extra"
    if variant == "file_truncated_mid_record":
        os.truncate(path, last + RECORD_HEADER_BYTES + 4 * (int(counts[-1]) // 2))
        return "torn_last"
    raise AssertionError(variant)


@pytest.mark.parametrize(
    "variant",
    [
        "length_committed_payload_garbage",
        "length_committed_payload_zeroed",
        "header_half_written",
        "uncommitted_whole_record",
        "trailing_garbage",
        "garbage_after_zero_word",
        "file_truncated_mid_record",
    ],
)
def test_torn_tail_is_cut_and_reported_and_the_writer_continues_after_it(tmp_path, torn_base, variant):
    base, (ids, counts, seqs, _segs, offs) = torn_base
    data_dir = tmp_path / "copy"
    shutil.copytree(base, data_dir)
    end = int(offs[-1]) + record_bytes(int(counts[-1]))
    outcome = _torn(variant, data_dir, offs, counts, end)

    backlog, report = reopen(data_dir)
    try:
        if outcome == "torn_extra":  # bytes after the last record: cut, every record intact
            assert report.torn_records == 1 and report.torn_bytes > 0, report
            assert report.quarantined == []
            check_pending(backlog, ids, counts)
        elif outcome == "torn_last":  # the last record itself is torn: cut with it
            assert report.torn_records == 1 and 0 < report.torn_bytes <= record_bytes(int(counts[-1])), report
            assert report.quarantined == []
            check_pending(backlog, ids[:-1], counts[:-1])
        else:  # a committed length word over a bad payload: the record is dropped and reported, as torn or quarantined
            quarantined = [q["offset"] for q in report.quarantined]
            assert (report.torn_records == 1 and quarantined == []) or (report.torn_records == 0 and quarantined == [int(offs[-1])]), report
            check_pending(backlog, ids[:-1], counts[:-1])
    finally:
        backlog.close()

    # the writer continues after the cut; the next recovery finds the old and the new records, nothing torn
    new_ids = (np.uint64(5) << np.uint64(40)) | np.arange(1000, 1004, dtype=np.uint64)
    new_counts = np.array([1, 77, 300, 9])
    append_more(data_dir, new_ids, new_counts)
    backlog, report = reopen(data_dir)
    try:
        assert report.torn_records == 0 and report.torn_bytes == 0, report
        kept = slice(None) if outcome == "torn_extra" else slice(None, -1)
        check_pending(backlog, np.concatenate([ids[kept], new_ids]), np.concatenate([counts[kept], new_counts]))
        if outcome != "dropped":
            assert report.quarantined == []
        pend = backlog.pending()
        new = pend[np.isin(pend["item_id"], new_ids)]
        assert (new["seq"] >= np.uint64(len(ids) - (outcome != "torn_extra"))).all()
    finally:
        backlog.close()


# --- 2. bit flips -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def flip_base(tmp_path_factory):
    """One unsealed segment, half full: 60 records of 1 to 300 tokens, a few longer, some of
    16 and 48 tokens (128 and 256 bytes: a one-bit length word, which a flip turns to 0)."""
    rng = np.random.default_rng([SEED, 2])
    counts = rng.integers(1, 300, 60)
    counts[::7] = 1
    counts[3::11] = rng.integers(700, 1500, counts[3::11].size)
    counts[5::9] = 16
    counts[6::13] = 48
    base = tmp_path_factory.mktemp("flip_base")
    built = write_backlog(base, counts)
    assert (built[3] == 0).all(), "all in segment 0"
    return base, built


def _which_record(offs: np.ndarray, counts: np.ndarray, byte: int) -> tuple[int, int]:
    r = int(np.searchsorted(offs, byte, side="right")) - 1
    return r, byte - int(offs[r])


def test_single_bit_flips_in_an_unsealed_segment_lose_only_the_flipped_record(tmp_path, flip_base):
    base, (ids, counts, _seqs, _segs, offs) = flip_base
    end = int(offs[-1]) + record_bytes(int(counts[-1]))
    rng = np.random.default_rng([SEED, 3])
    outcomes = {"quarantined": 0, "resynced": 0, "torn_last": 0, "torn_after": 0}
    names = {"named": 0, "unnamed": 0, "misnamed": 0}
    num_flips = 240
    for trial in range(num_flips):
        data_dir = tmp_path / f"f{trial}"
        shutil.copytree(base, data_dir)
        if trial % 12 == 11:  # in the zero bytes after the last record
            byte = int(rng.integers(end, end + 512))
        elif trial % 12 == 7:  # in the frame of the last record (length, magic, seq, num_tokens)
            lo, hi, _name = FRAME_FIELDS[int(rng.integers(0, len(FRAME_FIELDS)))]
            byte = int(offs[-1]) + int(rng.integers(lo, hi))
        elif trial % 6 == 5:  # in a record header
            byte = int(offs[rng.integers(0, offs.size)]) + int(rng.integers(0, RECORD_HEADER_BYTES))
        else:
            byte = int(rng.integers(SEGMENT_HEADER_BYTES, end))
        bit = int(rng.integers(0, 8))
        flip_bit(seg_path(data_dir), byte, bit)
        backlog, report = reopen(data_dir)
        where = f"trial {trial}: bit {bit} of byte {byte}"
        try:
            if byte >= end:
                assert report.quarantined == [], where
                assert report.torn_records == 1 and report.torn_bytes >= 1, where
                check_pending(backlog, ids, counts)
                outcomes["torn_after"] += 1
                continue
            r, field = _which_record(offs, counts, byte)
            keep = np.arange(ids.size) != r
            frame = any(lo <= field < hi for lo, hi, _ in FRAME_FIELDS)
            if frame and r == ids.size - 1:  # the last record's frame is broken: nothing follows, the tail is cut
                assert report.quarantined == [], where
                assert report.torn_records == 1 and 0 < report.torn_bytes <= record_bytes(int(counts[r])), where
                outcomes["torn_last"] += 1
            else:  # quarantined at its offset (CRC or frame), resync finds every later record
                assert [q["offset"] for q in report.quarantined] == [int(offs[r])], f"{where}: {report.quarantined}"
                assert report.quarantined[0]["reason"] and report.quarantined[0]["segment"] == 0
                assert report.torn_records == 0 and report.torn_bytes == 0, where
                outcomes["resynced" if frame else "quarantined"] += 1
                # Not lost in silence: a record whose header still names its item
                # comes back `corrupt()` for that item; one that names none is counted.
                corrupt = backlog.corrupt()["item_id"].tolist()
                if frame or ITEM_HIGH[0] <= field < ITEM_HIGH[1] or PRODUCER_WORD[0] <= field < PRODUCER_WORD[1]:
                    assert corrupt == [] and report.unnamed_corrupt == 1, f"{where}: {corrupt} {report}"
                    names["unnamed"] += 1
                elif ITEM_LOW[0] <= field < ITEM_LOW[1]:  # a flip no check can see: the header names another item
                    assert corrupt == [int(ids[r]) ^ (1 << (8 * (field - ITEM_LOW[0]) + bit))], where
                    names["misnamed"] += 1
                else:
                    assert corrupt == [int(ids[r])] and report.corrupt_records == 1, where
                    assert report.quarantined[0]["item_id"] == int(ids[r]) and report.unnamed_corrupt == 0, where
                    names["named"] += 1
        finally:
            backlog.close()
        if trial % 8 == 0:  # the writer continues after the damage; its records come back
            new_ids = (np.uint64(6) << np.uint64(40)) | np.arange(trial * 4, trial * 4 + 3, dtype=np.uint64)
            new_counts = np.array([1, 50, 200])
            append_more(data_dir, new_ids, new_counts)
            backlog, report = reopen(data_dir)
            try:
                check_pending(backlog, np.concatenate([ids[keep], new_ids]), np.concatenate([counts[keep], new_counts]))
                assert report.torn_records == 0
            finally:
                backlog.close()
        shutil.rmtree(data_dir)
    assert sum(outcomes.values()) == num_flips
    assert all(outcomes.values()), f"every kind of flip must be drawn: {outcomes}"
    assert names["named"] and names["unnamed"], names


def test_bit_flip_in_the_segment_header_is_rewritten_and_its_records_survive(tmp_path, flip_base):
    # The header's bytes rotted (bad magic or checksum); the file's place and name say what they held,
    # and every record carries its own CRC and sequence number (it used to set
    # the whole file aside, every record in it lost without a result).
    base, (ids, counts, _seqs, _segs, offs) = flip_base
    rng = np.random.default_rng([SEED, 4])
    for trial in range(8):
        data_dir = tmp_path / f"h{trial}"
        shutil.copytree(base, data_dir)
        flip_bit(seg_path(data_dir), int(rng.integers(0, SEGMENT_HEADER_BYTES)), int(rng.integers(0, 8)))
        backlog, report = reopen(data_dir)  # must not raise
        try:
            assert report.quarantined, "a segment whose header fails its checks must be reported"
            assert report.quarantined[0]["segment"] == 0
            assert report.segment_headers_rewritten == 1 and len(report.damaged_files) == 1, report
            assert seg_path(data_dir).with_name(f"{0:020d}.header.corrupt").stat().st_size == SEGMENT_HEADER_BYTES
            check_pending(backlog, ids, counts)
            new_ids = (np.uint64(6) << np.uint64(40)) | np.arange(3, dtype=np.uint64)
            w = backlog.writer(0, fsync="never")
            w.append_many(*make_batch(new_ids, [4, 5, 6]))
            w.close(clean=False)
        finally:
            backlog.close()
        backlog, report = reopen(data_dir)
        try:
            check_pending(backlog, np.concatenate([ids, new_ids]), np.concatenate([counts, [4, 5, 6]]))
            assert report.segment_headers_rewritten == 0, "the header was rewritten once"
        finally:
            backlog.close()


def make_foreign(path: Path, version: int = 2) -> None:
    """Give a segment a sound header this build does not read (another layout version)."""
    head = bytearray(path.read_bytes()[:SEGMENT_HEADER_BYTES])
    head[8:12] = struct.pack("<I", version)
    head[60:64] = struct.pack("<I", crc32c.crc32c(bytes(head[:60])))
    poke(path, 0, bytes(head))


def test_a_segment_of_another_layout_version_is_set_aside_and_its_numbers_never_reused(tmp_path, flip_base):
    base, (ids, counts, _seqs, _segs, offs) = flip_base
    data_dir = tmp_path / "foreign"
    shutil.copytree(base, data_dir)
    make_foreign(seg_path(data_dir))
    backlog, report = reopen(data_dir)  # must not raise
    try:
        assert report.quarantined[0]["segment"] == 0 and report.segments_set_aside == 1
        assert "layout version 2" in report.damaged_files[0]["reason"]
        assert backlog.pending().size == 0
        # a writer of this backlog starts afresh, past the sequence numbers the bad file held
        new_ids = (np.uint64(6) << np.uint64(40)) | np.arange(3, dtype=np.uint64)
        w = backlog.writer(0, fsync="never")
        w.append_many(*make_batch(new_ids, [4, 5, 6]))
        w.close(clean=False)
    finally:
        backlog.close()
    backlog, report = reopen(data_dir)
    try:
        check_pending(backlog, new_ids, [4, 5, 6])
        assert (backlog.pending()["seq"] >= np.uint64(ids.size)).all()
    finally:
        backlog.close()


def test_zeroed_length_word_in_the_middle_is_quarantined_and_later_records_survive(tmp_path):
    # A zero length word is the end of data only when nothing follows it (found by the review of
    # it used to end the scan and zero every later committed record as a torn tail).
    counts = [16] * 10  # 128-byte records: the length word has one bit set
    ids, counts, _seqs, _segs, offs = write_backlog(tmp_path, counts)
    assert record_bytes(16) == 128
    flip_bit(seg_path(tmp_path), int(offs[3]), 7)  # length 128 -> 0
    backlog, report = reopen(tmp_path)
    try:
        keep = np.arange(10) != 3
        check_pending(backlog, ids[keep], counts[keep])
        assert [q["offset"] for q in report.quarantined] == [int(offs[3])]
    finally:
        backlog.close()


# --- sequence numbers are never reused: the ack file may remember them -----------------------------


def test_after_a_segment_is_set_aside_a_later_open_never_reuses_its_sequence_numbers(tmp_path):
    ids, counts, *_ = write_backlog(tmp_path, [5] * 10)
    backlog, _ = reopen(tmp_path)
    backlog.ack(0, np.arange(5))  # a consumer finished records 0..4
    backlog.save_acks()
    backlog.close()
    make_foreign(seg_path(tmp_path))
    backlog, report = reopen(tmp_path)  # sets the segment aside
    assert report.quarantined and backlog.pending().size == 0
    backlog.close()
    new_ids = batch_ids(9, 3)
    append_more(tmp_path, new_ids, [4, 4, 4])  # a later run of the broker appends
    backlog, report = reopen(tmp_path)
    try:
        check_pending(backlog, new_ids, [4, 4, 4])
    finally:
        backlog.close()


def test_new_records_never_take_sequence_numbers_the_ack_file_marks_done(tmp_path):
    ids, counts, _seqs, _segs, offs = write_backlog(tmp_path, [5] * 5)
    backlog, _ = reopen(tmp_path)
    backlog.ack(0, [4])  # record 4 was handed out and finished; the ack file is fsynced
    backlog.save_acks()
    backlog.close()
    # power loss: the page holding record 4 never reached the disk (its bytes read back as zeros)
    end = int(offs[-1]) + record_bytes(5)
    poke(seg_path(tmp_path), int(offs[-1]), bytes(end - int(offs[-1])))
    backlog, report = reopen(tmp_path)
    check_pending(backlog, ids[:4], counts[:4])
    backlog.close()
    new_ids = batch_ids(9, 2)
    append_more(tmp_path, new_ids, [4, 4])
    backlog, report = reopen(tmp_path)
    try:
        check_pending(backlog, np.concatenate([ids[:4], new_ids]), [5, 5, 5, 5, 4, 4])
    finally:
        backlog.close()


@pytest.fixture(scope="module")
def sealed_base(tmp_path_factory):
    """Four segments of 64 KiB: three sealed (with .idx), one active."""
    rng = np.random.default_rng([SEED, 5])
    counts = rng.integers(1, 800, 180)
    base = tmp_path_factory.mktemp("sealed_base")
    built = write_backlog(base, counts)
    assert len(np.unique(built[3])) >= 3
    return base, built


def test_bit_flip_in_a_seal_index_falls_back_to_scanning_that_segment(tmp_path, sealed_base):
    base, (ids, counts, _seqs, segs, _offs) = sealed_base
    firsts = np.unique(segs)
    backlog, baseline = reopen(base)
    backlog.close()
    rng = np.random.default_rng([SEED, 6])
    for trial in range(24):
        data_dir = tmp_path / f"i{trial}"
        shutil.copytree(base, data_dir)
        first = int(firsts[rng.integers(0, firsts.size - 1)])  # a sealed one
        idx = data_dir / "backlog" / "w000" / f"{first:020d}.idx"
        assert idx.exists()
        flip_bit(idx, int(rng.integers(0, idx.stat().st_size)), int(rng.integers(0, 8)))
        backlog, report = reopen(data_dir)
        try:
            assert report.scanned_segments == baseline.scanned_segments + 1, "the segment with a bad index is scanned"
            assert report.quarantined == [] and report.torn_bytes == 0
            check_pending(backlog, ids, counts)
        finally:
            backlog.close()
        shutil.rmtree(data_dir)


# --- 3. a full disk ------------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs mounted for the test (skipped when this machine cannot mount one)."""
    with mounted_tmpfs(tmp_path / "small_fs", mib=2) as mnt:
        yield mnt


def batch_ids(k: int, count: int) -> np.ndarray:
    return (np.uint64(7) << np.uint64(40)) | (np.uint64(k * 100) + np.arange(count, dtype=np.uint64))


def no_temp_files(data_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(data_dir)) for p in data_dir.rglob(".*.tmp"))


def test_disk_full_on_a_small_filesystem_loses_nothing_and_appending_resumes_after_reclaim(small_fs):
    segment_bytes = 384 << 10  # 2 MiB holds five of them: the sixth cannot be allocated
    data_dir = small_fs / "data"
    backlog, _ = reopen(data_dir, segment_bytes)
    w = backlog.writer(0, fsync="never")
    committed_ids, committed_counts = [], []
    counts = np.array([3000, 2500, 1, 2999, 3001, 700])
    failed = None
    for k in range(100):
        ids = batch_ids(k, counts.size)
        try:
            w.append_many(*make_batch(ids, counts))
        except DiskFull as exc:
            failed = (k, ids, exc)
            break
        committed_ids.append(ids)
        committed_counts.append(counts)
    assert failed is not None, "a 2 MiB filesystem must fill up"
    k_full, ids_full, exc = failed
    assert exc.appended == 0 or 0 < exc.appended <= ids_full.size
    assert k_full >= 10, "several segments went in before the disk was full"
    # a retry while still full fails the same way, and adds nothing
    with pytest.raises(DiskFull):
        w.append_many(*make_batch(ids_full, counts))
    w.close(clean=False)
    backlog.close()

    backlog, report = reopen(data_dir, segment_bytes)
    try:
        pend = backlog.pending()
        went_in = np.isin(pend["item_id"], ids_full)
        assert int(went_in.sum()) == exc.appended, "appended counts exactly the failed call's records that went in"
        want_ids = np.concatenate(committed_ids + [pend["item_id"][went_in]])
        want_counts = np.concatenate(committed_counts + [pend["num_tokens"][went_in].astype(np.int64)])
        check_pending(backlog, want_ids, want_counts)
        assert report.quarantined == [] and report.torn_bytes == 0
        # space returns: everything is done, reclaim deletes all sealed segments
        backlog.ack(0, pend["seq"])
        backlog.save_acks()
        assert backlog.reclaim() >= 4
        w = backlog.writer(0, fsync="never")
        try:
            w.append_many(*make_batch(ids_full, counts))
            w.append_many(*make_batch(batch_ids(k_full + 1, counts.size), counts))
        finally:
            w.close(clean=True)
    finally:
        backlog.close()
    backlog, report = reopen(data_dir, segment_bytes)
    try:
        more = np.concatenate([ids_full, batch_ids(k_full + 1, counts.size)])
        check_pending(backlog, more, np.concatenate([counts, counts]))
        assert no_temp_files(data_dir) == []
    finally:
        backlog.close()


def test_disk_full_then_space_freed_by_deleting_a_file_the_same_writer_resumes(small_fs):
    segment_bytes = 256 << 10
    data_dir = small_fs / "data"
    backlog, _ = reopen(data_dir, segment_bytes)
    w = backlog.writer(0, fsync="never")
    counts = np.array([4000, 4000, 3000])
    w.append_many(*make_batch(batch_ids(0, 3), counts))
    filler = fill(small_fs, 40 * PAGE)  # room for a seal index, not for another segment
    committed = [batch_ids(0, 3)]
    with pytest.raises(DiskFull) as info:
        for k in range(1, 50):
            w.append_many(*make_batch(batch_ids(k, 3), counts))
            committed.append(batch_ids(k, 3))
    k_full = len(committed)
    assert info.value.appended == 0 or info.value.appended < 3
    assert no_temp_files(data_dir) == [], "a failed allocation leaves no spare file behind"
    filler.unlink()
    w.append_many(*make_batch(batch_ids(k_full, 3), counts))  # the same writer, the same batch: it goes in now
    committed.append(batch_ids(k_full, 3))
    w.close(clean=True)
    backlog.close()
    backlog, report = reopen(data_dir, segment_bytes)
    try:
        pend = backlog.pending()
        partial = np.isin(pend["item_id"], batch_ids(k_full, 3)).sum() - 3
        assert partial in (0, info.value.appended), "the failed call's records are in at most once"
        ids = np.concatenate(committed)
        check_pending(backlog, ids, np.tile(counts, len(committed)))
        assert report.quarantined == []
    finally:
        backlog.close()


def test_disk_full_while_sealing_is_disk_full_and_all_or_nothing(small_fs):
    segment_bytes = 256 << 10
    data_dir = small_fs / "data"
    backlog, _ = reopen(data_dir, segment_bytes)
    w = backlog.writer(0, fsync="never")
    w.append_many(*make_batch(batch_ids(0, 1), [40000]))  # 160 KB of a 256 KiB segment
    fill(small_fs, segment_bytes)  # exactly one more segment fits: the spare, and then nothing
    counts = np.array([9000, 9000, 9000, 9000])  # two fit in the active segment, two need the next one
    ids = batch_ids(1, 4)
    try:
        w.append_many(*make_batch(ids, counts))
        went_in = "all"
    except DiskFull:
        went_in = "none"
    finally:
        try:
            w.close(clean=False)
        finally:
            backlog.close()
    backlog, _ = reopen(data_dir, segment_bytes)
    try:
        n = int(np.isin(backlog.pending()["item_id"], ids).sum())
        assert n == (4 if went_in == "all" else 0), f"{n} of the batch's 4 records went in"
    finally:
        backlog.close()


class _OsWith:
    """`os` with some functions replaced, for one module's view of it."""

    def __init__(self, **replaced):
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(os, name)


def _fallocate_failing_once(err: int, calls: list):
    def posix_fallocate(fd, offset, length):
        calls.append(length)
        if len(calls) == 1:
            raise OSError(err, os.strerror(err))
        return os.posix_fallocate(fd, offset, length)

    return posix_fallocate


@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_injected_allocation_error(tmp_path, monkeypatch, err):
    data_dir = tmp_path / "data"
    backlog, _ = reopen(data_dir)
    w = backlog.writer(0, fsync="never")
    first = batch_ids(0, 1)
    w.append_many(*make_batch(first, [10000]))  # 40 KB of a 64 KiB segment
    calls: list[int] = []
    monkeypatch.setattr(segment_mod, "os", _OsWith(posix_fallocate=_fallocate_failing_once(err, calls)))
    ids = batch_ids(1, 3)
    counts = np.array([3000, 3000, 3000])  # needs a new segment
    if err == errno.ENOSPC:
        with pytest.raises(DiskFull) as info:
            w.append_many(*make_batch(ids, counts))
        appended = info.value.appended
        assert "space" in str(info.value)
    else:
        with pytest.raises(OSError) as info:
            w.append_many(*make_batch(ids, counts))
        assert info.value.errno == errno.EIO, "an I/O error is not a full disk: it propagates as it is"
        appended = None
    assert calls, "the injected posix_fallocate was called"
    assert no_temp_files(data_dir) == [], "a failed allocation leaves no spare file behind"
    w.append_many(*make_batch(ids, counts))  # the error was transient: the retry goes in
    w.close(clean=False)
    backlog.close()
    monkeypatch.undo()
    backlog, report = reopen(data_dir)
    try:
        pend = backlog.pending()
        n = int(np.isin(pend["item_id"], ids).sum())
        if appended is not None:
            assert n == 3 + appended, "DiskFull.appended says exactly how many of the failed call went in"
        assert report.quarantined == [] and report.torn_bytes == 0
        assert n in (3, 6)
        if n == 3:
            check_pending(backlog, np.concatenate([first, ids]), np.concatenate([[10000], counts]))
    finally:
        backlog.close()


# --- 4. limits and bad states --------------------------------------------------------------------


def dir_snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_record_larger_than_a_segment_is_refused_before_anything_is_written(tmp_path):
    data_dir = tmp_path / "data"
    backlog, _ = reopen(data_dir)
    w = backlog.writer(0, fsync="never")
    try:
        w.append_many(*make_batch(batch_ids(0, 2), [5, 6]))
        before, next_seq, end = dir_snapshot(data_dir), w.next_seq, w.end_offset
        with pytest.raises(ValueError, match="exceeds a segment"):
            w.append_many(*make_batch(batch_ids(1, 1), [MAX_TOKENS + 1]))
        with pytest.raises(ValueError):  # one too large in a batch: none of the batch goes in
            w.append_many(*make_batch(batch_ids(2, 3), [10, MAX_TOKENS + 1, 10]))
        assert dir_snapshot(data_dir) == before and w.next_seq == next_seq and w.end_offset == end
        w.append_many(*make_batch(batch_ids(3, 2), [MAX_TOKENS, 1]))  # exactly a segment's maximum fits
    finally:
        w.close(clean=False)
        backlog.close()
    backlog, report = reopen(data_dir)
    try:
        check_pending(backlog, np.concatenate([batch_ids(0, 2), batch_ids(3, 2)]), [5, 6, MAX_TOKENS, 1])
    finally:
        backlog.close()


def test_stale_temp_files_are_removed_at_open_and_counted(tmp_path):
    data_dir = tmp_path / "data"
    ids, counts, *_ = write_backlog(data_dir, [3, 4, 5])
    backlog, _ = reopen(data_dir)
    backlog.ack(0, [0])
    backlog.save_acks()
    backlog.close()
    root = data_dir / "backlog"
    stale = [
        root / ".acks.bin.123.tmp",
        root / "w000" / ".x.tmp",
        root / "w000" / ".spare-0123456789ab.tmp",
        root / "w000" / f".{0:020d}.idx.77.tmp",
    ]
    for path in stale:
        path.write_bytes(b"half a write")
    backlog, report = reopen(data_dir)
    try:
        assert report.temp_files_removed == len(stale)
        assert not any(p.exists() for p in stale)
        assert report.ack_file == "ok"
        check_pending(backlog, ids[1:], counts[1:])
    finally:
        backlog.close()
    backlog, report = reopen(data_dir)
    assert report.temp_files_removed == 0
    backlog.close()


def test_directories_are_0700_and_files_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        data_dir = tmp_path / "data"
        rng = np.random.default_rng([SEED, 7])
        write_backlog(data_dir, rng.integers(1, 800, 120))  # seals two segments or more
        backlog, _ = reopen(data_dir)
        backlog.ack(0, [0, 1])
        backlog.save_acks()
        backlog.close()
        backlog, _ = reopen(data_dir)
        backlog.writer(0, fsync="never").close(clean=True)
        backlog.close()
    finally:
        os.umask(old)
    root = data_dir / "backlog"
    names = {p.suffix or p.name for p in root.rglob("*") if p.is_file()}
    assert {".seg", ".idx", ".bin"} <= names, names
    for path in [data_dir, root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        if path.is_dir():
            assert mode == 0o700, f"{path}: {mode:o}"
        else:
            assert mode == 0o600, f"{path}: {mode:o}"


def test_record_magic_constant_matches_the_layout_table():
    # the fault tests above poke bytes by the layout table: make sure it is the one the code uses
    assert struct.pack("<I", RECORD_MAGIC) == b"SMBR"
    assert record_bytes(1) == 72 and record_bytes(2) == 72 and record_bytes(0) == RECORD_HEADER_BYTES
