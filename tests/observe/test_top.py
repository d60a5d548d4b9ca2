"""`shmbroker top` in a pseudo-terminal (pexpect) against real brokers, and its pure rendering.

The pty tests read the screen as it is drawn, strip the escape sequences and look for text; every
wait has a deadline long enough for a slow 2-core machine (a fresh `top` imports numba and rich).
"""

from __future__ import annotations

import io
import os
import re
import secrets
import signal
import subprocess
import sys
import termios
import time

import numpy as np
import pytest
from rich.console import Console
from support.brokerproc import BrokerProc, serve
from support.harness import sweep_shm

from shmbroker.cli import main
from shmbroker.observe import top

pexpect = pytest.importorskip("pexpect")  # a safety net: pexpect is in the `test` extra

CONSUMERS = ("big", "small")  # SMALL_CONFIG's consumers (tests/support/brokerproc.py)
SCREEN_SECONDS = 30.0  # for a fresh `top` to draw what is asked (imports, attach)
EXIT_SECONDS = 10.0
ANSI = re.compile(r"\x1b(\[[0-9;?]*[ -/]*[@-~]|\][^\x07\x1b]*(\x07|\x1b\\)|[()][0-9A-Za-z]|[=>78])")
TAIL_CHARS = 400_000  # a few 60 x 200 frames with their escape sequences


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("broker"), "top") as b:
        yield b


def _no_leftovers(instance: str) -> None:
    left = sweep_shm(instance)
    assert left == [], f"broker left {left}"


def _spawn(data_dir: str, *extra: str, stdin_devnull: bool = False, preexec_fn=None):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TERM"] = "xterm-256color"
    cmd = [sys.executable, "-m", "shmbroker.cli", "top", "--data-dir", data_dir, *extra]
    if stdin_devnull:  # stdout still the pty, stdin not a terminal
        cmd = ["/bin/sh", "-c", 'exec "$@" < /dev/null', "sh", *cmd]
    return pexpect.spawn(cmd[0], cmd[1:], dimensions=(60, 200), env=env, encoding="utf-8", codec_errors="replace",
                         preexec_fn=preexec_fn)


def _until(child, *patterns: str, timeout_seconds: float = SCREEN_SECONDS) -> str:
    """The screen text (escape sequences stripped) once all `patterns` appear in what was drawn since the call."""
    raw = ""
    deadline = time.monotonic() + timeout_seconds
    while True:
        text = ANSI.sub("", raw)
        if all(re.search(p, text) for p in patterns):
            return text
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"top did not show {patterns} in {timeout_seconds} s; it showed:\n{text[-6000:]}")
        try:
            raw = (raw + child.read_nonblocking(1 << 16, timeout=min(0.5, left)))[-TAIL_CHARS:]
        except pexpect.TIMEOUT:
            continue
        except pexpect.EOF:
            raise AssertionError(f"top exited (status {child.wait()}) before showing {patterns}:\n{ANSI.sub('', raw)[-6000:]}") from None


def _exits_zero(child) -> str:
    """What `top` wrote until it exited; asserts status 0 and that the terminal is as it was (canonical, echo)."""
    child.expect(pexpect.EOF, timeout=EXIT_SECONDS)
    tail = child.before
    lflag = termios.tcgetattr(child.child_fd)[3]  # the pty's settings outlive the child until close()
    child.close()
    assert lflag & termios.ICANON and lflag & termios.ECHO, "top left the terminal in cbreak mode"
    assert child.exitstatus == 0, f"exit status {child.exitstatus}, signal {child.signalstatus}:\n{ANSI.sub('', tail)[-3000:]}"
    return tail


def _submit(data_dir: str, count: int, length: int) -> None:
    from shmbroker.client.producer import Producer

    with Producer("top-" + secrets.token_hex(3), data_dir=data_dir) as p:
        for i in range(count):
            p.submit(np.arange(i, i + length, dtype=np.uint32), max_new_tokens=1)
        got, deadline = 0, time.monotonic() + 30
        while got < count and time.monotonic() < deadline:
            got += len(p.take_results(1.0))
    assert got == count


