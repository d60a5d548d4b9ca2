"""The supervisor's lock: one live holder per data directory; a dead holder's lock is taken over."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from shmbroker.disk.lockfile import LOCK_FILE, AlreadyRunning, InstanceLock

HOLD = """
import sys, time
from shmbroker.disk.lockfile import InstanceLock
lock = InstanceLock.acquire(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def hold_in_child(data_dir) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(data_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_acquire_writes_pid_owner_only_and_release_removes_it(tmp_path):
    with InstanceLock.acquire(tmp_path) as lock:
        path = tmp_path / LOCK_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().startswith(f"pid {os.getpid()} start ")
        assert not lock.took_over
    assert not path.exists()
    lock.release()  # idempotent


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    proc = hold_in_child(tmp_path)
    try:
        with pytest.raises(AlreadyRunning) as err:
            InstanceLock.acquire(tmp_path)
        assert f"pid {proc.pid} " in str(err.value) and str(tmp_path) in str(err.value)
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {proc.pid} ")  # untouched by the refusal
    finally:
        proc.kill()
        proc.wait()


def test_same_process_second_acquire_is_refused_too(tmp_path):
    with InstanceLock.acquire(tmp_path):
        with pytest.raises(AlreadyRunning):
            InstanceLock.acquire(tmp_path)


def test_a_dead_holders_lock_is_taken_over(tmp_path):
    proc = hold_in_child(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (tmp_path / LOCK_FILE).exists()  # left behind by the killed holder
    deadline = time.monotonic() + 5
    while True:
        try:
            lock = InstanceLock.acquire(tmp_path)
            break
        except AlreadyRunning:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    with lock:
        assert lock.took_over and lock.previous.startswith(f"pid {proc.pid} ")
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} ")


def test_forked_children_keep_the_lock_held(tmp_path):
    lock = InstanceLock.acquire(tmp_path)
    pid = os.fork()
    if pid == 0:  # the child holds the inherited descriptor until it exits
        time.sleep(1.0)
        os._exit(0)
    try:
        os.close(lock._fd)  # the parent lets go; the child's copy still holds the flock
        lock._fd = None
        with pytest.raises(AlreadyRunning):
            InstanceLock.acquire(tmp_path)
    finally:
        os.waitpid(pid, 0)
    with InstanceLock.acquire(tmp_path) as again:
        assert again.took_over
