"""A real Prometheus server scrapes a real broker: the counters it stores are the exact counts of a known workload.

The `prometheus` binary is found on PATH or installed from Debian's `prometheus` package (as root,
or through `sudo -n`); where neither works the tests are skipped, saying what failed. Prometheus
listens on a free loopback port with its database in the test's temporary directory, and is always
stopped at the end.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import BrokerProc
from test_dashboard import SCRAPE_CONFIG, load_dashboard, metrics_addr, queries

from shmbroker.client.producer import Producer
from shmbroker.ring.items import STATUS_CODES

INSTALL_TIMEOUT_SECONDS = 600.0
pytestmark = pytest.mark.timeout(int(INSTALL_TIMEOUT_SECONDS) + 180)  # the first test's set-up may install the package

READY_TIMEOUT_SECONDS = 30.0
CONVERGE_TIMEOUT_SECONDS = 30.0
RESULT_WAIT_SECONDS = 60.0
LENGTHS = [40 + 37 * i for i in range(40)]  # 40 items, all shorter than both consumers' max_input_len (2048)


# -- the binary ------------------------------------------------------------------------------------


def _apt(args: list[str], prefix: list[str], deadline: float) -> subprocess.CompletedProcess:
    timeout = max(1.0, deadline - time.monotonic())
    cmd = [*prefix, "env", "DEBIAN_FRONTEND=noninteractive", "apt-get", *args]
    return subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)


def _tail(proc: subprocess.CompletedProcess, lines: int = 4) -> str:
    return " | ".join((proc.stdout + proc.stderr).strip().splitlines()[-lines:])


def install_prometheus() -> str | None:
    """Install Debian's `prometheus` package; None once installed, else why it could not be."""
    if shutil.which("apt-get") is None:
        return "no apt-get on this machine"
    if os.geteuid() == 0:
        prefix = []
    elif shutil.which("sudo") is not None:
        prefix = ["sudo", "-n"]
    else:
        return "not root and no sudo to run apt-get with"
    deadline = time.monotonic() + INSTALL_TIMEOUT_SECONDS
    install = ["install", "-y", "--no-install-recommends", "prometheus"]
    try:
        got = _apt(install, prefix, deadline)
        if got.returncode != 0:
            text = got.stdout + got.stderr
            if any(s in text for s in ("Unable to locate package", "has no installation candidate", "Failed to fetch")):
                update = _apt(["update"], prefix, deadline)  # the package lists are missing or stale
                if update.returncode != 0:
                    return f"`apt-get update` exited {update.returncode}: {_tail(update)}"
                got = _apt(install, prefix, deadline)
        if got.returncode != 0:
            return f"`apt-get {' '.join(install)}` exited {got.returncode}: {_tail(got)}"
    except subprocess.TimeoutExpired:
        return f"apt-get did not finish in {INSTALL_TIMEOUT_SECONDS:.0f} s"
    except OSError as exc:
        return f"apt-get could not run: {exc}"
    return None


@pytest.fixture(scope="module")
def prometheus_bin() -> str:
    found = shutil.which("prometheus")
    if found is None:
        t0 = time.monotonic()
        why = install_prometheus()
        found = shutil.which("prometheus")
        if found is None:
            why = why or "the package installed but no `prometheus` is on PATH"
            pytest.skip(f"no Prometheus server: not on PATH, and installing Debian's `prometheus` package failed: {why}")
        print(f"installed Debian's prometheus package in {time.monotonic() - t0:.1f} s")
    return found


# -- the server ------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusProc:
    def __init__(self, binary: str, tmp: Path, target: str):
        self.tmp = tmp
        self.config = tmp / "prometheus.yml"
        self.config.write_text("global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n"
                               "scrape_configs:\n  - job_name: shmbroker\n    scrape_interval: 1s\n"
                               f"    static_configs:\n      - targets: [\"{target}\"]\n")
        self.port = free_port()
        self.log_path = tmp / "prometheus.log"
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen([binary, f"--config.file={self.config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                      f"--web.listen-address=127.0.0.1:{self.port}"],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def get(self, path: str, **params) -> bytes:
        url = f"http://127.0.0.1:{self.port}{path}"
        if params:
            url += "?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.read()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"prometheus exited with {self.proc.returncode}:\n{self.log()}"
            try:
                self.get("/-/ready")
                return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"prometheus not ready in {READY_TIMEOUT_SECONDS} s:\n{self.log()}")

    def query(self, expr: str) -> dict:
        try:
            reply = json.loads(self.get("/api/v1/query", query=expr))
        except urllib.error.HTTPError as exc:  # 400 for a bad expression: its body says why
            reply = json.loads(exc.read())
        return reply

    def scalar(self, expr: str) -> float | None:
        """The value of a one-series query; None while it has no series."""
        reply = self.query(expr)
        assert reply["status"] == "success", (expr, reply)
        result = reply["data"]["result"]
        return float(result[0]["value"][1]) if result else None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)


