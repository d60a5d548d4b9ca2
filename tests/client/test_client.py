"""The producer client against a real registry and real shared-memory rings.

Every test runs its own broker side (conftest's `broker`: an `Owner` and a `Registry` on its own
tmp data directory, a random instance) and reads what the producer wrote
from the ingest ring the way the broker does (`ingest.RingSet`, zero-copy).
Submit: every accepted input form arrives exactly; every bad input is
refused with TypeError/ValueError before anything is written. Full rings,
reconnects, results, and a spawned producer process.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
from support.harness import DRAIN_SECONDS, BrokerSide, Rec

from shmbroker.client.producer import Producer, Result
from shmbroker.client.reader import SeenIds
from shmbroker.errors import BrokerError, Full, NotRunning
from shmbroker.ring import items
from shmbroker.ring import layout as L
from shmbroker.ring.items import NO_PREFIX, STATUS_CODES, U32_MAX, model_id
from shmbroker.ring.ring import PRODUCER

pytestmark = pytest.mark.timeout(60)

JOIN_SECONDS = 30.0
SMALL_RING_BYTES = 1024  # 256 words: max 118 tokens per item, ~14 items of 10 tokens


@pytest.fixture
def small_broker(make_broker) -> BrokerSide:
    return make_broker(ingest_ring_bytes=SMALL_RING_BYTES)


def base_id(p: Producer) -> int:
    return p.producer_id << items.SEQ_BITS


def assert_rec(rec: Rec, key, tokens, max_new_tokens, prefix_len=NO_PREFIX, model=0) -> None:
    assert rec.key == key
    assert rec.max_new_tokens == max_new_tokens
    assert rec.prefix_len == prefix_len
    assert rec.model == model
    assert rec.flags == 0
    assert rec.tokens.dtype == np.uint32
    np.testing.assert_array_equal(rec.tokens, np.asarray(tokens, dtype=np.uint64).astype(np.uint32))


def run_child(ctx_name: str, target, *args) -> int:
    proc = mp.get_context(ctx_name).Process(target=target, args=args)
    proc.start()
    proc.join(JOIN_SECONDS)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        raise AssertionError(f"child {target.__name__} did not finish in {JOIN_SECONDS} s")
    return proc.exitcode


# -- submit: what goes in arrives exactly ---------------------------------------------


def test_submit_accepts_every_integer_form_and_delivers_it_exactly(broker):
    base = np.array([0, 1, 7, 65535, 128_000, U32_MAX], dtype=np.uint64)
    strided = np.arange(40, dtype=np.uint32)[::3]
    assert not strided.flags.c_contiguous
    cases = [
        (base.astype(np.uint32), dict(max_new_tokens=16)),
        (np.array([5, 6, 7, 8], np.int64), dict(max_new_tokens=0, prefix_len=2, model="llama-3-8b")),
        (np.array([1, 2, 65535], np.uint16), dict(max_new_tokens=U32_MAX)),
        (np.array([3, 2**31 - 1], np.int32), dict(max_new_tokens=np.int64(9), prefix_len=np.int32(0))),
        (strided, dict(max_new_tokens=1, prefix_len=len(strided))),
        (np.arange(20, dtype=np.int64)[::-2], dict(max_new_tokens=2, model="m")),
        (base, dict(max_new_tokens=3)),  # uint64 in range
        ([9, 8, 7, U32_MAX], dict(max_new_tokens=4, prefix_len=1)),
        ((4, 5), dict(max_new_tokens=5, model="llama-3-8b")),
        (np.array([42], np.uint8), dict(max_new_tokens=6)),
    ]
    with Producer("forms", data_dir=broker.data_dir) as p:
        assert p.producer_id >= 1
        ids = [p.submit(tokens, **kw) for tokens, kw in cases]
        assert ids == [base_id(p) | i for i in range(len(cases))]
        assert p.next_item_id == base_id(p) | len(cases)
    got = broker.collect("forms", len(cases))
    for i, ((tokens, kw), rec) in enumerate(zip(cases, got)):
        prefix = kw.get("prefix_len")
        assert_rec(
            rec,
            i,
            tokens,
            int(kw["max_new_tokens"]),
            NO_PREFIX if prefix is None else int(prefix),
            model_id(kw.get("model")),
        )
    assert model_id("llama-3-8b") not in (0, model_id("m"))


def test_submit_many_delivers_batches_with_shared_and_per_item_values(broker):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 50, size=12)
    offsets = np.zeros(13, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 2**32, size=int(offsets[-1]), dtype=np.uint64).astype(np.uint32)
    per_max = np.arange(12, dtype=np.int64) * 100
    per_prefix = [int(n) // 2 for n in lengths]
    with Producer("many", data_dir=broker.data_dir) as p:
        first = p.submit([1, 2, 3], max_new_tokens=1)
        ids_a = p.submit_many(flat, offsets, max_new_tokens=64)
        ids_b = p.submit_many(flat.astype(np.int64), list(offsets), max_new_tokens=per_max, prefix_len=per_prefix, model="m7")
        ids_c = p.submit_many(flat[:10].tolist(), np.array([0, 4, 10], np.int32), max_new_tokens=[7, 8], prefix_len=4)
        b = base_id(p)
        assert first == b
        assert ids_a.dtype == np.uint64
        np.testing.assert_array_equal(ids_a, b + 1 + np.arange(12, dtype=np.uint64))
        np.testing.assert_array_equal(ids_b, b + 13 + np.arange(12, dtype=np.uint64))
        np.testing.assert_array_equal(ids_c, [b + 25, b + 26])
        assert p.next_item_id == b + 27
    got = broker.collect("many", 27)
    assert [r.key for r in got] == list(range(27))
    assert_rec(got[0], 0, [1, 2, 3], 1)
    for i in range(12):
        row = flat[offsets[i] : offsets[i + 1]]
        assert_rec(got[1 + i], 1 + i, row, 64)
        assert_rec(got[13 + i], 13 + i, row, int(per_max[i]), per_prefix[i], model_id("m7"))
    assert_rec(got[25], 25, flat[0:4], 7, 4)
    assert_rec(got[26], 26, flat[4:10], 8, 4)


# -- bad input: refused before anything is written -------------------------------------

# (id, call(p) -> None, exception type, message regex)
BAD_SUBMITS = [
    ("empty-list", lambda p: p.submit([], max_new_tokens=1), ValueError, "empty"),
    ("empty-array", lambda p: p.submit(np.array([], np.uint32), max_new_tokens=1), ValueError, "empty"),
    ("empty-int64", lambda p: p.submit(np.array([], np.int64), max_new_tokens=1), ValueError, "empty"),
    ("2d", lambda p: p.submit(np.ones((2, 3), np.uint32), max_new_tokens=1), ValueError, "1-D"),
    ("2d-list", lambda p: p.submit([[1, 2], [3, 4]], max_new_tokens=1), ValueError, "1-D"),
    ("float", lambda p: p.submit(np.array([1.0, 2.0]), max_new_tokens=1), TypeError, "float64"),
    ("float-list", lambda p: p.submit([1.5, 2.0], max_new_tokens=1), TypeError, "float"),
    ("bool", lambda p: p.submit(np.array([True, False]), max_new_tokens=1), TypeError, "bool"),
    ("str", lambda p: p.submit("hello", max_new_tokens=1), (TypeError, ValueError), "tokens"),
    ("str-list", lambda p: p.submit(["1", "2"], max_new_tokens=1), TypeError, "tokens"),
    ("bytes", lambda p: p.submit(b"\x01\x02", max_new_tokens=1), (TypeError, ValueError), "tokens"),
    ("negative", lambda p: p.submit([1, -1, 2], max_new_tokens=1), ValueError, "negative"),
    ("negative-int32", lambda p: p.submit(np.array([4, -7], np.int32), max_new_tokens=1), ValueError, "negative"),
    ("above-u32", lambda p: p.submit([1, 2**32], max_new_tokens=1), ValueError, "uint32"),
    ("above-u32-uint64", lambda p: p.submit(np.array([2**32 + 5], np.uint64), max_new_tokens=1), ValueError, "uint32"),
    ("huge-int", lambda p: p.submit([1, 2**70], max_new_tokens=1), TypeError, "tokens"),
    ("object", lambda p: p.submit(np.array([1, 2], dtype=object), max_new_tokens=1), TypeError, "object"),
    ("none-in-list", lambda p: p.submit([1, None], max_new_tokens=1), TypeError, "tokens"),
    ("max-new-negative", lambda p: p.submit([1], max_new_tokens=-1), ValueError, "max_new_tokens"),
    ("max-new-2**32", lambda p: p.submit([1], max_new_tokens=2**32), ValueError, "max_new_tokens"),
    ("max-new-np-2**32", lambda p: p.submit([1], max_new_tokens=np.int64(2**32)), ValueError, "max_new_tokens"),
    ("max-new-float", lambda p: p.submit([1], max_new_tokens=3.0), TypeError, "max_new_tokens"),
    ("max-new-bool", lambda p: p.submit([1], max_new_tokens=True), TypeError, "max_new_tokens"),
    ("max-new-str", lambda p: p.submit([1], max_new_tokens="8"), TypeError, "max_new_tokens"),
    ("max-new-none", lambda p: p.submit([1], max_new_tokens=None), TypeError, "max_new_tokens"),
    ("prefix-too-long", lambda p: p.submit([1, 2, 3], max_new_tokens=1, prefix_len=4), ValueError, "prefix_len"),
    ("prefix-negative", lambda p: p.submit([1, 2, 3], max_new_tokens=1, prefix_len=-1), ValueError, "prefix_len"),
    ("prefix-float", lambda p: p.submit([1, 2, 3], max_new_tokens=1, prefix_len=1.0), TypeError, "prefix_len"),
    ("prefix-bool", lambda p: p.submit([1, 2, 3], max_new_tokens=1, prefix_len=True), TypeError, "prefix_len"),
    ("model-int", lambda p: p.submit([1], max_new_tokens=1, model=7), TypeError, "model"),
    ("model-bytes", lambda p: p.submit([1], max_new_tokens=1, model=b"llama"), TypeError, "model"),
    ("model-empty", lambda p: p.submit([1], max_new_tokens=1, model=""), (TypeError, ValueError), "model"),
    ("oversized", lambda p: p.submit(np.ones(p.max_tokens + 1, np.uint32), max_new_tokens=1), ValueError, "exceeds"),
    ("oversized-list", lambda p: p.submit([1] * (p.max_tokens + 1), max_new_tokens=1), ValueError, "exceeds"),
    (
        "oversized-strided",
        lambda p: p.submit(np.ones(2 * p.max_tokens + 4, np.int64)[::2], max_new_tokens=1),
        ValueError,
        "exceeds",
    ),
]


def _flat(n: int) -> np.ndarray:
    return np.arange(1, n + 1, dtype=np.uint32)


BAD_SUBMIT_MANYS = [
    ("flat-empty", lambda p: p.submit_many([], [0, 0], max_new_tokens=1), ValueError, "empty"),
    ("flat-2d", lambda p: p.submit_many(np.ones((2, 2), np.uint32), [0, 4], max_new_tokens=1), ValueError, "1-D"),
    ("flat-float", lambda p: p.submit_many(np.ones(4), [0, 4], max_new_tokens=1), TypeError, "dtype"),
    ("flat-negative", lambda p: p.submit_many([1, -2, 3], [0, 3], max_new_tokens=1), ValueError, "negative"),
    ("offsets-not-from-0", lambda p: p.submit_many(_flat(6), [1, 3, 6], max_new_tokens=1), ValueError, "start at 0"),
    ("offsets-not-to-len", lambda p: p.submit_many(_flat(6), [0, 3, 5], max_new_tokens=1), ValueError, "end at"),
    ("offsets-past-len", lambda p: p.submit_many(_flat(6), [0, 3, 7], max_new_tokens=1), ValueError, "end at"),
    ("offsets-decrease", lambda p: p.submit_many(_flat(6), [0, 4, 2, 6], max_new_tokens=1), ValueError, "decrease"),
    ("offsets-empty-item", lambda p: p.submit_many(_flat(6), [0, 3, 3, 6], max_new_tokens=1), ValueError, "item 1"),
    ("offsets-2d", lambda p: p.submit_many(_flat(6), np.array([[0, 3], [3, 6]]), max_new_tokens=1), ValueError, "1-D"),
    ("offsets-one", lambda p: p.submit_many(_flat(6), [0], max_new_tokens=1), ValueError, "offsets"),
    ("offsets-float", lambda p: p.submit_many(_flat(6), [0.0, 6.0], max_new_tokens=1), TypeError, "offsets"),
    (
        "oversized-middle",
        lambda p: p.submit_many(
            _flat(p.max_tokens + 11), [0, 5, p.max_tokens + 6, p.max_tokens + 11], max_new_tokens=1
        ),
        ValueError,
        "item 1",
    ),
    ("max-new-short", lambda p: p.submit_many(_flat(6), [0, 2, 4, 6], max_new_tokens=[1, 2]), ValueError, "max_new_tokens"),
    ("max-new-long", lambda p: p.submit_many(_flat(6), [0, 2, 4, 6], max_new_tokens=np.ones(4, np.int64)), ValueError, "max_new_tokens"),
    ("max-new-2d", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=np.ones((2, 1), np.int64)), ValueError, "max_new_tokens"),
    ("max-new-neg-item", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=[5, -1]), ValueError, "max_new_tokens"),
    ("max-new-big-item", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=[5, 2**32]), ValueError, "max_new_tokens"),
    ("max-new-float-items", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=[1.0, 2.0]), TypeError, "max_new_tokens"),
    ("max-new-bool", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=True), TypeError, "max_new_tokens"),
    ("max-new-negative", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=-3), ValueError, "max_new_tokens"),
    ("prefix-short", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=1, prefix_len=[1]), ValueError, "prefix_len"),
    ("prefix-exceeds-item", lambda p: p.submit_many(_flat(6), [0, 5, 6], max_new_tokens=1, prefix_len=2), ValueError, "prefix_len"),
    ("prefix-exceeds-one", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=1, prefix_len=[3, 4]), ValueError, "prefix_len"),
    ("prefix-negative", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=1, prefix_len=-1), ValueError, "prefix_len"),
    ("model-int", lambda p: p.submit_many(_flat(6), [0, 3, 6], max_new_tokens=1, model=3), TypeError, "model"),
]


def _check_refused_and_intact(side: BrokerSide, call, exc, match) -> None:
    with Producer("bad", data_dir=side.data_dir) as p:
        b = base_id(p)
        assert p.submit([10, 11, 12], max_new_tokens=5) == b
        assert p.submit_many(_flat(4), [0, 1, 4], max_new_tokens=6).tolist() == [b + 1, b + 2]
        before = side.header("bad")
        with pytest.raises(exc, match=match) as info:
            call(p)
        assert not isinstance(info.value, Full)
        assert side.header("bad") == before, "a refused call wrote to the ring"
        assert p.next_item_id == b + 3
        assert p.submit([13], max_new_tokens=7) == b + 3
    got = side.collect("bad", 4)
    assert_rec(got[0], 0, [10, 11, 12], 5)
    assert_rec(got[1], 1, [1], 6)
    assert_rec(got[2], 2, [2, 3, 4], 6)
    assert_rec(got[3], 3, [13], 7)


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in BAD_SUBMITS], ids=[c[0] for c in BAD_SUBMITS])
def test_bad_submit_is_refused_and_writes_nothing(broker, call, exc, match):
    _check_refused_and_intact(broker, call, exc, match)


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in BAD_SUBMIT_MANYS], ids=[c[0] for c in BAD_SUBMIT_MANYS])
def test_bad_submit_many_is_refused_and_writes_nothing(broker, call, exc, match):
    _check_refused_and_intact(broker, call, exc, match)


def test_item_larger_than_a_small_ring_is_value_error_never_full(small_broker):
    with Producer("big", data_dir=small_broker.data_dir, timeout_seconds=0.2) as p:
        assert p.max_tokens == L.max_tokens(SMALL_RING_BYTES // 4)
        p.submit(np.ones(p.max_tokens, np.uint32), max_new_tokens=1)  # the largest that fits
        # The ring is now more than half full: an oversized item must still be ValueError, at once.
        before = small_broker.header("big")
        for block in (False, True):
            t0 = time.monotonic()
            with pytest.raises(ValueError, match="exceeds"):
                p.submit(np.ones(p.max_tokens + 1, np.uint32), max_new_tokens=1, block=block)
            with pytest.raises(ValueError, match="exceeds"):
                p.submit_many(_flat(p.max_tokens + 3), [0, 1, p.max_tokens + 3], max_new_tokens=1, block=block)
            assert time.monotonic() - t0 < 0.5
        assert small_broker.header("big") == before
        assert p.next_item_id == base_id(p) | 1
    got = small_broker.collect("big", 1)
    assert got[0].tokens.size == got[0].tokens.sum() == L.max_tokens(SMALL_RING_BYTES // 4)


def test_submit_after_close_raises_broker_error(broker):
    p = Producer("closed", data_dir=broker.data_dir)
    p.submit([1], max_new_tokens=1)
    p.close()
    p.close()  # idempotent
    with pytest.raises(BrokerError, match="closed"):
        p.submit(np.array([1, 2], np.uint32), max_new_tokens=1)
    broker.collect("closed", 1)


def test_read_only_uint32_tokens_are_accepted(broker):
    """BUG: a read-only uint32 array (np.frombuffer of bytes, a memory-mapped file) is valid input."""
    ro = np.frombuffer(np.array([5, 6, 7], np.uint32).tobytes(), np.uint32)
    assert not ro.flags.writeable
    with Producer("ro", data_dir=broker.data_dir) as p:
        item = p.submit(ro, max_new_tokens=2)
        assert item == base_id(p)
    assert_rec(broker.collect("ro", 1)[0], 0, [5, 6, 7], 2)


def test_max_new_tokens_past_int64_is_value_error(broker):
    with Producer("ovf", data_dir=broker.data_dir) as p:
        before = broker.header("ovf")
        for tokens in (np.array([1, 2], np.uint32), [1, 2]):
            for value in (2**63, 2**64, 2**70):
                with pytest.raises(ValueError, match="max_new_tokens"):
                    p.submit(tokens, max_new_tokens=value)
        with pytest.raises(ValueError, match="max_new_tokens"):
            p.submit_many([1, 2], [0, 1, 2], max_new_tokens=2**64)
        assert broker.header("ovf") == before
        assert p.next_item_id == base_id(p)


# -- full ring --------------------------------------------------------------------------


def _fill(p: Producer, item: np.ndarray, limit: int = 200) -> int:
    """Submit `item` with block=False until the ring refuses; return how many went in."""
    for n in range(limit):
        try:
            p.submit(item, max_new_tokens=n)
        except Full:
            return n
    raise AssertionError(f"ring never filled in {limit} submits")


def test_full_ring_raises_at_once_or_after_timeout_and_loses_nothing(small_broker):
    item = np.arange(10, dtype=np.uint32)
    with Producer("full", data_dir=small_broker.data_dir, timeout_seconds=0.2) as p:
        b = base_id(p)
        n = _fill(p, item)
        assert 5 <= n <= 20
        assert p.next_item_id == b | n
        head = small_broker.header("full")["head"]

        t0 = time.monotonic()
        with pytest.raises(Full) as info:
            p.submit(item, max_new_tokens=0, block=False)
        assert time.monotonic() - t0 < 0.1
        assert info.value.submitted == 0 and list(info.value.ids) == []

        t0 = time.monotonic()
        with pytest.raises(Full):
            p.submit(item, max_new_tokens=0, timeout_seconds=0.3)
        assert 0.28 <= time.monotonic() - t0 < 1.5

        t0 = time.monotonic()
        with pytest.raises(Full):
            p.submit(item, max_new_tokens=0)  # the Producer's default timeout, 0.2 s
        assert 0.18 <= time.monotonic() - t0 < 1.5

        t0 = time.monotonic()
        with pytest.raises(Full) as info:
            p.submit_many(np.tile(item, 2), [0, 10, 20], max_new_tokens=0, timeout_seconds=0.3)
        assert 0.28 <= time.monotonic() - t0 < 1.5
        assert info.value.submitted == 0 and list(info.value.ids) == []

        st = small_broker.header("full")
        assert st["head"] == head and st["num_pushed"] == n
        assert p.next_item_id == b | n

        got = small_broker.collect("full", n)
        assert [r.key for r in got] == list(range(n))
        assert all(r.max_new_tokens == i for i, r in enumerate(got))
        assert p.submit(item + 1, max_new_tokens=99, block=False) == b | n
        assert p.submit(item + 2, max_new_tokens=98, block=False) == b | (n + 1)
    got = small_broker.collect("full", n + 2)
    assert [r.key for r in got] == list(range(n + 2))
    assert_rec(got[n], n, item + 1, 99)
    assert_rec(got[n + 1], n + 1, item + 2, 98)


def test_submit_many_partly_fitting_reports_exactly_what_went_in(small_broker):
    count = 40
    flat = np.arange(1, count * 10 + 1, dtype=np.uint32)
    offsets = np.arange(0, count * 10 + 1, 10, dtype=np.int64)
    per_max = np.arange(count, dtype=np.int64) + 1000
    with Producer("part", data_dir=small_broker.data_dir, timeout_seconds=5.0) as p:
        b = base_id(p)
        assert p.submit([7], max_new_tokens=1) == b
        with pytest.raises(Full) as info:
            p.submit_many(flat, offsets, max_new_tokens=per_max, block=False)
        k = info.value.submitted
        assert 0 < k < count
        np.testing.assert_array_equal(info.value.ids, b + 1 + np.arange(k, dtype=np.uint64))
        assert p.next_item_id == b + 1 + k
        got = small_broker.collect("part", 1 + k)
        assert [r.key for r in got] == list(range(1 + k))
        for i in range(k):
            assert_rec(got[1 + i], 1 + i, flat[offsets[i] : offsets[i + 1]], int(per_max[i]))

        # with a deadline: partial again, bounded in time
        t0 = time.monotonic()
        with pytest.raises(Full) as info:
            p.submit_many(flat[offsets[k] :], offsets[k:] - offsets[k], max_new_tokens=per_max[k:], timeout_seconds=0.3)
        assert 0.28 <= time.monotonic() - t0 < 1.5
        k2 = info.value.submitted
        assert 0 < k2 < count - k
        np.testing.assert_array_equal(info.value.ids, b + 1 + k + np.arange(k2, dtype=np.uint64))
        got = small_broker.collect("part", 1 + k + k2)
        for i in range(k, k + k2):
            assert_rec(got[1 + i], 1 + i, flat[offsets[i] : offsets[i + 1]], int(per_max[i]))

        # the rest goes in as the consumer drains; no id skipped or reused
        done = k + k2
        for _ in range(count):
            if done == count:
                break
            try:
                ids = p.submit_many(flat[offsets[done] :], offsets[done:] - offsets[done], max_new_tokens=per_max[done:], block=False)
                np.testing.assert_array_equal(ids, b + 1 + done + np.arange(count - done, dtype=np.uint64))
                done = count
            except Full as exc:
                assert exc.submitted > 0  # the ring was drained before this call
                np.testing.assert_array_equal(exc.ids, b + 1 + done + np.arange(exc.submitted, dtype=np.uint64))
                done += exc.submitted
                small_broker.collect("part", 1 + done)
        assert done == count
        assert p.next_item_id == b + 1 + count
    got = small_broker.collect("part", 1 + count)
    assert [r.key for r in got] == list(range(1 + count))
    for i in range(count):
        assert_rec(got[1 + i], 1 + i, flat[offsets[i] : offsets[i + 1]], int(per_max[i]))


def test_blocked_submit_resumes_when_the_consumer_drains(small_broker):
    """Producer far ahead of a slow consumer thread: every item arrives once, in order, no Full."""
    count = 300
    side = small_broker
    rng = np.random.default_rng(3)
    rows = [rng.integers(0, 2**32, size=int(n), dtype=np.uint64).astype(np.uint32) for n in rng.integers(1, 100, count)]
    with Producer("slow", data_dir=side.data_dir, timeout_seconds=10.0) as p:
        stop = threading.Event()
        errors: list[BaseException] = []

        def consume():
            try:
                deadline = time.monotonic() + DRAIN_SECONDS
                while len(side.received.get("slow", [])) < count + 20 and not stop.is_set():
                    assert time.monotonic() < deadline
                    if side.drain_once() == 0:
                        side.rings.wait(0.02)
                    time.sleep(0.001)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        t = threading.Thread(target=consume)
        t.start()
        try:
            for i, row in enumerate(rows):
                assert p.submit(row, max_new_tokens=i) == base_id(p) | i
            flat = np.concatenate(rows[:20])
            offs = np.zeros(21, np.int64)
            offs[1:] = np.cumsum([r.size for r in rows[:20]])
            ids = p.submit_many(flat, offs, max_new_tokens=5)
            assert ids[0] == base_id(p) | count
        except BaseException:
            stop.set()
            raise
        finally:
            t.join(DRAIN_SECONDS + 5)
    assert not errors, errors
    got = side.received["slow"]
    assert [r.key for r in got] == list(range(count + 20))
    for i, row in enumerate(rows):
        assert_rec(got[i], i, row, i)
    assert side.header("slow")["num_full"] > 0  # it really had to wait


# -- connecting -------------------------------------------------------------------------


def _connect_submit_and(data_dir: str, name: str, how: str, count: int) -> None:
    p = Producer(name, data_dir=data_dir)
    for i in range(count):
        p.submit([i + 1], max_new_tokens=i)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    p.close()


def test_reconnect_after_close_resumes_the_sequence(broker):
    with Producer("again", data_dir=broker.data_dir) as p1:
        pid1 = p1.producer_id
        p1.submit([1], max_new_tokens=0)
        p1.submit_many([2, 3], [0, 1, 2], max_new_tokens=0)
    with Producer("again", data_dir=broker.data_dir) as p2:
        assert p2.producer_id == pid1
        assert p2.next_item_id == base_id(p2) | 3
        assert p2.submit([4], max_new_tokens=0) == base_id(p2) | 3
    with Producer("other", data_dir=broker.data_dir) as q:
        assert q.producer_id != pid1
        assert q.next_item_id == base_id(q)
    got = broker.collect("again", 4)
    assert [r.key for r in got] == [0, 1, 2, 3]
    assert [int(r.tokens[0]) for r in got] == [1, 2, 3, 4]


def test_reconnect_after_the_process_died_resumes_the_sequence(broker):
    assert run_child("fork", _connect_submit_and, broker.data_dir, "crash", "kill", 5) == -signal.SIGKILL
    with Producer("crash", data_dir=broker.data_dir) as p:
        assert p.producer_id == broker.entry("crash").producer_id
        assert broker.entry("crash").pid == os.getpid()
        assert p.next_item_id == base_id(p) | 5
        assert p.submit([6], max_new_tokens=5) == base_id(p) | 5
    got = broker.collect("crash", 6)
    assert [r.key for r in got] == list(range(6))
    assert [int(r.tokens[0]) for r in got] == [1, 2, 3, 4, 5, 6]


def test_name_closed_by_a_live_process_can_be_taken_by_another(broker):
    """BUG: after a clean close the name is free; the registry still refuses it while the closer lives."""
    with Producer("handoff", data_dir=broker.data_dir) as p:
        p.submit([1], max_new_tokens=0)
    assert run_child("fork", _connect_submit_and, broker.data_dir, "handoff", "close", 2) == 0
    got = broker.collect("handoff", 3)
    assert [r.key for r in got] == [0, 1, 2]


def _try_connect(data_dir: str, name: str, conn) -> None:
    try:
        Producer(name, data_dir=data_dir).close()
        conn.send(("connected", None))
    except BrokerError as exc:
        conn.send((type(exc).__name__, str(exc)))


def test_second_live_producer_with_the_same_name_is_refused(broker):
    with Producer("solo", data_dir=broker.data_dir) as p:
        p.submit([1], max_new_tokens=0)
        parent, child = mp.get_context("fork").Pipe()
        assert run_child("fork", _try_connect, broker.data_dir, "solo", child) == 0
        assert parent.poll(1)
        kind, message = parent.recv()
        assert kind == "BrokerError"
        assert "solo" in message and "in use" in message and str(os.getpid()) in message
        assert p.submit([2], max_new_tokens=0) == base_id(p) | 1  # the holder is unaffected
    assert [r.key for r in broker.collect("solo", 2)] == [0, 1]


def test_second_live_producer_in_the_same_process_is_refused(broker):
    """BUG: two live Producers of one name in one process share one SPSC ring and hand out the same ids."""
    with Producer("twin", data_dir=broker.data_dir) as p:
        p.submit([1], max_new_tokens=0)
        with pytest.raises(BrokerError):
            Producer("twin", data_dir=broker.data_dir).close()


def test_no_broker_raises_not_running(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(NotRunning, match="no broker"):
        Producer("x", data_dir=tmp_path / "nothing-here", connect_timeout_seconds=1.0)
    # a socket file left by a dead broker: connection refused, still NotRunning
    path = tmp_path / "broker.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()
    with pytest.raises(NotRunning):
        Producer("x", data_dir=tmp_path, connect_timeout_seconds=1.0)
    assert time.monotonic() - t0 < 5


# -- results ----------------------------------------------------------------------------


def _answer_reader(ring) -> None:
    """What the results process does when a reader attaches (here the test plays that process)."""
    ring.header[L.H_SESSION_READY] = ring.header[L.H_SESSION]


def test_results_yields_what_the_broker_pushes_and_returns_on_timeout(broker):
    with Producer("res", data_dir=broker.data_dir) as p:
        ids = [p.submit([i + 1], max_new_tokens=4) for i in range(6)]
        out = broker.entry("res").results.attach(PRODUCER)
        _answer_reader(out)
        try:
            statuses = ["ok", "too_long", "invalid", "engine_error", "ok", "ok"]
            payloads = [
                np.array([100, 101, 102], np.uint32),
                np.array([], np.uint32),
                np.array([], np.uint32),
                np.array([U32_MAX], np.uint32),
                np.arange(500, dtype=np.uint32),
                np.array([9], np.uint32),
            ]
            for seq in (0, 2, 1, 3, 4, 5):  # results come back in any order
                # a result record: key = item id, meta = (status, generated tokens, 0, error bytes)
                assert out.push(payloads[seq], ids[seq], STATUS_CODES[statuses[seq]], payloads[seq].size, 0, 0) == L.OK
            t0 = time.monotonic()
            got = list(p.results(timeout_seconds=0.3))
            elapsed = time.monotonic() - t0
            assert 0.28 <= elapsed < 2.0
            assert [r.item_id for r in got] == [ids[s] for s in (0, 2, 1, 3, 4, 5)]
            for r in got:
                assert isinstance(r, Result)
                seq = r.item_id & items.SEQ_MASK
                assert r.status == statuses[seq]
                assert r.tokens.dtype == np.uint32
                np.testing.assert_array_equal(r.tokens, payloads[seq])
            t0 = time.monotonic()
            assert list(p.results(timeout_seconds=0.2)) == []
            assert 0.18 <= time.monotonic() - t0 < 2.0
            assert list(p.results()) == []  # default: no waiting
        finally:
            out.close()


def test_results_wait_wakes_on_arrival_and_handles_many(broker):
    count = 700  # more than one internal batch
    with Producer("many-res", data_dir=broker.data_dir) as p:
        base = p.next_item_id & ~items.SEQ_MASK
        out = broker.entry("many-res").results.attach(PRODUCER)
        _answer_reader(out)
        try:

            def push_later():
                time.sleep(0.1)
                for seq in range(count):
                    deadline = time.monotonic() + 5
                    while out.push(np.array([seq, seq], np.uint32), base | seq, 0, 2) != L.OK:
                        assert time.monotonic() < deadline
                        time.sleep(0.001)

            t = threading.Thread(target=push_later)
            t.start()
            got = []
            t0 = time.monotonic()
            for r in p.results(timeout_seconds=1.0):
                got.append(r)
                if len(got) == count:
                    break
            t.join(10)
            assert time.monotonic() - t0 < 10
        finally:
            out.close()
    assert len(got) == count
    assert [r.item_id & items.SEQ_MASK for r in got] == list(range(count))
    assert all(r.status == "ok" and r.tokens.tolist() == [i, i] for i, r in enumerate(got))


def test_results_not_lost_when_iteration_stops_early(broker):
    """results() takes a result off the ring only when it yields it: a break loses none."""
    with Producer("early", data_dir=broker.data_dir) as p:
        base = p.next_item_id & ~items.SEQ_MASK
        out = broker.entry("early").results.attach(PRODUCER)
        _answer_reader(out)
        try:
            for seq in range(3):
                assert out.push(np.array([seq], np.uint32), base | seq, 0, 1) == L.OK
            it = p.results(timeout_seconds=0.2)
            first = next(it)
            it.close()
            rest = list(p.results(timeout_seconds=0.2))
        finally:
            out.close()
    assert first.item_id & items.SEQ_MASK == 0
    assert [r.item_id & items.SEQ_MASK for r in rest] == [1, 2]


# -- a spawned producer process ----------------------------------------------------------

SPAWN_ITEMS = 10_000
SPAWN_SEED = 11


def _spawn_workload() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SPAWN_SEED)
    lengths = rng.integers(1, 65, size=SPAWN_ITEMS)
    offsets = np.zeros(SPAWN_ITEMS + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 2**32, size=int(offsets[-1]), dtype=np.uint64).astype(np.uint32)
    return flat, offsets


def _spawned_producer(data_dir: str) -> None:
    flat, offsets = _spawn_workload()
    half = SPAWN_ITEMS // 2
    with Producer("spawned", data_dir=data_dir, timeout_seconds=20.0) as p:
        for i in range(half):
            assert p.submit(flat[offsets[i] : offsets[i + 1]], max_new_tokens=i) == base_id(p) | i
        for lo in range(half, SPAWN_ITEMS, 500):
            hi = lo + 500
            ids = p.submit_many(
                flat[offsets[lo] : offsets[hi]], offsets[lo : hi + 1] - offsets[lo], max_new_tokens=np.arange(lo, hi)
            )
            assert int(ids[0]) == base_id(p) | lo


def test_spawned_producer_delivers_10k_items_in_order(make_broker):
    side = make_broker(ingest_ring_bytes=1 << 15)  # small enough to wrap many times
    proc = mp.get_context("spawn").Process(target=_spawned_producer, args=(side.data_dir,))
    proc.start()
    try:
        deadline = time.monotonic() + 40
        while len(side.received.get("spawned", [])) < SPAWN_ITEMS:
            assert time.monotonic() < deadline, "spawned producer too slow"
            if proc.exitcode not in (None, 0):
                raise AssertionError(f"spawned producer exited with {proc.exitcode}")
            if side.drain_once() == 0:
                if side.rings.sources:
                    side.rings.wait(0.05)
                else:
                    time.sleep(0.01)
        proc.join(JOIN_SECONDS)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    side.drain_once()
    got = side.received["spawned"]
    assert len(got) == SPAWN_ITEMS
    flat, offsets = _spawn_workload()
    assert [r.key for r in got] == list(range(SPAWN_ITEMS))
    assert [r.max_new_tokens for r in got] == list(range(SPAWN_ITEMS))
    assert all(r.prefix_len == NO_PREFIX and r.model == 0 for r in got)
    np.testing.assert_array_equal(np.concatenate([r.tokens for r in got]), flat)
    assert side.entry("spawned").pid == proc.pid


def test_dedupe_keeps_each_producer_ids_apart_in_one_batch():
    """After a broker restart one batch of results mixes a name's old and new producer ids: each id is
    judged against its own producer's seen set (and a duplicate inside the batch is dropped)."""
    p = SeenIds()
    a, b = 1 << items.SEQ_BITS, 2 << items.SEQ_BITS
    assert p.fresh(np.array([a | 5, b | 7, a | 6], np.uint64)).tolist() == [True, True, True]
    assert p.fresh(np.array([a | 7, b | 5, b | 7, a | 5, a | 7], np.uint64)).tolist() == [True, True, False, False,
                                                                                          False]
    assert p.fresh(np.array([b | 6, b | 6], np.uint64)).tolist() == [True, False]


