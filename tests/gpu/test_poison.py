"""Poison items, hung engines, crash loops and engine outages, on a real broker.

Each test runs `shmbroker supervise` (tests/support/brokerproc.py) with one consumer whose engine misbehaves
on demand: the simulated engine's faults (`SimSettings`: poison_token, hang_token, block_token,
fail_token, fail_after; engines/faults.py), an engine whose package is missing (a crash loop),
or the `openai` engine against a completions server that is down for a while
(tests/engines/test_engine_openai.py's FakeCompletionsServer). Small deadlines and back-offs keep each test
a few seconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
import types
import urllib.request
from http.server import ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.brokerproc import BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.control.segment import Control
from shmbroker.control.stats import read_role

POISON = 999_001  # token ids of the tests' prompts are below 1000: a marked item holds one of these
HANG = 999_002
FAILS = 999_003
FAST = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.05
restart_backoff_max_seconds = 0.2
crash_loop_restarts = 1000
engine_retry_min_seconds = 0.05
engine_retry_max_seconds = 0.2
"""


def config(engine_settings: str, extra: str = "", *, engine: str = "sim", batch_size: int = 8) -> str:
    return FAST + extra + f"""
[[consumers]]
name = "g"
max_batch_size = {batch_size}
max_batch_tokens = 4096
max_input_len = 512
engine = "{engine}"
engine_settings = {{ {engine_settings} }}
"""


def prompts(n: int, seed: int = 0, marked: dict | None = None) -> list[np.ndarray]:
    """n prompts of 20-60 tokens below 1000; marked {k: token}: prompt k holds that token too."""
    rng = np.random.default_rng(seed)
    out = [rng.integers(0, 1000, int(rng.integers(20, 60)), dtype=np.uint32) for _ in range(n)]
    for k, token in (marked or {}).items():
        out[k] = np.concatenate([out[k], np.array([token], np.uint32)])
    return out


def run_items(broker, tokens, max_new=3, timeout_seconds=60.0, name="t") -> dict:
    """Submit every prompt, wait for every result; {item index: Result} (missing: none came)."""
    with Producer(name, data_dir=broker.data_dir) as p:
        ids = [p.submit(t, max_new_tokens=max_new) for t in tokens]
        index = {i: k for k, i in enumerate(ids)}
        got: dict = {}
        deadline = time.monotonic() + timeout_seconds
        while len(got) < len(ids) and time.monotonic() < deadline:
            for r in p.results(0.2):
                got.setdefault(index[r.item_id], r)
    return got


def slot_words(broker, role: str) -> dict:
    """The role's statistics and the supervisor's words about it (`watch.BrokerView.snapshot`)."""
    from shmbroker.observe.watch import BrokerView

    view = BrokerView.attach(broker.data_dir)
    try:
        snap = view.snapshot()
    finally:
        view.close()
    proc = next(p for p in snap["processes"] if p["role"] == role)
    return {**proc, "stats": snap["consumers"].get(role.split("-", 1)[1], {})}


def gpu_stats(broker) -> dict:
    info = broker.info()
    ctl = Control.attach(info["control"], info["roles"], readonly=True)
    try:
        return read_role(ctl, info["roles"].index("gpu-g"))
    finally:
        ctl.close()


def assert_others_ok(got: dict, n: int, bad: set, max_new: int = 3) -> None:
    missing = sorted(set(range(n)) - set(got))
    assert not missing, f"{len(missing)} of {n} items have no result: {missing}"
    wrong = {k: (r.status, r.error) for k, r in got.items() if k not in bad and r.status != "ok"}
    assert not wrong, wrong
    assert all(got[k].tokens.size == max_new for k in got if k not in bad)


# -- poison items ---------------------------------------------------------------------------

