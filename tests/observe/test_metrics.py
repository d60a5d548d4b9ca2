"""The Prometheus exporter against a running broker: the numbers it exports are the broker's accounting,
exactly; its address is configured, taken addresses fail the start, it survives its own restart."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.brokerproc import SMALL_CONFIG, BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.config import settings
from shmbroker.control.segment import Control
from shmbroker.control.stats import read_role
from shmbroker.demo.figures import consumer_figures
from shmbroker.observe.watch import BrokerView
from shmbroker.workloads.synthetic import generate

RESULT_SECONDS = 60.0


def scrape(data_dir: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one /metrics scrape of the broker on data_dir."""
    addr = json.loads((Path(data_dir) / "broker.json").read_text())["metrics_addr"]
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def by_consumer(samples: dict, name: str) -> dict[str, float]:
    return {dict(labels)["consumer"]: v for (n, labels), v in samples.items() if n == name}


def _submit_all(p: Producer, wl) -> None:
    lengths = wl.lengths
    for i in range(len(wl)):
        a, b = int(wl.offsets[i]), int(wl.offsets[i + 1])
        prefix = int(wl.prefix_lens[i]) or None
        p.submit(wl.tokens[a:b], max_new_tokens=1, prefix_len=prefix if prefix and prefix < lengths[i] else None)


def _take(p: Producer, n: int) -> np.ndarray:
    status = []
    deadline = time.monotonic() + RESULT_SECONDS
    while sum(len(s) for s in status) < n:
        assert time.monotonic() < deadline, "results did not all arrive"
        batch = p.take_results(0.5)
        status.append(np.asarray(batch.status))
    return np.concatenate(status)


def _gpu_counted(data_dir: str, items: int) -> None:
    """Wait until the GPU processes and the results process published every item (each publishes its
    counters just after handing the results on, so a producer may hold them before they count)."""
    deadline = time.monotonic() + 10
    view = BrokerView.attach(data_dir)
    try:
        while True:
            snap = view.snapshot()
            if sum(c["items"] for c in snap["consumers"].values()) >= items and snap["results"]["results"] >= items:
                break
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        view.close()


def test_exported_numbers_equal_the_broker_accounting_exactly(tmp_path):
    # families with shared prefixes and varied lengths, all within the big consumer's 8192 tokens;
    # items over 2048 can only go to big; the small consumer is padded, so padding is real
    wl = generate(600, seed=11, num_families=12, system_tokens_median=700, turn_tokens_median=300,
                  reply_tokens_median=120, max_len=8000)
    tokens = int(wl.lengths.sum())
    with BrokerProc(tmp_path) as broker:
        with Producer("acct", data_dir=broker.data_dir) as p:
            _submit_all(p, wl)
            status = _take(p, len(wl))
        assert (status == 0).all()
        _gpu_counted(broker.data_dir, len(wl))
        samples = scrape(broker.data_dir)
        info = broker.info()
        cfg = settings.load(broker.config_path, data_dir=broker.data_dir)
        ctl = Control.attach(info["control"], info["roles"], readonly=True)
        try:
            figures = {c.name: consumer_figures(read_role(ctl, info["roles"].index(f"gpu-{c.name}")), c.contract,
                                                c.engine_settings.mode) for c in cfg.consumers}
        finally:
            ctl.close()
        snapshot_view = BrokerView.attach(broker.data_dir)
        try:
            snap = snapshot_view.snapshot()
        finally:
            snapshot_view.close()

    # token and item counts against the workload itself
    exported_tokens = by_consumer(samples, "shmbroker_consumer_input_tokens_total")
    assert sum(exported_tokens.values()) == tokens
    assert sum(by_consumer(samples, "shmbroker_consumer_items_total").values()) == len(wl)
    assert samples[("shmbroker_ingest_tokens_total", (("ingest", "0"),))] == tokens
    assert samples[("shmbroker_ingest_items_total", (("ingest", "0"),))] == len(wl)
    assert samples[("shmbroker_results_total", ())] == len(wl)
    # each consumer's figures: the exporter, `status --json` and the demo's accounting agree exactly
    for name, f in figures.items():
        assert exported_tokens[name] == f["tokens"] == snap["consumers"][name]["tokens"]
        for metric, key in (("shmbroker_consumer_padded_tokens_total", "padded_tokens"),
                            ("shmbroker_consumer_rectangle_tokens_total", "rect_tokens"),
                            ("shmbroker_consumer_cache_hit_blocks_total", "hit_blocks"),
                            ("shmbroker_consumer_cache_queried_blocks_total", "queried_blocks"),
                            ("shmbroker_consumer_shape_switches_total", "shape_switches"),
                            ("shmbroker_consumer_excess_shape_switches_total", "excess_shape_switches"),
                            ("shmbroker_consumer_families_total", "families"),
                            ("shmbroker_consumer_batches_total", "batches")):
            assert by_consumer(samples, metric)[name] == f[key] == snap["consumers"][name][key], (name, metric)
        assert by_consumer(samples, "shmbroker_consumer_cache_hit_ratio")[name] == f["cache_hit_rate"]
        assert snap["consumers"][name]["hit_rate"] == f["cache_hit_rate"]
        if f["rect_tokens"]:
            assert by_consumer(samples, "shmbroker_consumer_padding_waste_ratio")[name] == f["padding_waste"]
            assert snap["consumers"][name]["padding_waste"] == f["padding_waste"]
    assert figures["small"]["rect_tokens"] > 0 and figures["small"]["items"] > 0, "the padded consumer ran"
    assert figures["big"]["queried_blocks"] > 0 and figures["big"]["hit_blocks"] > 0, "prefixes were reused"
    assert samples[("shmbroker_consumer_guard_refusals_total", (("consumer", "big"), ("model", "default")))] == 0