def _snapshot_when(data_dir: str, done, timeout_seconds: float = 10.0) -> dict:
    from shmbroker.observe.watch import BrokerView

    view = BrokerView.attach(data_dir)
    try:
        deadline = time.monotonic() + timeout_seconds
        while not done(snap := view.snapshot()):
            assert time.monotonic() < deadline, f"counters never settled: {snap['ingest']}"
            time.sleep(0.05)
        return snap
    finally:
        view.close()


def test_top_shows_the_running_broker_and_quits_on_q(broker):
    before = _snapshot_when(broker.data_dir, lambda s: True)["ingest"]["tokens"]
    _submit(broker.data_dir, 37, 11)
    expected = before + 37 * 11
    _snapshot_when(broker.data_dir, lambda s: s["ingest"]["tokens"] == expected)
    child = _spawn(broker.data_dir)
    try:
        screen = _until(child, *(rf"─ {name} +default · sim/" for name in CONSUMERS), rf"tokens total +{expected:,}\b",
                        r"supervisor pid " + str(broker.proc.pid), r"press q to quit", r"gpu-small +\d+ +yes",
                        r"padding waste", r"cache hit rate", r"tokens/s")
        assert "no broker is running" not in screen
        child.send("q")
        tail = _exits_zero(child)
    finally:
        child.close(force=True)
    assert "\x1b[?1049l" in tail  # back from the alternate screen


def test_top_waits_for_a_broker_attaches_and_notices_it_going(tmp_path):
    instance = "top" + secrets.token_hex(3)
    later = BrokerProc(tmp_path, instance=instance)
    child = _spawn(later.data_dir)
    try:
        _until(child, r"no broker is running on data directory", r"press q to quit")
        # the pty's line discipline while top runs: cbreak (no ICANON, no ECHO), signals still on
        lflag = termios.tcgetattr(child.child_fd)[3]
        assert not lflag & termios.ICANON and not lflag & termios.ECHO and lflag & termios.ISIG
        with later:
            _until(child, *(rf"─ {name} +default · sim/" for name in CONSUMERS), r"supervisor pid " + str(later.proc.pid))
        _until(child, r"no broker is running on data directory")
        child.send("q")
        _exits_zero(child)
    finally:
        child.close(force=True)
    _no_leftovers(instance)


def test_top_exits_zero_on_ctrl_c(broker):
    child = _spawn(broker.data_dir, "--interval", "0.2")
    try:
        _until(child, *(rf"─ {name} " for name in CONSUMERS))
        child.sendintr()
        _exits_zero(child)
    finally:
        child.close(force=True)


