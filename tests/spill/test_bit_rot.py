"""Bit rot: bytes flipped in the broker's files between two runs; the broker starts, and every item
ends in exactly one final state: `ok` with the simulated engine's tokens for its prompt, or `corrupt`.

One real broker (`brokerproc.BrokerProc`, a slow paced engine) takes a seeded backlog from producer
`rot` (half of it with request options, whose words are then part of the records damaged) and stops cleanly (SIGTERM) with most of it not run yet: sealed segments with their indexes,
the writer's active segment with its clean-shutdown marker, the ack file, `producers.json`, the
results log (its middle and its last record) and its delivery cursor. Each case copies that data directory, damages one file (`TARGETS`: a seeded choice of
bytes XORed with a nonzero value), starts a fast broker on it, reconnects `rot` and reads results
until every item has one. The union of both runs' results must hold every submitted item, each
with one status (duplicates of a redelivered item agree), `ok` ones with the right tokens, and an
item `corrupt` only if the damage touched its record.

Focused tests pin one kind of damage each:
- a record failing its CRC at recovery (the active segment scanned, no clean marker) comes
  back `corrupt` instead of vanishing; one whose header cannot name its item is counted;
- a sealed segment's payload flipped or zeroed (its index durable, the page not) comes back
  `corrupt`, not `ok` with tokens computed from damaged input;
- a sealed segment whose header (or whose index) is damaged is set aside, reported and
  its records served, instead of crash-looping the scheduler.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.engines.sim import Sim
from shmbroker.engines.sim_requests import output_length, sample_key
from shmbroker.request.options import RequestOptions
from shmbroker.spill.layout import RECORD_HEADER_BYTES, SEGMENT_HEADER_BYTES
from shmbroker.spill.segment import read_idx
from shmbroker.spill.store import Backlog

pytestmark = pytest.mark.timeout(180)

NAME = "rot"
NUM_ITEMS = 1100  # of 600..1000 tokens: 3 MiB of records, three sealed segments and an active one
SEGMENT_BYTES = 1 << 20  # the smallest the settings take
RESULT_WAIT_SECONDS = 40.0
SEEDS = (1, 2)

CONFIG = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = {segment_bytes}
index_items = 4096
max_wait_seconds = 0.2

[[consumers]]
name = "g"
max_batch_size = {size}
max_batch_tokens = 16384
max_input_len = 1024
engine_settings = {{ mode = "packed", cache_tokens = 65536, pace_seconds = {pace} }}
"""
OPTIONS = RequestOptions(temperature=0.9, top_p=0.95, seed=11, stop=("\n\n",))


def sampled(item_id: int, max_new: int, prompt: np.ndarray, opts: RequestOptions | None) -> np.ndarray:
    """The simulated engine's tokens for an item under its options (engines/sim_requests.py)."""
    key = sample_key(item_id, Sim.digest(prompt), opts)
    out = Sim.generated_many(np.array([item_id], np.uint64), np.array([max_new]), keys=np.array([key], np.uint64)).flat
    return out[: output_length(out, opts)]


SLOW = CONFIG.format(segment_bytes=SEGMENT_BYTES, size=4, pace=1.0)  # the first run: tens of items a second
FAST = CONFIG.format(segment_bytes=SEGMENT_BYTES, size=16, pace=0.0)


# -- the first run: a backlog mostly not run yet, stopped cleanly ---------------------------------


