"""The durable backlog under crashes: SIGKILL of a writer at random points, acks and reclaim after
recovery, the ack file replaced atomically under SIGKILL, the clean-shutdown marker.

Every crash test forks a child that does the work and reports progress to the
test over a pipe, one message per `os.write` (each well under PIPE_BUF, so a
message is never torn by the kill); the test SIGKILLs the child at a seeded
random point and then recovers with `Backlog.open`. What a child reports is
"acknowledged": an `append_many` that returned, a `save_acks` that returned.
Work is generated deterministically from (seed, iteration, round, batch), so
the test knows what the child was doing when it died without being told.

Kill points are drawn from several distributions (right after the fork,
uniform over the run, right after the k-th acknowledged batch, a seeded
delay after the child enters a seal or a segment allocation, inside the
record-writing kernel of a heavy batch, after the child finished and idles)
so that kills land in record writes, seals, rolls and idle time alike. The
child reports entering a seal, an allocation or the write kernel by wrapping
those names in its own copy of `spill.writer`. Segments are 64 KiB (a roll
every few batches); every fourth iteration uses 1 MiB segments, where one
segment-sized record takes ~0.5 ms to write, long enough for a kill to land
inside it even on a loaded machine. Every wait has a deadline; a child also
arms SIGALRM, so it cannot outlive a failed test. A pure-Python walk of the
newest segment before each recovery says what recovery must find (committed
records) and must report as torn (nonzero bytes after them).
"""

from __future__ import annotations

import os
import select
import signal
import struct
import time
import traceback
from pathlib import Path

import crc32c
import numpy as np
import pytest

from shmbroker.spill import writer as writer_mod
from shmbroker.spill.acks import Acks
from shmbroker.spill.layout import ITEM_DTYPE, RECORD_MAGIC, SEGMENT_HEADER_BYTES, max_tokens, record_bytes
from shmbroker.spill.store import Backlog
from shmbroker.spill.writer import SEAL_QUEUE_MAX

pytestmark = pytest.mark.timeout(120)

SEGMENT_BYTES = 64 << 10  # small, so that rolls and seals happen every few batches
BIG_SEGMENT_BYTES = 1 << 20  # every fourth kill iteration: a segment-sized record takes ~0.5 ms to write
SEED = 20261129
ROUND_ORDINALS = 1 << 20  # item ordinals of round r are r * ROUND_ORDINALS + k * BATCH_ORDINALS + j
BATCH_ORDINALS = 16
BATCH_RECORDS_MAX = 10
MAX_BATCHES = 240  # a child appends at most this many batches, then idles until killed
CHILD_ALARM_SECONDS = 20  # a child never outlives this, whatever the test does
MSG_SECONDS = 5.0  # longest wait for a child's next message before the test kills anyway
REAP_SECONDS = 5.0

MSG_BATCH = b"B"  # u32 batch index, then (item_id u64, seq u64) per record: append_many returned
MSG_ROLL = b"R"  # the child enters a seal (write_idx) or a segment allocation
MSG_WRITE = b"W"  # the child enters the record-writing kernel (write_records)
MSG_DONE = b"D"  # every batch appended; the child idles
MSG_SAVED = b"S"  # u64 k: save_acks of state k returned
MSG_ERROR = b"E"  # a traceback
_FRAME = struct.Struct("<cI")


# --- the work: deterministic items --------------------------------------------------------


