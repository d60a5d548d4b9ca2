"""The Grafana dashboard and the Prometheus example in tools/grafana/ against a real broker's exporter.

Every metric name the dashboard's queries use must be one the exporter exposes once a broker has
done work on every consumer: a renamed metric breaks this test, not a user's dashboard.
"""

from __future__ import annotations

import json
import re
import secrets
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.jobs import store
from shmbroker.ring.items import STATUS_CODES

pytestmark = pytest.mark.timeout(120)

GRAFANA = Path(__file__).resolve().parents[2] / "tools" / "grafana"
DASHBOARD = GRAFANA / "shmbroker-dashboard.json"
SCRAPE_CONFIG = GRAFANA / "prometheus.yml"
README = GRAFANA.parent.parent / "docs" / "operations.md"  # its table of exported metrics
README_SECTION = "## Exported metrics"
METRIC = re.compile(r"\bshmbroker_[a-z0-9_]+")
QUERY_KEYS = ("expr", "query", "definition")  # panel targets; template variables (object or string query)
RESULT_WAIT_SECONDS = 60.0


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def queries(node) -> list[str]:
    """Every query text in the dashboard: targets' `expr`, template variables' `query` and `definition`."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in QUERY_KEYS and isinstance(value, str):
                found.append(value)
            else:
                found.extend(queries(value))
    elif isinstance(node, list):
        for value in node:
            found.extend(queries(value))
    return found


def referenced_metrics(dashboard: dict) -> set[str]:
    return {name for q in queries(dashboard) for name in METRIC.findall(q)}


def sample_names(exposition: str) -> set[str]:
    """Sample names of a Prometheus text exposition."""
    names = set()
    for line in exposition.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def readme_metrics() -> set[str]:
    """The sample names of the table of exported metrics in docs/operations.md (first column, `shmbroker_` left out)."""
    text = README.read_text()
    section = text[text.index(README_SECTION):]
    section = section[: section.find("\n## ", 1)]
    names = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update("shmbroker_" + n for n in re.findall(r"`([a-z0-9_]+)`", line.split("|")[1]))
    return names


def metrics_addr(data_dir: str) -> str:
    return json.loads((Path(data_dir) / "broker.json").read_text())["metrics_addr"]


def scrape(addr: str) -> str:
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        assert resp.status == 200
        return resp.read().decode()


def sample_values(exposition: str, name: str) -> dict[str, float]:
    """Values of one sample name by its label text (`{consumer="big",model="default"}`)."""
    out = {}
    for line in exposition.splitlines():
        m = re.match(rf"{name}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            out[m.group(1) or ""] = float(m.group(2))
    return out


def submit_round(p: Producer, rng: np.random.Generator, families: int = 4, per_family: int = 10) -> int:
    """Items of a few prefix families, all shorter than both consumers' max_input_len (2048), and one
    of 4000 tokens: longer than `small` takes, within `big`'s 8192. Returns how many were submitted."""
    n = 0
    for _ in range(families):
        prefix = rng.integers(0, 50_000, 600).astype(np.uint32)
        for k in range(per_family):
            p.submit(np.concatenate([prefix, rng.integers(0, 50_000, 20 + 7 * k).astype(np.uint32)]), max_new_tokens=1)
            n += 1
    p.submit(rng.integers(0, 50_000, 4000).astype(np.uint32), max_new_tokens=1)
    return n + 1


def wait_results(p: Producer, count: int) -> None:
    got, deadline = 0, time.monotonic() + RESULT_WAIT_SECONDS
    while got < count:
        assert time.monotonic() < deadline, f"{got} of {count} results in {RESULT_WAIT_SECONDS} s"
        batch = p.take_results(1.0)
        assert np.all(batch.status == STATUS_CODES["ok"]), batch.status
        got += len(batch)


# -- the dashboard's structure ---------------------------------------------------------------------


def test_dashboard_structure():
    d = load_dashboard()
    assert d["schemaVersion"] >= 36 and d["title"] and d["uid"]
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    consumer = variables["consumer"]
    assert consumer["type"] == "query"
    assert re.fullmatch(r"label_values\(shmbroker_consumer_info(\{[^}]*\})?, consumer\)", consumer["definition"])
    assert consumer["includeAll"] and consumer["multi"]

    panels = d["panels"]
    rows = [p for p in panels if p["type"] == "row"]
    titles = [r["title"].lower() for r in rows]
    repeated = [r for r in rows if r.get("repeat") == "consumer"]
    assert len(repeated) == 1, "one row repeated per consumer"
    for name in ("backlog", "ingest", "health"):
        assert any(name in t for t in titles), f"no {name} row in {titles}"

    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    in_consumer_row = False
    for p in panels:
        if p["type"] == "row":
            in_consumer_row = p.get("repeat") == "consumer"
            assert not p.get("panels"), "rows are expanded: their panels follow them"
            continue
        assert p["targets"], f"panel {p['title']!r} has no target"
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], p["title"]
            assert METRIC.search(t["expr"]), (p["title"], t["expr"])
            if in_consumer_row:  # the repeated row shows one consumer each
                assert 'consumer="$consumer"' in t["expr"], (p["title"], t["expr"])
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]


