"""End to end through real processes: `shmbroker supervise` in a subprocess (tests/support/brokerproc.py),
producers in this process or in forked children, the simulated engine's deterministic tokens.

Each ok result must carry `Sim.generated(item_id, max_new_tokens, prompt)`; every submitted item must get
exactly one result at its producer, and no producer may see a result for an id it did not submit.
"""

from __future__ import annotations

import multiprocessing
import os
import secrets
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import SMALL_CONFIG, BrokerProc
from support.harness import Workload, shm_leftovers

from shmbroker.client.producer import Producer
from shmbroker.engines.sim import Sim
from shmbroker.ring.items import STATUS_CODES

pytestmark = pytest.mark.timeout(120)

FORK = multiprocessing.get_context("fork")
RESULT_WAIT_SECONDS = 60.0  # the most a test waits for its last result


# -- helpers -------------------------------------------------------------------------------


def _instance() -> str:
    return "t" + secrets.token_hex(4)


class Expect:
    """What one producer submitted (item id -> max_new_tokens) and what came back."""

    def __init__(self):
        self.max_new: dict[int, int] = {}
        self.special: dict[int, str] = {}  # item id -> the status it must get, other than ok
        self.digests: dict[int, int] = {}  # item id -> its prompt's Sim.digest (absent: tokens not checked)
        self.counts: Counter = Counter()
        self.results: dict[int, object] = {}

    def add(self, ids, max_new, prompts, status: str = "ok") -> None:
        """`prompts`: the one prompt of one id, a list of prompts, or (flat, offsets) as submit_many took
        them; None: the tokens of ok results are not checked."""
        ids = np.atleast_1d(np.asarray(ids, np.uint64)).tolist()
        mn = np.broadcast_to(np.asarray(max_new, np.int64), (len(ids),)).tolist()
        digests = [None] * len(ids) if prompts is None else _digests(prompts, len(ids))
        for i, m, d in zip(ids, mn, digests):
            assert i not in self.max_new, f"item id {i:#x} given out twice"
            self.max_new[i] = m
            if d is not None:
                self.digests[i] = d
            if status != "ok":
                self.special[i] = status

    def take(self, result) -> None:
        self.counts[result.item_id] += 1
        self.results.setdefault(result.item_id, result)

    def drain(self, producer: Producer, timeout_seconds: float = 0.0) -> None:
        for r in producer.results(timeout_seconds=timeout_seconds):
            self.take(r)

    def complete(self) -> bool:
        return all(i in self.counts for i in self.max_new)

    def collect(self, producer: Producer, wait_seconds: float = RESULT_WAIT_SECONDS) -> None:
        """Read results until every submitted item has one (or the wait is over), then a little
        longer to catch duplicates or strays."""
        deadline = time.monotonic() + wait_seconds
        while not self.complete() and time.monotonic() < deadline:
            self.drain(producer, 0.2)
        self.drain(producer, 0.3)

    def problems(self) -> dict:
        """Everything wrong, as small samples (empty lists: all good)."""
        missing = [i for i in self.max_new if i not in self.counts]
        twice = [i for i, n in self.counts.items() if n > 1]
        foreign = [i for i in self.counts if i not in self.max_new]
        bad_status, bad_tokens, no_error = [], [], []
        for i, want_max in self.max_new.items():
            r = self.results.get(i)
            if r is None:
                continue
            want = self.special.get(i, "ok")
            if r.status != want:
                bad_status.append((i, r.status, want, r.error))
            elif want == "ok" and i in self.digests:
                expected = Sim.generated_many(np.array([i], np.uint64), np.array([want_max]),
                                              np.array([self.digests[i]])).flat
                if r.tokens.dtype != np.uint32 or not np.array_equal(r.tokens, expected):
                    bad_tokens.append((i, want_max, r.tokens[:8].tolist(), expected[:8].tolist()))
            elif not r.error:
                no_error.append((i, r.status, r.error))
        out = {"missing": missing, "twice": twice, "foreign": foreign, "bad_status": bad_status,
               "bad_tokens": bad_tokens, "no_error_text": no_error}
        return {k: (len(v), v[:5]) for k, v in out.items() if v}


def _digests(prompts, count: int) -> list[int]:
    if isinstance(prompts, tuple):
        flat, offsets = prompts
        flat = np.asarray(flat, np.uint32)
        offsets = np.asarray(offsets, np.int64)
        prompts = [flat[offsets[k] : offsets[k + 1]] for k in range(offsets.size - 1)]
    elif count == 1 and not (isinstance(prompts, list) and len(prompts) == 1 and np.ndim(prompts[0]) == 1):
        prompts = [prompts]
    assert len(prompts) == count, "one prompt per id"
    return [Sim.digest(t) for t in prompts]


