"""A broker for a benchmark: `shmbroker supervise` in a subprocess on a scratch directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

READY_SECONDS = 120.0

# The default configuration's two consumers (`settings.default_consumers`) on the simulated engine in
# zero-cost mode: every batch returns at once, so a benchmark measures the broker, not a model.
ZERO_COST_CONSUMERS = """
[[consumers]]
name = "big"
max_batch_size = 256
max_batch_tokens = 131072
max_input_len = 131072
engine_settings = { mode = "packed", cache_tokens = 2097152, zero_cost = true }

[[consumers]]
name = "small"
max_batch_size = 64
max_batch_tokens = 16384
max_input_len = 16384
engine_settings = { mode = "packed", cache_tokens = 262144, zero_cost = true }
"""


class BenchBroker:
    """Started with `config` (TOML text) on `<tmp>/data`; `wait_ready()` returns the registry's info."""

    def __init__(self, tmp: str, config: str):
        self.data_dir = os.path.join(tmp, "data")
        self.config_path = os.path.join(tmp, "shmbroker.toml")
        if "metrics_addr" not in config:  # the exporter on a free port: the default one may be taken
            config = 'metrics_addr = "127.0.0.1:0"\n' + config
        Path(self.config_path).write_text(config)
        self.log_path = os.path.join(tmp, "supervisor.log")
        self._log = open(self.log_path, "wb")
        self.started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", self.config_path,
                                      "--data-dir", self.data_dir], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, poll_seconds: float = 0.05) -> dict:
        from ..protocol import request

        while True:
            try:
                reply = request(self.data_dir, {"op": "info"}, 1.0)
                if reply.get("ok"):
                    return reply
            except (OSError, ValueError):  # no broker yet, or one that died mid-reply
                pass
            if self.proc.poll() is not None or time.perf_counter() - self.started > READY_SECONDS:
                raise RuntimeError("the broker did not start: " + Path(self.log_path).read_text(errors="replace")[-2000:])
            time.sleep(poll_seconds)

    def wait_engine(self, view, role: str, timeout_seconds: float) -> None:
        """Until GPU process `role` runs its loop (a heartbeat after its start: its engine is built);
        a broker that exits or an engine not built in time is an error naming the log's tail."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            p = next((x for x in view.snapshot()["processes"] if x["role"] == role), None)
            if p is not None and p["alive"] and p["heartbeat_age_seconds"] is not None \
                    and p["heartbeat_age_seconds"] < p["uptime_seconds"]:
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the broker's {role} did not build its engine in {timeout_seconds:.0f} s: "
                                   + Path(self.log_path).read_text(errors="replace")[-3000:])
            time.sleep(0.1)

    def role_pids(self, info: dict) -> dict[str, int]:
        """Each role's pid, from the control segment the registry's `info` names."""
        from ..control.segment import Control

        ctl = Control.attach(info["control"], info["roles"])
        try:
            return {role: int(ctl.role(r)[0]) for r, role in enumerate(info["roles"])}
        finally:
            ctl.close()

    def killed(self) -> None:
        """The supervisor was SIGKILLed and reaped by the caller: its log file is closed."""
        self._log.close()

    def stop(self) -> int:
        """SIGTERM, wait (SIGKILL after 60 s); the exit status."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self._log.close()
        return code


@dataclass
class CardRun:
    """One workload through a broker of one GPU process ("card"): the seconds from the first submit
    to the last result, the results' status codes and generated token counts, and the card's
    counters (`watch.BrokerView` snapshot) before the submit and once they count every item."""

    seconds: float
    status: np.ndarray
    num_tokens: np.ndarray
    card_before: dict
    card: dict
    sched_peak_rss_mb: float = 0.0  # the scheduler's peak resident memory (VmHWM) at the end


def peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (VmHWM), in MiB; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def through_one_card(tmp: str, config: str, producer: str, flat, offsets, max_new_tokens,
                     timeout_seconds: float, options: list | None = None, prefix_len=None) -> CardRun:
    """Start a broker of `config` (one consumer named "card") under `tmp`, wait until its engine is
    built, submit the items in one `submit_many` (with `options`, each item's own request options:
    one `submit` each), take every result back, stop the broker."""
    from ..client.producer import Producer
    from ..observe.watch import BrokerView

    os.makedirs(tmp, exist_ok=True)
    broker = BenchBroker(tmp, config)
    n = len(offsets) - 1
    try:
        info = broker.wait_ready()
        with Producer(producer, data_dir=broker.data_dir) as p:
            view = BrokerView.attach(broker.data_dir)
            try:
                deadline = time.monotonic() + timeout_seconds  # the engine built and every result back
                broker.wait_engine(view, "gpu-card", timeout_seconds)
                before = view.snapshot()["consumers"]["card"]
                t0 = time.perf_counter()
                if options is None:
                    p.submit_many(flat, offsets, max_new_tokens=max_new_tokens, prefix_len=prefix_len)
                else:
                    for i, o in enumerate(options):
                        p.submit(flat[offsets[i] : offsets[i + 1]], max_new_tokens=int(max_new_tokens[i]), options=o)
                status, num_tokens = [], []
                got = 0
                while got < n:
                    batch = p.take_results(1.0)
                    got += len(batch)
                    status.append(batch.status)
                    num_tokens.append(batch.num_tokens)
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{got} of {n} results through the broker")
                seconds = time.perf_counter() - t0
                while True:  # the consumer's counters follow its results
                    card = view.snapshot()["consumers"]["card"]
                    if card["items"] - before["items"] >= n or time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
                rss = peak_rss_mb(broker.role_pids(info)["sched"])
            finally:
                view.close()
    finally:
        broker.stop()
    return CardRun(seconds, np.concatenate(status), np.concatenate(num_tokens), before, card, rss)