@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode, kill", [("packed", "abort"), ("padded", "segfault")])
def test_a_poison_item_fails_after_bounded_attempts_and_every_other_item_is_ok(tmp_path, mode, kill):
    """The engine process dies whenever the poison item is added: its batch is redelivered
    poison_attempts times as is, then split, and the item alone kills it poison_attempts times more;
    then it comes back engine_error and the process stops dying. Every other item is ok."""
    n, bad = 40, 13
    cfg = config(f'mode = "{mode}", pace_seconds = 0.0, poison_token = {POISON}, poison_kill = "{kill}"',
                 "poison_attempts = 2\n")
    with BrokerProc(tmp_path, cfg) as broker:
        got = run_items(broker, prompts(n, marked={bad: POISON}))
        assert_others_ok(got, n, {bad})
        assert got[bad].status == "engine_error"
        assert got[bad].error == "the engine process died on this item 2 times"
        proc = slot_words(broker, "gpu-g")
        assert proc["restarts"] == 4, proc  # 2 deliveries of its batch, 2 of the item alone: bounded
        assert proc["last_exit"] == ("killed by SIGABRT" if kill == "abort" else "killed by SIGSEGV"), proc
        stats = gpu_stats(broker)
        assert stats["poisoned"] == 1 and stats["split_batches"] == 1, stats
        assert stats["redelivered"] >= 4, stats
        assert stats["ok"] >= n - 1 and stats["engine_errors"] == 1, stats  # ok: runs (a redelivery runs again)


@pytest.mark.timeout(120)
def test_a_crash_looping_role_is_reported_in_status_top_and_metrics(tmp_path):
    """A consumer whose engine cannot load dies at every start: its restarts back off (bounded), and
    `status`, `top` and the metrics say it is in a crash loop, with its last error."""
    from shmbroker.observe.top import render
    from shmbroker.observe.watch import BrokerView

    cfg = FAST.replace("crash_loop_restarts = 1000", "crash_loop_restarts = 3") + """
[[consumers]]
name = "g"
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 512
engine = "trtllm"
engine_settings = { model = "/nonexistent/model" }
"""
    broker = BrokerProc(tmp_path, cfg)
    broker.wait_ready = lambda timeout_seconds=60.0: _wait_registry(broker, timeout_seconds)
    with broker:
        deadline = time.monotonic() + 30
        while not (proc := slot_words(broker, "gpu-g"))["crash_loop"]:
            assert time.monotonic() < deadline, broker.log()
            time.sleep(0.1)
        assert proc["restarts"] >= 2
        assert proc["last_exit"] == "exited with status 1", proc
        assert "EngineUnavailable" in proc["last_error"], proc
        out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--json", "--data-dir", broker.data_dir],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        report = {p["role"]: p for p in json.loads(out.stdout)["processes"]}
        assert report["gpu-g"]["crash_loop"] and "EngineUnavailable" in report["gpu-g"]["last_error"]
        assert not report["sched"]["crash_loop"] and report["sched"]["last_error"] is None
        text = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--data-dir", broker.data_dir],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "200"}).stdout
        assert "crash loop" in text and "EngineUnavailable" in text, text
        view = BrokerView.attach(broker.data_dir)
        try:
            from rich.console import Console

            console = Console(width=200, record=True, file=open(os.devnull, "w"))
            console.print(render(view.snapshot(), {}))
            screen = console.export_text()
            addr = view.snapshot()["metrics_addr"]
        finally:
            view.close()
        assert "CRASH LOOP" in screen and "EngineUnavailable" in screen, screen
        metrics = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        samples = {(s.name, tuple(sorted(s.labels.items()))): s for fam in text_string_to_metric_families(metrics)
                   for s in fam.samples}
        assert samples[("shmbroker_process_crash_loop", (("kind", "gpu"), ("process", "gpu-g")))].value == 1
        assert samples[("shmbroker_process_crash_loop", (("kind", "sched"), ("process", "sched")))].value == 0
        errors = [s.labels["error"] for (name, _), s in samples.items()
                  if name == "shmbroker_process_last_exit_info" and s.labels["process"] == "gpu-g"]
        assert len(errors) == 1 and "EngineUnavailable" in errors[0], errors
        # bounded: the restarts back off (0.1 s doubling to 0.2 s here), they do not spin
        first = slot_words(broker, "gpu-g")["restarts"]
        time.sleep(2.0)
        assert slot_words(broker, "gpu-g")["restarts"] - first <= 2.0 / 0.1


def _wait_registry(broker, timeout_seconds: float) -> dict:
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        if broker.proc.poll() is not None:
            raise RuntimeError(f"supervisor exited with {broker.proc.returncode}:\n{broker.log()}")
        info = broker.info()
        if info is not None:
            return info
        time.sleep(0.05)
    raise TimeoutError(broker.log())


