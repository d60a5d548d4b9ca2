"""SPSC rings between real processes: fork and spawn, millions of records, waits, SIGKILL, attach rules.

The owner (this test process) creates every ring through `Owner`; children
attach by name, as the broker's roles do. Each child talks to the test over a
pipe: it reports progress, its result or its traceback, and the test never
waits on it without a deadline.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from shmbroker.errors import Full, PeerDead
from shmbroker.ring import layout as L
from shmbroker.ring import ring as ring_mod
from shmbroker.ring import spsc
from shmbroker.ring.digest import OUT_OF_ORDER, digest_records, expected_digest
from shmbroker.ring.owned import create_ring
from shmbroker.ring.ring import CONSUMER, PRODUCER, Ring, RingNames

pytestmark = pytest.mark.timeout(60)

DEV_SHM = Path("/dev/shm")
MSG_SECONDS = 20.0  # longest wait for one message from a child (spawn imports numba)
JOIN_SECONDS = 10.0
META = 0xFFFFFFFF  # a meta word with every bit set
KEY0 = (1 << 40) + 12345  # keys above 32 bits
# PeerDead must come soon after the peer dies: a stale heartbeat, one sleep slice, a /proc read.
PEER_DEAD_SECONDS = 1.5
assert ring_mod.STALE_SECONDS + 2 * ring_mod.SLEEP_SLICE_SECONDS < PEER_DEAD_SECONDS


# --- harness ------------------------------------------------------------------------




def _child_main(conn, target, args) -> None:
    """Runs in the child: target(conn, *args); its return value or traceback goes back on the pipe."""
    try:
        result = target(conn, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        conn.close()
        os._exit(1)
    conn.send(("done", result))
    conn.close()


class Child:
    """A child process running `target(conn, *args)`, with bounded waits on everything."""

    def __init__(self, method: str, target, *args):
        ctx = mp.get_context(method)
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_child_main, args=(child_conn, target, args), daemon=True)
        self.proc.start()
        child_conn.close()
        self.pid = self.proc.pid

    def _get(self, timeout: float):
        if not self.conn.poll(timeout):
            raise AssertionError(f"child {self.pid} sent nothing for {timeout} s (exit code {self.proc.exitcode})")
        try:
            kind, value = self.conn.recv()
        except EOFError:
            self.proc.join(JOIN_SECONDS)
            raise AssertionError(f"child {self.pid} died without a word (exit code {self.proc.exitcode})") from None
        if kind == "error":
            raise AssertionError(f"child {self.pid} failed:\n{value}")
        return kind, value

    def recv(self, timeout: float = MSG_SECONDS):
        """The child's next progress message."""
        kind, value = self._get(timeout)
        assert kind == "msg", f"expected a progress message, child finished with {value!r}"
        return value

    def send(self, value) -> None:
        self.conn.send(value)

    def result(self, timeout: float = MSG_SECONDS):
        """The child's return value; it must then exit 0."""
        kind, value = self._get(timeout)
        assert kind == "done", f"expected the child's result, got progress {value!r}"
        self.proc.join(JOIN_SECONDS)
        assert self.proc.exitcode == 0, f"child exit code {self.proc.exitcode}"
        return value

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> None:
        self.proc.join(JOIN_SECONDS)
        assert self.proc.exitcode is not None, f"child {self.pid} did not exit"

    def close(self) -> None:
        if self.proc.is_alive():
            self.kill()
        self.proc.join(JOIN_SECONDS)
        self.conn.close()


@pytest.fixture
def children():
    """Start children with children(method, target, *args); all are killed and reaped after the test."""
    started: list[Child] = []

    def start(method: str, target, *args) -> Child:
        child = Child(method, target, *args)
        started.append(child)
        return child

    yield start
    for child in started:
        child.close()


def say(conn, value) -> None:
    conn.send(("msg", value))


def attach(names: dict, side: str) -> Ring:
    return Ring.attach(RingNames.from_dict(names), side)


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.001)


# --- records with known content --------------------------------------------------------


