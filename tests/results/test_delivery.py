"""Results reach each producer name exactly as acknowledged: a reader killed mid-stream, a new
reader process, a results process restarted under a live or a dead reader."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import serve

from shmbroker.cli import main
from shmbroker.client.producer import Producer

ITEMS = 6000


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("delivery")) as b:
        yield b


def _submit(broker, name: str, count: int, tag: int) -> list[int]:
    flat = np.arange(count, dtype=np.uint32) + np.uint32(tag << 16)
    offsets = np.arange(count + 1, dtype=np.int64)
    with Producer(name, data_dir=broker.data_dir) as p:
        return p.submit_many(flat, offsets, max_new_tokens=2).tolist()


def _wait_all_on_ring(broker, name: str, count: int) -> None:
    """Read every result without acknowledging any: all of them are then on the name's ring."""
    seen = set()
    deadline = time.monotonic() + 120
    with Producer(name, data_dir=broker.data_dir) as p:
        while len(seen) < count:
            assert time.monotonic() < deadline, f"{len(seen)} of {count} results came"
            for r in p.results(timeout_seconds=1.0, auto_ack=False):
                seen.add(r.item_id)
                if len(seen) == count:
                    break
        p._auto_ack = False  # leave without acknowledging: the next reader gets them all again


def _read_some(p: Producer, count: int) -> set[int]:
    """Read `count` results without acknowledging them."""
    got: set[int] = set()
    deadline = time.monotonic() + 60
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count} results came"
        for r in p.results(timeout_seconds=1.0, auto_ack=False):
            got.add(r.item_id)
            if len(got) == count:
                break
    return got


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        out.append(json.loads(line))  # every line whole: a torn one was cut by the next run
    return out


def _results_cmd(broker, name: str, out: Path, timeout: float = 1.0) -> list[str]:
    return [sys.executable, "-m", "shmbroker.cli", "results", "--name", name, "--data-dir", broker.data_dir,
            "--out", str(out), "--timeout", str(timeout)]


def test_results_reader_sigkilled_mid_stream_then_run_again_gives_each_result_once(broker, tmp_path):
    """Before: `results --out` popped results before writing them through a buffered file
    and the broker counted popped as consumed, so each SIGKILL lost what was in the buffer."""
    name = "kill-" + os.urandom(3).hex()
    ids = _submit(broker, name, ITEMS, 1)
    _wait_all_on_ring(broker, name, ITEMS)
    out = tmp_path / "out.jsonl"
    rng = random.Random(14)
    partial_runs = 0
    for _ in range(3):
        before = _size(out)
        proc = subprocess.Popen(_results_cmd(broker, name, out), stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while _size(out) <= before and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)  # until this run has written something: then it is mid-stream
        time.sleep(rng.uniform(0.0, 0.05))
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        lines = out.read_text().count("\n") if out.exists() else 0
        if 0 < lines < ITEMS and _size(out) > before:
            partial_runs += 1
    assert subprocess.run(_results_cmd(broker, name, out), stderr=subprocess.DEVNULL, timeout=120).returncode == 0
    got = [r["item_id"] for r in _lines(out)]
    assert len(got) == len(set(got)), f"{len(got) - len(set(got))} duplicated results"
    assert set(got) == set(ids), f"{len(set(ids) - set(got))} results lost"
    assert all(r["status"] == "ok" for r in _lines(out))
    assert partial_runs >= 1  # at least one kill landed mid-stream (else the test shows nothing)


def test_a_new_reader_process_gets_only_what_no_reader_acknowledged(broker, tmp_path):
    """Across client processes: one reader acknowledges half and exits; another process
    under the same name gets exactly the other half."""
    name = "half-" + os.urandom(3).hex()
    ids = _submit(broker, name, 400, 2)
    with Producer(name, data_dir=broker.data_dir) as p:
        first = _read_some(p, 200)
        p.ack()
    out = tmp_path / "rest.jsonl"
    assert subprocess.run(_results_cmd(broker, name, out, 3.0), stderr=subprocess.DEVNULL, timeout=120).returncode == 0
    rest = [r["item_id"] for r in _lines(out)]
    assert len(rest) == len(set(rest)) == 200
    assert set(rest) | first == set(ids) and not set(rest) & first


@pytest.mark.parametrize("reader", ["alive", "gone"])
def test_results_process_restart_redelivers_nothing_acknowledged(broker, tmp_path, reader):
    """Before: a restarted results process replayed from one global offset, and a new
    client process yielded again everything an earlier one had already read."""
    name = f"restart-{reader}-" + os.urandom(3).hex()
    ids = _submit(broker, name, 300, 3)
    p = Producer(name, data_dir=broker.data_dir)
    try:
        got = _read_some(p, 150)
        p.ack()
        time.sleep(0.5)  # a checkpoint saves the cursor
        if reader == "gone":
            p._auto_ack = False
            p.close()
        old = broker.kill_role("results")
        deadline = time.monotonic() + 60
        while broker.role_pids().get("results") in (old, 0):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        if reader == "alive":
            for r in p.results(timeout_seconds=3.0, auto_ack=False):
                assert r.item_id not in got
                got.add(r.item_id)
            assert got == set(ids)
        p.ack()
    finally:
        p.close()
    out = tmp_path / "after.jsonl"
    assert subprocess.run(_results_cmd(broker, name, out, 2.0), stderr=subprocess.DEVNULL, timeout=120).returncode == 0
    later = [r["item_id"] for r in _lines(out)]
    assert len(later) == len(set(later))
    assert not set(later) & got  # nothing acknowledged comes again
    assert set(later) | got == set(ids)


def test_submit_default_names_differ_between_runs(broker, tmp_path, capsys):
    """`submit-<pid>` was reused with the pid, handing an old run's results to a new --out."""
    src = tmp_path / "p.jsonl"
    src.write_text(json.dumps({"tokens": [1, 2], "max_new_tokens": 1}) + "\n")
    names = set()
    for _ in range(2):
        assert main(["submit", str(src), "--data-dir", broker.data_dir]) == 0
        err = capsys.readouterr().err
        names.add(err.split("as producer '", 1)[1].split("'", 1)[0])
    assert len(names) == 2


def test_results_waiting_for_a_slow_reader_cost_about_8_bytes_each_in_memory():
    """A reader far behind: the results process holds the log offsets of what it has not read,
    pushed a few at a time (before: one small array each, about 100 bytes a result; the results
    process of a steady run grew 100 MB in 300 s behind two readers slower than the producers)."""
    import tracemalloc

    from shmbroker.results.delivery import IndexedOffsets
    from shmbroker.results.log import OffsetQueue

    n = 100_000
    tracemalloc.start()
    try:
        waiting, inflight = OffsetQueue(), IndexedOffsets()
        before = tracemalloc.get_traced_memory()[0]
        for at in range(n):
            waiting.extend(np.array([at], np.int64))
            inflight.append(np.array([at], np.int64))
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= 2 * 9 * n, f"{held / n:.0f} bytes a result held"
    assert len(waiting) == n and waiting.first() == 0 and np.concatenate(waiting.peek_all()).tolist() == list(range(n))
    inflight.drop_below(n - 3)
    assert inflight.base == n - 3 and inflight.peek_all().tolist() == [n - 3, n - 2, n - 1]
    waiting.drop(n - 1)
    assert len(waiting) == 1 and waiting.first() == n - 1