def test_top_started_with_sigint_ignored_still_exits_zero_on_ctrl_c(tmp_path):
    """A script or a background job may start top with SIGINT ignored (a shell's `cmd &` does), and
    Python keeps an ignored SIGINT ignored: the terminal's Ctrl-C must still quit it."""
    child = _spawn(str(tmp_path), preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        _until(child, r"no broker is running")
        child.sendintr()
        _exits_zero(child)
    finally:
        child.close(force=True)


def test_top_exits_zero_on_sigterm(tmp_path):
    child = _spawn(str(tmp_path))
    try:
        _until(child, r"no broker is running")
        child.kill(signal.SIGTERM)
        _exits_zero(child)
    finally:
        child.close(force=True)


def test_top_without_a_terminal_on_stdin_refreshes_until_ctrl_c(tmp_path):
    child = _spawn(str(tmp_path), stdin_devnull=True)
    try:
        _until(child, r"no broker is running")
        child.send("q")  # not read: stdin is not the terminal
        _until(child, r"no broker is running", timeout_seconds=5.0)
        child.sendintr()
        _exits_zero(child)
    finally:
        child.close(force=True)


@pytest.mark.parametrize("interval", ["0.6", "0", "-1", "nan"])
def test_top_refuses_intervals_over_half_a_second(interval, tmp_path, capsys):
    assert main(["top", "--data-dir", str(tmp_path), "--interval", interval]) == 2
    assert "--interval" in capsys.readouterr().err


def _text(renderable, width: int = 200, height: int = 60) -> str:
    console = Console(file=io.StringIO(), width=width, height=height, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def test_render_shows_a_real_snapshot_with_known_rates(broker):
    _submit(broker.data_dir, 5, 40)
    snap = _snapshot_when(broker.data_dir, lambda s: s["consumers"]["big"]["batches"] + s["consumers"]["small"]["batches"] > 0)
    big = snap["consumers"]["big"]
    big.update(padding_waste=0.125, hit_rate=0.875, batches=1000, items=4000, excess_shape_switches=7, too_long=3)
    earlier = {**snap, "t_monotonic_ns": snap["t_monotonic_ns"] - 2 * 10**9,
               "consumers": {**snap["consumers"], "big": {**big, "tokens": big["tokens"] - 24_690, "items": big["items"] - 20,
                                                             "busy_ns": big["busy_ns"] - 10**9, "batches": 990,
                                                             "batch_wait_ns": big["batch_wait_ns"] - 30_000_000}},
               "ingest": {**snap["ingest"], "bytes": snap["ingest"]["bytes"] - 3_000_000}}
    rates = top.window(earlier, snap)
    assert rates["consumers"]["big"]["batch_wait_seconds"] == pytest.approx(0.003)
    text = _text(top.render(snap, rates))
    for pattern in (r"padding waste +12\.5%", r"cache hit rate +87\.5%", r"tokens/s +12,345\b", r"items/s +10\.0\b",
                    r"busy +50\.0%", r"batch wait +3\.00 ms", r"batches / items +1,000 / 4,000", r"\(7 excess\)",
                    r"failed items +3 \(too long 3\)", r"MB/s +1\.50\b", rf"supervisor pid {broker.proc.pid}\b",
                    r"ingest-0 +\d+ +yes", r"batch:big +\d+\.\d%"):
        assert re.search(pattern, text), f"{pattern!r} not in\n{text}"
    # before any rate window (one snapshot) and on a small terminal it still renders, with dashes for the rates
    assert "tokens/s" in _text(top.render(snap, top.window(snap, snap)), width=80, height=24)


def test_render_highlights_dead_and_stale_processes(broker):
    snap = _snapshot_when(broker.data_dir, lambda s: True)
    snap["processes"][0].update(alive=False)
    snap["processes"][1].update(heartbeat_age_seconds=3.5)
    text = _text(top.render(snap, {}))
    assert re.search(rf"{snap['processes'][0]['role']} +\d+ +DEAD", text)
    assert re.search(r"3\.50s STALE", text)
    assert "no broker is running" in _text(top.waiting("/nowhere", "no broker is running on data directory '/nowhere'"))


QUIT_PROBE = """
import gc, os, sys
from shmbroker.observe import top

seen = []
def frame(self):
    seen.append(os.sched_getscheduler(0))
    raise KeyboardInterrupt
top.Top.frame = frame
before = os.sched_getscheduler(0)
assert top.run(sys.argv[1]) == 0
print("policies", before, seen[0], os.sched_getscheduler(0), "frozen", gc.get_freeze_count(), file=sys.stderr)
"""


def test_quitting_leaves_the_idle_priority_and_the_heap_frozen(tmp_path):
    """What keeps Ctrl-C prompt on a busy host: the exit does not run at SCHED_IDLE where the kernel
    lets `top` leave it, and the interpreter's teardown does not collect the whole heap."""
    proc = subprocess.run([sys.executable, "-c", QUIT_PROBE, str(tmp_path)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    before, watching, after, frozen = map(int, re.search(r"policies (\d+) (\d+) (\d+) frozen (\d+)", proc.stderr).groups())
    assert before == os.SCHED_OTHER and watching == os.SCHED_IDLE
    if os.geteuid() == 0:  # an ordinary user may not leave SCHED_IDLE (RLIMIT_NICE)
        assert after == before
    assert frozen > 0