# -- hung engines --------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_a_hung_batch_is_killed_and_redelivered(tmp_path):
    """An item that never finishes (the engine runs the others: the batch misses its deadline): the
    watchdog kills the GPU process, its batch is redelivered (the other items come back ok), and the
    hang counts as a delivery: after poison_attempts the item alone, and then it fails."""
    n, bad = 30, 7
    cfg = config(f'mode = "packed", pace_seconds = 0.0, hang_token = {HANG}',
                 "poison_attempts = 1\nbatch_deadline_seconds = 1.0\nbatch_deadline_token_seconds = 0.0\n")
    with BrokerProc(tmp_path, cfg) as broker:
        started = time.monotonic()
        got = run_items(broker, prompts(n, seed=1, marked={bad: HANG}))
        assert_others_ok(got, n, {bad})
        assert got[bad].status == "engine_error"
        assert got[bad].error == "the engine process died on this item 1 time"
        proc = slot_words(broker, "gpu-g")
        assert proc["watchdog_kills"] == 2 and proc["restarts"] == 2, proc
        assert "missed its batch deadline" in proc["last_error"], proc
        assert time.monotonic() - started < 30


@pytest.mark.timeout(120)
def test_an_engine_call_that_blocks_is_a_dead_engine_within_twice_its_deadline(tmp_path):
    """An item that blocks the engine's poll for ever: the process's heartbeat goes on (the watchdog
    kills nothing), the call misses its deadline (engine_call_seconds 1 s plus the poll's own timeout),
    and the process exits as for a dead engine within twice that, its window handed back: the other
    items come back ok. The blocking item kills every engine it meets, so it still counts deliveries
    and fails alone after poison_attempts."""
    n, bad = 30, 7
    cfg = config(f'mode = "packed", pace_seconds = 0.0, block_token = {HANG}',
                 "poison_attempts = 1\nengine_call_seconds = 1.0\nbatch_deadline_token_seconds = 0.0\n"
                 "heartbeat_timeout_seconds = 1.0\n")
    with BrokerProc(tmp_path, cfg) as broker:
        started = time.monotonic()
        got = run_items(broker, prompts(n, seed=1, marked={bad: HANG}))
        assert_others_ok(got, n, {bad})
        assert got[bad].status == "engine_error"
        assert got[bad].error == "the engine process died on this item 1 time"
        proc = slot_words(broker, "gpu-g")
        assert proc["watchdog_kills"] == 0, proc  # its heartbeat went on while the call blocked
        assert proc["restarts"] >= 2, proc
        assert "engine dead: its poll call did not return by its deadline" in proc["last_error"], proc
        assert proc["stats"]["engine_deaths"] == proc["restarts"], proc
        assert proc["stats"]["engine_restart_ns"] > 0 and proc["stats"]["engine_load_ns"] > 0, proc
        text = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--data-dir", broker.data_dir],
                              capture_output=True, text=True, timeout=60, env={**os.environ, "COLUMNS": "250"}).stdout
        assert "engine dead: its poll call did not return" in text and "engine_deaths" in text, text
        addr = json.loads((Path(broker.data_dir) / "broker.json").read_text())["metrics_addr"]
        metrics = urllib.request.urlopen(f"http://{addr}/metrics", timeout=10).read().decode()
        samples = {s.name: s.value for fam in text_string_to_metric_families(metrics) for s in fam.samples
                   if s.labels.get("consumer") == "g"}
        assert samples["shmbroker_consumer_engine_deaths_total"] == proc["restarts"], samples
        assert 0 < samples["shmbroker_consumer_engine_restart_seconds"] < 30, samples
        # each death within 2 x its ~1.05 s deadline, plus a sim engine's restart (about a second here)
        assert time.monotonic() - started < proc["restarts"] * (2 * 1.05 + 3.0) + 5.0


@pytest.mark.timeout(120)
def test_slow_but_progressing_work_is_not_killed(tmp_path):
    """A padded rectangle that takes longer than the deadline's floor, within the deadline its tokens
    give it, and a paced packed stream whose batches take longer than the floor but keep finishing
    items: nothing is killed. The GPU process's loop keeps beating meanwhile."""
    n = 12
    # a rectangle of 12 items x ~60 tokens: ~1.2 s paced; the floor alone (0.3 s) would kill it
    cfg = config('mode = "padded", pace_seconds = 1.0, prefill_token_seconds = 0.0015, batch_overhead_seconds = 0.0, '
                 'decode_step_seconds = 0.0, decode_token_seconds = 0.0',
                 "batch_deadline_seconds = 0.3\nbatch_deadline_token_seconds = 0.003\n"
                 "heartbeat_timeout_seconds = 0.5\n", batch_size=16)
    with BrokerProc(tmp_path, cfg) as broker:
        started = time.monotonic()
        got = run_items(broker, prompts(n, seed=2))
        assert time.monotonic() - started > 1.0  # it did take longer than the floor
        assert_others_ok(got, n, set())
        proc = slot_words(broker, "gpu-g")
        assert proc["watchdog_kills"] == 0 and proc["restarts"] == 0, proc