def make_records(seed: int, count: int, max_tokens: int):
    """(flat, offsets, meta): lengths mix 0, max_tokens and small; tokens and meta over all of uint32."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, count)
    kind = rng.integers(0, 10, count)
    lengths[kind == 0] = 0
    lengths[kind == 1] = max_tokens
    lengths[:4] = [0, max_tokens, 1, 0]
    lengths[-1] = max_tokens
    offsets = np.zeros(count + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 1 << 32, int(offsets[-1]), dtype=np.uint32)
    flat[:: 97] = META  # some all-ones tokens
    meta = rng.integers(0, 1 << 32, (count, L.META_WORDS), dtype=np.uint32)
    meta[0] = META
    meta[1] = 0
    return flat, offsets, meta


def push_records(ring: Ring, flat, offsets, meta, key0: int) -> None:
    """The first half one at a time with push_wait, the rest in one push_many."""
    count = offsets.size - 1
    half = count // 2
    for i in range(half):
        m = [int(x) for x in meta[i]]
        ring.push_wait(flat[offsets[i] : offsets[i + 1]], key0 + i, m[0], m[1], m[2], m[3], 10.0)
    rest = np.ascontiguousarray(offsets[half:] - offsets[half])
    pushed = ring.push_many(flat[offsets[half] :], rest, key0 + half, np.ascontiguousarray(meta[half:]), 10.0)
    assert pushed == count - half


def pop_and_check(ring: Ring, flat, offsets, meta, key0: int, timeout: float = 20.0) -> int:
    """Pop every record with pop_many and compare key, meta and tokens exactly; return the count."""
    count = offsets.size - 1
    batch = 64
    out_tokens = np.empty(2 * ring.max_tokens, np.uint32)
    out_offsets = np.empty(batch + 1, np.int64)
    out_keys = np.empty(batch, np.uint64)
    out_meta = np.empty((batch, L.META_WORDS), np.uint32)
    got = 0
    deadline = time.monotonic() + timeout
    while got < count:
        n = ring.pop_many(out_tokens, out_offsets, out_keys, out_meta, batch)
        if n == 0:
            assert ring.wait_readable(max(0.0, deadline - time.monotonic())), f"stalled after {got} of {count} records"
            continue
        for j in range(n):
            i = got + j
            assert i < count, f"more records than were pushed (key {int(out_keys[j])})"
            assert int(out_keys[j]) == key0 + i, f"record {i}: key {int(out_keys[j])} != {key0 + i}"
            assert np.array_equal(out_meta[j], meta[i]), f"record {i}: meta {out_meta[j]} != {meta[i]}"
            want = flat[offsets[i] : offsets[i + 1]]
            have = out_tokens[out_offsets[j] : out_offsets[j + 1]]
            assert have.size == want.size, f"record {i}: {have.size} tokens != {want.size}"
            assert np.array_equal(have, want), f"record {i}: tokens differ"
        got += n
    return got


# --- 1. records cross fork and spawn intact, both directions --------------------------------

RECORDS = 600
SEED = 11


def produce_child(conn, names: dict, seed: int, count: int) -> int:
    with attach(names, PRODUCER) as ring:
        flat, offsets, meta = make_records(seed, count, ring.max_tokens)
        push_records(ring, flat, offsets, meta, KEY0)
        return ring.counters()["num_pushed"]


def consume_child(conn, names: dict, seed: int, count: int) -> int:
    with attach(names, CONSUMER) as ring:
        flat, offsets, meta = make_records(seed, count, ring.max_tokens)
        n = pop_and_check(ring, flat, offsets, meta, KEY0)
        assert not ring.wait_readable(0.05), "a record beyond the last one pushed"
        return n


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_producer_parent_consumer(owner, children, method):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(CONSUMER) as ring:
        child = children(method, produce_child, owned.names.to_dict(), SEED, RECORDS)
        flat, offsets, meta = make_records(SEED, RECORDS, ring.max_tokens)
        assert pop_and_check(ring, flat, offsets, meta, KEY0) == RECORDS
        assert child.result() == RECORDS
        assert not ring.wait_readable(0.05)
        c = ring.counters()
        assert c["num_pushed"] == c["num_popped"] == RECORDS
        assert c["head"] == c["tail"]


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_parent_producer_child_consumer(owner, children, method):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(PRODUCER) as ring:
        child = children(method, consume_child, owned.names.to_dict(), SEED + 1, RECORDS)
        flat, offsets, meta = make_records(SEED + 1, RECORDS, ring.max_tokens)
        push_records(ring, flat, offsets, meta, KEY0)
        assert child.result() == RECORDS
        assert ring.next_key == KEY0 + RECORDS
        c = ring.counters()
        assert c["num_pushed"] == c["num_popped"] == RECORDS


# --- 2. millions of records, exactly once, in order, many laps --------------------------------

POOL_RECORDS = 4096
POOL_REPEATS = 733  # 3,002,368 records
STREAM_RING_BYTES = 64 * 1024


def stream_pool():
    rng = np.random.default_rng(5)
    lengths = rng.integers(0, 16, POOL_RECORDS)
    offsets = np.zeros(POOL_RECORDS + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 1 << 32, int(offsets[-1]), dtype=np.uint32)
    return flat, offsets


def stream_producer(conn, names: dict, repeats: int) -> int:
    flat, offsets = stream_pool()
    meta = np.zeros((1, L.META_WORDS), np.uint32)
    with attach(names, PRODUCER) as ring:
        for r in range(repeats):
            assert ring.push_many(flat, offsets, r * POOL_RECORDS, meta, 20.0) == POOL_RECORDS
        return ring.next_key


def drain_peek(ring: Ring, total: int, timeout: float) -> np.ndarray:
    """Zero-copy drain: keys must run 0.. in order; returns the digest accumulator."""
    positions = np.empty(8192, np.int64)
    acc = np.zeros(4, np.uint64)
    words = ring.data_words
    words64 = ring.buf[L.HEADER_BYTES :].view(np.uint64)
    next_key = 0
    deadline = time.monotonic() + timeout
    while next_key < total:
        n, new_tail = ring.peek_many(positions, positions.size)
        if n == 0:
            assert ring.wait_readable(max(0.0, deadline - time.monotonic())), f"stalled at key {next_key} of {total}"
            continue
        got = digest_records(words, words64, positions, n, next_key, acc)
        assert got != OUT_OF_ORDER, f"a key out of order after key {next_key}"
        ring.release(new_tail, n)
        next_key = got
    return acc


def drain_pop(ring: Ring, total: int, timeout: float) -> int:
    """Copying drain: each batch's keys, lengths and tokens compared with the pool, vectorised."""
    flat, offsets = stream_pool()
    lengths2 = np.tile(np.diff(offsets), 2)
    offsets2 = np.zeros(2 * POOL_RECORDS + 1, np.int64)
    offsets2[1:] = np.cumsum(lengths2)
    flat2 = np.concatenate([flat, flat])
    batch = POOL_RECORDS
    out_tokens = np.empty(16 * batch, np.uint32)
    out_offsets = np.empty(batch + 1, np.int64)
    out_keys = np.empty(batch, np.uint64)
    out_meta = np.empty((batch, L.META_WORDS), np.uint32)
    got = 0
    deadline = time.monotonic() + timeout
    while got < total:
        n = ring.pop_many(out_tokens, out_offsets, out_keys, out_meta, batch)
        if n == 0:
            assert ring.wait_readable(max(0.0, deadline - time.monotonic())), f"stalled at key {got} of {total}"
            continue
        assert np.array_equal(out_keys[:n], np.arange(got, got + n, dtype=np.uint64)), f"keys out of order after {got}"
        p = got % POOL_RECORDS
        assert np.array_equal(np.diff(out_offsets[: n + 1]), lengths2[p : p + n]), f"lengths differ after {got}"
        used = int(out_offsets[n])
        lo = int(offsets2[p])
        assert np.array_equal(out_tokens[:used], flat2[lo : lo + used]), f"tokens differ after {got}"
        got += n
    return got


