"""Small runs of the benchmark, the demo and the CLI, so that they cannot rot.

No speed thresholds: shared machines drift. Only shape, positivity and the
benchmarks' own delivery verification are asserted.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shmbroker import cli, demo
from shmbroker.bench import ring as bench_ring
from shmbroker.ring.owner import MANIFEST_FILE

pytestmark = pytest.mark.timeout(60)

SCALE = 0.002
RATE_KEYS = (
    "single_items_per_s",
    "bulk_items_per_s",
    "bulk_tokens_per_s",
    "mpqueue_items_per_s",
    "memcpy_bytes_per_s",
    "producer_attach_seconds",
)


def check_ring_result(result: dict) -> None:
    assert isinstance(result, dict)
    for key in RATE_KEYS:
        value = result[key]
        assert isinstance(value, float), (key, value)
        assert math.isfinite(value) and value > 0, (key, value)
    assert result["verified"] is True
    plan = bench_ring._plan(SCALE)
    assert result["single_items"] == plan["single"]
    assert result["bulk_items"] == plan["bulk_calls"] * bench_ring.BULK_BATCH
    assert result["mpqueue_items"] == plan["mpqueue"]
    # bulk tokens/s is bulk items/s times the item size: the two rates describe one phase
    assert result["bulk_tokens_per_s"] == pytest.approx(result["bulk_items_per_s"] * bench_ring.BULK_TOKENS)


def test_bench_ring_small_run_is_verified():
    check_ring_result(bench_ring.run(scale=SCALE))


def test_cli_bench_ring_json_prints_one_object(capsys):
    assert cli.main(["bench", "ring", "--json", "--scale", str(SCALE)]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.strip()]
    assert len(lines) == 1, out
    check_ring_result(json.loads(lines[0]))


def test_cli_bench_text_output_lists_every_key(capsys, monkeypatch):
    fake = {"single_items_per_s": 1234.5, "verified": True, "cpus": 2}
    seen = {}

    def fake_run(scale):
        seen["scale"] = scale
        return fake

    monkeypatch.setattr(bench_ring, "run", fake_run)
    assert cli.main(["bench", "ring", "--scale", "0.5"]) == 0
    out = capsys.readouterr().out
    assert seen["scale"] == 0.5
    assert "single_items_per_s: 1234.5" in out
    assert "verified: True" in out and "cpus: 2" in out


def test_cli_refuses_unknown_commands_and_benchmarks(capsys):
    for argv in (["bench", "nope"], ["frobnicate"], [], ["bench", "ring", "--scale", "x"]):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
        assert info.value.code == 2
    capsys.readouterr()


def test_demo_small_run_reports_each_producer(tmp_path):
    data = tmp_path / "demo"
    report = demo.run(data_dir=str(data), chat_items=2000, batch_items=300)
    assert set(report) == {"chat", "batch", "backlog"}
    backlog = report.pop("backlog")
    # everything went through the backlog on disk, came back after a reopen, and was drained
    assert backlog["verified"] is True
    assert backlog["recovered_items"] == 2300
    assert backlog["disk_bytes_after_drain"] <= (64 << 20) + (64 << 10)  # one segment per writer
    assert report["chat"]["items"] == 2000
    assert report["batch"]["items"] == 300
    chat_tokens = sum(int(x.size) for x in demo.chat_workload(2000))
    flat, _ = demo.batch_workload(300)
    assert report["chat"]["tokens"] == chat_tokens
    assert report["batch"]["tokens"] == int(flat.size)
    for r in report.values():
        assert r["verified"] is True
        assert r["seconds"] > 0 and r["items_per_s"] > 0 and r["tokens_per_s"] > 0
    # everything the demo created is unlinked and struck from the manifest; the socket is gone
    manifest = json.loads((data / MANIFEST_FILE).read_text())
    assert manifest["segments"] == [] and manifest["doorbells"] == []
    assert not (data / "broker.sock").exists()


def test_cli_warm_succeeds(capsys, monkeypatch, tmp_path):
    # prune_stale() removes cache directories of other kernel sources under the cache root;
    # point the root somewhere private so a concurrent checkout's cache is left alone.
    monkeypatch.setenv("SHMBROKER_NUMBA_CACHE", str(tmp_path / "numba-cache"))
    assert cli.main(["warm"]) == 0
    out = capsys.readouterr().out
    assert "numba kernels ready" in out
    assert not Path(tmp_path / "numba-cache").exists() or list(Path(tmp_path / "numba-cache").iterdir()) == []