# -- an engine that is down ------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_an_engine_that_dies_is_restarted_and_its_items_are_retried_not_failed(tmp_path):
    """A dead engine (every poll raises once 12 items were added): what it held is handed back and
    retried, and after a few failures in a row the GPU process exits, so the supervisor restarts it
    with a fresh engine; every item comes back ok, none engine_error, restarts bounded."""
    n = 40
    cfg = config('mode = "packed", pace_seconds = 0.0, fail_after = 12', "poison_attempts = 3\n", batch_size=4)
    with BrokerProc(tmp_path, cfg) as broker:
        got = run_items(broker, prompts(n, seed=3))
        assert_others_ok(got, n, set())
        proc = slot_words(broker, "gpu-g")
        assert 1 <= proc["restarts"] <= 12, proc
        assert "engine dead" in proc["last_error"] and "fail_after" in proc["last_error"], proc
        stats = gpu_stats(broker)
        assert stats["engine_errors"] == 0 and stats["engine_retries"] > 0, stats
        assert stats["engine_deaths"] == proc["restarts"], (stats, proc)


@pytest.mark.timeout(120)
def test_a_refused_item_fails_alone(tmp_path):
    n, bad = 30, 5
    cfg = config(f'mode = "packed", pace_seconds = 0.0, fail_token = {FAILS}')
    with BrokerProc(tmp_path, cfg) as broker:
        got = run_items(broker, prompts(n, seed=4, marked={bad: FAILS}))
        assert_others_ok(got, n, {bad})
        assert got[bad].status == "engine_error" and "fail_token" in got[bad].error
        assert slot_words(broker, "gpu-g")["restarts"] == 0


def _server_on(port: int, **knobs):
    """tests/engines/test_engine_openai.py's fake completions server, listening on `port`."""
    from engines import test_engine_openai as fake  # tests/engines, a sibling of this test's folder on sys.path

    class Bound(ThreadingHTTPServer):
        def __init__(self, _addr, handler):
            super().__init__(("127.0.0.1", port), handler)

    saved = fake.ThreadingHTTPServer
    fake.ThreadingHTTPServer = Bound
    try:
        return fake.FakeCompletionsServer(**knobs)
    finally:
        fake.ThreadingHTTPServer = saved


@pytest.mark.timeout(120)
def test_openai_server_down_items_wait_and_come_back_ok_a_refused_item_fails_alone(tmp_path):
    """The server is down (connection refused), then up but overloaded (503), then well: every item
    dispatched meanwhile is handed back and retried with back-off (counted), none fails for the
    outage and the GPU process is not restarted; the item the server refuses (400) fails alone."""
    from engines import test_engine_openai as fake  # tests/engines, a sibling of this test's folder on sys.path

    with socket.socket() as sock:  # a free port, nothing listening on it yet
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    n, bad = 24, 9
    cfg = config(f'base_url = "http://127.0.0.1:{port}/v1", model = "{fake.MODEL}", retries = 0, '
                 'timeout_seconds = 5.0, backoff_seconds = 0.01, max_in_flight = 4', engine="openai")
    tokens = prompts(n, seed=5, marked={bad: fake.REJECTED})
    server = None
    with BrokerProc(tmp_path, cfg) as broker, Producer("o", data_dir=broker.data_dir) as p:
        try:
            ids = [p.submit(t, max_new_tokens=3) for t in tokens]
            early = list(p.results(1.5))  # the server is down all this time
            assert early == []
            down = gpu_stats(broker)
            assert down["engine_retries"] > 0 and down["engine_down"] == 1, down
            server = _server_on(port, fail_first=3, fail_status=503)
            got = {r.item_id: r for r in early}
            deadline = time.monotonic() + 30
            while len(got) < n and time.monotonic() < deadline:
                got.update((r.item_id, r) for r in p.results(0.2))
            assert len(got) == n, f"{n - len(got)} items have no result"
            for k, i in enumerate(ids):
                r = got[i]
                if k == bad:
                    assert r.status == "engine_error" and r.error.startswith("HTTP 400"), r
                else:
                    assert r.status == "ok", (k, r.status, r.error)
                    assert r.tokens.tolist() == fake.generated(tokens[k].tolist(), 3)
            assert server.statuses[:3] == [503] * 3
            after = gpu_stats(broker)
            assert after["engine_errors"] == 1 and after["engine_down"] == 0, after
            assert slot_words(broker, "gpu-g")["restarts"] == 0
        finally:
            if server is not None:
                server.close()