@pytest.mark.parametrize("read", ["peek", "pop"])
def test_millions_of_records_exactly_once_in_order(owner, children, read):
    repeats = POOL_REPEATS if read == "peek" else POOL_REPEATS // 3
    total = repeats * POOL_RECORDS
    owned = create_ring(owner, "x", STREAM_RING_BYTES)
    with owned.attach(CONSUMER) as ring:
        started = time.monotonic()
        child = children("fork", stream_producer, owned.names.to_dict(), repeats)
        if read == "peek":
            acc = drain_peek(ring, total, timeout=30.0)
            flat, offsets = stream_pool()
            items = [flat[offsets[i] : offsets[i + 1]] for i in range(POOL_RECORDS)]
            assert acc.tolist() == expected_digest(items, repeats).tolist()
        else:
            assert drain_pop(ring, total, timeout=30.0) == total
        assert child.result() == total
        elapsed = time.monotonic() - started
        assert not ring.wait_readable(0.02), "a record beyond the last one pushed"
        c = ring.counters()
        assert c["num_pushed"] == c["num_popped"] == total
        assert c["head"] == c["tail"]
        assert c["tail"] > 500 * c["capacity_words"], "the ring did not wrap many times"
        assert elapsed < 15.0, f"{total} records took {elapsed:.1f} s"


