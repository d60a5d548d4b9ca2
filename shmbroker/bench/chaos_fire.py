"""The broker under fire in `bench chaos`: its configuration, the killer's blows, and the filler
that keeps a small filesystem nearly full.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from pathlib import Path

from .broker import BenchBroker
from .chaos_procs import Reader

FILL_LEFT_BYTES = 256 << 10  # what the filler leaves free on a small filesystem
FILL_FILE = "filler.ballast"
# on a small filesystem: the silent producer's results leave the shared log early (results/behind.py)
SMALL_FS_CONFIG = "results_name_bytes = 1048576\n"

# poison_attempts: here every death is the killer's, not an engine's; a GPU process killed while it
# holds a batch counts as a delivery of it (gpu/deliveries.py), so the default 3 would fail items
# the killer happened to hit three times in a row
CONFIG = """
poison_attempts = 8
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536

[[consumers]]
name = "big"
max_batch_size = 32
max_batch_tokens = 16384
max_input_len = 4096
engine_settings = { mode = "packed", cache_tokens = 131072, pace_seconds = 0.0 }

[[consumers]]
name = "small"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 2048
engine_settings = { mode = "padded", cache_tokens = 65536, pace_seconds = 0.0 }
"""


class Broker:
    def __init__(self, tmp: str, instance: str, extra: str = ""):
        self.tmp = tmp
        self.config = f'instance = "{instance}"\n' + extra + CONFIG
        self.b: BenchBroker | None = None
        self.starts = 0

    def start(self, wait: bool = True) -> None:
        self.b = BenchBroker(self.tmp, self.config)
        self.starts += 1
        if wait:
            self.info = self.b.wait_ready()
            self.wait_roles()

    def wait_roles(self, timeout_seconds: float = 120.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_seconds
        while True:
            pids = self.role_pids()
            if pids and all(pids.values()):
                return pids
            if time.monotonic() > deadline:
                raise RuntimeError("broker roles did not all start: "
                                   + Path(self.b.log_path).read_text(errors="replace")[-3000:])
            time.sleep(0.05)

    def role_pids(self) -> dict[str, int]:
        try:
            return self.b.role_pids(self.b.wait_ready())
        except (OSError, RuntimeError, ValueError):  # a broker between two lives
            return {}

    def kill_supervisor(self) -> None:
        self.b.proc.kill()
        self.b.proc.wait(30)
        self.b.killed()

    def stop(self) -> int:
        return self.b.stop()


class Filler(threading.Thread):
    """Every 2-5 s, take all but FILL_LEFT_BYTES of a filesystem's free space for 0.5-2 s."""

    def __init__(self, directory: str, seed: int):
        super().__init__(daemon=True)
        self.path = os.path.join(directory, FILL_FILE)
        self.directory = directory
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.fills = 0
        self.min_free_bytes: int | None = None

    def _free(self) -> int:
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        self.min_free_bytes = free if self.min_free_bytes is None else min(self.min_free_bytes, free)
        return free

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(2.0, 5.0)):
            take = self._free() - FILL_LEFT_BYTES
            if take <= 0:
                continue
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, take)
                self.fills += 1
            except OSError:
                pass
            finally:
                os.close(fd)
            end = time.monotonic() + self.rng.uniform(0.5, 2.0)
            while time.monotonic() < end and not self.halt.is_set():
                self._free()
                time.sleep(0.1)
            os.unlink(self.path)

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def mount_small_fs(tmp: str, mib: int) -> tuple[str | None, str | None]:
    """(the mounted data directory, None) or (None, why it could not be mounted)."""
    path = os.path.join(tmp, "data")
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(mib)}m,mode=0700", "tmpfs", path],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if r.returncode != 0:
        return None, (r.stderr or r.stdout).strip() or f"mount exited {r.returncode}"
    return path, None


def strike(broker: Broker, readers: list[Reader], rng: random.Random) -> int:
    """One random blow; returns the processes killed."""
    roll = rng.random()
    if roll < 0.12:  # the supervisor; sometimes its successor too, during its recovery
        broker.kill_supervisor()
        broker.start(wait=False)
        if rng.random() < 0.4:
            time.sleep(rng.uniform(0.05, 0.6))
            if broker.b.proc.poll() is None:
                broker.kill_supervisor()
                broker.start(wait=False)
                broker.b.wait_ready()
                broker.wait_roles()
                return 2
        broker.b.wait_ready()
        broker.wait_roles()
        return 1
    if roll < 0.3:
        return int(rng.choice(readers).kill())
    pids = broker.role_pids()
    victims = [r for r in pids if r != "metrics" and pids[r]]
    count = 2 if roll > 0.85 else 1
    killed = 0
    for role in rng.sample(victims, min(count, len(victims))):
        try:
            os.kill(pids[role], signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def kill_during_stop(broker: Broker, rng: random.Random) -> int:
    pids = broker.role_pids()
    broker.b.proc.send_signal(signal.SIGTERM)
    time.sleep(rng.uniform(0.0, 0.3))
    killed = 0
    role = rng.choice([r for r in pids if pids[r]]) if pids else None
    if role is not None:
        try:
            os.kill(pids[role], signal.SIGKILL)
            killed = 1
        except ProcessLookupError:
            pass
    try:
        broker.b.proc.wait(60)
    except subprocess.TimeoutExpired:
        broker.b.proc.kill()
        broker.b.proc.wait()
    broker.b.killed()
    return killed