def assert_all_delivered(expect: Expect, broker: BrokerProc | None = None, what: str = "") -> None:
    problems = expect.problems()
    log = f"\nsupervisor.log:\n{broker.log()}" if broker is not None else ""
    assert not problems, f"{what} {len(expect.max_new)} items submitted: {problems}{log}"


def _run_producer(name: str, data_dir: str, seed: int, n_items: int) -> dict:
    """A producer process's whole life: submit a seeded workload, read every result, check it."""
    work = Workload(seed)
    expect = Expect()
    with Producer(name, data_dir=data_dir) as p:
        done = 0
        while done < n_items:
            done += work.submit_some(p, expect, n_items - done)
            if work.rng.random() < 0.2:
                expect.drain(p)  # read what is there while still submitting
        expect.collect(p)
    return {"submitted": len(expect.max_new), "results": sum(expect.counts.values()),
            "problems": expect.problems()}


def _child(conn, fn, *args) -> None:
    try:
        conn.send(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def _start_child(fn, *args):
    parent, child = FORK.Pipe(duplex=False)
    proc = FORK.Process(target=_child, args=(child, fn, *args), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def _child_result(proc, conn, timeout_seconds: float, broker: BrokerProc):
    if not conn.poll(timeout_seconds):
        proc.kill()
        raise AssertionError(f"producer process {proc.pid} gave no answer in {timeout_seconds} s\n{broker.log()}")
    kind, value = conn.recv()
    proc.join(10)
    assert kind == "ok", f"producer process failed:\n{value}\nsupervisor.log:\n{broker.log()}"
    return value


def _supervise_cmd(data_dir, config_path) -> list[str]:
    return [sys.executable, "-m", "shmbroker.cli", "supervise", "--data-dir", str(data_dir),
            "--config", str(config_path)]


# -- 1. every item gets exactly one result ---------------------------------------------------


def test_two_producer_processes_get_exactly_one_result_per_item(tmp_path):
    n_items = 2500
    with BrokerProc(tmp_path) as broker:
        children = [_start_child(_run_producer, f"e2e-{k}", broker.data_dir, 1000 + k, n_items) for k in range(2)]
        reports = [_child_result(proc, conn, 100, broker) for proc, conn in children]
        for k, report in enumerate(reports):
            assert report["submitted"] == n_items
            assert not report["problems"], f"producer e2e-{k}: {report['problems']}\n{broker.log()}"
            assert report["results"] == n_items


# -- 2. too long / unknown model ---------------------------------------------------------------


def test_too_long_and_unknown_model_fail_alone(tmp_path):
    rng = np.random.default_rng(2)
    expect = Expect()
    with BrokerProc(tmp_path) as broker, Producer("e2e-bad-items", data_dir=broker.data_dir) as p:
        def good(n: int) -> None:
            tokens = rng.integers(0, 50_000, size=n, dtype=np.uint32)
            expect.add(p.submit(tokens, max_new_tokens=5), 5, tokens)

        for k in range(30):
            good(int(rng.integers(1, 3000)))
            if k % 3 == 0:  # longer than big's max_input_len (8192), the longest of every consumer
                tokens = rng.integers(0, 50_000, size=int(rng.integers(8193, 12_000)), dtype=np.uint32)
                expect.add(p.submit(tokens, max_new_tokens=5), 5, None, "too_long")
            if k % 3 == 1:  # no consumer serves this model
                tokens = rng.integers(0, 50_000, size=int(rng.integers(1, 3000)), dtype=np.uint32)
                expect.add(p.submit(tokens, max_new_tokens=5, model="nope"), 5, None, "invalid")
            if k % 5 == 2:
                tokens = rng.integers(0, 50_000, size=int(rng.integers(1, 3000)), dtype=np.uint32)
                expect.add(p.submit(tokens, max_new_tokens=5, prefix_len=1, model="nope"), 5, None, "invalid")
        # the limits exactly: 8192 fits big; 8193 fits none
        expect.add(p.submit(np.ones(8192, np.uint32), max_new_tokens=3), 3, np.ones(8192, np.uint32))
        expect.add(p.submit(np.ones(8193, np.uint32), max_new_tokens=3), 3, None, "too_long")
        expect.add(p.submit(np.ones(2048, np.uint32), max_new_tokens=3), 3, np.ones(2048, np.uint32))
        expect.add(p.submit(np.ones(2049, np.uint32), max_new_tokens=3), 3, np.ones(2049, np.uint32))
        # submit_many: one batch mixing good and too long; one whole batch for the unknown model
        lengths = np.array([10, 9000, 700, 20_000, 1], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        flat = rng.integers(0, 50_000, size=int(offsets[-1]), dtype=np.uint32)
        ids = p.submit_many(flat, offsets, max_new_tokens=4)
        for k, (i, n) in enumerate(zip(ids, lengths)):
            expect.add(i, 4, flat[offsets[k] : offsets[k + 1]], "too_long" if n > 8192 else "ok")
        ids = p.submit_many(flat[:711], [0, 5, 305, 711], max_new_tokens=4, model="nope")
        expect.add(ids, 4, None, "invalid")
        for _ in range(20):
            good(int(rng.integers(1, 3000)))
        expect.collect(p)
        assert_all_delivered(expect, broker, "good, too long and unknown-model")
        too_long = [expect.results[i] for i, s in expect.special.items() if s == "too_long"]
        invalid = [expect.results[i] for i, s in expect.special.items() if s == "invalid"]
        assert all("token" in r.error and r.tokens.size == 0 for r in too_long), too_long[:3]
        assert all("model" in r.error and r.tokens.size == 0 for r in invalid), invalid[:3]


# -- 3. bad input through the client --------------------------------------------------------


BAD_SUBMITS = [
    ("empty array", lambda p: p.submit(np.zeros(0, np.uint32), max_new_tokens=1), ValueError, "empty"),
    ("empty list", lambda p: p.submit([], max_new_tokens=1), ValueError, "empty"),
    ("float tokens", lambda p: p.submit(np.array([1.0, 2.0]), max_new_tokens=1), TypeError, "dtype"),
    ("float list", lambda p: p.submit([1.5, 2.5], max_new_tokens=1), TypeError, "integer"),
    ("string tokens", lambda p: p.submit("abc", max_new_tokens=1), (TypeError, ValueError), "tokens"),
    ("negative id", lambda p: p.submit(np.array([1, -5, 3]), max_new_tokens=1), ValueError, "negative"),
    ("negative id in a list", lambda p: p.submit([3, -1], max_new_tokens=1), ValueError, "negative"),
    ("id above uint32", lambda p: p.submit(np.array([1, 1 << 32], np.int64), max_new_tokens=1), ValueError, "uint32"),
    ("2-D tokens", lambda p: p.submit(np.ones((2, 3), np.uint32), max_new_tokens=1), ValueError, "1-D"),
    ("negative max_new_tokens", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=-1), ValueError,
     "max_new_tokens"),
    ("max_new_tokens above uint32", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=1 << 32), ValueError,
     "max_new_tokens"),
    ("float max_new_tokens", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=2.5), TypeError,
     "max_new_tokens"),
    ("str max_new_tokens", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens="4"), TypeError,
     "max_new_tokens"),
    ("bool max_new_tokens", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=True), TypeError,
     "max_new_tokens"),
    ("prefix_len past the end", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=1, prefix_len=4),
     ValueError, "prefix_len"),
    ("negative prefix_len", lambda p: p.submit(np.ones(3, np.uint32), max_new_tokens=1, prefix_len=-1),
     ValueError, "prefix_len"),
    ("submit_many with an empty item",
     lambda p: p.submit_many(np.ones(6, np.uint32), [0, 3, 3, 6], max_new_tokens=1), ValueError, "empty"),
    ("submit_many with offsets short of the end",
     lambda p: p.submit_many(np.ones(6, np.uint32), [0, 3, 5], max_new_tokens=1), ValueError, "offsets"),
    ("submit_many with float tokens",
     lambda p: p.submit_many(np.ones(6, np.float32), [0, 3, 6], max_new_tokens=1), TypeError, "dtype"),
    ("submit_many with a negative token",
     lambda p: p.submit_many(np.array([1, 2, -3, 4]), [0, 2, 4], max_new_tokens=1), ValueError, "negative"),
    ("submit_many with one bad max_new_tokens",
     lambda p: p.submit_many(np.ones(6, np.uint32), [0, 3, 6], max_new_tokens=[4, -1]), ValueError,
     "max_new_tokens"),
    ("submit_many with too few max_new_tokens",
     lambda p: p.submit_many(np.ones(6, np.uint32), [0, 3, 6], max_new_tokens=[4]), ValueError, "max_new_tokens"),
    ("submit_many with a prefix_len past its item",
     lambda p: p.submit_many(np.ones(6, np.uint32), [0, 2, 6], max_new_tokens=1, prefix_len=[3, 1]), ValueError,
     "prefix_len"),
]


