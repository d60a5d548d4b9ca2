"""The backlog's parts one at a time: CRC32C kernel, acks, record kernels, seal index, segment files, writer.

Each against something simpler: the `crc32c` package, a Python set, plain
numpy buffers. The regression tests at the end pin bugs found here; each
says what was wrong and where.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import crc32c as crc32c_pkg
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import shmbroker.spill.segment as segment_mod
from shmbroker.errors import DiskFull
from shmbroker.ring import crc as kcrc
from shmbroker.spill import records
from shmbroker.spill.acks import ACKS_FILE, AckFileCorrupt, Acks
from shmbroker.spill.layout import (
    ITEM_DTYPE,
    R64_ITEM,
    R64_PREFIX_KEY,
    R64_SEQ,
    R_BAND,
    R_CRC,
    R_LENGTH,
    R_MAX_NEW,
    R_MODEL,
    R_NUM_TOKENS,
    R_PREFIX_LEN,
    R_PRODUCER,
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    idx_name,
    max_tokens,
    record_bytes,
)
from shmbroker.spill.model import record_bytes as model_record_bytes
from shmbroker.spill.segment import SegmentFile, idx_bytes, read_idx, write_idx
from shmbroker.spill.store import Backlog
from shmbroker.spill.writer import SegmentWriter

pytestmark = pytest.mark.timeout(120)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


# -- helpers ---------------------------------------------------------------------


def make_batch(lengths, seed=0, shapes=None):
    """(flat, offsets, items) with random tokens and metadata; shapes: optional (model, prefix_key, band) per item."""
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
    items = np.zeros(len(lengths), ITEM_DTYPE)
    items["item_id"] = rng.integers(0, 2**63, len(lengths), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    items["prefix_key"] = rng.integers(0, 2**63, len(lengths), dtype=np.uint64)
    items["producer"] = rng.integers(0, 2**32, len(lengths), dtype=np.uint32)
    items["model"] = rng.integers(0, 2**32, len(lengths), dtype=np.uint32)
    items["prefix_len"] = rng.integers(0, 2**32, len(lengths), dtype=np.uint32)
    items["max_new_tokens"] = rng.integers(0, 2**32, len(lengths), dtype=np.uint32)
    items["shape_band"] = rng.integers(0, 2**32, len(lengths), dtype=np.uint32)
    if shapes is not None:
        for i, (model, key, band) in enumerate(shapes):
            items[i]["model"], items[i]["prefix_key"], items[i]["shape_band"] = model, key, band
    return flat, offsets, items


def write_all(seg, start, flat, offsets, items, seq0, end_limit=None):
    """write_records over the whole batch in input order; returns (n written, new offset, seqs, record offsets)."""
    count = offsets.size - 1
    order = np.arange(count, dtype=np.int64)
    out_seq = np.zeros(count, np.uint64)
    out_off = np.zeros(count, np.int64)
    n, end = records.write_records(
        seg, start, seg.size if end_limit is None else end_limit, flat, offsets, items, order, 0, seq0, out_seq, out_off
    )
    return int(n), int(end), out_seq, out_off


def scan_all(seg, start, end, next_seq, check_crc=True, chunk=64):
    """scan until it stops; returns (offsets, statuses, outcome, offset, next_seq, cut)."""
    out_off = np.zeros(chunk, np.int64)
    out_st = np.zeros(chunk, np.int64)
    offs, sts = [], []
    off = start
    for _ in range(100_000):
        n, outcome, off, next_seq, cut = records.scan(seg, off, end, next_seq, check_crc, out_off, out_st)
        offs += out_off[:n].tolist()
        sts += out_st[:n].tolist()
        if outcome != records.SCAN_FULL:
            return offs, sts, int(outcome), int(off), int(next_seq), int(cut)
    raise AssertionError("scan did not finish")


def header_fields(seg, off):
    w32 = seg[off : off + RECORD_HEADER_BYTES].view(np.uint32)
    w64 = seg[off : off + RECORD_HEADER_BYTES].view(np.uint64)
    return {
        "seq": int(w64[R64_SEQ]),
        "item_id": int(w64[R64_ITEM]),
        "prefix_key": int(w64[R64_PREFIX_KEY]),
        "producer": int(w32[R_PRODUCER]),
        "model": int(w32[R_MODEL]),
        "prefix_len": int(w32[R_PREFIX_LEN]),
        "num_tokens": int(w32[R_NUM_TOKENS]),
        "max_new_tokens": int(w32[R_MAX_NEW]),
        "shape_band": int(w32[R_BAND]),
    }


def new_writer(tmp_path: Path, **kw) -> SegmentWriter:
    kw.setdefault("segment_bytes", 8192)
    kw.setdefault("fsync", "never")
    return SegmentWriter(tmp_path, 0, next_seq=0, active=None, active_end=SEGMENT_HEADER_BYTES, active_offsets=[], **kw)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- CRC32C kernel -----------------------------------------------------------------


def test_record_bytes_agree_with_the_model():
    for n in range(0, 300):
        assert record_bytes(n) == model_record_bytes(n)


@settings(max_examples=200, deadline=None)
@given(data=st.binary(min_size=0, max_size=600), start=st.integers(0, 16), cut=st.integers(0, 16))
def test_crc32c_kernel_equals_package(data, start, cut):
    buf = np.frombuffer(bytes(17) + data + bytes(17), np.uint8)[17 - start :]  # data at an unaligned address
    lo, hi = start, start + max(0, len(data) - cut)
    want = crc32c_pkg.crc32c(bytes(buf[lo:hi]))
    assert int(kcrc.crc32c_final(kcrc.crc32c_update(kcrc.crc32c_init(), buf, lo, hi))) == want
    assert int(kcrc.crc32c(buf[lo:hi].copy())) == want
    assert int(kcrc.crc32c(buf[lo:hi])) == want  # a view at an unaligned address
    assert int(kcrc.crc32c_final(kcrc._bytes_update(kcrc.crc32c_init(), buf, lo, hi))) == want  # the table path


def test_crc32c_kernel_every_small_length_and_start():
    rng = np.random.default_rng(1)
    base = rng.integers(0, 256, 200, dtype=np.uint8)
    for start in range(9):
        for length in range(0, 80):
            want = crc32c_pkg.crc32c(base[start : start + length].tobytes())
            assert int(kcrc.crc32c_final(kcrc.crc32c_update(kcrc.crc32c_init(), base, start, start + length))) == want, (start, length)


def test_crc32c_kernel_continues_across_pieces_and_large_buffers():
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    want = crc32c_pkg.crc32c(data.tobytes())
    assert int(kcrc.crc32c(data)) == want
    cuts = sorted(rng.integers(0, data.size, 9).tolist())
    crc = kcrc.crc32c_init()
    for lo, hi in zip([0] + cuts, cuts + [data.size]):
        crc = kcrc.crc32c_update(crc, data, lo, hi)
    assert int(kcrc.crc32c_final(crc)) == want
    assert int(kcrc.crc32c(np.empty(0, np.uint8))) == crc32c_pkg.crc32c(b"") == 0


# -- acks against a Python set ---------------------------------------------------------

SEQ_MAX = 160
SEQS = st.one_of(
    st.lists(st.integers(0, SEQ_MAX), max_size=20),
    st.builds(lambda lo, n: list(range(lo, lo + n)), st.integers(0, SEQ_MAX), st.integers(0, 40)),
)


def model_cursor_and_runs(done: set[int]) -> tuple[int, list[tuple[int, int]]]:
    cursor = 0
    while cursor in done:
        cursor += 1
    runs = []
    for s in sorted(x for x in done if x > cursor):
        if runs and runs[-1][1] == s:
            runs[-1] = (runs[-1][0], s + 1)
        else:
            runs.append((s, s + 1))
    return cursor, runs


def check_acks_equal(acks: Acks, model: dict[int, set[int]]):
    probe = np.arange(SEQ_MAX + 50, dtype=np.uint64)
    for writer in (0, 1, 2):
        done = model.get(writer, set())
        assert acks.done_mask(writer, probe).tolist() == [int(s) in done for s in probe]
        cursor, runs = model_cursor_and_runs(done)
        assert acks.cursor.get(writer, 0) == cursor
        assert [tuple(int(v) for v in r) for r in acks.ranges.get(writer, np.empty((0, 2), np.uint64))] == runs


class AcksMachine(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.acks = Acks()
        self.model: dict[int, set[int]] = {}

    @rule(writer=st.integers(0, 2), seqs=SEQS, shuffle=st.randoms(use_true_random=False))
    def ack(self, writer, seqs, shuffle):
        shuffle.shuffle(seqs)
        self.acks.ack(writer, seqs if len(seqs) != 1 else seqs[0])
        self.model.setdefault(writer, set()).update(seqs)

    @rule(writer=st.integers(0, 2), seq=st.integers(0, SEQ_MAX + 10))
    def set_floor(self, writer, seq):
        self.acks.set_floor(writer, seq)
        self.model.setdefault(writer, set()).update(range(seq))

    @rule()
    def compact(self):
        self.acks.compact()

    @rule(writer=st.integers(0, 2), lo=st.integers(0, SEQ_MAX + 10), n=st.integers(0, 60))
    def all_done(self, writer, lo, n):
        done = self.model.get(writer, set())
        assert self.acks.all_done(writer, lo, lo + n) == all(s in done for s in range(lo, lo + n))

    @rule()
    def round_trip(self):
        again = Acks.from_bytes(self.acks.to_bytes())
        check_acks_equal(again, self.model)
        self.acks = again  # later steps go on from the loaded copy

    @invariant()
    def same_done_sets(self):
        if hasattr(self, "acks"):
            check_acks_equal(self.acks, self.model)
            assert self.acks.num_ranges() == sum(len(model_cursor_and_runs(d)[1]) for d in self.model.values())


AcksMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestAcksModel = AcksMachine.TestCase


def test_acks_absorb_into_the_cursor_on_boundaries():
    acks = Acks()
    acks.ack(0, [3, 4, 5, 10])
    acks.compact()
    assert acks.cursor[0] == 0 and acks.ranges[0].tolist() == [[3, 6], [10, 11]]
    assert not acks.all_done(0, 0, 1) and acks.all_done(0, 3, 6) and not acks.all_done(0, 3, 7) and acks.all_done(0, 5, 5)
    acks.ack(0, [0, 1, 2])
    acks.compact()
    assert acks.cursor[0] == 6 and acks.ranges[0].tolist() == [[10, 11]]
    assert acks.all_done(0, 0, 6) and not acks.all_done(0, 0, 7) and acks.all_done(0, 10, 11) and not acks.all_done(0, 10, 12)
    acks.set_floor(0, 10)  # absorbs the run that starts at the floor
    assert acks.cursor[0] == 11 and acks.ranges[0].size == 0
    acks.set_floor(0, 5)  # a floor below the cursor changes nothing
    assert acks.cursor[0] == 11


def test_acks_many_at_once_compact_themselves():
    acks = Acks()
    seqs = np.random.default_rng(3).permutation(200_000).astype(np.uint64)
    acks.ack(1, seqs[:150_000])  # past COMPACT_EVERY: merged at once
    assert acks.cursor[1] == int(np.setdiff1d(np.arange(200_001), seqs[:150_000])[0])
    acks.ack(1, seqs[150_000:])
    assert acks.num_ranges() == 0 and acks.cursor[1] == 200_000


@FAST
@given(writers=st.dictionaries(st.integers(0, 5), st.lists(st.integers(0, 300), max_size=40), max_size=4), data=st.data())
def test_ack_bytes_detect_any_corrupted_byte(writers, data):
    acks = Acks()
    for w, seqs in writers.items():
        acks.ack(w, seqs)
    raw = acks.to_bytes()
    pos = data.draw(st.integers(0, len(raw) - 1), label="pos")
    flip = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(raw)
    bad[pos] ^= flip
    with pytest.raises(AckFileCorrupt):
        Acks.from_bytes(bytes(bad))
    cut = data.draw(st.integers(0, len(raw) - 1), label="cut")
    with pytest.raises(AckFileCorrupt):
        Acks.from_bytes(raw[:cut])
    with pytest.raises(AckFileCorrupt):
        Acks.from_bytes(raw + b"\0")


def test_acks_save_load_mode_0600(tmp_path):
    acks = Acks()
    acks.ack(0, [0, 1, 2, 7])
    acks.ack(3, [5])
    (tmp_path / ACKS_FILE).write_bytes(b"old")
    os.chmod(tmp_path / ACKS_FILE, 0o644)
    acks.save(tmp_path)
    assert stat.S_IMODE((tmp_path / ACKS_FILE).stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == [".reserve", ACKS_FILE]  # no temp file left (the space reserve stays)
    loaded = Acks.load(tmp_path)
    check_acks_equal(loaded, {0: {0, 1, 2, 7}, 3: {5}})
    assert loaded.to_bytes() == acks.to_bytes()
    assert Acks.load(tmp_path / "nowhere").num_ranges() == 0  # no file: nothing done
    raw = bytearray((tmp_path / ACKS_FILE).read_bytes())
    raw[17] ^= 1
    (tmp_path / ACKS_FILE).write_bytes(bytes(raw))
    with pytest.raises(AckFileCorrupt):
        Acks.load(tmp_path)


# -- record kernels on a plain buffer -------------------------------------------------------

LENGTHS = st.lists(st.one_of(st.integers(0, 40), st.integers(40, 700)), min_size=0, max_size=40)


@FAST
@given(lengths=LENGTHS, seed=st.integers(0, 2**32 - 1), seq0=st.integers(0, 2**40))
def test_records_round_trip(lengths, seed, seq0):
    flat, offsets, items = make_batch(lengths, seed)
    seg = np.zeros(SEGMENT_HEADER_BYTES + sum(record_bytes(n) for n in lengths) + 256, np.uint8)
    n, end, out_seq, out_off = write_all(seg, SEGMENT_HEADER_BYTES, flat, offsets, items, seq0)
    assert n == len(lengths)
    assert out_seq.tolist() == list(range(seq0, seq0 + n))
    expected_offsets = (SEGMENT_HEADER_BYTES + np.r_[0, np.cumsum([record_bytes(k) for k in lengths])]).tolist()
    assert out_off.tolist() == expected_offsets[:-1] and end == expected_offsets[-1]
    offs, sts, outcome, off, next_seq, cut = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, seq0, chunk=7)  # SCAN_FULL several times
    assert (outcome, off, next_seq, cut) == (records.SCAN_END, end, seq0 + n, 0)
    assert offs == out_off.tolist() and sts == [records.REC_OK] * n
    for i, o in enumerate(offs):
        h = header_fields(seg, o)
        assert h["seq"] == seq0 + i and h["num_tokens"] == lengths[i]
        for key in ("item_id", "prefix_key", "producer", "model", "prefix_len", "max_new_tokens", "shape_band"):
            assert h[key] == int(items[i][key]), key
        assert int(seg[o : o + 4].view(np.uint32)[0]) == record_bytes(lengths[i])
        assert int(seg[o + 4 * R_CRC : o + 4 * R_CRC + 4].view(np.uint32)[0]) == crc32c_pkg.crc32c(
            seg[o + 12 : o + record_bytes(lengths[i])].tobytes()
        )
    out_flat = np.zeros(flat.size, np.uint32)
    out_offsets = np.zeros(n + 1, np.int64)
    assert records.gather(seg, out_off, out_flat, out_offsets, 0) == n
    assert np.array_equal(out_flat, flat) and np.array_equal(out_offsets, offsets)


def test_write_records_stops_at_the_end_limit():
    flat, offsets, items = make_batch([100] * 10)
    limit = SEGMENT_HEADER_BYTES + 3 * record_bytes(100) + record_bytes(100) - 8
    seg = np.zeros(8192, np.uint8)
    n, end, _seq, out_off = write_all(seg, SEGMENT_HEADER_BYTES, flat, offsets, items, 5, end_limit=limit)
    assert n == 3 and end == SEGMENT_HEADER_BYTES + 3 * record_bytes(100)
    assert not seg[end:].any()  # nothing written past the records that fit


def test_scan_never_trusts_an_uncommitted_record():
    flat, offsets, items = make_batch([10, 11, 12])
    seg = np.zeros(4096, np.uint8)
    _n, _end, _seq, out_off = write_all(seg, SEGMENT_HEADER_BYTES, flat, offsets, items, 0)
    seg[int(out_off[2]) : int(out_off[2]) + 4] = 0  # the last length word never got stored
    offs, sts, outcome, off, next_seq, cut = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, 0)
    assert offs == out_off[:2].tolist() and sts == [records.REC_OK] * 2
    # its bytes form no record: a torn tail, to be cut, never a clean end with bytes after it
    assert (outcome, off, next_seq) == (records.SCAN_TORN, int(out_off[2]), 2)
    assert cut > 0 and not seg[off + cut :].any()


def test_scan_quarantines_bad_crc_and_resyncs_past_a_wrong_sequence():
    flat, offsets, items = make_batch([10, 11, 12, 13, 14], seed=4)
    seg = np.zeros(8192, np.uint8)
    _n, end, _seq, out_off = write_all(seg, SEGMENT_HEADER_BYTES, flat, offsets, items, 100)
    seg[int(out_off[1]) + RECORD_HEADER_BYTES + 3] ^= 0x10  # a token bit of record 1
    o = int(out_off[3])
    seg[o + 8 * R64_SEQ : o + 8 * R64_SEQ + 8] = np.array([999], np.uint64).view(np.uint8)  # record 3: wrong sequence
    seg[o + 4 * R_CRC : o + 4 * R_CRC + 4] = np.array([crc32c_pkg.crc32c(seg[o + 12 : o + record_bytes(13)].tobytes())], np.uint32).view(
        np.uint8
    )
    offs, sts, outcome, off, next_seq, cut = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, 100)
    assert offs == out_off.tolist()
    assert sts == [records.REC_OK, records.REC_BAD_CRC, records.REC_OK, records.REC_BAD_FRAME, records.REC_OK]
    assert (outcome, off, next_seq, cut) == (records.SCAN_END, end, 105, 0)
    # without CRC checks the flipped token goes unnoticed, the sequence still does not
    offs, sts, *_ = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, 100, check_crc=False)
    assert sts == [records.REC_OK, records.REC_OK, records.REC_OK, records.REC_BAD_FRAME, records.REC_OK]
    # a scan expecting another first sequence takes nothing at the start as a record of its own
    offs, sts, *_ = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, 50)
    assert sts[0] == records.REC_BAD_FRAME


def test_scan_cuts_a_torn_tail():
    flat, offsets, items = make_batch([10, 20])
    seg = np.zeros(4096, np.uint8)
    _n, end, _seq, out_off = write_all(seg, SEGMENT_HEADER_BYTES, flat, offsets, items, 0)
    seg[end : end + 4] = np.array([200], np.uint32).view(np.uint8)  # a length word, then garbage
    seg[end + 100] = 7
    offs, sts, outcome, off, next_seq, cut = scan_all(seg, SEGMENT_HEADER_BYTES, seg.size, 0)
    assert offs == out_off.tolist() and sts == [records.REC_OK] * 2
    assert (outcome, off, next_seq, cut) == (records.SCAN_TORN, end, 2, 101)


# -- seal index -----------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[], [0], [5, 100, 0, 33, 700, 1]])
def test_idx_round_trip_and_corruption(tmp_path, lengths):
    seg = SegmentFile.create(tmp_path, 3, 40, 8192)
    try:
        flat, offsets, items = make_batch(lengths, seed=5)
        n, end, _seq, out_off = write_all(seg.buf, SEGMENT_HEADER_BYTES, flat, offsets, items, 40)
        assert n == len(lengths)
        write_idx(tmp_path, seg.first_seq, idx_bytes(seg, out_off, end))
        path = tmp_path / idx_name(40)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        got = read_idx(path)
        assert got is not None
        idx_offsets, headers, idx_end = got
        assert idx_offsets.tolist() == out_off.tolist() and idx_end == end
        for k, o in enumerate(out_off):
            assert headers[k].tobytes() == seg.buf[o : o + RECORD_HEADER_BYTES].tobytes()
        raw = path.read_bytes()
        for pos in sorted({0, 9, 17, 60, len(raw) // 2, len(raw) - 1}):
            bad = bytearray(raw)
            bad[pos] ^= 0x01
            path.write_bytes(bytes(bad))
            assert read_idx(path) is None, pos
        path.write_bytes(raw[:-1])
        assert read_idx(path) is None
        path.write_bytes(raw[:10])
        assert read_idx(path) is None
        path.unlink()
        assert read_idx(path) is None
    finally:
        seg.close()


# -- segment files ------------------------------------------------------------------------


def test_segment_header_refuses_foreign_files(tmp_path):
    seg = SegmentFile.create(tmp_path, 2, 77, 8192)
    path = seg.path
    seg.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    again = SegmentFile.open(path)
    assert (again.first_seq, again.writer, again.size) == (77, 2, 8192)
    again.close()
    fds = open_fds()
    foreign = tmp_path / "foreign.seg"
    foreign.write_bytes(np.random.default_rng(6).integers(0, 256, 8192, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError):
        SegmentFile.open(foreign)
    zeros = tmp_path / "zeros.seg"
    zeros.write_bytes(bytes(8192))
    with pytest.raises(ValueError):
        SegmentFile.open(zeros)
    empty = tmp_path / "empty.seg"
    empty.write_bytes(b"")
    with pytest.raises(ValueError):
        SegmentFile.open(empty)
    raw = bytearray(path.read_bytes())
    for pos in (0, 12, 20, 59, 61):  # magic, writer, first_seq, reserved, the checksum itself
        bad = bytearray(raw)
        bad[pos] ^= 0x04
        path.write_bytes(bytes(bad))
        with pytest.raises(ValueError):
            SegmentFile.open(path)
    assert open_fds() == fds  # a refused file leaves no descriptor open


# -- the writer --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        {"fsync": "sometimes"},
        {"fsync": "ALWAYS"},
        {"segment_bytes": 0},
        {"segment_bytes": 2048},
        {"segment_bytes": 4095},
        {"segment_bytes": 8192 + 512},
        {"segment_bytes": -4096},
        {"fsync_interval_ms": 0},
        {"fsync": "interval", "fsync_interval_ms": -1.0},
    ],
)
def test_writer_refuses_bad_settings(tmp_path, kw):
    with pytest.raises(ValueError):
        new_writer(tmp_path, **kw)
    w = new_writer(tmp_path)  # a refused writer holds nothing (no lock, no thread)
    w.close()


def test_writer_refuses_a_record_larger_than_a_segment(tmp_path):
    w = new_writer(tmp_path, segment_bytes=8192)
    try:
        largest = max_tokens(8192)
        assert record_bytes(largest) + SEGMENT_HEADER_BYTES == 8192
        with pytest.raises(ValueError):
            w.append_many(*make_batch([3, largest + 1]))
        assert w.next_seq == 0 and not list(tmp_path.glob("*.seg"))
        seqs, segments, offs = w.append_many(*make_batch([largest, largest]))  # exactly a segment each
        assert seqs.tolist() == [0, 1] and segments.tolist() == [0, 1] and offs.tolist() == [SEGMENT_HEADER_BYTES] * 2
    finally:
        w.close()


@FAST
@given(
    shapes=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([0, 5, 2**63 + 1]), st.integers(0, 2)), min_size=1, max_size=60),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_append_many_clusters_a_batch_by_shape(tmp_path_factory, shapes, seed, data):
    lengths = data.draw(st.lists(st.integers(0, 300), min_size=len(shapes), max_size=len(shapes)), label="lengths")
    backlog, _ = Backlog.open(tmp_path_factory.mktemp("cluster"), segment_bytes=64 << 10)
    w = backlog.writer(0, fsync="never")
    try:
        w.append_many(*make_batch([7, 9], seed + 1))  # the batch does not start at a segment's start
        flat, offsets, items = make_batch(lengths, seed, shapes)
        seqs, segments, offs = w.append_many(flat, offsets, items, cluster=True)
        key = [(int(it["model"]), int(it["prefix_key"]), int(it["shape_band"])) for it in items]
        by_seq = np.argsort(seqs)
        assert seqs[by_seq].tolist() == list(range(2, 2 + len(shapes)))
        assert by_seq.tolist() == sorted(range(len(shapes)), key=lambda i: key[i])  # shape order, stable
        for a, b in zip(by_seq[:-1], by_seq[1:]):
            if segments[a] == segments[b]:  # written back to back: a shape's records are contiguous
                assert offs[b] == offs[a] + record_bytes(lengths[a])
            else:
                assert offs[b] == SEGMENT_HEADER_BYTES
        # cluster=False keeps input order
        seqs2, _segments2, offs2 = w.append_many(flat, offsets, items, cluster=False)
        assert seqs2.tolist() == list(range(2 + len(shapes), 2 + 2 * len(shapes)))
    finally:
        w.close()
        backlog.close()


# -- bugs -------------------------------------------------------------------------------


def test_reserve_covers_every_segment_a_batch_rolls_into(tmp_path, monkeypatch):
    w = new_writer(tmp_path, segment_bytes=8192)
    try:
        # 2136- and 6000-byte records alternate: no two fit in one 8 KiB segment, so 4 records take 4 segments
        lengths = [518, 1484, 518, 1484]
        assert [record_bytes(n) for n in lengths] == [2136, 6000, 2136, 6000]

        def disk_full(*_args, **_kw):
            raise DiskFull("injected: no space once the batch has started")

        monkeypatch.setattr(segment_mod, "allocate_spare", disk_full)  # only allocations after the reservation fail
        try:
            w.append_many(*make_batch(lengths), cluster=False)
        except DiskFull:
            assert w.next_seq == 0, f"DiskFull after {w.next_seq} of the batch's records were committed"
    finally:
        w.close()


def test_spares_do_not_outlive_a_batch(tmp_path):
    backlog, _ = Backlog.open(tmp_path, segment_bytes=8192)
    w = backlog.writer(0, fsync="never")
    try:
        seqs, segments, _offs = w.append_many(*make_batch([984] * 4), cluster=False)
        assert sorted(set(segments.tolist())) == [0, 2]
        backlog.ack(0, seqs)
        assert backlog.reclaim() == 1
        assert list(backlog.root.glob("w000/.spare-*")) == []
        assert backlog.disk_bytes() <= 8192 + 4096
    finally:
        w.close()
        backlog.close()


def test_a_zeroed_length_word_mid_segment_loses_only_that_record(tmp_path):
    backlog, _ = Backlog.open(tmp_path, segment_bytes=65536)
    w = backlog.writer(0, fsync="never")
    _seqs, _segments, offs = w.append_many(*make_batch([10, 11, 12, 13, 14]), cluster=False)
    w.close(clean=False)
    backlog.close()
    path = tmp_path / "backlog" / "w000" / f"{0:020d}.seg"
    raw = bytearray(path.read_bytes())
    raw[int(offs[2]) + 4 * R_LENGTH : int(offs[2]) + 4 * R_LENGTH + 4] = bytes(4)
    path.write_bytes(bytes(raw))
    backlog, report = Backlog.open(tmp_path, segment_bytes=65536)
    try:
        assert sorted(backlog.pending()["seq"].tolist()) == [0, 1, 3, 4]
        assert len(report.quarantined) == 1
    finally:
        backlog.close()


def test_a_read_only_look_stops_at_a_run_being_written_and_never_skips_past_it(tmp_path):
    """A scheduler scans the backlog read-only while ingest appends: a run whose commit word is not
    written yet ends what it sees, even when a later run is already committed behind it (resynchronising
    past it would count the run as done: its records would never be served)."""
    from shmbroker.spill.layout import ITEM_DTYPE
    from shmbroker.spill.store import Backlog

    backlog, _ = Backlog.open(tmp_path)
    writer = backlog.writer(0, fsync="never")
    offsets = []
    for n in (3, 4, 2):  # three runs: committed, "being written", committed
        flat = np.arange(10 * n, dtype=np.uint32)
        _, _, rec_offsets = writer.append_many(flat, np.arange(n + 1, dtype=np.int64) * 10, np.zeros(n, ITEM_DTYPE))
        offsets.append(int(rec_offsets.min()))
    path = next((tmp_path / "backlog" / "w000").glob("*.seg"))
    writer.close(clean=False)
    backlog.close()
    with open(path, "r+b") as f:  # the middle run's commit word, not written yet
        f.seek(offsets[1])
        f.write(b"\0\0\0\0")
    look, _ = Backlog.open(tmp_path, readonly=True)
    assert look.pending()["seq"].tolist() == [0, 1, 2]
    assert look._writers[0].next_seq == 3
    look.close()
    crash, report = Backlog.open(tmp_path)  # recovery after a crash resynchronises past it instead
    assert crash.pending()["seq"].tolist() == [0, 1, 2, 7, 8]
    crash.close()


def test_opening_a_segment_its_writer_cuts_that_instant_looks_at_its_size_again(tmp_path, monkeypatch):
    """A GPU process maps a segment while its writer seals it (cuts it to its used length): the size
    it read a moment before is too large for the mmap; the open looks again instead of failing."""
    import os as os_mod

    from shmbroker.spill import segment as segmod
    from shmbroker.spill.layout import ITEM_DTYPE
    from shmbroker.spill.store import Backlog

    backlog, _ = Backlog.open(tmp_path)
    with backlog.writer(0, fsync="never") as writer:
        writer.append_many(np.arange(30, dtype=np.uint32), np.array([0, 10, 30], np.int64), np.zeros(2, ITEM_DTYPE))
    backlog.close()
    path = next((tmp_path / "backlog" / "w000").glob("*.seg"))
    real = os_mod.fstat
    calls = []

    class Stale:
        def __init__(self, st):
            self.st_size = st.st_size + (1 << 20)  # the size before the cut

    def fstat(fd):
        calls.append(fd)
        st = real(fd)
        return Stale(st) if len(calls) == 1 else st

    monkeypatch.setattr(segmod.os, "fstat", fstat)
    seg = segmod.SegmentFile.open(path)
    try:
        assert len(calls) == 2
        assert seg.size == real(seg.fd).st_size
    finally:
        seg.close()


def test_segments_shrunk_for_a_full_disk_recover_with_the_rest(tmp_path):
    """The salvage at a start on a full disk goes on in segments that fit the free space
    (`shrink_segments`): they sit beside full-size ones and recover with them, no sequence reused."""
    backlog, _ = Backlog.open(tmp_path, segment_bytes=1 << 20)
    writer = backlog.writer(0, fsync="never")
    first = make_batch([200] * 300, seed=1)
    writer.append_many(*first, cluster=False)
    writer.shrink_segments(64 << 10)
    second = make_batch([200] * 2000, seed=2)  # fills the first segment, then small ones
    seqs, _, _ = writer.append_many(*second, cluster=False)
    writer.close()
    backlog.close()
    sizes = sorted(p.stat().st_size for p in (tmp_path / "backlog" / "w000").glob("*.seg"))
    assert sizes[0] <= 64 << 10 and sizes[-1] > 64 << 10 and len(sizes) > 3  # small ones beside the first
    again, report = Backlog.open(tmp_path, segment_bytes=1 << 20)
    pending = again.pending()
    assert pending["seq"].tolist() == list(range(2300))
    assert sorted(pending["item_id"].tolist()) == sorted(first[2]["item_id"].tolist() + second[2]["item_id"].tolist())
    assert seqs.min() == 300
    again.close()