def test_counters_never_go_back_across_a_gpu_restart(tmp_path):
    """The consumer's counters, watched while its process is killed and restarted, only grow."""
    rng = np.random.default_rng(3)
    with BrokerProc(tmp_path) as broker:
        view = BrokerView.attach(broker.data_dir)
        seen: list[tuple[int, int, int]] = []
        try:
            with Producer("restart", data_dir=broker.data_dir) as p:
                n = 0
                for round_ in range(6):
                    for _ in range(50):
                        p.submit(rng.integers(0, 30_000, size=int(rng.integers(600, 1800)), dtype=np.uint32),
                                 max_new_tokens=1)
                        n += 1
                    if round_ == 2:
                        broker.kill_role("gpu-big")
                    deadline = time.monotonic() + 2.0
                    while time.monotonic() < deadline:
                        c = view.snapshot()["consumers"]["big"]
                        seen.append((c["batches"], c["items"], c["tokens"]))
                        time.sleep(0.01)
                _take(p, n)
        finally:
            view.close()
        snap = BrokerView.attach(broker.data_dir)
        try:
            restarts = {x["role"]: x["restarts"] for x in snap.snapshot()["processes"]}
        finally:
            snap.close()
    assert restarts["gpu-big"] >= 1
    arr = np.array(seen)
    assert (np.diff(arr, axis=0) >= 0).all(), "a counter went back"
    assert arr[-1, 1] > 0


def test_a_taken_metrics_addr_fails_the_start_clearly(tmp_path):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    cfg = tmp_path / "shmbroker.toml"
    cfg.write_text(f'instance = "mt{port}"\nmetrics_addr = "127.0.0.1:{port}"\n' + SMALL_CONFIG)
    try:
        out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", str(cfg),
                              "--data-dir", str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    finally:
        taken.close()
    assert out.returncode == 2
    assert f"metrics_addr 127.0.0.1:{port}" in out.stderr and "in use" in out.stderr
    assert not (tmp_path / "data" / "broker.json").exists()


TWO_MODELS = """
[[consumers]]
name = "q"
model = "qwen2"
max_batch_size = 16
max_batch_tokens = 16384
max_input_len = 4096
engine_settings = { mode = "packed", cache_tokens = 65536 }

[[consumers]]
name = "l"
model = "llama-3-8b"
max_batch_size = 16
max_batch_tokens = 16384
max_input_len = 4096
engine_settings = { mode = "padded", cache_tokens = 65536 }
"""