def test_seen_set_slides_and_stays_small_over_many_results():
    from shmbroker.client.seen import SeenSet

    seen = SeenSet()
    rng = np.random.default_rng(1)
    total = 600_000
    order = np.arange(total)
    for lo in range(0, total, 5000):  # results come back a little out of order, some twice
        chunk = order[lo : lo + 5000].copy()
        rng.shuffle(chunk)
        again = chunk[:50]
        assert seen.add(chunk).all()
        assert not seen.add(again).any()
    assert seen.full_below >= (total - 5000) // SeenSet.CHUNK
    assert seen.nbytes() <= 2 * SeenSet.CHUNK
    assert not seen.add(np.array([0, total - 1], np.int64)).any()  # below the base and in the window
    assert seen.add(np.array([total, total, total + 7], np.int64)).tolist() == [True, False, True]


def test_seen_set_stays_small_for_a_reader_that_starts_late_or_misses_one():
    """Before: a reader whose first result had sequence S allocated S bytes (a new
    process reading an old name's results), and one result that never came stopped the window
    from sliding, so it grew with every result after it."""
    from shmbroker.client.seen import SeenSet

    seen = SeenSet()
    start = 5_000_000_000  # a name that has submitted five billion items before this reader
    assert seen.add(np.arange(start, start + 10, dtype=np.int64)).all()
    assert seen.nbytes() <= SeenSet.CHUNK
    gap = SeenSet()
    total = 1_000_000
    for lo in range(1, total, 10_000):  # seq 0 never comes back
        assert gap.add(np.arange(lo, min(lo + 10_000, total), dtype=np.int64)).all()
    assert gap.nbytes() <= 3 * SeenSet.CHUNK  # the chunk that holds the gap and the newest one
    assert gap.add(np.array([0, 5, total - 1, total], np.int64)).tolist() == [True, False, False, True]
