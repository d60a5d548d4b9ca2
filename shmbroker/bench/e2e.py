"""`shmbroker bench e2e`: the whole broker, in processes, against a `multiprocessing.Queue` pipeline.

The broker runs as `shmbroker supervise` does (a subprocess: supervisor, ingest, scheduler,
results, one GPU process per consumer of the default configuration) on a fresh data directory,
with the default fsync policy and the simulated engine in zero-cost mode (it returns at once, so
the broker is what is measured). Two producer processes each submit `items` 256-token items
(`submit_many` in chunks of CHUNK) while they read their results (`take_results`); every item
must come back exactly once with an ok status. With `--options` every item carries SHARED_OPTIONS
(one set of request options, as a job's items do): what carrying them costs. With `--schema` the
runs that would be observed instead carry, besides, a reference to one JSON schema (SHARED_SCHEMA,
stored once as a payload and read once by the GPU process): `schema_items_per_s` and
`schema_vs_plain` against the plain runs, alternated in the same run. Figures:

- items_per_s, tokens_per_s: items over the time from the first submit to the last result;
- submit_to_result_us_p50/p99: from the submit call that sent an item to its result's arrival;
- disk_write_bytes_per_s: the disk's sequential write bandwidth, measured in the same run
  (DISK_PROBE_BYTES written in 4 MiB pieces, fdatasync every 16 MiB, as the backlog does);
  disk_bound_items_per_s: that over the bytes one item costs on disk (its backlog record and its
  result record), so a reader sees which limit holds;
- mpqueue_items_per_s: the same pipeline shape (producers -> one dispatcher -> two workers ->
  results) on `multiprocessing.Queue` (`mpqueue.py`), in the same run;
- observed_items_per_s, observed_vs_plain: the cost of watching. After one uncounted warm-up run
  the broker runs `2 × pairs` times on fresh data directories, in the order plain, observed,
  observed, plain, ... (so a drift of the machine falls on both alike); an observed run has its
  Prometheus exporter scraped every second (`Observer`) and `shmbroker top` attached in a
  pseudo-terminal the whole time (both started before the clock).
  items_per_s and the latencies are the median plain run's; observed_items_per_s the median
  observed run's; observed_vs_plain their ratio (the target: at least 0.95);
- exported_tokens, exported_tokens_match: the consumers' input tokens on the exporter's last
  scrape of the last observed run, against what the producers sent (items × tokens_per_item).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..request.options import encode, parse_options
from ..ring.wire import res_bytes
from ..spill.layout import record_bytes
from . import mpqueue
from .broker import ZERO_COST_CONSUMERS, BenchBroker

TOKENS = 256
CHUNK = 1024
MAX_NEW_TOKENS = 1
# `--options`: what every item carries (a job's usual set; the zero-cost engine honours and ignores it)
SHARED_OPTIONS = {"temperature": 0.7, "top_p": 0.95, "seed": 1234, "stop_token_ids": [2]}
# `--schema`: every item references one JSON schema (a payload stored once; the engine reads it once)
SHARED_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": [f"field{k}" for k in range(24)],
    "properties": {f"field{k}": {"type": "string", "description": f"the record's field number {k}"} for k in range(24)}}}}}
DISK_PROBE_BYTES = 256 << 20
# what an observed run adds (`Observer.finish`); reported from the last observed run
OBSERVER_FIELDS = ("scrapes", "scrape_seconds_max", "top_bytes", "exported_tokens", "exported_tokens_match",
                   "watch_cpu_seconds", "watch_cpu_share")

def _producer(index: int, data_dir: str, items: int, conn, options: dict | None = None) -> None:
    from ..client.producer import Producer
    from ..ring.items import SEQ_MASK

    rng = np.random.default_rng(index)
    prefixes = rng.integers(0, 32_000, size=(64, 64), dtype=np.uint32)
    flat = np.empty(CHUNK * TOKENS, np.uint32)
    rows = flat.reshape(CHUNK, TOKENS)
    rows[:, 64:] = rng.integers(0, 32_000, size=(CHUNK, TOKENS - 64), dtype=np.uint32)
    offsets = np.arange(CHUNK + 1, dtype=np.int64) * TOKENS
    sent_ns = np.zeros(items, np.int64)
    latency_ns = np.zeros(items, np.int64)
    got = 0
    from ..supervisor.warmup import warm_rings

    warm_rings()  # the client's kernels in memory before the clock starts, as the broker's are
    with Producer(f"bench{index}", data_dir=data_dir) as p:
        conn.send("ready")
        conn.recv()
        base = p.next_item_id & ~SEQ_MASK
        t0 = time.perf_counter_ns()
        done = 0
        while done < items or got < items:
            if done < items:
                n = min(CHUNK, items - done)
                rows[:n, :64] = prefixes[(done // CHUNK + np.arange(n)) % 64]
                now = time.perf_counter_ns()
                p.submit_many(flat[: n * TOKENS], offsets[: n + 1], max_new_tokens=MAX_NEW_TOKENS, options=options)
                sent_ns[done : done + n] = now
                done += n
            while True:
                batch = p.take_results(0.0 if done < items else 0.05)
                if len(batch) == 0:
                    break
                k = (batch.item_ids - np.uint64(base)).astype(np.int64)
                if (k < 0).any() or (k >= items).any() or (batch.status != 0).any():
                    raise AssertionError("a foreign or failed result")
                latency_ns[k] = time.perf_counter_ns() - sent_ns[k]
                got += len(batch)
            if done >= items and time.perf_counter_ns() - t0 > 600e9:
                raise TimeoutError(f"producer {index}: {got} of {items} results after 600 s")
        t1 = time.perf_counter_ns()
    conn.send((t0, t1, latency_ns))


def disk_write_bandwidth(directory: str, total: int = DISK_PROBE_BYTES) -> float:
    """Bytes per second of sequential writes with an fdatasync every 16 MiB."""
    path = Path(directory) / "disk-probe"
    chunk = np.random.default_rng(0).integers(0, 255, size=4 << 20, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, chunk)
            if written % (16 << 20) == 0:
                os.fdatasync(fd)
        os.fdatasync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return written / seconds


def run(items_per_producer: int = 500_000, *, mpqueue_items: int = 40_000, scale: float = 1.0,
        data_dir: str | None = None, pairs: int = 4, options: bool = False, schema: bool = False) -> dict:
    items = max(CHUNK, int(items_per_producer * scale))
    shared = SHARED_OPTIONS if options else None
    # the runs of the second kind: observed, or with `schema` the same items referencing SHARED_SCHEMA
    second = {**(shared or {}), **SHARED_SCHEMA} if schema else shared
    tmp = tempfile.mkdtemp(prefix="shmb-e2e-", dir=data_dir)
    try:
        disk_bw = disk_write_bandwidth(tmp, int(DISK_PROBE_BYTES * min(1.0, max(scale, 0.125))))
        runs: dict[bool, list] = {False: [], True: []}
        warm = os.path.join(tmp, "warm")
        os.mkdir(warm, 0o700)
        _run_broker(warm, max(CHUNK, items // 4), options=shared)  # not counted: a first run in a fresh process is slower
        shutil.rmtree(warm, ignore_errors=True)
        for k in range(2 * pairs):
            observed = k % 4 in (1, 2)  # plain, observed, observed, plain, ...
            run_dir = os.path.join(tmp, f"run{k}")
            os.mkdir(run_dir, 0o700)
            runs[observed].append(_run_broker(run_dir, items, observe=observed and not schema,
                                              options=second if observed else shared))
            shutil.rmtree(run_dir, ignore_errors=True)
        out = _median_run(runs[False])
        watched = _median_run(runs[True])
        out["plain_runs_items_per_s"] = [r["items_per_s"] for r in runs[False]]
        out["observed_runs_items_per_s"] = [r["items_per_s"] for r in runs[True]]
        if schema:  # the second kind's runs were the schema's, not observed
            out["schema_runs_items_per_s"] = out.pop("observed_runs_items_per_s")
            out["schema_items_per_s"] = watched["items_per_s"]
            out["schema_vs_plain"] = round(watched["items_per_s"] / out["items_per_s"], 3)
            out["schema_option_words"] = int(encode(parse_options(second)).size)
        else:
            out["observed_items_per_s"] = watched["items_per_s"]
            out["observed_vs_plain"] = round(watched["items_per_s"] / out["items_per_s"], 3)
            last = runs[True][-1]
            out.update({key: last[key] for key in OBSERVER_FIELDS})
        out["options"] = shared
        out["disk_write_bytes_per_s"] = round(disk_bw, 1)
        option_words = encode(parse_options(shared)).size if shared else 0
        per_item = record_bytes(TOKENS + option_words) + res_bytes(MAX_NEW_TOKENS)
        out["disk_bytes_per_item"] = per_item
        out["disk_bound_items_per_s"] = round(disk_bw / per_item, 1)
        base = mpqueue.run(max(1000, int(mpqueue_items * scale)) // 2)
        out.update(base)
        out["vs_mpqueue"] = round(out["items_per_s"] / base["mpqueue_items_per_s"], 2)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _median_run(runs: list[dict]) -> dict:
    by_speed = sorted(runs, key=lambda r: r["items_per_s"])
    out = dict(by_speed[(len(by_speed) - 1) // 2])
    out["items_per_s"] = round(statistics.median(r["items_per_s"] for r in runs), 1)
    out["tokens_per_s"] = round(out["items_per_s"] * TOKENS, 1)
    for key in OBSERVER_FIELDS:
        out.pop(key, None)
    return out


def _run_broker(tmp: str, items: int, *, observe: bool = False, options: dict | None = None) -> dict:
    broker = BenchBroker(tmp, f'instance = "e2e{os.getpid()}"\n' + ZERO_COST_CONSUMERS)
    data = broker.data_dir
    ctx = mp.get_context("fork")
    procs, conns = [], []
    observer = None
    try:
        broker.wait_ready()
        for i in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_producer, args=(i, data, items, child, options), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("a producer did not connect")
            c.recv()
        if observe:  # after the producers forked: they inherit neither its threads nor its terminal
            observer = Observer(data)
            observer.wait_attached()  # top started, drew, and the exporter answered: then the clock
        for c in conns:
            c.send("go")
        reports = []
        for c, proc in zip(conns, procs):
            while not c.poll(1.0):
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"producer exited with {proc.exitcode}")
            reports.append(c.recv())
        t0 = min(r[0] for r in reports)
        t1 = max(r[1] for r in reports)
        seconds = (t1 - t0) / 1e9
        lat = np.concatenate([r[2] for r in reports]) / 1000.0
        total = 2 * items
        watched = observer.finish(total * TOKENS) if observer is not None else {}
        return {
            **watched,
            "items_per_s": round(total / seconds, 1),
            "tokens_per_s": round(total * TOKENS / seconds, 1),
            "submit_to_result_us_p50": round(float(np.percentile(lat, 50)), 1),
            "submit_to_result_us_p99": round(float(np.percentile(lat, 99)), 1),
            "items": total,
            "seconds": round(seconds, 3),
            "tokens_per_item": TOKENS,
        }
    finally:
        if observer is not None:
            observer.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        broker.stop()


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