def test_named_models_are_served_and_counted_per_model(tmp_path):
    """Model names whose 32-bit FNV hash had the top bit set ("qwen2", "llama-3-8b") crashed the
    scheduler's index (ids must be below 2^31); the per-model metrics carry the names."""
    from shmbroker.ring.items import model_id

    assert all(0 < model_id(f"model-{i}") < 1 << 31 for i in range(2000))
    rng = np.random.default_rng(8)
    counts = {"qwen2": 30, "llama-3-8b": 20}
    with BrokerProc(tmp_path, config=TWO_MODELS) as broker:
        with Producer("models", data_dir=broker.data_dir) as p:
            for model, n in counts.items():
                for _ in range(n):
                    p.submit(rng.integers(0, 30_000, size=int(rng.integers(50, 900)), dtype=np.uint32),
                             max_new_tokens=1, model=model)
            status = _take(p, sum(counts.values()))
        assert (status == 0).all()
        _gpu_counted(broker.data_dir, sum(counts.values()))
        samples = scrape(broker.data_dir)
    items = {dict(labels)["model"]: v for (n, labels), v in samples.items() if n == "shmbroker_consumer_items_total"}
    assert items == counts
    pending = {dict(labels)["model"]: v for (n, labels), v in samples.items() if n == "shmbroker_backlog_pending_items"}
    assert pending == {"qwen2": 0, "llama-3-8b": 0}


def test_openmetrics_scrape_parses(tmp_path):
    """Prometheus asks for OpenMetrics first; its stricter parser refuses clashing family names."""
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om_families

    with BrokerProc(tmp_path) as broker:
        with Producer("om", data_dir=broker.data_dir) as p:
            p.submit(np.arange(100, dtype=np.uint32), max_new_tokens=1)
            _take(p, 1)
        addr = json.loads((Path(broker.data_dir) / "broker.json").read_text())["metrics_addr"]
        req = urllib.request.Request(f"http://{addr}/metrics",
                                     headers={"Accept": "application/openmetrics-text; version=1.0.0"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
            text = resp.read().decode()
    names = {fam.name for fam in om_families(text)}
    assert "shmbroker_results_parked" in names and "shmbroker_results_parked_now" in names


def test_no_exporter_when_metrics_addr_is_empty(tmp_path):
    with BrokerProc(tmp_path, config='metrics_addr = ""\n' + SMALL_CONFIG) as broker:
        desc = json.loads((Path(broker.data_dir) / "broker.json").read_text())
        assert desc["metrics_addr"] is None
        assert "metrics" not in desc["roles"]
        view = BrokerView.attach(broker.data_dir)
        try:
            assert view.snapshot()["metrics_addr"] is None
        finally:
            view.close()


def test_the_exporter_restarts_on_its_address(tmp_path):
    with BrokerProc(tmp_path) as broker:
        before = scrape(broker.data_dir)
        assert before[("shmbroker_broker_up", ())] == 1
        broker.kill_role("metrics")
        deadline = time.monotonic() + 20
        while True:
            try:
                after = scrape(broker.data_dir)
                break
            except OSError:
                assert time.monotonic() < deadline, "the exporter did not come back"
                time.sleep(0.1)
        restarts = after[("shmbroker_process_restarts_total", (("kind", "metrics"), ("process", "metrics")))]
        assert restarts >= 1
        assert after[("shmbroker_process_up", (("kind", "gpu"), ("process", "gpu-big")))] == 1


def test_metrics_addr_configuration():
    assert settings.load(None, data_dir="/tmp/x").metrics_addr == "127.0.0.1:9464"  # loopback by default
    assert settings.parse({"metrics_addr": "[::1]:9000"}).metrics_addr == "[::1]:9000"
    assert settings.parse_addr("[::1]:9000") == ("::1", 9000)
    for bad in ("9464", "host:", "host:99999", 5):
        with pytest.raises(settings.ConfigError, match="metrics_addr"):
            settings.parse({"metrics_addr": bad})