def wait_for(prom: PrometheusProc, expected: dict[str, float]) -> dict[str, float | None]:
    """Poll until every query equals its expected value (or the time is up); the last values seen."""
    deadline = time.monotonic() + CONVERGE_TIMEOUT_SECONDS
    while True:
        seen = {expr: prom.scalar(expr) for expr in expected}
        if seen == expected or time.monotonic() > deadline:
            return seen
        time.sleep(0.25)


# -- the tests -------------------------------------------------------------------------------------


def test_prometheus_stores_the_exact_counts(prometheus_bin, tmp_path):
    rng = np.random.default_rng(11)
    prefix = rng.integers(0, 50_000, 32).astype(np.uint32)  # one shared prefix: cache hits too
    items = [np.concatenate([prefix, rng.integers(0, 50_000, n - prefix.size).astype(np.uint32)]) for n in LENGTHS]
    tokens = sum(LENGTHS)
    prom = None
    with BrokerProc(tmp_path, instance="t" + secrets.token_hex(4)) as broker:
        try:
            prom = PrometheusProc(prometheus_bin, tmp_path, metrics_addr(broker.data_dir))
            prom.wait_ready()
            assert wait_for(prom, {'up{job="shmbroker"}': 1.0}) == {'up{job="shmbroker"}': 1.0}, prom.log()
            with Producer("prometheus", data_dir=broker.data_dir) as p:
                for item in items:
                    p.submit(item, max_new_tokens=1)
                got, deadline = 0, time.monotonic() + RESULT_WAIT_SECONDS
                while got < len(items):
                    assert time.monotonic() < deadline, f"{got} of {len(items)} results in {RESULT_WAIT_SECONDS} s"
                    batch = p.take_results(1.0)
                    assert np.all(batch.status == STATUS_CODES["ok"]), batch.status
                    got += len(batch)
            expected = {
                "sum(shmbroker_consumer_input_tokens_total)": float(tokens),
                "sum(shmbroker_ingest_tokens_total)": float(tokens),
                "sum(shmbroker_consumer_items_total)": float(len(items)),
                "sum(shmbroker_consumer_ok_items_total)": float(len(items)),
                "sum(shmbroker_ingest_items_total)": float(len(items)),
                "sum(shmbroker_results_total)": float(len(items)),
            }
            seen = wait_for(prom, expected)
            assert seen == expected, f"after {CONVERGE_TIMEOUT_SECONDS} s Prometheus holds {seen}"

            # the dashboard's queries are valid PromQL and find the broker's series
            consumers = json.loads(prom.get("/api/v1/label/consumer/values", **{"match[]": "shmbroker_consumer_info"}))
            assert sorted(consumers["data"]) == ["big", "small"], consumers
            for expr in queries(load_dashboard()):
                expr = expr.replace("$consumer", "big").replace("$instance", ".*")
                if expr.startswith("label_values("):
                    continue  # a Grafana function, not PromQL: its series are the label look-up above
                reply = prom.query(expr)
                assert reply["status"] == "success", (expr, reply)
            assert prom.scalar('sum(rate(shmbroker_consumer_input_tokens_total{consumer=~".*"}[1m]))') > 0
        finally:
            if prom is not None:
                prom.stop()


def test_example_scrape_config_passes_promtool(prometheus_bin):
    promtool = shutil.which("promtool") or str(Path(prometheus_bin).with_name("promtool"))
    if not Path(promtool).exists():
        pytest.skip("no promtool beside prometheus")
    got = subprocess.run([promtool, "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stdout + got.stderr
