"""A real broker for tests: `shmbroker supervise` in a subprocess, on a temporary data directory.

    with BrokerProc(tmp_path) as broker:       # started, ready (its registry answers)
        p = Producer("a", data_dir=broker.data_dir)
        broker.role_pids()                     # {"ingest-0": pid, "sched": pid, ...}
        broker.kill_role("sched")              # SIGKILL one child; the supervisor restarts it
        broker.kill()                          # SIGKILL the supervisor (its children die with it)
        broker.start()                         # a new supervisor on the same data directory
    # leaving the block stops it with SIGTERM and checks that it exited 0

    @pytest.fixture(scope="module")            # a module's broker fixture
    def broker(tmp_path_factory):
        with serve(tmp_path_factory.mktemp("broker"), "cmd") as b:
            yield b                            # afterwards: exited 0, nothing of its instance in /dev/shm
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .harness import sweep_shm

# Small rings and segments: a test broker needs little memory and starts fast.
SMALL_CONFIG = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 5.0

[[consumers]]
name = "big"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 8192
engine_settings = { mode = "packed", cache_tokens = 262144 }

[[consumers]]
name = "small"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 2048
engine_settings = { mode = "padded", cache_tokens = 65536 }
"""


EPHEMERAL_METRICS = 'metrics_addr = "127.0.0.1:0"\n'


class BrokerProc:
    def __init__(self, tmp_path, config: str | None = SMALL_CONFIG, instance: str | None = None):
        self.tmp = Path(tmp_path)
        self.instance = instance  # None: the configuration's default
        self.data_dir = str(self.tmp / "data")
        # every test broker's exporter on a free port (the default 9464 may be taken on a test machine)
        text = (config or "") if "metrics_addr" in (config or "") else EPHEMERAL_METRICS + (config or "")
        text = text if instance is None else f'instance = "{instance}"\n' + text
        self.config_path = self.tmp / "shmbroker.toml"
        self.config_path.write_text(text)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.tmp / "supervisor.log"
        self.starts = 0

    def start(self, ready_timeout_seconds: float = 60.0) -> BrokerProc:
        cmd = [sys.executable, "-m", "shmbroker.cli", "supervise", "--data-dir", self.data_dir]
        if self.config_path is not None:
            cmd += ["--config", str(self.config_path)]
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.starts += 1
        try:
            self.wait_ready(ready_timeout_seconds)
        except BaseException:  # a broker that never got ready is not left running behind the failed test
            self.proc.kill()
            self.proc.wait()
            raise
        return self

    def info(self) -> dict | None:
        from shmbroker.protocol import request

        try:
            reply = request(self.data_dir, {"op": "info"}, 1.0)
        except (OSError, ValueError):
            return None
        return reply if reply.get("ok") and reply.get("pid") == self.proc.pid else None

    def wait_ready(self, timeout_seconds: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"supervisor exited with {self.proc.returncode}:\n{self.log()}")
            info = self.info()
            if info is not None and all(self.role_pids(info).values()) and self.log_says_up():
                return info
            time.sleep(0.05)
        raise TimeoutError(f"broker not ready in {timeout_seconds} s:\n{self.log()}")

    def log_says_up(self) -> bool:
        """The log holds this supervisor's "up" line: it is written just after the registry starts to
        answer, so a test that reads the log from here on never sees a start it did not make."""
        try:
            return self.log_path.read_text(errors="replace").count("' up in ") >= self.starts
        except FileNotFoundError:
            return False

    def role_pids(self, info: dict | None = None) -> dict[str, int]:
        from shmbroker.control.segment import Control

        info = info or self.info()
        ctl = Control.attach(info["control"], info["roles"])
        try:
            return {role: int(ctl.role(r)[0]) for r, role in enumerate(info["roles"])}
        finally:
            ctl.close()

    def kill_role(self, role: str) -> int:
        pid = self.role_pids()[role]
        os.kill(pid, signal.SIGKILL)
        return pid

    def kill(self) -> None:
        """SIGKILL the supervisor (its children die with it: PR_SET_PDEATHSIG)."""
        self.proc.kill()
        self.proc.wait(30)

    def stop(self, timeout_seconds: float = 60.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout_seconds)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def __enter__(self) -> BrokerProc:
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        code = self.stop()
        if exc_type is None:
            assert code == 0, f"supervisor exited with {code}:\n{self.log()}"


@contextmanager
def serve(tmp_path, prefix: str = "t", config: str | None = SMALL_CONFIG) -> Iterator[BrokerProc]:
    """A started BrokerProc on a fresh instance (`prefix` + a random token, in `broker.instance`);
    after the block it has stopped with exit 0 and left nothing of its instance in /dev/shm."""
    instance = prefix + secrets.token_hex(3)
    broker = BrokerProc(tmp_path, config=config, instance=instance)
    with broker:
        yield broker
    left = sweep_shm(instance)
    assert left == [], f"broker left {left}"