def test_bad_input_raises_and_loses_nothing(tmp_path):
    rng = np.random.default_rng(3)
    expect = Expect()
    with BrokerProc(tmp_path) as broker, Producer("e2e-bad-input", data_dir=broker.data_dir) as p:
        def good() -> None:
            tokens = rng.integers(0, 50_000, size=int(rng.integers(1, 2000)), dtype=np.uint32)
            expect.add(p.submit(tokens, max_new_tokens=6), 6, tokens)

        for _ in range(10):
            good()
        for what, call, exc, words in BAD_SUBMITS:
            before = p.next_item_id
            with pytest.raises(exc, match=words) as info:
                call(p)
            assert p.next_item_id == before, f"{what}: {info.value!r} consumed an item id"
            good()  # the producer is still usable at once
        # many more after all of them, in both ways
        for _ in range(50):
            good()
        flat = rng.integers(0, 50_000, size=4000, dtype=np.uint32)
        offsets = np.sort(rng.choice(np.arange(1, 4000), size=99, replace=False))
        offsets = np.concatenate([[0], offsets, [4000]])
        expect.add(p.submit_many(flat, offsets, max_new_tokens=2), 2, (flat, offsets))
        # the ids are consecutive: no bad call took one
        ids = sorted(expect.max_new)
        assert ids == list(range(ids[0], ids[0] + len(ids)))
        # read them in columns this time
        deadline = time.monotonic() + RESULT_WAIT_SECONDS
        counts: Counter = Counter()
        status, ntok = {}, {}
        while len(counts) < len(ids) and time.monotonic() < deadline:
            batch = p.take_results(0.2)
            for i, s, n in zip(batch.item_ids.tolist(), batch.status.tolist(), batch.num_tokens.tolist()):
                counts[i] += 1
                status[i], ntok[i] = s, n
        batch = p.take_results(0.3)
        for i in batch.item_ids.tolist():
            counts[i] += 1
        missing = [i for i in ids if i not in counts]
        assert not missing, f"{len(missing)} of {len(ids)} good items got no result\n{broker.log()}"
        assert set(counts) == set(ids), "results for ids never submitted"
        assert max(counts.values()) == 1, "an item got two results"
        assert all(status[i] == STATUS_CODES["ok"] for i in ids)
        assert all(ntok[i] == expect.max_new[i] for i in ids)