# -- the watchdog on real processes ----------------------------------------------------------------

def test_the_watchdog_tells_startup_waiting_and_progress_from_a_hang(owner):
    """Real processes in role slots of a real control segment: one that starts slowly (no beat yet),
    one waiting on a ring (its ring side beats), one that beats and one that missed its deadline;
    only the silent and the late ones are judged hung."""
    from shmbroker.config.broker import BrokerConfig
    from shmbroker.control.segment import R_BEAT, R_DEADLINE, R_PID, R_STARTED
    from shmbroker.ring.owned import create_ring
    from shmbroker.ring.ring import CONSUMER
    from shmbroker.supervisor.watchdog import Limits, Watchdog

    roles = ["slow-start", "waiting", "beating", "silent", "late"]
    ctl = Control.create(owner, roles)
    ring = create_ring(owner, "w", 1 << 16)
    kids = []
    try:
        for r, role in enumerate(roles):
            ctl.role(r)[R_STARTED] = time.monotonic_ns()  # before the fork, as the supervisor does
            pid = os.fork()
            if pid == 0:
                try:
                    slot = ctl.role(r)
                    if role == "waiting":
                        slot[R_BEAT] = time.monotonic_ns()
                        side = ring.attach(CONSUMER)
                        side.wait_readable(30.0)  # beats the ring's consumer side, not the slot
                    for _ in range(600):
                        if role in ("beating", "late"):
                            slot[R_BEAT] = time.monotonic_ns()
                        if role == "silent" and not slot[R_BEAT]:
                            slot[R_BEAT] = time.monotonic_ns()  # once, then silent
                        time.sleep(0.05)
                finally:
                    os._exit(0)
            kids.append(pid)
            ctl.role(r)[R_PID] = pid
        ctl.role(roles.index("late"))[R_DEADLINE] = time.monotonic_ns() + 500_000_000
        limits = Limits.of(BrokerConfig(data_dir="unused"))
        limits = dataclasses.replace(limits, heartbeat_timeout_seconds=0.6, startup_timeout_seconds=5.0)
        dog = Watchdog(ctl, roles, limits,
                       rings={"waiting": [(ring.segment.buf, CONSUMER)]})
        time.sleep(1.2)
        hung = dict(dog.check({role: pid for role, pid in zip(roles, kids)}))
        assert set(hung) == {"silent", "late"}, hung
        assert "heartbeat stale" in hung["silent"] and "missed its batch deadline" in hung["late"]
    finally:
        for pid in kids:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        ctl.close()


def test_the_failure_settings_are_validated_with_their_defaults_in_one_place():
    from shmbroker.config import settings
    from shmbroker.config.broker import BrokerConfig

    # each default is declared once, on its field
    defaults = types.SimpleNamespace(DEFAULT_POISON_ATTEMPTS=BrokerConfig.poison_attempts,
                                     DEFAULT_BATCH_DEADLINE_SECONDS=BrokerConfig.batch_deadline_seconds,
                                     DEFAULT_HEARTBEAT_TIMEOUT_SECONDS=BrokerConfig.heartbeat_timeout_seconds)

    cfg = settings.parse({})
    assert cfg.poison_attempts == defaults.DEFAULT_POISON_ATTEMPTS == 3
    assert cfg.batch_deadline_seconds == defaults.DEFAULT_BATCH_DEADLINE_SECONDS
    assert cfg.heartbeat_timeout_seconds == defaults.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    for raw, key in (({"poison_attempts": 0}, "poison_attempts"), ({"heartbeat_timeout_seconds": 0}, "heartbeat"),
                     ({"engine_retry_min_seconds": 9.0, "engine_retry_max_seconds": 1.0}, "engine_retry_min"),
                     ({"consumers": [{"name": "g", "max_batch_size": 1, "max_batch_tokens": 8, "max_input_len": 8,
                                      "engine_settings": {"poison_kill": "explode"}}]}, "poison_kill")):
        with pytest.raises(settings.ConfigError, match=key):
            settings.parse(raw)
    assert settings.parse({"batch_deadline_token_seconds": 0.0}).batch_deadline_token_seconds == 0.0