def test_dashboard_uses_the_asked_queries():
    text = "\n".join(queries(load_dashboard()))
    for needle in ("rate(shmbroker_consumer_input_tokens_total", "rate(shmbroker_consumer_items_total",
                   "shmbroker_consumer_padding_waste_ratio", "shmbroker_consumer_cache_hit_ratio",
                   "rate(shmbroker_consumer_shape_switches_total", "shmbroker_consumer_excess_shape_switches_total",
                   "rate(shmbroker_consumer_engine_busy_seconds_total", "shmbroker_consumer_batch_wait_seconds_total",
                   "by (reason) (rate(shmbroker_consumer_failed_items_total", "shmbroker_backlog_pending_tokens",
                   "shmbroker_backlog_pending_items", "shmbroker_backlog_families", "shmbroker_backlog_oldest_item_age_seconds",
                   "shmbroker_backlog_segments", "shmbroker_backlog_disk_bytes", "shmbroker_sched_overflow_items",
                   "rate(shmbroker_ingest_items_total", "rate(shmbroker_ingest_tokens_total",
                   "rate(shmbroker_ingest_appended_bytes_total", "by (reason) (rate(shmbroker_rejected_items_total",
                   "shmbroker_ingest_disk_full_total", "shmbroker_process_up", "shmbroker_process_restarts_total",
                   "shmbroker_process_heartbeat_age_seconds", "shmbroker_ring_used_ratio", "shmbroker_ring_full_total",
                   "shmbroker_broker_up"):
        assert needle in text, needle


# -- every name the dashboard uses is exposed ------------------------------------------------------


def test_dashboard_metrics_are_exposed(tmp_path):
    referenced = referenced_metrics(load_dashboard())
    assert len(referenced) >= 30, sorted(referenced)
    rng = np.random.default_rng(7)
    with BrokerProc(tmp_path, instance="t" + secrets.token_hex(4)) as broker, \
            Producer("dashboard", data_dir=broker.data_dir) as p:
        addr = metrics_addr(broker.data_dir)
        # a live batch job's files (as `submit --job` writes them before its first item): its metrics
        # are exposed only while a job is live (tests/jobs/test_jobs.py runs real ones)
        store.write_meta(broker.data_dir, store.JobMeta("dashboard-job", "/x.jsonl", "sha256:0", 10, phase="in_progress"))
        for _ in range(5):  # until every consumer ran a batch (the scheduler decides who takes what)
            wait_results(p, submit_round(p, rng))
            text = scrape(addr)
            batches = sample_values(text, "shmbroker_consumer_batches_total")
            if len(batches) == 2 and all(v > 0 for v in batches.values()):
                break
        assert len(batches) == 2 and all(v > 0 for v in batches.values()), batches
        exposed = sample_names(text)
    missing = sorted(referenced - exposed)
    assert not missing, f"the dashboard uses metrics the exporter does not expose: {missing}"
    documented = readme_metrics()
    assert not documented - exposed, f"README documents metrics not exposed: {sorted(documented - exposed)}"
    assert not exposed - documented, f"README's metric table lacks {sorted(exposed - documented)}"


# -- the Prometheus example ------------------------------------------------------------------------


def test_scrape_config_parses():
    text = SCRAPE_CONFIG.read_text()
    assert "\t" not in text, "YAML has no tabs"
    try:
        import yaml
    except ImportError:
        yaml = None
    if yaml is not None:
        cfg = yaml.safe_load(text)
        jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
        job = jobs["shmbroker"]
        assert job.get("scrape_interval", cfg.get("global", {}).get("scrape_interval")) == "5s"
        assert job["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
        return
    # without PyYAML: the lines that matter, at the right nesting
    lines = [ln.split("#", 1)[0].rstrip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    assert "scrape_configs:" in lines
    assert re.search(r"^  - job_name: shmbroker$", "\n".join(lines), re.M)
    assert re.search(r"^    scrape_interval: 5s$", "\n".join(lines), re.M)
    assert re.search(r"^      - targets: \[\"127\.0\.0\.1:9464\"\]$", "\n".join(lines), re.M)
    for ln in lines:  # every line a key, a list item or a continuation: indentation in steps of two
        assert (len(ln) - len(ln.lstrip(" "))) % 2 == 0, ln
        assert re.match(r"^ *(- )?[a-z_]+:( .*)?$", ln), ln