# -- 4. a producer killed mid-submit ----------------------------------------------------------


def _submit_forever(name: str, data_dir: str, started) -> None:
    """A producer that submits until it is killed: one batch of about a quarter of its ingest ring
    over and over (so it is mostly inside a ring write or waiting for room), now and then one item."""
    work = Workload(4)
    items = [work.item()[0] for _ in range(200)]
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([t.size for t in items], out=offsets[1:])
    flat = np.concatenate(items)
    with Producer(name, data_dir=data_dir, timeout_seconds=120) as p:
        n = 0
        while True:
            n += p.submit_many(flat, offsets, max_new_tokens=2).size
            p.submit(items[n % len(items)], max_new_tokens=2, prefix_len=1)
            n += 1
            if n > 300:
                started.set()


def test_producer_killed_mid_submit_disturbs_no_other(tmp_path):
    with BrokerProc(tmp_path) as broker:
        pids = broker.role_pids()
        started = FORK.Event()
        victim = FORK.Process(target=_submit_forever, args=("e2e-victim", broker.data_dir, started), daemon=True)
        victim.start()
        work = Workload(40)
        expect = Expect()
        try:
            with Producer("e2e-survivor", data_dir=broker.data_dir) as p:
                done = 0
                while done < 600:
                    done += work.submit_some(p, expect, 600 - done)
                    expect.drain(p)
                assert started.wait(30), f"the victim did not get going\n{broker.log()}"
                time.sleep(0.05)
                os.kill(victim.pid, signal.SIGKILL)
                victim.join(10)
                assert victim.exitcode == -signal.SIGKILL
                while done < 1500:
                    done += work.submit_some(p, expect, 1500 - done)
                    expect.drain(p)
                expect.collect(p)
                assert_all_delivered(expect, broker, "survivor:")
                assert broker.role_pids() == pids, f"a broker process died\n{broker.log()}"

                # the dead producer's name is free again; reconnected, it gets the result of every
                # item its ring had taken (its sequence resumes right after them)
                with Producer("e2e-victim", data_dir=broker.data_dir) as again:
                    first = again.next_item_id & ~((1 << 40) - 1)
                    committed = again.next_item_id - first
                    assert committed > 300
                    victim_expect = Expect()
                    victim_expect.add(np.arange(first, again.next_item_id, dtype=np.uint64), 0, None)
                    victim_expect.collect(again, 30)
                    got = [i for i in victim_expect.max_new if i in victim_expect.counts]
                    assert len(got) == committed and not victim_expect.problems().get("twice"), \
                        f"{committed - len(got)} of the killed producer's {committed} items got no result\n{broker.log()}"
                    # the survivor still works after all that
                    m = 3
                    expect.add(p.submit(np.arange(1, 100, dtype=np.uint32), max_new_tokens=m), m,
                               np.arange(1, 100, dtype=np.uint32))
                    expect.collect(p, 20)
                    assert_all_delivered(expect, broker, "survivor after the reconnect:")
        finally:
            if victim.is_alive():
                victim.kill()
                victim.join(10)