class Submitted:
    """What `rot` submitted (item id -> (max_new_tokens, prompt)) and every result it got, per id."""

    def __init__(self):
        self.items: dict[int, tuple[int, np.ndarray]] = {}
        self.results: dict[int, list] = {}
        self.in_backlog: set[int] = set()  # items still to run when the first run stopped

    def take(self, producer: Producer, timeout_seconds: float, until: float | None = None) -> int:
        """Read what comes within timeout_seconds (and, given `until`, stop at that monotonic time)."""
        n = 0
        for r in producer.results(timeout_seconds):
            self.results.setdefault(r.item_id, []).append((r.status, r.tokens.copy(), r.error))
            n += 1
            if until is not None and time.monotonic() > until:
                break
        return n

    def copy(self) -> Submitted:
        out = Submitted()
        out.items = self.items
        out.in_backlog = self.in_backlog
        out.results = {i: list(v) for i, v in self.results.items()}
        return out


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(data directory of the first run, what was submitted and answered in it)."""
    root = tmp_path_factory.mktemp("rot-base")
    rng = np.random.default_rng(14)
    sub = Submitted()
    broker = BrokerProc(root, SLOW)
    try:
        broker.start()
        with Producer(NAME, data_dir=broker.data_dir) as p:
            lengths = rng.integers(600, 1000, NUM_ITEMS)
            max_new = rng.integers(4, 12, NUM_ITEMS)
            offsets = np.zeros(NUM_ITEMS + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            flat = rng.integers(1, 30_000, int(offsets[-1]), dtype=np.uint32)
            # the second half carries request options: their words are in the records the damage hits
            half = NUM_ITEMS // 2
            ids = np.concatenate([
                p.submit_many(flat[: offsets[half]], offsets[: half + 1], max_new_tokens=max_new[:half]),
                p.submit_many(flat[offsets[half] :], offsets[half:] - offsets[half], max_new_tokens=max_new[half:],
                              options=OPTIONS)])
            for k, i in enumerate(ids.tolist()):
                sub.items[i] = (int(max_new[k]), flat[offsets[k] : offsets[k + 1]].copy(), OPTIONS if k >= half else None)
            deadline = time.monotonic() + 0.5
            while time.monotonic() < deadline:
                sub.take(p, 0.1, deadline)
    finally:
        code = broker.stop()  # SIGTERM: a clean stop, most of the backlog not run
    assert code == 0, f"supervisor exited with {code}:\n{broker.log()}"
    data = Path(broker.data_dir)
    backlog = data / "backlog"
    assert list(backlog.glob("w000/*.idx")), "the first run sealed no segment"
    assert (backlog / "w000" / "CLEAN").exists() and (backlog / "acks.bin").exists()
    assert (data / "producers.json").exists()
    look, _ = Backlog.open(data, segment_bytes=SEGMENT_BYTES, readonly=True)
    try:
        pending = look.pending().copy()
    finally:
        look.close()
    assert pending.size > NUM_ITEMS // 2, f"only {pending.size} items left for the second run"
    sub.in_backlog = {int(i) for i in pending["item_id"]}
    return data, sub, pending


def unanswered(recs: np.ndarray, sub: Submitted) -> np.ndarray:
    """The records of items without a result yet."""
    return recs[~np.isin(recs["item_id"], np.array(list(sub.results), np.uint64))]


def sealed_pending(data: Path, pending: np.ndarray) -> np.ndarray:
    """Pending records of sealed segments (those with an index)."""
    sealed = [int(p.stem) for p in (data / "backlog" / "w000").glob("*.idx")]
    return pending[np.isin(pending["segment"], np.array(sealed, np.uint64))]


def active_pending(data: Path, pending: np.ndarray) -> np.ndarray:
    newest = max(int(p.stem) for p in (data / "backlog" / "w000").glob("*.seg"))
    return pending[pending["segment"] == np.uint64(newest)]


def seg_file(data: Path, first: int) -> Path:
    return data / "backlog" / "w000" / f"{first:020d}.seg"


def idx_file(data: Path, first: int) -> Path:
    return data / "backlog" / "w000" / f"{first:020d}.idx"


def xor_bytes(path: Path, at: list[int], values: list[int]) -> None:
    raw = bytearray(path.read_bytes())
    for a, v in zip(at, values):
        raw[a] ^= v
    path.write_bytes(bytes(raw))


def items_touched(data: Path, first: int, at: list[int]) -> set[int]:
    """Item ids whose records (per the segment's index) hold any of the byte offsets `at`."""
    offsets, headers, _end = read_idx(idx_file(data, first))
    nbytes = headers.view("<u4")[:, 0].astype(np.int64)
    ids = headers.view("<u8")[:, 3]
    out = set()
    for a in at:
        hit = (offsets <= a) & (a < offsets + nbytes)
        out.update(int(i) for i in ids[hit])
    return out


# -- the second run --------------------------------------------------------------------------------


def run_again(tmp_path: Path, data: Path, sub: Submitted) -> tuple[Submitted, BrokerProc]:
    """A fast broker on `data` (tmp_path/data); `rot` reads until every item has a result. Returns
    the union of both runs' results and the (stopped) broker."""
    broker = BrokerProc(tmp_path, FAST)
    assert Path(broker.data_dir) == data
    out = sub.copy()
    try:
        broker.start()
        with Producer(NAME, data_dir=broker.data_dir) as p:
            deadline = time.monotonic() + RESULT_WAIT_SECONDS
            while not set(out.items) <= set(out.results) and time.monotonic() < deadline:
                out.take(p, 0.2)
            out.take(p, 0.3)  # anything more would be a duplicate
    finally:
        code = broker.stop()  # a broker that failed to start is stopped too
    assert code == 0, f"supervisor exited with {code}:\n{broker.log()}"
    return out, broker


def final_states(out: Submitted, broker: BrokerProc, may_be_corrupt: set[int]) -> dict[str, int]:
    """Check the union of results; the number of items per final state."""
    missing = [i for i in out.items if i not in out.results]
    foreign = [i for i in out.results if i not in out.items]
    torn, wrong, disagree, bad_corrupt = [], [], [], []
    counts = {"ok": 0, "corrupt": 0, "duplicated": 0}
    for i, got in out.results.items():
        if i not in out.items:
            continue
        m, prompt, opts = out.items[i]
        statuses = {s for s, _, _ in got}
        if len(statuses) != 1:
            disagree.append((hex(i), sorted(statuses)))
            continue
        status = statuses.pop()
        counts["duplicated"] += len(got) > 1
        if status == "ok":
            want = sampled(i, m, prompt, opts)
            if not all(np.array_equal(t, want) for _, t, _ in got):
                wrong.append(hex(i))
        elif status == "corrupt":
            if i not in may_be_corrupt:
                bad_corrupt.append(hex(i))
            if not all(e for _, _, e in got):
                torn.append(hex(i))  # a corrupt result says why
        else:
            torn.append((hex(i), status, got[0][2]))
        counts[status] = counts.get(status, 0) + 1
    problems = {k: v for k, v in (("missing", missing), ("foreign", foreign), ("ok with wrong tokens", wrong),
                                  ("states disagree", disagree), ("corrupt though undamaged", bad_corrupt),
                                  ("other status or no error text", torn)) if v}
    where = (f"; of the missing, {sum(i in out.in_backlog for i in missing)} were in the backlog at the second start"
             if missing else "")
    assert not problems, f"{ {k: (len(v), v[:4]) for k, v in problems.items()} }{where}\n{broker.log()}"
    return counts


# -- the sweep -------------------------------------------------------------------------------------


def _sealed_segment(data: Path, rng, pending) -> set[int]:
    """A few bytes anywhere in a sealed segment that holds pending records (its header included)."""
    firsts = np.unique(sealed_pending(data, pending)["segment"]).tolist()
    first = int(firsts[int(rng.integers(len(firsts)))])
    path = seg_file(data, first)
    size = path.stat().st_size
    at = sorted({int(a) for a in rng.integers(0, size, int(rng.integers(1, 4)))})
    if rng.random() < 0.5:
        at[0] = int(rng.integers(0, SEGMENT_HEADER_BYTES))  # the segment header itself
    xor_bytes(path, at, [int(v) for v in rng.integers(1, 256, len(at))])
    return items_touched(data, first, at)


def _sealed_index(data: Path, rng, pending) -> set[int]:
    idxs = sorted((data / "backlog" / "w000").glob("*.idx"))
    path = idxs[int(rng.integers(len(idxs)))]
    at = sorted({int(a) for a in rng.integers(0, path.stat().st_size, int(rng.integers(1, 4)))})
    xor_bytes(path, at, [int(v) for v in rng.integers(1, 256, len(at))])
    return set()


def _one_file(relative: str):
    def damage(data: Path, rng, pending) -> set[int]:
        path = data / relative
        at = sorted({int(a) for a in rng.integers(0, path.stat().st_size, int(rng.integers(1, 4)))})
        xor_bytes(path, at, [int(v) for v in rng.integers(1, 256, len(at))])
        return set()

    return damage


def _unread_results(data: Path) -> list[tuple[int, int, int]]:
    """(offset, length, item id) of the result records at or after rot's delivery cursor."""
    import json

    from shmbroker.ring.wire import scan_results

    cursor = json.loads((data / "results" / "cursor.json").read_text())["names"][NAME][0]
    log = np.fromfile(sorted((data / "results").glob("*.log"))[-1], np.uint8)
    pos = np.empty(1 << 16, np.int64)
    n, _, _ = scan_results(log, 0, log.size, pos, True)
    out = []
    for p in pos[:n].tolist():
        if p >= cursor:
            out.append((p, int(log[p : p + 4].view(np.uint32)[0]), int(log[p + 8 : p + 16].view(np.uint64)[0])))
    return out


def _results_log(where: str):
    """Bytes of the tokens of an unread result record (its frame intact: bit rot in the data, the
    bulk of the file) in the middle of the log or its last record."""

    def damage(data: Path, rng, pending) -> set[int]:
        recs = _unread_results(data)
        assert len(recs) >= 3, "the first run left too few unread results"
        at, size, item = recs[-1] if where == "tail" else recs[int(rng.integers(0, len(recs) - 1))]
        path = sorted((data / "results").glob("*.log"))[-1]
        xor_bytes(path, [at + 40 + int(rng.integers(0, size - 40))], [int(rng.integers(1, 256))])
        return {item}

    return damage


# target name -> damage(data_dir, rng, pending records) -> item ids that may come back corrupt.
TARGETS = {
    "results_log_middle": _results_log("middle"),
    "results_log_tail": _results_log("tail"),
    "results_cursor": _one_file("results/cursor.json"),
    "nothing": lambda data, rng, pending: set(),  # the control: an undamaged copy
    "sealed_segment": _sealed_segment,
    "sealed_index": _sealed_index,
    "clean_marker": _one_file("backlog/w000/CLEAN"),
    "acks": _one_file("backlog/acks.bin"),
    "producers": _one_file("producers.json"),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("target", sorted(TARGETS))
def test_bit_rot_sweep(tmp_path, base, target, seed):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    rng = np.random.default_rng([14, seed, sorted(TARGETS).index(target)])
    may_be_corrupt = TARGETS[target](data, rng, pending)
    out, broker = run_again(tmp_path, data, sub)
    final_states(out, broker, may_be_corrupt)


# -- a record failing its CRC at recovery ----------------------------------------------


def test_a_record_failing_its_crc_at_recovery_comes_back_corrupt(tmp_path, base):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    (data / "backlog" / "w000" / "CLEAN").unlink()  # as after a crash: recovery checks every record
    victims = unanswered(active_pending(data, pending), sub)[:2]
    assert victims.size == 2, "the active segment holds no pending record"
    for rec in victims:
        xor_bytes(seg_file(data, int(rec["segment"])), [int(rec["offset"]) + RECORD_HEADER_BYTES + 5], [0x40])
    out, broker = run_again(tmp_path, data, sub)
    counts = final_states(out, broker, {int(i) for i in victims["item_id"]})
    assert {out.results[int(i)][0][0] for i in victims["item_id"]} == {"corrupt"}
    assert counts["corrupt"] == 2
    # found by the scheduler's recovery and sent as failed rows (not run, not read by an engine)
    assert all("when the broker recovered it" in out.results[int(i)][0][2] for i in victims["item_id"])


# -- records served unchecked -----------------------------------------------------------


def test_a_sealed_record_flipped_after_its_index_comes_back_corrupt_not_ok(tmp_path, base):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    recs = unanswered(sealed_pending(data, pending), sub)
    flipped, zeroed = recs[0], recs[-1]
    assert int(flipped["segment"]) != int(zeroed["segment"]) or int(flipped["offset"]) != int(zeroed["offset"])
    xor_bytes(seg_file(data, int(flipped["segment"])), [int(flipped["offset"]) + RECORD_HEADER_BYTES + 9], [0x01])
    # a power loss with fsync = "never": the index reached the disk, this record's page did not
    path = seg_file(data, int(zeroed["segment"]))
    raw = bytearray(path.read_bytes())
    start = int(zeroed["offset"])
    raw[start : start + RECORD_HEADER_BYTES + 4 * int(zeroed["num_tokens"])] = bytes(
        RECORD_HEADER_BYTES + 4 * int(zeroed["num_tokens"]))
    path.write_bytes(bytes(raw))
    out, broker = run_again(tmp_path, data, sub)
    victims = {int(flipped["item_id"]), int(zeroed["item_id"])}
    counts = final_states(out, broker, victims)
    assert {out.results[i][0][0] for i in victims} == {"corrupt"}
    assert counts["corrupt"] == 2
    # found by the GPU process's check before the engine read them
    assert "fails its crc32c check" in out.results[int(flipped["item_id"])][0][2]
    assert "no intact record" in out.results[int(zeroed["item_id"])][0][2]


def test_a_flipped_option_word_comes_back_corrupt_never_run_with_other_options(tmp_path, base):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    recs = unanswered(pending, sub)
    recs = recs[[sub.items[int(i)][2] is not None for i in recs["item_id"]]][:3]
    assert recs.size == 3, "no pending record carries options"
    for k, rec in enumerate(recs):  # a bit of the temperature, of the seed, of the stop string
        at = int(rec["offset"]) + RECORD_HEADER_BYTES + 4 * int(rec["num_tokens"]) + (6, 4 * 5 + 1, 4 * 9)[k]
        xor_bytes(seg_file(data, int(rec["segment"])), [at], [0x08])
    out, broker = run_again(tmp_path, data, sub)
    victims = {int(i) for i in recs["item_id"]}
    counts = final_states(out, broker, victims)
    assert {out.results[i][0][0] for i in victims} == {"corrupt"} and counts["corrupt"] == 3


# -- damaged metadata ------------------------------------------------------------------


def test_a_sealed_segment_with_a_damaged_header_is_set_aside_and_its_records_served(tmp_path, base):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    first = int(sealed_pending(data, pending)["segment"][0])
    xor_bytes(seg_file(data, first), [17], [0x10])  # its first_seq field: the header checksum fails
    out, broker = run_again(tmp_path, data, sub)
    counts = final_states(out, broker, set())
    assert counts["corrupt"] == 0
    assert "header rewritten" in broker.log()
    assert seg_file(data, first).with_name(f"{first:020d}.header.corrupt").exists()


def test_a_damaged_index_and_record_in_one_segment_name_the_record_corrupt(tmp_path, base):
    data0, sub, pending = base
    data = tmp_path / "data"
    shutil.copytree(data0, data)
    recs = unanswered(sealed_pending(data, pending), sub)
    rec = recs[recs["segment"] == recs["segment"][0]][1]
    first = int(rec["segment"])
    xor_bytes(idx_file(data, first), [40], [0x08])  # the index fails its checksum: the segment is scanned
    xor_bytes(seg_file(data, first), [int(rec["offset"]) + RECORD_HEADER_BYTES], [0x80])
    out, broker = run_again(tmp_path, data, sub)
    counts = final_states(out, broker, {int(rec["item_id"])})
    assert out.results[int(rec["item_id"])][0][0] == "corrupt"
    assert counts["corrupt"] == 1


# -- the same holes, one process (no broker): recovery's and the reader's checks ---------------------


def test_a_record_failing_its_crc_stays_in_the_backlog_until_its_result_acks_it(tmp_path):
    from test_spill_faults import flip_bit, seg_path, write_backlog

    ids, counts, seqs, segs, offs = write_backlog(tmp_path, [3000] * 12)  # 64 KiB segments: five records each
    assert segs[1] == 0 and segs[-1] > 0
    (tmp_path / "backlog" / "w000" / f"{0:020d}.idx").unlink()  # rolled away from, never sealed (a crash)
    flip_bit(seg_path(tmp_path), int(offs[1]) + RECORD_HEADER_BYTES + 100, 3)
    backlog, report = Backlog.open(tmp_path, segment_bytes=64 << 10)
    try:
        assert backlog.corrupt()["item_id"].tolist() == [int(ids[1])] and report.corrupt_records == 1
        assert int(ids[1]) not in backlog.pending()["item_id"].tolist()
        assert report.quarantined[0]["item_id"] == int(ids[1])
    finally:
        backlog.close()
    # the recovery sealed the segment; no result acked the record yet: it is still there, to be served
    # (and checked again by the GPU process that reads it), not acked away in silence
    backlog, report = Backlog.open(tmp_path, segment_bytes=64 << 10)
    try:
        assert int(ids[1]) in backlog.pending()["item_id"].tolist() + backlog.corrupt()["item_id"].tolist()
        backlog.ack(0, [int(seqs[1])])  # its `corrupt` result acks it
        backlog.save_acks()
    finally:
        backlog.close()
    backlog, report = Backlog.open(tmp_path, segment_bytes=64 << 10)
    try:
        assert int(ids[1]) not in backlog.pending()["item_id"].tolist() + backlog.corrupt()["item_id"].tolist()
        assert backlog.pending().size == ids.size - 1 and report.unnamed_corrupt == 0
    finally:
        backlog.close()


def test_the_reader_check_names_what_is_wrong_with_each_record(tmp_path):
    from test_spill_faults import write_backlog

    from shmbroker.gpu.segments import SegmentViews
    from shmbroker.spill.locate import record_locations
    from shmbroker.spill.records import CHECK_CRC, CHECK_FRAME, CHECK_GONE, CHECK_OK

    ids, counts, seqs, segs, offs = write_backlog(tmp_path, [40, 50, 60, 70, 3000, 3000, 3000, 3000, 3000, 3000])
    assert segs[-1] > 0
    backlog, _ = Backlog.open(tmp_path, segment_bytes=64 << 10, readonly=True)
    locs = record_locations(backlog.pending())
    backlog.close()
    locs = locs[np.argsort(locs["seq"])]
    views = SegmentViews(tmp_path / "backlog")
    try:
        assert (views.check(locs) == CHECK_OK).all()
        xor_bytes(seg_file(tmp_path, 0), [int(offs[1]) + RECORD_HEADER_BYTES + 7], [0x20])  # a token
        zeroed = int(offs[2])  # a page a power loss left unwritten: the whole record reads as zeros
        raw = bytearray(seg_file(tmp_path, 0).read_bytes())
        raw[zeroed : zeroed + RECORD_HEADER_BYTES + 240] = bytes(RECORD_HEADER_BYTES + 240)
        seg_file(tmp_path, 0).write_bytes(bytes(raw))
        wrong = locs.copy()
        wrong["item_id"][3] ^= 1  # a location naming another item than the record holds
        views.close()
        last = int(segs[-1])
        xor_bytes(seg_file(tmp_path, last), [3], [0x01])  # the newest segment's header
        got = views.check(wrong).tolist()
        want = [CHECK_OK, CHECK_CRC, CHECK_FRAME, CHECK_FRAME] + [CHECK_OK] * (locs.size - 4)
        for k in np.flatnonzero(locs["segment"] == np.uint64(last)).tolist():
            want[k] = CHECK_GONE
        assert got == want
    finally:
        views.close()
