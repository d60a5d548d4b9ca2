"""What an operator attaches to a running broker while `bench e2e` measures it (`Observer`):
Prometheus scraping its exporter every second, and `shmbroker top` in a pseudo-terminal."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

SCRAPE_SECONDS = 1.0
EXPORTED_WAIT_SECONDS = 10.0


class Observer:
    """What an operator attaches to a running broker: Prometheus scraping its exporter every second
    (a thread here), and `shmbroker top` in a pseudo-terminal (its screen is read and dropped)."""

    def __init__(self, data_dir: str):
        import pty
        import subprocess
        import sys
        import threading

        from ..observe.watch import BrokerView

        self.addr = json.loads((Path(data_dir) / "broker.json").read_text())["metrics_addr"]
        view = BrokerView.attach(data_dir)
        try:
            self.exporter_pid = next(p["pid"] for p in view.snapshot()["processes"] if p["role"] == "metrics")
        finally:
            view.close()
        self.scrapes = 0
        self.scrape_seconds_max = 0.0
        self.top_bytes = 0
        self.scrape_errors: list[str] = []
        self._stop = threading.Event()
        self._scraper = threading.Thread(target=self._scrape_loop, daemon=True)
        self._scraper.start()
        self._master, slave = pty.openpty()
        _set_window(slave, 50, 160)
        env = dict(os.environ, TERM="xterm-256color")
        self.top = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "top", "--data-dir", data_dir],
                                    stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self._reader = threading.Thread(target=self._read_loop, daemon=True)
        self._reader.start()

    def wait_attached(self, timeout_seconds: float = 60.0) -> None:
        """Until top drew its first screen and one scrape came back (their start-up is not the cost
        of watching a broker, which is what the observed runs measure)."""
        deadline = time.monotonic() + timeout_seconds
        while self.top_bytes == 0 or self.scrapes == 0:
            if self.scrape_errors:
                raise RuntimeError(f"the exporter did not answer: {self.scrape_errors[0]}")
            if self.top.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"shmbroker top did not attach (exit status {self.top.poll()})")
            time.sleep(0.05)
        self._cpu_from = self._cpu()

    def _cpu(self) -> tuple[float, dict[str, float]]:
        """(monotonic seconds, CPU seconds so far of top, the exporter process and this process's
        scraping and pty-reading threads (the whole bench process: its main thread only waits))."""
        t = os.times()
        return time.monotonic(), {"top": _cpu_seconds(self.top.pid), "exporter": _cpu_seconds(self.exporter_pid),
                                  "scraper": t.user + t.system}

    def scrape(self) -> str:
        import urllib.request

        t0 = time.perf_counter()
        with urllib.request.urlopen(f"http://{self.addr}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        self.scrape_seconds_max = max(self.scrape_seconds_max, time.perf_counter() - t0)
        self.scrapes += 1
        return text

    def _scrape_loop(self) -> None:
        while True:
            try:
                self.scrape()
            except OSError as exc:  # counted, and `finish` fails the run: an unscraped run is not observed
                self.scrape_errors.append(repr(exc))
            if self._stop.wait(SCRAPE_SECONDS):
                return

    def _read_loop(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the terminal closed: top exited
                return
            if not chunk:
                return
            self.top_bytes += len(chunk)

    def finish(self, expected_tokens: int) -> dict:
        """Stop scraping and quit top (q); then the exporter's consumer input tokens, once the GPU
        processes published their last batches, against what the producers sent."""
        import subprocess

        from prometheus_client.parser import text_string_to_metric_families

        t1, cpu1 = self._cpu()
        t0, cpu0 = self._cpu_from
        watch_cpu = {k: round(cpu1[k] - cpu0[k], 3) for k in cpu1}
        self._stop.set()
        self._scraper.join(30)
        deadline = time.monotonic() + 30
        while self.top_bytes == 0 and time.monotonic() < deadline:  # a short run may end before top drew
            time.sleep(0.05)
        while True:
            os.write(self._master, b"q")
            try:
                top_code = self.top.wait(1.0)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() > deadline:
                    raise RuntimeError("shmbroker top did not quit on q") from None
        deadline = time.monotonic() + EXPORTED_WAIT_SECONDS
        while True:
            exported = 0
            for fam in text_string_to_metric_families(self.scrape()):
                exported += sum(int(s.value) for s in fam.samples if s.name == "shmbroker_consumer_input_tokens_total")
            if exported >= expected_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if top_code != 0:
            raise RuntimeError(f"shmbroker top exited with {top_code}")
        if self.scrape_errors:
            raise RuntimeError(f"{len(self.scrape_errors)} scrapes failed: {self.scrape_errors[0]}")
        return {"scrapes": self.scrapes, "scrape_seconds_max": round(self.scrape_seconds_max, 4),
                "top_bytes": self.top_bytes, "exported_tokens": exported,
                "exported_tokens_match": exported == expected_tokens, "watch_cpu_seconds": watch_cpu,
                "watch_cpu_share": round(sum(watch_cpu.values()) / (os.cpu_count() * (t1 - t0)), 4)
                if t1 > t0 else 0.0}

    def close(self) -> None:
        self._stop.set()
        if self.top.poll() is None:
            self.top.kill()
            self.top.wait(10)
        try:
            os.close(self._master)
        except OSError:
            pass


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _set_window(fd: int, rows: int, cols: int) -> None:
    import fcntl
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
