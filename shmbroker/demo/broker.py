"""The broker as the demo runs it: wait until every process is in its loop, read the roles'
counters, stop it, and find what shared memory of its instance is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ..control import roles

READY_SECONDS = 120.0
STOP_SECONDS = 120.0
COUNTERS_SECONDS = 10.0
SHM_DIR = "/dev/shm"


def wait_ready(sup: subprocess.Popen, data: str, log_path: Path) -> dict:
    """The registry's info once it answers for this supervisor and every broker process runs its loop."""
    from ..control.segment import R_BEAT, R_PID, R_STARTED, Control
    from ..protocol import request

    deadline = time.monotonic() + READY_SECONDS
    while True:
        if sup.poll() is not None:
            raise RuntimeError(f"the broker exited with {sup.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker was not ready in {READY_SECONDS:.0f} s:\n{_tail(log_path)}")
        try:
            info = request(data, {"op": "info"}, 1.0)
        except (OSError, ValueError):
            info = {}
        if info.get("ok") and info.get("pid") == sup.pid:
            ctl = Control.attach(info["control"], info["roles"], readonly=True)
            try:
                # every process forked and in its loop: a heartbeat after its start (the scheduler's
                # first comes after its start scan of the backlog)
                slots = [ctl.role(r) for r in range(len(info["roles"]))]
                if all(int(s[R_PID]) and int(s[R_BEAT]) >= int(s[R_STARTED]) for s in slots):
                    return info
            finally:
                ctl.close()
        time.sleep(0.05)


def read_counters(info: dict, items: int) -> dict[str, dict[str, int]]:
    """Every role's counters, once the GPU processes have counted all `items` (they count a batch
    just after writing its results, so the last results can reach a producer first)."""
    from ..control.segment import Control
    from ..control.stats import read_role

    ctl = Control.attach(info["control"], info["roles"], readonly=True)
    try:
        deadline = time.monotonic() + COUNTERS_SECONDS
        while True:
            out = {role: read_role(ctl, r) for r, role in enumerate(info["roles"])}
            if any(v is None for v in out.values()):  # a process restarting mid-publication: read again
                if time.monotonic() > deadline:
                    raise TimeoutError("a broker process's statistics stayed unreadable")
                time.sleep(0.02)
                continue
            done = sum(c["items"] for role, c in out.items() if roles.kind_of(role) is roles.Kind.GPU)
            if done >= items or time.monotonic() > deadline:
                return out
            time.sleep(0.02)
    finally:
        ctl.close()


def stop(sup: subprocess.Popen) -> int:
    if sup.poll() is None:
        sup.send_signal(signal.SIGTERM)
        try:
            return sup.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()
            return -signal.SIGKILL
    return sup.returncode


def shm_left(instance: str, data: str) -> list[str]:
    """Shared memory of this instance still there: names in /dev/shm, or still in the data directory's manifest."""
    from ..ring.owner import Manifest

    tag = f"shmb.{instance}."
    found = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tag) or n.startswith("sem." + tag)) \
        if os.path.isdir(SHM_DIR) else []
    listed = Manifest(data).names()
    return found + [n for kind in ("segments", "doorbells") for n in listed[kind]]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""