# --- 3. waits: wake promptly, sleep (not spin), give up at the deadline -----------------------


def late_producer(conn, names: dict, delay: float) -> float:
    with attach(names, PRODUCER) as ring:
        say(conn, time.monotonic())
        time.sleep(delay)
        pushed_at = time.monotonic()
        assert ring.push(np.arange(3, dtype=np.uint32), 7) == L.OK
        conn.recv()  # keep attached until the test has looked
        return pushed_at


def test_consumer_wakes_when_a_record_arrives(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    timeout = 5.0
    with owned.attach(CONSUMER) as ring:
        child = children("fork", late_producer, owned.names.to_dict(), 0.2)
        child.recv()
        started = time.monotonic()
        cpu_started = time.process_time()
        assert ring.wait_readable(timeout)
        woke = time.monotonic()
        cpu_seconds = time.process_time() - cpu_started
        child.send("go")
        pushed_at = child.result()
        elapsed = woke - started
        assert woke >= pushed_at
        assert 0.15 <= elapsed < 1.0 < timeout, elapsed
        assert woke - pushed_at < 0.5, f"woke {woke - pushed_at:.3f} s after the push"
        assert cpu_seconds < 0.5 * elapsed, f"waiting {elapsed:.2f} s burned {cpu_seconds:.2f} s of CPU"
        out = (np.empty(8, np.uint32), np.empty(2, np.int64), np.empty(1, np.uint64), np.empty((1, 4), np.uint32))
        assert ring.pop_many(*out, 1) == 1 and int(out[2][0]) == 7


def fill(ring: Ring, tokens: np.ndarray, key0: int) -> int:
    """Push records until the ring refuses one; return the next key."""
    key = key0
    while ring.push(tokens, key) == L.OK:
        key += 1
    return key


def blocked_producer(conn, names: dict, timeout: float):
    with attach(names, PRODUCER) as ring:
        tokens = np.arange(100, dtype=np.uint32)
        key = fill(ring, tokens, 0)
        say(conn, key)
        started = time.monotonic()
        cpu_started = time.process_time()
        ring.push_wait(tokens, key, 1, 2, 3, 4, timeout)
        return time.monotonic() - started, time.process_time() - cpu_started, key


def test_blocked_producer_resumes_when_the_consumer_pops(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(CONSUMER) as ring:
        child = children("fork", blocked_producer, owned.names.to_dict(), 10.0)
        full_at_key = child.recv()
        wait_until(lambda: ring.header[L.H_PRODUCER_WAITING] == 1, 5.0, "the producer to sleep")
        time.sleep(0.2)
        out = (np.empty(200, np.uint32), np.empty(2, np.int64), np.empty(1, np.uint64), np.empty((1, 4), np.uint32))
        # Two records: one record's space need not cover a wrap skip plus the sentinel.
        assert ring.pop_many(*out, 1) == 1 and int(out[2][0]) == 0
        assert ring.pop_many(*out, 1) == 1 and int(out[2][0]) == 1
        elapsed, cpu_seconds, key = child.result()
        assert key == full_at_key
        assert 0.2 <= elapsed < 2.0, elapsed
        assert cpu_seconds < 0.5 * elapsed, f"waiting {elapsed:.2f} s burned {cpu_seconds:.2f} s of CPU"
        assert ring.counters()["num_pushed"] == full_at_key + 1


def full_producer(conn, names: dict, timeout: float):
    with attach(names, PRODUCER) as ring:
        tokens = np.arange(100, dtype=np.uint32)
        key = fill(ring, tokens, 0)
        started = time.monotonic()
        try:
            ring.push_wait(tokens, key, 0, 0, 0, 0, timeout)
        except Full:
            return time.monotonic() - started, "Full"
        return time.monotonic() - started, "pushed"


def test_push_wait_on_a_full_ring_raises_full_after_its_timeout(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(CONSUMER):  # a live consumer that never pops
        child = children("fork", full_producer, owned.names.to_dict(), 0.3)
        elapsed, error = child.result()
        assert error == "Full"
        assert 0.3 <= elapsed < 0.3 + 0.5, elapsed


# --- 4. SIGKILL: nothing committed is lost, the survivor learns, a new peer resumes ----------


def pushes_then_waits(conn, names: dict, count: int) -> None:
    with attach(names, PRODUCER) as ring:
        flat, offsets, meta = make_records(3, count, 200)
        push_records(ring, flat, offsets, meta, KEY0)
        say(conn, ring.next_key)
        conn.recv()  # killed here
        raise AssertionError("not killed")


def test_killed_producer_loses_nothing_committed_and_is_reported_dead(owner, children):
    count = 1000
    owned = create_ring(owner, "x", 1 << 20)
    with owned.attach(CONSUMER) as ring:
        child = children("fork", pushes_then_waits, owned.names.to_dict(), count)
        assert child.recv() == KEY0 + count
        assert ring.peer_alive()
        child.kill()  # not reaped yet: a zombie must count as dead too
        flat, offsets, meta = make_records(3, count, 200)
        assert pop_and_check(ring, flat, offsets, meta, KEY0) == count
        started = time.monotonic()
        with pytest.raises(PeerDead):
            ring.wait_readable(10.0)
        assert time.monotonic() - started < PEER_DEAD_SECONDS
        assert not ring.peer_alive()
        child.reap()
        assert ring.counters()["num_popped"] == count


def pops_then_waits(conn, names: dict, num_pop: int) -> None:
    with attach(names, CONSUMER) as ring:
        out = (np.empty(ring.max_tokens, np.uint32), np.empty(2, np.int64), np.empty(1, np.uint64), np.empty((1, 4), np.uint32))
        keys = []
        deadline = time.monotonic() + 10.0
        while len(keys) < num_pop:
            if ring.pop_many(*out, 1) == 0:
                assert ring.wait_readable(deadline - time.monotonic())
                continue
            keys.append(int(out[2][0]))
        say(conn, keys)
        conn.recv()  # killed here
        raise AssertionError("not killed")


def pushes_until_dead(conn, names: dict, timeout: float):
    with attach(names, PRODUCER) as ring:
        key = 0
        try:
            while True:
                ring.push_wait(np.full(key % 50, key, np.uint32), key, key, 0, 0, 0, timeout)
                key += 1
        except PeerDead:
            return "PeerDead", key, time.monotonic()
        except Full:
            return "Full", key, time.monotonic()


def drains_all(conn, names: dict) -> list[int]:
    with attach(names, CONSUMER) as ring:
        out = (np.empty(ring.max_tokens, np.uint32), np.empty(65, np.int64), np.empty(64, np.uint64), np.empty((64, 4), np.uint32))
        keys = []
        while ring.wait_readable(0.2):
            n = ring.pop_many(*out, 64)
            for j in range(n):
                key = int(out[2][j])
                want = np.full(key % 50, key, np.uint32)
                assert np.array_equal(out[0][out[1][j] : out[1][j + 1]], want), f"key {key}: tokens differ"
                assert int(out[3][j][0]) == key, f"key {key}: meta differs"
                keys.append(key)
        return keys


def test_killed_consumer_wakes_blocked_producer_and_a_new_consumer_resumes(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    names = owned.names.to_dict()
    num_pop = 40
    consumer = children("fork", pops_then_waits, names, num_pop)
    wait_until(lambda: owned.segment.buf[: L.HEADER_BYTES].view(np.int64)[L.H_CONSUMER_PID] != 0, 10.0, "the consumer")
    producer = children("fork", pushes_until_dead, names, 10.0)
    assert consumer.recv() == list(range(num_pop))
    header = owned.segment.buf[: L.HEADER_BYTES].view(np.int64)
    wait_until(lambda: header[L.H_PRODUCER_WAITING] == 1, 10.0, "the producer to block on the full ring")
    time.sleep(0.1)
    killed_at = time.monotonic()
    consumer.kill()
    outcome, blocked_key, raised_at = producer.result()
    assert outcome == "PeerDead"
    assert raised_at - killed_at < PEER_DEAD_SECONDS
    tail_before = int(header[L.H_TAIL])
    assert int(header[L.H_NUM_POPPED]) == num_pop  # the dead consumer released exactly what it reported
    resumed = children("spawn", drains_all, names)
    keys = resumed.result()
    # The dead consumer released keys 0..num_pop-1; everything committed after them arrives once.
    assert keys == list(range(num_pop, blocked_key)), (keys[:3], keys[-3:], blocked_key)
    assert tail_before < int(header[L.H_TAIL]) == int(header[L.H_HEAD])


def test_never_attached_peer_is_absent_not_dead(owner):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(CONSUMER) as ring:
        assert ring.peer_pid() is None and not ring.peer_alive()
        started = time.monotonic()
        assert ring.wait_readable(0.3) is False
        assert 0.3 <= time.monotonic() - started < 0.3 + 0.5
    with owned.attach(PRODUCER) as ring:  # no consumer either: a full ring times out as Full
        tokens = np.arange(100, dtype=np.uint32)
        key = fill(ring, tokens, 0)
        with pytest.raises(Full):
            ring.push_wait(tokens, key, 0, 0, 0, 0, 0.3)


def attaches_and_closes(conn, names: dict) -> int:
    with attach(names, PRODUCER):
        pass
    return os.getpid()


def test_peer_that_closed_is_absent_not_dead(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    with owned.attach(CONSUMER) as ring:
        children("fork", attaches_and_closes, owned.names.to_dict()).result()
        assert ring.peer_pid() is None
        assert ring.wait_readable(0.2) is False


# --- 5. one live process per side -----------------------------------------------------------


def holds_side(conn, names: dict, side: str) -> None:
    with attach(names, side):
        say(conn, os.getpid())
        conn.recv()  # killed here
        raise AssertionError("not killed")


def tries_side(conn, names: dict, side: str) -> str:
    try:
        ring = attach(names, side)
    except RuntimeError as exc:
        return f"refused: {exc}"
    ring.close()
    return "attached"


@pytest.mark.parametrize("side", [PRODUCER, CONSUMER])
def test_second_live_process_on_a_side_is_refused_until_the_first_dies(owner, children, side):
    owned = create_ring(owner, "x", 64 * 1024)
    names = owned.names.to_dict()
    holder = children("fork", holds_side, names, side)
    holder_pid = holder.recv()
    answer = children("fork", tries_side, names, side).result()
    assert answer.startswith("refused") and str(holder_pid) in answer
    with pytest.raises(RuntimeError):
        owned.attach(side)  # this process too
    other = CONSUMER if side == PRODUCER else PRODUCER
    assert children("fork", tries_side, names, other).result() == "attached"
    holder.kill()
    holder.reap()
    assert children("spawn", tries_side, names, side).result() == "attached"
    with owned.attach(side) as ring:
        assert ring.header[L.H_PRODUCER_PID if side == PRODUCER else L.H_CONSUMER_PID] == os.getpid()


# --- regressions: producer recovery after a kill mid-batch, racing attaches ---------------------


def commits_without_publishing(conn, names: dict, published: int, unpublished: int) -> None:
    """Push `published` records, then commit `unpublished` more the way push_many does between
    its PUBLISH_EVERY head stores, and stop there: the state a SIGKILL inside push_many (or
    inside push, between the commit and the head store) leaves."""
    with attach(names, PRODUCER) as ring:
        for key in range(published):
            assert ring.push(np.full(5, key, np.uint32), key, key) == L.OK
        h = ring.header
        w = ring.data_words
        w64 = ring.buf[L.HEADER_BYTES :].view(np.uint64)
        head = int(h[L.H_HEAD])
        for key in range(published, published + unpublished):
            tokens = np.full(5, key, np.uint32)
            size = L.record_words(tokens.size)
            skip = int(spsc.reserve(h, w.size, head, size))
            assert skip != spsc.NO_SPACE
            head = int(spsc.write_record(w, w64, h, head, skip, size, tokens, 0, tokens.size, key, key, 0, 0, 0))
        say(conn, head)
        conn.recv()  # SIGKILLed here, head and next_key not yet stored
        raise AssertionError("not killed")


def resumes_and_pushes(conn, names: dict, count: int) -> list[int]:
    with attach(names, PRODUCER) as ring:
        key0 = ring.next_key  # what Producer does on reconnect (client/submitter.py)
        for key in range(key0, key0 + count):
            ring.push_wait(np.full(5, key, np.uint32), key, key, 0, 0, 0, 5.0)
        return list(range(key0, key0 + count))


def drain_keys(ring: Ring, wait_seconds: float) -> list[int]:
    out = (np.empty(64, np.uint32), np.empty(9, np.int64), np.empty(8, np.uint64), np.empty((8, 4), np.uint32))
    keys = []
    while True:
        try:
            if not ring.wait_readable(wait_seconds):
                break
        except PeerDead:  # drained, and the producer is gone
            break
        n = ring.pop_many(*out, 8)
        for j in range(n):
            key = int(out[2][j])
            assert np.array_equal(out[0][out[1][j] : out[1][j + 1]], np.full(5, key, np.uint32)), f"key {key} torn"
            keys.append(key)
    return keys


def test_producer_reattached_after_sigkill_mid_batch_resumes_after_every_committed_record(owner, children):
    published, unpublished, more = 10, 5, 5
    owned = create_ring(owner, "x", 64 * 1024)
    names = owned.names.to_dict()
    with owned.attach(CONSUMER) as ring:
        first = children("fork", commits_without_publishing, names, published, unpublished)
        first.recv()
        first.kill()
        first.reap()
        # Committed records are delivered: the consumer follows commit words, not the head.
        assert drain_keys(ring, 0.3) == list(range(published + unpublished))
        # A new producer process resumes, as a reconnecting Producer does.
        resumed_keys = children("fork", resumes_and_pushes, names, more).result()
        delivered = drain_keys(ring, 0.3)
        assert resumed_keys == list(range(published + unpublished, published + unpublished + more)), (
            f"reattached producer resumed at key {resumed_keys[0]}, but keys up to "
            f"{published + unpublished - 1} were already committed and delivered"
        )
        assert delivered == resumed_keys


def slow_claim_attach(conn, names: dict, side: str, delay_seconds: float) -> str:
    """Attach with the /proc read of _claim_side slowed down (as a preempted process would be)."""
    real = ring_mod.start_ticks

    def slow(pid):
        time.sleep(delay_seconds)
        return real(pid)

    ring_mod.start_ticks = slow
    try:
        ring = attach(names, side)
    except RuntimeError:
        return "refused"
    say(conn, "attached")
    conn.recv()  # hold the side until the test is done
    ring.close()
    return "attached"


def test_two_processes_attaching_one_side_at_once_only_one_wins(owner, children):
    owned = create_ring(owner, "x", 64 * 1024)
    names = owned.names.to_dict()
    racers = [children("fork", slow_claim_attach, names, PRODUCER, 0.3) for _ in range(2)]
    outcomes = []
    for racer in racers:
        kind, value = racer._get(MSG_SECONDS)
        outcomes.append(value)
    assert sorted(outcomes) == ["attached", "refused"], outcomes
