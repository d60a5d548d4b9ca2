"""Small runs of the benchmark, the demo and the CLI, so that they cannot rot.

No speed thresholds: shared machines drift. Only shape, positivity and the
benchmarks' own delivery verification are asserted.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from rich.console import Console

from shmbroker import cli
from shmbroker.bench import ring as bench_ring
from shmbroker.demo import run as demo

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
    report = demo.run(data_dir=str(tmp_path), items=3000)
    # every item came back exactly once, ok, with the simulated engine's tokens, to the producer that sent it
    assert report["verified"] is True
    assert set(report["producers"]) == {"chat", "batch"}
    assert sum(p["items"] for p in report["producers"].values()) == report["items"] == 3000
    for p in report["producers"].values():
        assert p["verified"] is True
        assert p["results"] == p["items"] > 0
        assert p["missing"] == p["duplicates"] == p["foreign"] == p["not_ok"] == p["token_mismatches"] == 0
        assert p["seconds"] > 0 and p["items_per_s"] > 0
    assert report["wall"]["items_per_s"] > 0
    # per-consumer figures from the broker's own counters, for each consumer of the default configuration
    assert set(report["consumers"]) == {"big", "small"}
    for f in [*report["consumers"].values(), report["total"]]:
        assert 0.0 <= f["cache_hit_rate"] <= 1.0
        assert 0.0 <= f["padding_waste"] <= 1.0
        packed = f.get("packed", f.get("mode") == "packed")  # a packed consumer's records are groups for a
        assert 0.0 < f["batch_fill"] <= (float("inf") if packed else 1.0)  # continuous engine: no rectangle
        assert f["excess_shape_switches"] <= f["shape_switches"]
        assert f["modeled_seconds"] > 0 and f["modeled_tokens_per_s"] > 0
        assert f["failed"] == f["guard_violations"] == 0
    assert report["total"]["items"] == 3000 and report["total"]["tokens"] == report["input_tokens"]
    assert report["total"]["makespan_seconds"] == max(f["modeled_seconds"] for f in report["consumers"].values())
    # FIFO feeding of the same workload, beside it
    fifo = report["fifo"]
    assert fifo["items"] == 3000 and fifo["input_tokens"] == report["input_tokens"]
    assert 0.0 <= fifo["cache_hit_rate"] <= fifo["cache_hit_rate_max"] <= 1.0
    assert 0.0 <= fifo["padding_waste"] <= 1.0
    assert fifo["makespan_seconds"] > 0
    assert report["vs_fifo"]["makespan_speedup"] > 0 and report["vs_fifo"]["modeled_seconds_speedup"] > 0
    # the broker stopped cleanly: exit 0, none of its instance's shared memory left, its directory removed
    assert report["exit_code"] == 0 and report["shm_left"] == [] and report["stopped_cleanly"] is True
    assert report["data_dir"] is None and list(tmp_path.iterdir()) == []
    # generation: every item's own output length, each result that many tokens
    assert report["max_new_tokens"] is None
    assert report["output_tokens"] == report["total"]["output_tokens"] > report["items"]
    assert sum(p["output_tokens"] for p in report["producers"].values()) == report["output_tokens"]
    # the engine alone on the same items and consumers, simulated in the same run, and the ratio of the makespans
    alone = report["engine_alone"]
    assert alone["items"] == 3000 and alone["input_tokens"] == report["input_tokens"]
    assert alone["output_tokens"] == report["output_tokens"] == report["fifo"]["output_tokens"]
    assert set(alone["consumers"]) == set(report["consumers"])
    assert alone["makespan_seconds"] > 0
    assert 0.0 <= alone["cache_hit_rate"] <= alone["cache_hit_rate_max"] == fifo["cache_hit_rate_max"]
    ratio = report["vs_engine_alone"]["makespan_ratio"]
    assert ratio == report["total"]["makespan_seconds"] / alone["makespan_seconds"]
    assert report["vs_engine_alone"]["met"] == (ratio <= demo.MAKESPAN_RATIO_MAX)
    # the summary's first lines: one sentence saying what was run and what was measured
    out = io.StringIO()
    demo.print_summary(report, Console(file=out, width=100))
    text = " ".join(out.getvalue().split())
    assert text.startswith(" ".join(report["headline"].split()))
    assert report["headline"].startswith("Ran 3,000 generated prompts (")
    assert report["headline"].endswith(f"modeled makespan {report['total']['makespan_seconds']:,.1f} s vs "
                                       f"{alone['makespan_seconds']:,.1f} s ({ratio:.3f}).")
    assert report["headline"].count(". ") == 0  # one sentence


def test_cli_warm_succeeds(capsys, monkeypatch, tmp_path):
    # prune_stale() removes cache directories of other kernel sources under the cache root;
    # point the root somewhere private so a concurrent checkout's cache is left alone.
    monkeypatch.setenv("SHMBROKER_NUMBA_CACHE", str(tmp_path / "numba-cache"))
    assert cli.main(["warm"]) == 0
    out = capsys.readouterr().out
    assert "numba kernels ready" in out
    assert not Path(tmp_path / "numba-cache").exists() or list(Path(tmp_path / "numba-cache").iterdir()) == []