# -- 5. graceful shutdown ----------------------------------------------------------------------


def test_graceful_stop_leaves_no_shared_memory(tmp_path):
    instance = _instance()
    broker = BrokerProc(tmp_path, instance=instance)
    broker.start()
    try:
        pids = broker.role_pids()
        assert shm_leftovers(instance), "the broker's shared memory is not where this test looks"
        work = Workload(5)
        expect = Expect()
        with Producer("e2e-stop", data_dir=broker.data_dir) as p:
            done = 0
            while done < 300:
                done += work.submit_some(p, expect, 300 - done)
            expect.collect(p)
            assert_all_delivered(expect, broker)
            # more in flight while it stops, and a producer still attached
            done = 0
            while done < 300:
                done += work.submit_some(p, expect, 300 - done)
            code = broker.stop()
        assert code == 0, f"supervisor exited with {code}\n{broker.log()}"
        left = shm_leftovers(instance)
        assert left == [], f"left in /dev/shm after a graceful stop: {left}\n{broker.log()}"
        data = Path(broker.data_dir)
        assert not (data / "broker.sock").exists(), "broker.sock left behind"
        assert not (data / "supervisor.lock").exists(), "supervisor.lock left behind"
        for pid in pids.values():
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        broker.stop()
        for path in shm_leftovers(instance):
            path.unlink(missing_ok=True)


# -- 6. a second supervisor ----------------------------------------------------------------------


def test_second_supervisor_is_refused_and_first_keeps_working(tmp_path):
    instance = _instance()
    with BrokerProc(tmp_path, instance=instance) as broker:
        pids = broker.role_pids()
        expect = Expect()
        with Producer("e2e-first", data_dir=broker.data_dir) as p:
            expect.add(p.submit(np.arange(1, 500, dtype=np.uint32), max_new_tokens=2), 2,
                       np.arange(1, 500, dtype=np.uint32))
            shm_before = shm_leftovers(instance)
            t0 = time.monotonic()
            second = subprocess.run(_supervise_cmd(broker.data_dir, broker.config_path), capture_output=True,
                                    text=True, timeout=60)
            took = time.monotonic() - t0
            out = second.stdout + second.stderr
            assert second.returncode != 0, f"a second supervisor started:\n{out}"
            assert took < 15, f"the refusal took {took:.1f} s"
            assert str(broker.proc.pid) in out and "supervisor.lock" in out, out
            # the first is untouched: same processes, same shared memory, its socket, its lock
            assert broker.info() is not None
            assert broker.role_pids() == pids
            assert shm_leftovers(instance) == shm_before
            assert (Path(broker.data_dir) / "broker.sock").exists()
            lock = (Path(broker.data_dir) / "supervisor.lock").read_text()
            assert lock.startswith(f"pid {broker.proc.pid} ")
            work = Workload(6)
            done = 0
            while done < 300:
                done += work.submit_some(p, expect, 300 - done)
            expect.collect(p)
            assert_all_delivered(expect, broker, "after a second supervisor was refused:")
            with Producer("e2e-later", data_dir=broker.data_dir) as q:
                later = Expect()
                later.add(q.submit([1, 2, 3], max_new_tokens=1), 1, [1, 2, 3])
                later.collect(q, 20)
                assert_all_delivered(later, broker, "a producer that connected afterwards:")
    assert shm_leftovers(instance) == []