def item_tokens(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The tokens of items `ids` (counts[i] tokens each), concatenated: a function of (item id, position)."""
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    starts = np.cumsum(counts) - counts
    rep = np.repeat(np.asarray(ids, np.uint64), counts)
    pos = (np.arange(total, dtype=np.int64) - np.repeat(starts, counts)).astype(np.uint64)
    mixed = rep * np.uint64(0x9E3779B97F4A7C15) + pos * np.uint64(0x2545F4914F6CDD1D)
    return (mixed >> np.uint64(17)).astype(np.uint32)


def item_meta(ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """ITEM_DTYPE rows of items `ids`: every field a function of the id (shape_band of the length)."""
    ids = np.asarray(ids, np.uint64)
    items = np.zeros(ids.size, ITEM_DTYPE)
    items["item_id"] = ids
    items["producer"] = ids >> np.uint64(40)
    items["model"] = (ids * np.uint64(7)) % np.uint64(3)
    items["prefix_key"] = ((ids // np.uint64(3)) % np.uint64(4) + np.uint64(1)) * np.uint64(0x100000001B3)
    items["prefix_len"] = ids % np.uint64(13)
    items["max_new_tokens"] = ids % np.uint64(97) + np.uint64(1)
    items["shape_band"] = np.asarray(counts, np.int64) // 1024
    return items


def segment_bytes_for(iteration: int) -> int:
    return BIG_SEGMENT_BYTES if iteration % 4 == 3 else SEGMENT_BYTES


def is_heavy(iteration: int, rnd: int, k: int) -> bool:
    return bool(np.random.default_rng([SEED, iteration, rnd, k, 1]).random() < 0.1)


def gen_batch(iteration: int, rnd: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch k of round `rnd` of iteration `iteration`: (flat tokens, offsets, items).

    Lengths: 1 token (15 %), 2..699 (most), half a segment to a segment (3.5 %),
    exactly a segment's maximum (1.5 %). One batch in ten is heavy, so that a
    write-kernel call lasts long enough to be hit by a kill: records of 2000
    tokens to a segment (64 KiB segments), or one record of half a segment to
    a segment (1 MiB segments).
    """
    most = max_tokens(segment_bytes_for(iteration))
    rng = np.random.default_rng([SEED, iteration, rnd, k])
    count = int(rng.integers(1, BATCH_RECORDS_MAX + 1))
    heavy = is_heavy(iteration, rnd, k)
    if heavy and most > max_tokens(SEGMENT_BYTES):
        count = 1
    kind = rng.random(count)
    counts = rng.integers(2, 700, count)
    counts[kind < 0.15] = 1
    big = (kind > 0.95) & (kind <= 0.985)
    counts[big] = rng.integers(most // 2, most + 1, int(big.sum()))
    counts[kind > 0.985] = most
    if heavy:
        counts = rng.integers(most // 2 if count == 1 else 2000, most + 1, count)
    ordinals = rnd * ROUND_ORDINALS + k * BATCH_ORDINALS + np.arange(count)
    ids = (np.uint64(1 + iteration) << np.uint64(40)) | ordinals.astype(np.uint64)
    offsets = np.zeros(count + 1, np.int64)
    offsets[1:] = np.cumsum(counts)
    return item_tokens(ids, counts), offsets, item_meta(ids, counts)


# --- child processes and their messages ------------------------------------------------------


def send(fd: int, kind: bytes, payload: bytes = b"") -> None:
    msg = _FRAME.pack(kind, len(payload)) + payload
    assert len(msg) <= select.PIPE_BUF or kind == MSG_ERROR  # atomic: a kill never tears a message
    view = memoryview(msg)
    while view:
        view = view[os.write(fd, view) :]


class Inbox:
    """Messages from one child, read without blocking; every wait has a deadline."""

    def __init__(self, fd: int):
        self.fd = fd
        self.buf = b""
        self.eof = False
        self.messages: list[tuple[bytes, bytes]] = []
        self.counts: dict[bytes, int] = {}
        self.writes_in_batch: dict[int, int] = {}  # batch index -> MSG_WRITEs seen while it was in progress
        os.set_blocking(fd, False)

    def poll(self, wait_seconds: float | None) -> None:
        """Read what is there, waiting up to wait_seconds for it (None: do not even select)."""
        if self.eof:
            return
        if wait_seconds is not None:
            ready, _, _ = select.select([self.fd], [], [], max(0.0, wait_seconds))
            if not ready:
                return
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.eof = True
            return
        self.buf += chunk
        while len(self.buf) >= _FRAME.size:
            kind, n = _FRAME.unpack_from(self.buf)
            if len(self.buf) < _FRAME.size + n:
                break
            self.messages.append((kind, self.buf[_FRAME.size : _FRAME.size + n]))
            self.buf = self.buf[_FRAME.size + n :]
            self.counts[kind] = self.counts.get(kind, 0) + 1
            if kind == MSG_WRITE:
                batch = self.counts.get(MSG_BATCH, 0)
                self.writes_in_batch[batch] = self.writes_in_batch.get(batch, 0) + 1
            if kind == MSG_ERROR:
                raise AssertionError("child failed:\n" + self.messages[-1][1].decode(errors="replace"))

    def wait_for(self, predicate, deadline: float, busy: bool = False) -> bool:
        """Poll until predicate() holds (True) or the deadline passes (False); busy: spin, no select."""
        while not predicate():
            if time.monotonic() >= deadline or self.eof:
                return False
            self.poll(None if busy else min(0.05, deadline - time.monotonic()))
        return True

    def drain(self) -> None:
        """After the child is reaped: read to EOF (it held the only write end)."""
        deadline = time.monotonic() + REAP_SECONDS
        while not self.eof:
            assert time.monotonic() < deadline, "pipe of a dead child never reached EOF"
            self.poll(0.05)
        assert self.buf == b"", f"a torn message ({len(self.buf)} bytes): writes under PIPE_BUF must be atomic"
        os.close(self.fd)

    def count(self, kind: bytes) -> int:
        return self.counts.get(kind, 0)


def fork_child(target, *args) -> tuple[int, Inbox]:
    """Run target(wfd, *args) in a forked child that can only end by os._exit or a signal."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            os.close(rfd)
            signal.alarm(CHILD_ALARM_SECONDS)
            target(wfd, *args)
        except BaseException:
            code = 1
            try:
                send(wfd, MSG_ERROR, traceback.format_exc().encode())
            except BaseException:
                pass
        finally:
            os._exit(code)
    os.close(wfd)
    return pid, Inbox(rfd)


def kill_and_reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + REAP_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.WIFSIGNALED(status), f"child ended by itself (status {status:#x}): it failed before the kill"
            return
        assert time.monotonic() < deadline, f"child {pid} survived SIGKILL"
        time.sleep(0.001)


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def writer_child(wfd: int, backlog: Backlog, iteration: int, rnd: int, fsync: str, num_batches: int) -> None:
    """Append batches 0.. of (iteration, rnd) with writer 0, reporting each; then idle until killed."""

    def marked(fn, kind):
        def call(*args, **kwargs):
            send(wfd, kind)
            return fn(*args, **kwargs)

        return call

    for name, kind in (("write_idx", MSG_ROLL), ("allocate_spare", MSG_ROLL), ("write_records", MSG_WRITE)):
        if hasattr(writer_mod, name):  # this child's copy of the module only
            setattr(writer_mod, name, marked(getattr(writer_mod, name), kind))
    w = backlog.writer(0, fsync=fsync)
    for k in range(num_batches):
        flat, offsets, items = gen_batch(iteration, rnd, k)
        seqs, _segments, _offsets = w.append_many(flat, offsets, items)
        pairs = np.empty((items.size, 2), "<u8")
        pairs[:, 0] = items["item_id"]
        pairs[:, 1] = seqs
        send(wfd, MSG_BATCH, struct.pack("<I", k) + pairs.tobytes())
    send(wfd, MSG_DONE)
    while True:
        time.sleep(1.0)


# --- an independent look at the newest segment ------------------------------------------------


def committed_chain(path: Path, first_seq: int) -> tuple[int, int, int]:
    """Walk committed records (length word set, frame and CRC sound) in pure Python.

    Returns (records, end offset, span of nonzero bytes after the end): what
    recovery must find and what it must report as a torn tail.
    """
    data = path.read_bytes()
    off, seq, count = SEGMENT_HEADER_BYTES, first_seq, 0
    while off + 64 <= len(data):
        length, magic, crc = struct.unpack_from("<III", data, off)
        if length == 0 or magic != RECORD_MAGIC or length % 8 or off + length > len(data):
            break
        (rec_seq,) = struct.unpack_from("<Q", data, off + 16)
        (num_tokens,) = struct.unpack_from("<I", data, off + 52)
        if record_bytes(num_tokens) != length or rec_seq != seq or crc32c.crc32c(data[off + 12 : off + length]) != crc:
            break
        off += length
        seq += 1
        count += 1
    return count, off, len(data[off:].rstrip(b"\0"))


def newest_segment(data_dir: Path, writer: int = 0) -> tuple[Path, int] | None:
    paths = sorted((data_dir / "backlog" / f"w{writer:03d}").glob("*.seg"))
    return (paths[-1], int(paths[-1].stem)) if paths else None


# --- what recovery must show ------------------------------------------------------------------


class Expected:
    """What the test knows: every item it could have appended, and the items recovery already returned."""

    def __init__(self, segment_bytes: int):
        self.segment_bytes = segment_bytes
        self.lengths: dict[int, int] = {}  # item id -> tokens, for every batch a child was given
        self.survivors: dict[int, int] = {}  # item id -> seq, returned by the last recovery

    def learn(self, items: np.ndarray, offsets: np.ndarray) -> None:
        for item_id, n in zip(items["item_id"].tolist(), np.diff(offsets).tolist()):
            self.lengths[item_id] = n


def verify_records(backlog: Backlog, recs: np.ndarray, lengths: dict[int, int]) -> None:
    """Tokens and metadata of `recs` are exactly what was appended for their item ids."""
    if recs.size == 0:
        return
    want_n = np.array([lengths[i] for i in recs["item_id"].tolist()], np.int64)
    assert np.array_equal(recs["num_tokens"].astype(np.int64), want_n), "recovered lengths differ from the appended ones"
    want = item_meta(recs["item_id"], want_n)
    for name in ("producer", "model", "prefix_key", "prefix_len", "max_new_tokens", "shape_band"):
        assert np.array_equal(recs[name], want[name]), f"recovered {name} differs from the appended one"
    order = np.lexsort((recs["offset"], recs["segment"], recs["writer"]))
    recs = recs[order]
    flat = np.empty(int(want_n.sum()), np.uint32)
    out_offsets = np.empty(recs.size + 1, np.int64)
    backlog.gather(recs, flat, out_offsets)
    assert np.array_equal(flat, item_tokens(recs["item_id"], recs["num_tokens"].astype(np.int64))), "recovered tokens differ"
    sample = recs[:: max(1, recs.size // 8)]
    for rec in sample:  # the zero-copy view agrees with the gathered copy
        n = int(rec["num_tokens"])
        assert np.array_equal(backlog.tokens(rec), item_tokens(np.array([rec["item_id"]]), np.array([n])))


def recover_and_check(data_dir: Path, exp: Expected, acked: dict[int, int], inflight: set[int], tally: dict) -> Backlog:
    """Backlog.open after a kill; assert exactly-once recovery of every acknowledged item. Returns the backlog."""
    newest = newest_segment(data_dir)
    chain = committed_chain(*newest) if newest else (0, SEGMENT_HEADER_BYTES, 0)
    backlog, report = Backlog.open(data_dir, segment_bytes=exp.segment_bytes)
    assert report.quarantined == [], f"a kill must never leave a CRC-failing record: {report.quarantined}"
    # Sealed segments are read from their index; only the newest is scanned, plus at most
    # SEAL_QUEUE_MAX + 1 segments a fsync="interval" writer had rolled away from and not yet sealed.
    assert report.scanned_segments <= 2 + SEAL_QUEUE_MAX, "sealed segments must be read from their index"
    pend = backlog.pending()
    ids = pend["item_id"].tolist()
    got = dict(zip(ids, pend["seq"].tolist()))
    assert len(got) == len(ids), "an item was recovered twice"
    # no gaps, no duplicates: writer 0's sequence numbers are dense
    assert sorted(got.values()) == list(range(len(ids))), "sequence numbers of a killed writer must stay dense"
    # every item acknowledged before the kill (earlier survivors too) is back, at the seq it was given
    for item_id, seq in list(exp.survivors.items()) + list(acked.items()):
        assert item_id in got, f"item {item_id:#x} was acknowledged as committed and is lost"
        assert got[item_id] == seq, f"item {item_id:#x} came back at seq {got[item_id]}, appended at {seq}"
    # nothing the child never tried: only the batch in flight may add unacknowledged items
    extra = set(got) - set(exp.survivors) - set(acked)
    assert extra <= inflight, f"recovered items the child never appended: {sorted(extra - inflight)[:5]}"
    verify_records(backlog, pend, exp.lengths)
    # the newest segment: recovery found exactly the committed chain and reported what was after it
    if newest:
        path, first = newest
        mine = pend[pend["segment"] == first]
        assert mine.size == chain[0], f"{path.name}: {chain[0]} committed records, recovery returned {mine.size}"
        if chain[2]:
            assert report.torn_records == 1, "bytes after the last committed record must be reported as a torn tail"
            assert chain[2] <= report.torn_bytes <= path.stat().st_size - chain[1]
            tally["torn"] += 1
        else:
            assert report.torn_bytes == 0 and report.torn_records == 0
        assert not path.read_bytes()[chain[1] :].strip(b"\0"), "recovery must leave nothing after the end it continues from"
    exp.survivors = got
    tally["max_records"] = max(tally["max_records"], len(got))
    return backlog


def kill_round(backlog: Backlog, exp: Expected, iteration: int, rnd: int, rng: np.random.Generator, tally: dict):
    """One child appends (iteration, rnd) batches and is killed at a seeded point. Returns (acked, in-flight ids)."""
    big = exp.segment_bytes > SEGMENT_BYTES
    modes = ["early", "uniform", "after_batches", "in_roll", "in_write", "idle"]
    mode = str(rng.choice(modes, p=[0.05, 0.15, 0.1, 0.25, 0.4, 0.05] if big else [0.05, 0.2, 0.2, 0.25, 0.25, 0.05]))
    fsync = str(rng.choice(["never", "interval", "always"], p=[0.6, 0.3, 0.1]))
    num_batches = int(rng.integers(1, 12)) if mode == "idle" else MAX_BATCHES
    pid, inbox = fork_child(writer_child, backlog, iteration, rnd, fsync, num_batches)
    deadline = time.monotonic() + MSG_SECONDS
    try:
        if mode == "early":
            spin(rng.uniform(0, 0.0015))
        elif mode == "uniform":
            inbox.wait_for(lambda: False, time.monotonic() + rng.uniform(0, 0.012))
        elif mode == "after_batches":
            k = int(rng.integers(1, 40))
            inbox.wait_for(lambda: inbox.count(MSG_BATCH) >= k, deadline)
            spin(rng.uniform(0, 0.00015))
        elif mode == "in_roll":
            j = int(rng.integers(1, 4))
            inbox.wait_for(lambda: inbox.count(MSG_ROLL) >= j, deadline)
            spin(float(np.exp(rng.uniform(np.log(1e-6), np.log(2e-3)))))  # log-uniform 1 us .. 2 ms
        elif mode == "in_write":  # inside a heavy batch's write kernel: spin-poll for its start, then kill
            heavy = [k for k in range(20 if big else 60) if is_heavy(iteration, rnd, k)]
            k = heavy[int(rng.integers(0, len(heavy)))] if heavy else int(rng.integers(0, 30))
            j = 1 if big else int(rng.integers(1, 3))  # big: one record, one kernel call of 0.2-0.4 ms
            inbox.wait_for(lambda: inbox.writes_in_batch.get(k, 0) >= j or inbox.count(MSG_BATCH) > k, deadline, busy=True)
            spin(rng.uniform(0, 0.00015 if big else 0.00003))
        else:
            assert inbox.wait_for(lambda: inbox.count(MSG_DONE) > 0, deadline), "child did not finish its batches"
    finally:
        kill_and_reap(pid)
    inbox.drain()
    tally["kills"] += 1
    tally[mode] += 1
    tally["rolls_seen"] += inbox.count(MSG_ROLL)
    acked: dict[int, int] = {}
    last = -1
    for kind, payload in inbox.messages:
        if kind == MSG_BATCH:
            (k,) = struct.unpack_from("<I", payload)
            assert k == last + 1, "batches are reported in order"
            last = k
            pairs = np.frombuffer(payload, "<u8", offset=4).reshape(-1, 2)
            acked.update(zip(pairs[:, 0].tolist(), pairs[:, 1].tolist()))
    for k in range(last + 1):
        _flat, offsets, items = gen_batch(iteration, rnd, k)
        exp.learn(items, offsets)
    inflight: set[int] = set()
    if last + 1 < num_batches:
        _flat, offsets, items = gen_batch(iteration, rnd, last + 1)
        exp.learn(items, offsets)
        inflight = set(items["item_id"].tolist())
    return acked, inflight


def new_tally() -> dict:
    keys = ["kills", "early", "uniform", "after_batches", "in_roll", "in_write", "idle", "rolls_seen", "torn", "max_records"]
    return dict.fromkeys(keys, 0)


def kill_rounds(
    data_dir: Path, iteration: int, rounds: int, rng: np.random.Generator, tally: dict, exp: Expected | None = None
) -> Expected:
    """`rounds` kills of successive writers on one growing backlog, each followed by a checked recovery."""
    exp = exp if exp is not None else Expected(segment_bytes_for(iteration))
    backlog = recover_and_check(data_dir, exp, {}, set(), tally)
    for rnd in range(rounds):
        try:
            acked, inflight = kill_round(backlog, exp, iteration, rnd, rng, tally)
        finally:
            backlog.close()
        backlog = recover_and_check(data_dir, exp, acked, inflight, tally)
    backlog.close()
    return exp


# --- 1. kill -9 of a writer at random points ---------------------------------------------------


def test_kill9_writer_recovers_every_acknowledged_item_exactly_once(tmp_path):
    iterations, rounds = 40, 5  # 200 kills
    tally = new_tally()
    t0 = time.monotonic()
    for iteration in range(iterations):
        rng = np.random.default_rng([SEED, 1, iteration])
        kill_rounds(tmp_path / f"it{iteration:03d}", iteration, rounds, rng, tally)
    seconds = time.monotonic() - t0
    print(f"kill -9: {tally} in {seconds:.1f} s")
    assert tally["kills"] == iterations * rounds
    # the schedule reached the places it is meant to (seeded modes; their outcomes depend on timing)
    assert tally["in_roll"] > 0 and tally["rolls_seen"] > tally["kills"], "kills must land during seals and rolls"
    assert tally["torn"] > 0, "some kill must land inside a record write (a torn tail)"


# --- 2. after recovery: ack everything, reclaim --------------------------------------------------


def test_after_kills_acking_everything_reclaims_all_but_one_segment_and_appending_continues(tmp_path):
    tally = new_tally()
    for iteration in range(8):
        data_dir = tmp_path / f"it{iteration:03d}"
        rng = np.random.default_rng([SEED, 2, iteration])
        exp = kill_rounds(data_dir, 100 + iteration, 3, rng, tally)
        segment_bytes = exp.segment_bytes
        backlog, report = Backlog.open(data_dir, segment_bytes=segment_bytes)
        pend = backlog.pending()
        assert pend.size == len(exp.survivors)
        drained_top = int(pend["seq"].max()) + 1 if pend.size else 0
        backlog.ack(0, pend["seq"])
        backlog.save_acks()
        backlog.close()

        backlog, report = Backlog.open(data_dir, segment_bytes=segment_bytes)
        try:
            assert backlog.pending().size == 0, "everything was acked and saved"
            assert report.pending_records == 0
            segs = sorted((data_dir / "backlog" / "w000").glob("*.seg"))
            assert len(segs) <= 1, f"a drained writer keeps at most its newest segment, found {len(segs)}"
            assert sum(p.stat().st_blocks * 512 for p in segs) <= segment_bytes
            # the rest is metadata: the ack file, a seal index, the writer lock (a few pages at most)
            reserve = sum(p.stat().st_blocks * 512 for p in backlog.root.glob(".reserve"))  # durable.RESERVE_FILE
            assert backlog.disk_bytes() - reserve <= segment_bytes + 3 * 4096, f"disk after drain: {backlog.disk_bytes()} bytes"
        finally:
            backlog.close()
        # a new writer continues after the drained records (never reusing their sequence numbers)
        rnd = 7  # a round the earlier kills did not use
        backlog, _ = Backlog.open(data_dir, segment_bytes=segment_bytes)
        try:
            acked, inflight = kill_round(backlog, exp, 100 + iteration, rnd, rng, tally)
        finally:
            backlog.close()
        newest = newest_segment(data_dir)
        chain = committed_chain(*newest) if newest else (0, 0, 0)
        backlog, report = Backlog.open(data_dir, segment_bytes=segment_bytes)
        try:
            pend = backlog.pending()
            got = set(pend["item_id"].tolist())
            assert set(acked) <= got <= set(acked) | inflight
            assert (pend["seq"] >= np.uint64(drained_top)).all(), "sequence numbers of drained records were reused"
            verify_records(backlog, pend, exp.lengths)
            assert report.quarantined == []
            assert (report.torn_records > 0) == (chain[2] > 0)
        finally:
            backlog.close()
    print(f"kill -9 then drain: {tally}")


# --- 3. the ack file under SIGKILL -------------------------------------------------------------


def ack_step(k: int) -> np.ndarray:
    """The sequence numbers acked by step k: scattered ones and a run that lets the cursor move."""
    rng = np.random.default_rng([SEED, 3, k])
    scattered = rng.integers(0, 50_000, 150)
    run = np.arange(40 * (k - 1), 40 * k)
    return np.concatenate([scattered, run]).astype(np.uint64)


def acks_child(wfd: int, backlog: Backlog, start: int, steps: int) -> None:
    for k in range(start + 1, start + 1 + steps):
        backlog.ack(0, ack_step(k))
        backlog.save_acks()
        send(wfd, MSG_SAVED, struct.pack("<Q", k))
    send(wfd, MSG_DONE)
    while True:
        time.sleep(1.0)


def test_ack_file_is_old_or_new_state_under_sigkill_and_temp_files_are_removed(tmp_path):
    data_dir = tmp_path / "acks"
    states = [Acks().to_bytes()]  # states[k]: the file after save k

    def state(k: int) -> bytes:
        model = Acks.from_bytes(states[-1])
        while len(states) <= k:
            model.ack(0, ack_step(len(states)))
            states.append(model.to_bytes())
        return states[k]

    rng = np.random.default_rng([SEED, 3])
    start = 0
    kills = temp_left = changed = 0
    t0 = time.monotonic()
    for _ in range(60):
        backlog, report = Backlog.open(data_dir, segment_bytes=SEGMENT_BYTES)
        mode = rng.integers(0, 3)
        pid, inbox = fork_child(acks_child, backlog, start, 400)
        try:
            if mode == 0:
                inbox.wait_for(lambda: False, time.monotonic() + rng.uniform(0, 0.02))
            else:  # right after the k-th save returned: inside the next one
                k = int(rng.integers(1, 6))
                inbox.wait_for(lambda inbox=inbox, k=k: inbox.count(MSG_SAVED) >= k, time.monotonic() + MSG_SECONDS)
                spin(rng.uniform(0, 0.0005))
        finally:
            kill_and_reap(pid)
            backlog.close()
        inbox.drain()
        kills += 1
        saved = [struct.unpack("<Q", p)[0] for kind, p in inbox.messages if kind == MSG_SAVED]
        last = saved[-1] if saved else start
        root = data_dir / "backlog"
        path = root / "acks.bin"
        if not path.exists():
            assert last == 0, "the ack file vanished after a save returned"
            found = 0
        else:
            loaded = Acks.load(root)  # never raises: the rename is atomic, a torn temp file is never the file
            data = loaded.to_bytes()
            candidates = [k for k in (last, last + 1) if state(k) == data]
            assert candidates, f"ack file is neither state {last} (saved) nor {last + 1} (being saved)"
            found = candidates[-1]
        temps = sorted(p.name for p in root.glob(".*.tmp"))
        temp_left += len(temps)
        backlog, report = Backlog.open(data_dir, segment_bytes=SEGMENT_BYTES)
        try:
            assert report.temp_files_removed == len(temps), f"left by the kill: {temps}"
            assert not list(root.glob(".*.tmp"))
            if path.exists():
                assert report.ack_file == "ok"
                assert backlog.acks.to_bytes() == state(found)
        finally:
            backlog.close()
        changed += found != start
        start = found
    print(
        f"acks under SIGKILL: {kills} kills, state reached {start}, temp files left by kills {temp_left}, in {time.monotonic() - t0:.1f} s"
    )
    assert start > 0 and changed > 0, "the child must have saved something"


# --- 4. the clean-shutdown marker ----------------------------------------------------------------


def _write_twenty(data_dir: Path, clean: bool) -> np.ndarray:
    backlog, _ = Backlog.open(data_dir, segment_bytes=SEGMENT_BYTES)
    counts = np.arange(1, 21) * 7
    ids = (np.uint64(9) << np.uint64(40)) | np.arange(20, dtype=np.uint64)
    offsets = np.zeros(21, np.int64)
    offsets[1:] = np.cumsum(counts)
    w = backlog.writer(0, fsync="never")
    _seqs, _segs, rec_offsets = w.append_many(item_tokens(ids, counts), offsets, item_meta(ids, counts), cluster=False)
    w.close(clean=clean)
    backlog.close()
    return rec_offsets


def _flip_payload_byte(data_dir: Path, rec_offset: int) -> None:
    path = data_dir / "backlog" / "w000" / f"{0:020d}.seg"
    with open(path, "r+b") as f:
        f.seek(rec_offset + 64 + 5)
        b = f.read(1)
        f.seek(rec_offset + 64 + 5)
        f.write(bytes([b[0] ^ 0x10]))


def test_clean_marker_skips_the_crc_scan_and_trusts_the_tail(tmp_path):
    clean_dir, dirty_dir = tmp_path / "clean", tmp_path / "dirty"
    rec_offsets = _write_twenty(clean_dir, clean=True)
    assert np.array_equal(_write_twenty(dirty_dir, clean=False), rec_offsets)

    backlog, report = Backlog.open(clean_dir, segment_bytes=SEGMENT_BYTES)
    assert report.clean_writers == 1 and report.pending_records == 20
    backlog.close()
    backlog, report = Backlog.open(dirty_dir, segment_bytes=SEGMENT_BYTES)
    assert report.clean_writers == 0 and report.pending_records == 20
    backlog.close()

    # The same corruption of record 5's payload in both.
    _flip_payload_byte(clean_dir, int(rec_offsets[5]))
    _flip_payload_byte(dirty_dir, int(rec_offsets[5]))

    # With the marker, recovery trusts the tail up to the recorded end and checks no CRC:
    # the corrupt record is returned as it is (documented: the marker trusts the tail).
    backlog, report = Backlog.open(clean_dir, segment_bytes=SEGMENT_BYTES)
    try:
        assert report.clean_writers == 1
        assert report.quarantined == []
        pend = backlog.pending()
        assert pend.size == 20
        rec = pend[pend["item_id"] == ((9 << 40) | 5)][0]
        want = item_tokens(np.array([rec["item_id"]]), np.array([int(rec["num_tokens"])]))
        assert not np.array_equal(backlog.tokens(rec), want), "the flipped byte is what the trusted tail returns"
    finally:
        backlog.close()

    # Without it (close(clean=False)), every record is CRC-checked: the same record is quarantined.
    backlog, report = Backlog.open(dirty_dir, segment_bytes=SEGMENT_BYTES)
    try:
        assert report.clean_writers == 0
        assert [q["offset"] for q in report.quarantined] == [int(rec_offsets[5])]
        assert report.quarantined[0]["segment"] == 0 and report.quarantined[0]["reason"]
        assert backlog.pending().size == 19
        assert ((9 << 40) | 5) not in set(backlog.pending()["item_id"].tolist())
    finally:
        backlog.close()

    # A writer taken after a clean open removes the marker: the next recovery scans again.
    backlog, _ = Backlog.open(clean_dir, segment_bytes=SEGMENT_BYTES)
    backlog.writer(0, fsync="never").close(clean=False)
    backlog.close()
    backlog, report = Backlog.open(clean_dir, segment_bytes=SEGMENT_BYTES)
    try:
        assert report.clean_writers == 0
        assert [q["offset"] for q in report.quarantined] == [int(rec_offsets[5])]
    finally:
        backlog.close()
