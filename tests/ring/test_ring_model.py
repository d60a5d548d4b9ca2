"""The SPSC ring's numba kernels against `ReferenceRing`, a long many-lap run, and corrupt records.

One process plays both sides on a plain numpy buffer; concurrency is tested elsewhere.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from numba.core.errors import TypingError

from shmbroker.ring import layout, spsc
from shmbroker.ring.reference import Peek, Record, ReferenceRing

CAPACITIES_WORDS = [64, 128, 256, 512, 1024, 2048, 4096]
# Python ints above 2**63 - 1 reach numba as uint64: a second compile of every kernel.
KEYS = st.integers(0, 2**63 - 1 - 64)
MAX_RECORDS_PER_CALL = 16


def new_ring(capacity_words: int) -> np.ndarray:
    buf = np.zeros(layout.segment_bytes(capacity_words), np.uint8)
    layout.init_header(buf, capacity_words)
    return buf


def header(buf: np.ndarray) -> np.ndarray:
    return buf[: layout.HEADER_BYTES].view(np.int64)


def data_words(buf: np.ndarray) -> np.ndarray:
    return buf[layout.HEADER_BYTES :].view(np.uint32)


def plain(code: int) -> int:
    """The model does not track the wake flag: OK_WAKE reads as OK."""
    return layout.OK if code == layout.OK_WAKE else code


def kernel_pop(buf: np.ndarray, max_records: int, max_tokens: int) -> tuple[list[Record], int]:
    out_tokens = np.zeros(max_tokens, np.uint32)
    out_offsets = np.zeros(max_records + 1, np.int64)
    out_keys = np.zeros(max_records, np.uint64)
    out_meta = np.zeros((max_records, layout.META_WORDS), np.uint32)
    n, status, _wake = spsc.pop_many(buf, out_tokens, out_offsets, out_keys, out_meta, max_records)
    assert 0 <= n <= max_records
    assert out_offsets[0] == 0
    records = [
        Record(int(out_keys[i]), tuple(int(v) for v in out_meta[i]), out_tokens[out_offsets[i] : out_offsets[i + 1]].copy())
        for i in range(n)
    ]
    return records, int(status)


def kernel_peek(buf: np.ndarray, max_records: int) -> Peek:
    positions = np.zeros(max_records, np.int64)
    n, new_tail, status = spsc.peek_many(buf, positions, max_records)
    w = data_words(buf)
    w64 = buf[layout.HEADER_BYTES :].view(np.uint64)
    records = []
    for pos in positions[:n]:
        pos = int(pos)
        num_tokens = int(w[pos + 1])
        meta = tuple(int(v) for v in w[pos + 4 : pos + 8])
        tokens = w[pos + layout.RECORD_HEADER_WORDS : pos + layout.RECORD_HEADER_WORDS + num_tokens].copy()
        records.append(Record(int(w64[pos // 2 + 1]), meta, tokens))
    return Peek(records, [int(p) for p in positions[:n]], int(new_tail), int(status))


def assert_same_records(got: list[Record], want: list[Record]) -> None:
    assert [r.key for r in got] == [r.key for r in want]
    assert [r.meta for r in got] == [r.meta for r in want]
    for g, w in zip(got, want):
        assert g.tokens.dtype == np.uint32
        assert np.array_equal(g.tokens, w.tokens)


def assert_same_state(buf: np.ndarray, model: ReferenceRing) -> None:
    h = header(buf)
    assert bool(spsc.readable(buf)) == model.readable()
    assert int(spsc.writable_words(buf)) == model.free_words()
    assert int(h[layout.H_HEAD]) == model.head_words
    assert int(h[layout.H_TAIL]) == model.tail_words
    assert int(h[layout.H_NUM_PUSHED]) == model.num_pushed
    assert int(h[layout.H_NUM_POPPED]) == model.num_popped
    assert int(h[layout.H_NUM_FULL]) == model.num_full


class RingMachine(RuleBasedStateMachine):
    """Every call goes to the kernels and the model; results and state must agree after each step."""

    @initialize(capacity_words=st.sampled_from(CAPACITIES_WORDS), seed=st.integers(0, 2**32 - 1))
    def setup(self, capacity_words: int, seed: int) -> None:
        self.buf = new_ring(capacity_words)
        self.model = ReferenceRing(capacity_words)
        self.max_tokens = layout.max_tokens(capacity_words)
        self.rng = np.random.default_rng(seed)

    def draw_num_tokens(self, data) -> int:
        m = self.max_tokens
        edges = st.sampled_from([m - 1, m, m + 1, m + 2])  # m: exactly max_record_words; m + 1, m + 2: TOO_LARGE
        return data.draw(st.one_of(st.integers(0, 8), st.integers(0, m), edges), label="num_tokens")

    def draw_max_tokens(self, data) -> int:
        m = self.max_tokens
        return data.draw(st.one_of(st.sampled_from([0, 1, 7, m]), st.integers(0, 3 * m)), label="out_tokens")

    def random_meta(self, num_records: int) -> np.ndarray:
        return self.rng.integers(0, 2**32, (num_records, layout.META_WORDS), dtype=np.uint32)

    def push_batch(self, counts: list[int], key0: int, first: int, last: int) -> tuple[int, int]:
        offsets = np.zeros(len(counts) + 1, np.int64)
        offsets[1:] = np.cumsum(counts)
        flat = self.rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
        meta = self.random_meta(len(counts))
        count, status, _wake = spsc.push_many(self.buf, flat, offsets, key0, meta, first, last)
        want = self.model.push_many(flat, offsets, key0, meta, first, last)
        assert (int(count), plain(int(status))) == want
        return want

    def pop(self, max_records: int, max_tokens: int) -> int:
        got, status = kernel_pop(self.buf, max_records, max_tokens)
        want, want_status = self.model.pop_many(max_records, max_tokens)
        assert status == want_status
        assert_same_records(got, want)
        return len(got)

    @rule(data=st.data(), key=KEYS)
    def push_one(self, data, key: int) -> None:
        n = self.draw_num_tokens(data)
        tokens = self.rng.integers(0, 2**32, n, dtype=np.uint32)
        m0, m1, m2, m3 = (int(v) for v in self.random_meta(1)[0])
        code = spsc.push(self.buf, tokens, key, m0, m1, m2, m3)
        assert plain(int(code)) == self.model.push(tokens, key, m0, m1, m2, m3)

    @rule(data=st.data(), key0=KEYS)
    def push_many(self, data, key0: int) -> None:
        num_records = data.draw(st.integers(0, 12), label="num_records")
        counts = [self.draw_num_tokens(data) for _ in range(num_records)]
        first = data.draw(st.integers(0, len(counts)), label="first")
        last = data.draw(st.integers(first, len(counts)), label="last")
        self.push_batch(counts, key0, first, last)

    @rule(data=st.data(), max_records=st.integers(0, MAX_RECORDS_PER_CALL))
    def pop_many(self, data, max_records: int) -> None:
        self.pop(max_records, self.draw_max_tokens(data))

    @rule(max_records=st.integers(0, MAX_RECORDS_PER_CALL), release=st.booleans())
    def peek_release(self, max_records: int, release: bool) -> None:
        got = kernel_peek(self.buf, max_records)
        want = self.model.peek_many(max_records)
        assert (got.status, got.new_tail_words, got.offsets_words) == (want.status, want.new_tail_words, want.offsets_words)
        assert_same_records(got.records, want.records)
        if release:
            spsc.release(self.buf, got.new_tail_words, len(got.records))
            self.model.release(want.new_tail_words, len(want.records))

    @rule(turns=st.integers(1, 24), batch_records=st.integers(1, 32), record_tokens_max=st.sampled_from([0, 3, 20]))
    def churn(self, turns: int, batch_records: int, record_tokens_max: int) -> None:
        """Push a batch and pop some, `turns` times: small rings go round many times in one step."""
        top = min(record_tokens_max, self.max_tokens)
        for _ in range(turns):
            counts = [int(c) for c in self.rng.integers(0, top + 1, batch_records)]
            self.push_batch(counts, int(self.rng.integers(0, 2**62)), 0, batch_records)
            self.pop(int(self.rng.integers(1, 2 * batch_records + 1)), int(self.rng.integers(top, 4 * top + 2)))

    @invariant()
    def same_state(self) -> None:
        assert_same_state(self.buf, self.model)


RingMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
TestRingAgainstModel = RingMachine.TestCase


@pytest.mark.parametrize("capacity_words", [64, 128])
def test_many_laps_against_model(capacity_words):
    """A seeded mix of every call through a tiny ring, hundreds of laps, checked after each call."""
    rng = np.random.default_rng(capacity_words)
    buf = new_ring(capacity_words)
    model = ReferenceRing(capacity_words)
    top = layout.max_tokens(capacity_words) + 2
    for step in range(3000):
        op = rng.integers(0, 4)
        if op == 0:
            tokens = rng.integers(0, 2**32, int(rng.integers(0, top + 1)), dtype=np.uint32)
            assert plain(spsc.push(buf, tokens, step, 1, 2, 3, step)) == model.push(tokens, step, 1, 2, 3, step)
        elif op == 1:
            counts = rng.integers(0, rng.choice([4, top]) + 1, int(rng.integers(0, 9)))
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            flat = rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
            meta = rng.integers(0, 2**32, (counts.size, layout.META_WORDS), dtype=np.uint32)
            count, status, _wake = spsc.push_many(buf, flat, offsets, step << 8, meta, 0, counts.size)
            assert (int(count), plain(int(status))) == model.push_many(flat, offsets, step << 8, meta, 0, counts.size)
        elif op == 2:
            max_records, max_tokens = int(rng.integers(0, 9)), int(rng.integers(0, 2 * top))
            got, status = kernel_pop(buf, max_records, max_tokens)
            want, want_status = model.pop_many(max_records, max_tokens)
            assert status == want_status
            assert_same_records(got, want)
        else:
            max_records = int(rng.integers(0, 9))
            got, want = kernel_peek(buf, max_records), model.peek_many(max_records)
            assert (got.status, got.new_tail_words, got.offsets_words) == (want.status, want.new_tail_words, want.offsets_words)
            assert_same_records(got.records, want.records)
            spsc.release(buf, got.new_tail_words, len(got.records))
            model.release(want.new_tail_words, len(want.records))
        assert_same_state(buf, model)
    assert model.head_words // capacity_words > 100


@pytest.mark.parametrize("capacity_words", [64, 4096])
def test_push_many_tail_is_push_many_of_each_payload_with_its_tail(capacity_words):
    """Records pushed with tail words (an item's request options, written in place) read back as the
    records of the tokens and the tail one after another, through many laps, FULL and TOO_LARGE alike."""
    rng = np.random.default_rng(capacity_words + 1)
    buf = new_ring(capacity_words)
    model = ReferenceRing(capacity_words)
    top = layout.max_tokens(capacity_words) + 2
    for step in range(2000):
        if rng.integers(0, 2):
            tail = rng.integers(0, 2**32, int(rng.integers(0, 6)), dtype=np.uint32)
            counts = rng.integers(0, rng.choice([4, top]) + 1, int(rng.integers(0, 9)))
            offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
            flat = rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
            meta = rng.integers(0, 2**32, (1, layout.META_WORDS), dtype=np.uint32)
            whole = [np.concatenate([flat[a:b], tail]) for a, b in zip(offsets[:-1], offsets[1:])]
            joined = np.concatenate(whole + [np.zeros(0, np.uint32)]).astype(np.uint32)
            joined_offs = np.concatenate([[0], np.cumsum([w.size for w in whole])]).astype(np.int64)
            count, status, _wake = spsc.push_many_tail(buf, flat, offsets, tail, step << 8, meta, 0, counts.size)
            assert (int(count), plain(int(status))) == model.push_many(joined, joined_offs, step << 8, meta, 0,
                                                                        counts.size)
        else:
            max_records, max_tokens = int(rng.integers(0, 9)), int(rng.integers(0, 2 * top))
            got, status = kernel_pop(buf, max_records, max_tokens)
            want, want_status = model.pop_many(max_records, max_tokens)
            assert status == want_status
            assert_same_records(got, want)
        assert_same_state(buf, model)


@pytest.mark.parametrize("capacity_words", [64, 128, 4096])
def test_max_record_fits_at_every_offset_once_drained(capacity_words):
    """layout.max_record_words: the largest record a drained ring takes whatever its offset."""
    max_tokens = layout.max_tokens(capacity_words)
    for offset in range(0, capacity_words, 2):
        buf = new_ring(capacity_words)
        h = header(buf)
        h[layout.H_HEAD] = h[layout.H_TAIL] = capacity_words + offset  # drained, one lap on
        assert spsc.push(buf, np.zeros(max_tokens + 1, np.uint32), 1, 0, 0, 0, 0) == layout.TOO_LARGE
        tokens = np.arange(max_tokens, dtype=np.uint32)
        assert spsc.push(buf, tokens, 2, 0, 0, 0, 0) == layout.OK
        records, status = kernel_pop(buf, 2, max_tokens)
        assert status == layout.EMPTY
        assert [r.key for r in records] == [2]
        assert np.array_equal(records[0].tokens, tokens)


def test_strided_tokens_are_refused_not_copied_as_dense():
    """memcpy copies a dense run: a strided view (numba layout 'A') must be refused at typing."""
    buf = new_ring(64)
    tokens = np.arange(10, dtype=np.uint32)[::2]
    with pytest.raises((TypingError, TypeError), match="C-contiguous"):
        spsc.push(buf, tokens, 7, 0, 0, 0, 0)
    assert not spsc.readable(buf)


def test_done_rows_counted_out_leave_the_sleeping_producer_to_the_release():
    """A batch ring's consumer counts a record's done rows out just before it releases the record
    (a negative `count_done`): that must not claim the sleeping producer's waiting flag, or the
    release finds it cleared and the producer sleeps through the space it waits for."""
    buf = new_ring(64)
    h = header(buf)
    tokens = np.arange(4, dtype=np.uint32)
    assert plain(spsc.push(buf, tokens, 7, 0, 0, 0, 0)) == layout.OK
    positions = np.empty(1, np.int64)
    n, new_tail, _ = spsc.peek_many(buf, positions, 1)
    assert n == 1
    spsc.set_waiting(buf, layout.H_PRODUCER_WAITING)
    assert spsc.count_done(buf, 3)  # rows got results: wake the producer (its flag is claimed)
    assert h[layout.H_PRODUCER_WAITING] == 0 and h[layout.H_ROWS_DONE] == 3
    spsc.set_waiting(buf, layout.H_PRODUCER_WAITING)  # it looked, and sleeps again
    assert not spsc.count_done(buf, -3)  # counted out: nobody to wake, the flag stays
    assert h[layout.H_PRODUCER_WAITING] == 1 and h[layout.H_ROWS_DONE] == 0
    assert spsc.release(buf, new_tail, 1)  # the release wakes it
    assert h[layout.H_PRODUCER_WAITING] == 0


def test_two_million_records_many_laps_exactly_once_in_order():
    num_records = 2_000_000
    cap = 1024
    rng = np.random.default_rng(20240611)
    counts = rng.integers(0, 8, num_records)
    offsets = np.zeros(num_records + 1, np.int64)
    offsets[1:] = np.cumsum(counts)
    flat = rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
    meta = np.empty((num_records, layout.META_WORDS), np.uint32)
    meta[:, 0] = np.arange(num_records, dtype=np.uint32)
    meta[:, 1] = counts
    meta[:, 2:] = rng.integers(0, 2**32, (num_records, 2), dtype=np.uint32)
    key0 = 1 << 40
    batch_max = 128
    out_tokens = np.zeros(8 * batch_max, np.uint32)
    out_offsets = np.zeros(batch_max + 1, np.int64)
    out_keys = np.zeros(batch_max, np.uint64)
    out_meta = np.zeros((batch_max, layout.META_WORDS), np.uint32)
    push_sizes = rng.integers(1, batch_max + 1, num_records)
    pop_sizes = rng.integers(1, batch_max + 1, num_records)

    buf = new_ring(cap)
    pushed = popped = 0
    checksum = 0
    for turn in range(num_records):  # every turn pops at least one record
        if popped == num_records:
            break
        if pushed < num_records:
            last = min(num_records, pushed + int(push_sizes[turn]))
            count, status, _wake = spsc.push_many(buf, flat, offsets, key0, meta, pushed, last)
            assert status == (layout.OK if count == last - pushed else layout.FULL)
            pushed += int(count)
        n, status, _wake = spsc.pop_many(buf, out_tokens, out_offsets, out_keys, out_meta, int(pop_sizes[turn]))
        n = int(n)
        assert n >= 1
        assert status in (layout.OK, layout.EMPTY)
        assert np.array_equal(out_keys[:n], np.arange(key0 + popped, key0 + popped + n, dtype=np.uint64))
        assert np.array_equal(out_meta[:n], meta[popped : popped + n])
        assert np.array_equal(out_offsets[: n + 1], offsets[popped : popped + n + 1] - offsets[popped])
        checksum += int(out_tokens[: out_offsets[n]].sum(dtype=np.uint64))
        popped += n
    assert popped == num_records
    assert checksum == int(flat.sum(dtype=np.uint64))

    h = header(buf)
    assert int(h[layout.H_NUM_PUSHED]) == num_records
    assert int(h[layout.H_NUM_POPPED]) == num_records
    assert int(h[layout.H_HEAD]) == int(h[layout.H_TAIL])
    assert int(h[layout.H_HEAD]) // cap > 10_000  # laps
    assert not spsc.readable(buf)
    assert spsc.writable_words(buf) == cap - layout.SENTINEL_WORDS


CORRUPT_CAP = 64
CORRUPT_TAIL_OFFSET = 40  # two 20-word records pushed and popped
WRAP = layout.WRAP


@pytest.mark.parametrize(
    "garbage",
    [
        {"commit": 9},  # odd size
        {"commit": 4},  # smaller than a record header
        {"commit": layout.max_record_words(CORRUPT_CAP) + 2},  # over max_record_words
        {"commit": 0xFFFFFFFE},
        {"commit": 30},  # 40 + 30 runs past the end of the 64-word region
        {"commit": 10, "num_tokens": 3},  # 8 + 3 tokens overrun a 10-word record
        {"commit": WRAP, "word0": WRAP},  # a wrap to a wrap
        {"commit": WRAP, "word0": 0},  # a wrap to nothing
        {"commit": WRAP, "word0": 7},  # a wrap to an odd size
    ],
    ids=["odd", "small", "over_max", "huge", "past_end", "tokens_overrun", "wrap_wrap", "wrap_empty", "wrap_odd"],
)
def test_corrupt_commit_word_at_tail_returns_corrupt(garbage):
    buf = new_ring(CORRUPT_CAP)
    tokens = np.arange(12, dtype=np.uint32)
    for key in range(2):
        assert spsc.push(buf, tokens, key, 0, 0, 0, 0) == layout.OK
    assert len(kernel_pop(buf, 2, 100)[0]) == 2
    h = header(buf)
    assert int(h[layout.H_TAIL]) == CORRUPT_TAIL_OFFSET
    w = data_words(buf)
    w[CORRUPT_TAIL_OFFSET] = garbage["commit"]
    w[CORRUPT_TAIL_OFFSET + 1] = garbage.get("num_tokens", 0)
    if "word0" in garbage:
        w[0] = garbage["word0"]

    assert kernel_pop(buf, 4, 100) == ([], layout.CORRUPT)
    n, new_tail, status = spsc.peek_many(buf, np.zeros(4, np.int64), 4)
    assert (n, new_tail, status) == (0, CORRUPT_TAIL_OFFSET, layout.CORRUPT)
    assert int(h[layout.H_TAIL]) == CORRUPT_TAIL_OFFSET
    assert int(h[layout.H_NUM_POPPED]) == 2
    assert kernel_pop(buf, 4, 100) == ([], layout.CORRUPT)  # it stays stopped, and does not crash


def test_corrupt_record_after_good_ones_stops_after_them():
    buf = new_ring(CORRUPT_CAP)
    for key in range(3):
        assert spsc.push(buf, np.full(key, key, np.uint32), key, key, 0, 0, 0) == layout.OK
    h = header(buf)
    head = int(h[layout.H_HEAD])
    data_words(buf)[head] = 9  # the sentinel just past the last record

    records, status = kernel_pop(buf, 8, 100)
    assert status == layout.CORRUPT
    assert [r.key for r in records] == [0, 1, 2]
    assert int(h[layout.H_TAIL]) == head
    assert int(h[layout.H_NUM_POPPED]) == 3
    n, new_tail, status = spsc.peek_many(buf, np.zeros(4, np.int64), 4)
    assert (n, new_tail, status) == (0, head, layout.CORRUPT)