# -- 7. restart keeps undelivered results --------------------------------------------------------


def _submit_with_long_answers(p: Producer, work: Workload, expect: Expect, count: int) -> None:
    """`count` items of the workload, then 300 with 1000..4000 new tokens each: their results are
    far more than the producer's result ring holds, so most wait in the results log, and the GPU
    processes fall behind, so some items are still in the backlog when the broker stops."""
    done = 0
    while done < count:
        done += work.submit_some(p, expect, count - done)
    for _ in range(300):
        m = int(work.rng.integers(1000, 4001))
        tokens = work.rng.integers(0, 50_000, size=int(work.rng.integers(1, 3001)), dtype=np.uint32)
        expect.add(p.submit(tokens, max_new_tokens=m), m, tokens)


def test_restart_keeps_undelivered_results(tmp_path):
    name = "e2e-restart"
    with BrokerProc(tmp_path) as broker:
        work = Workload(7)
        expect = Expect()
        p = Producer(name, data_dir=broker.data_dir)
        _submit_with_long_answers(p, work, expect, 1500)
        code = broker.stop()  # with much of it still in flight, nothing read
        assert code == 0, f"supervisor exited with {code}\n{broker.log()}"
        p.close()
        broker.start()
        with Producer(name, data_dir=broker.data_dir) as again:
            expect.collect(again)
            assert_all_delivered(expect, broker, "across a restart:")
            # and it goes on: new items on the new broker
            more = Expect()
            done = 0
            while done < 200:
                done += work.submit_some(again, more, 200 - done)
            more.collect(again)
            assert_all_delivered(more, broker, "after the restart:")
            assert not set(more.max_new) & set(expect.max_new)


def test_crash_restart_loses_nothing(tmp_path):
    """The supervisor SIGKILLed right after the submits (items still in the ingest ring, in the
    backlog, in flight): a new one salvages and recovers, and every item gets exactly one result."""
    name = "e2e-crash"
    with BrokerProc(tmp_path) as broker:
        work = Workload(8)
        expect = Expect()
        p = Producer(name, data_dir=broker.data_dir)
        _submit_with_long_answers(p, work, expect, 1500)
        broker.kill()
        p.close()
        broker.start()
        with Producer(name, data_dir=broker.data_dir) as again:
            expect.collect(again)
            assert_all_delivered(expect, broker, "across a crash (supervisor SIGKILLed):")


# -- 8. bad configuration ---------------------------------------------------------------------


BAD_CONFIGS = [
    ("colour = \"blue\"\n" + SMALL_CONFIG, "colour"),
    (SMALL_CONFIG.replace("max_batch_size = 64", "max_batch_size = 64\nmax_batch = 3"), "consumers[0].max_batch"),
    (SMALL_CONFIG.replace("max_batch_size = 16", "max_batch_size = 0"), "consumers[1].max_batch_size"),
    (SMALL_CONFIG.replace("max_input_len = 2048", "max_input_len = 9000"), "consumers[1].max_input_len"),
    (SMALL_CONFIG.replace("ingest_ring_bytes = 1048576", "ingest_ring_bytes = 1000"), "ingest_ring_bytes"),
    (SMALL_CONFIG.replace('mode = "padded"', 'mode = "sideways"'), "consumers[1].engine_settings.mode"),
    (SMALL_CONFIG.replace("cache_tokens = 65536", "cache_tokens = 65536, turbo = true"),
     "consumers[1].engine_settings.turbo"),
    ("fsync = \"sometimes\"\n" + SMALL_CONFIG, "fsync"),
]


@pytest.mark.parametrize("text,key", BAD_CONFIGS, ids=[k for _, k in BAD_CONFIGS])
def test_bad_config_is_refused_at_start(tmp_path, text, key):
    instance = _instance()
    bad = tmp_path / "bad.toml"
    bad.write_text(f'instance = "{instance}"\n' + text)
    data = tmp_path / "data"
    t0 = time.monotonic()
    run = subprocess.run(_supervise_cmd(data, bad), capture_output=True, text=True, timeout=60)
    out = run.stdout + run.stderr
    assert run.returncode != 0, f"started with a bad configuration:\n{out}"
    assert time.monotonic() - t0 < 30
    assert key in out and "bad.toml" in out, out
    assert "Traceback" not in out, out
    assert not (data / "broker.sock").exists() and not (data / "supervisor.lock").exists()
    assert shm_leftovers(instance) == []
