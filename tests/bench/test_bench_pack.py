"""Small runs of `shmbroker bench pack`, so that the benchmark cannot rot.

No speed thresholds: only the JSON interface and invariants that hold on any
workload (docs/design.md "Words"), plus the seeded generator's headline: shape-pure
packing beats FIFO feeding, and with the workload's own output lengths a
packed engine fed by the broker beats the engine alone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shmbroker.bench import pack

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
SCALE = 0.02
GENERATOR_ITEMS = 400  # max(200, int(20_000 x SCALE))

ENGINE_MODES = ("padded", "packed")
ACCOUNTING = ("padding_waste", "batch_fill", "slot_fill", "cache_hit_rate", "cache_hit_rate_max",
              "excess_shape_switches", "guard_refusals", "modeled_seconds", "makespan_seconds", "lower_bound_seconds",
              "lower_bound_strict_seconds", "failed_too_long")
BASELINES = ("fifo", "engine_alone")
BROKER_ONLY = ("decision_us_p50", "decision_us_p99", "index_bytes_per_item")
CONSUMER_FIELDS = ("batches", "items", "input_tokens", "computed_tokens", "padding_waste", "batch_fill",
                   "slot_fill", "cache_hit_rate", "shape_switches", "families_served", "excess_shape_switches",
                   "modeled_seconds", "engine_steps", "decode_tokens", "failed_too_long")
CONSUMERS = ("big", "small")


@pytest.fixture(scope="module")
def offline():
    return pack.run(scale=SCALE)


@pytest.fixture(scope="module")
def streaming():
    return pack.run(scale=SCALE, mode="streaming")


@pytest.fixture(scope="module")
def generating():
    """The generator's own output lengths (max_new_tokens 0: the workload's)."""
    return pack.run(scale=SCALE, max_new_tokens=0)


def check_interface(result: dict, mode: str) -> None:
    assert result["mode"] == mode
    assert set(result["consumers"]) == set(CONSUMERS)
    for engine_mode in ENGINE_MODES:
        figures = result[engine_mode]
        for key in ACCOUNTING + BROKER_ONLY:
            assert isinstance(figures[key], (int, float)), (engine_mode, key, figures.get(key))
        for baseline in BASELINES:
            for key in ACCOUNTING:
                assert isinstance(figures[baseline][key], (int, float)), (engine_mode, baseline, key)
        assert isinstance(figures["makespan_vs_engine_alone"], float)
        for feeding in (figures, *(figures[b] for b in BASELINES)):
            assert set(feeding["consumers"]) == set(CONSUMERS)
            for name in CONSUMERS:
                for key in CONSUMER_FIELDS:
                    assert isinstance(feeding["consumers"][name][key], (int, float)), (engine_mode, name, key)


def check_invariants(result: dict, *, streaming: bool, decode: bool = False) -> None:
    """decode: the items generate more than one token (lower_bound_seconds bounds only the feedings
    that keep every consumer decoding; lower_bound_strict_seconds bounds any)."""
    items = result["items"]
    assert items > 0
    for engine_mode in ENGINE_MODES:
        broker = result[engine_mode]
        assert broker["guard_refusals"] == 0, engine_mode
        if not streaming:  # streaming: a drained family gets new arrivals, so coming back to it is no excess
            assert broker["excess_shape_switches"] == 0, engine_mode
        assert 0 < broker["decision_us_p50"] <= broker["decision_us_p99"]
        assert broker["index_bytes_per_item"] > 0
        for who, figures in (("shmbroker", broker), *((b, broker[b]) for b in BASELINES)):
            where = (engine_mode, who)
            consumers = figures["consumers"].values()
            assert sum(c["items"] for c in consumers) + figures["failed_too_long"] == items, where
            assert figures["failed_too_long"] == sum(c["failed_too_long"] for c in consumers), where
            assert figures["items"] == sum(c["items"] for c in consumers), where
            assert figures["modeled_seconds"] == pytest.approx(sum(c["modeled_seconds"] for c in consumers),
                                                               abs=1e-3 * len(CONSUMERS)), where
            assert figures["modeled_seconds"] >= figures["lower_bound_strict_seconds"], where
            assert figures["lower_bound_strict_seconds"] <= figures["lower_bound_seconds"] + 1e-3, where
            if not decode:
                assert figures["lower_bound_seconds"] == figures["lower_bound_strict_seconds"], where
                assert figures["modeled_seconds"] >= figures["lower_bound_seconds"], where
            assert figures["makespan_seconds"] >= figures["lower_bound_strict_seconds"] / len(CONSUMERS) - 1e-3, where
            assert 0 < figures["slot_fill"] <= 1, where
            assert figures["cache_hit_rate"] <= figures["cache_hit_rate_max"] + 1e-9, where
            assert 0 <= figures["cache_hit_rate"] <= 1, where
            assert 0 <= figures["padding_waste"] < 1, where
            assert 0 < figures["batch_fill"] <= 1, where
            for c in consumers:
                assert c["excess_shape_switches"] >= 0, where
                assert 0 <= c["batch_fill"] <= 1, where
            if engine_mode == "packed":  # a packed engine pads nothing
                assert figures["padding_waste"] == 0, where
                assert all(c["padding_waste"] == 0 for c in consumers), where
        if streaming:
            assert broker["max_wait_seconds"] >= 0
            assert broker["max_wait_configured_seconds"] > 0
            assert broker["idle_with_overdue"] == 0, engine_mode
            assert broker["fifo"]["max_wait_seconds"] >= 0
            assert broker["engine_alone"]["max_wait_seconds"] >= 0


def test_offline_interface(offline):
    check_interface(offline, "offline")
    assert offline["items"] == GENERATOR_ITEMS
    assert offline["workload"].startswith("generator(")


def test_offline_invariants(offline):
    check_invariants(offline, streaming=False)


def test_offline_packing_beats_fifo_on_the_generator(offline):
    padded, packed = offline["padded"], offline["packed"]
    assert padded["padding_waste"] < padded["fifo"]["padding_waste"]
    for figures in (padded, packed):
        assert figures["cache_hit_rate"] > figures["fifo"]["cache_hit_rate"]
        assert figures["modeled_seconds"] < figures["fifo"]["modeled_seconds"]
        assert figures["modeled_vs_fifo"] == pytest.approx(
            figures["modeled_seconds"] / figures["fifo"]["modeled_seconds"], abs=1e-3)


def test_decode_interface_and_invariants(generating):
    check_interface(generating, "offline")
    assert generating["max_new_tokens"] == "workload"
    check_invariants(generating, streaming=False, decode=True)
    for engine_mode in ENGINE_MODES:
        figures = generating[engine_mode]
        assert figures["lower_bound_seconds"] > figures["lower_bound_strict_seconds"]  # decode costs steps


def test_a_packed_engine_fed_by_the_broker_beats_the_engine_alone(generating):
    packed = generating["packed"]
    alone = packed["engine_alone"]
    # not the makespan: on 400 items it is about the longest single generation, whoever runs it
    assert packed["modeled_seconds"] < alone["modeled_seconds"]
    assert packed["cache_hit_rate"] > alone["cache_hit_rate"]
    assert packed["makespan_vs_engine_alone"] == pytest.approx(
        packed["makespan_seconds"] / alone["makespan_seconds"], abs=1e-3)
    # the window keeps the engine busy: the broker's engines step no more often than batch-at-a-time ones
    assert packed["engine_steps"] < packed["fifo"]["engine_steps"]
    # the same decode tokens whoever feeds the engines
    assert packed["decode_tokens"] == alone["decode_tokens"] == packed["fifo"]["decode_tokens"]


def test_a_padded_engine_alone_is_fifo_without_the_guard(generating):
    # (no "beats FIFO" here: on the generator's many small families, with its own output lengths, shape-pure
    # batches within a 1/16 padding tolerance are too small for a rectangle engine's decode steps)
    padded = generating["padded"]
    alone = padded["engine_alone"]
    assert alone["modeled_seconds"] == padded["fifo"]["modeled_seconds"]
    assert alone["guard_refusals"] == 0


def test_streaming_interface(streaming):
    check_interface(streaming, "streaming")
    for engine_mode in ENGINE_MODES:
        assert "max_wait_seconds" in streaming[engine_mode]
        assert "idle_with_overdue" in streaming[engine_mode]


def test_streaming_invariants(streaming):
    check_invariants(streaming, streaming=True)


def test_run_refuses_an_unknown_mode():
    with pytest.raises(ValueError, match="offline or streaming"):
        pack.run(scale=SCALE, mode="batch")


def without_timings(value):
    """The result less its wall-clock figures (decision latencies), which differ from run to run."""
    if isinstance(value, dict):
        return {k: without_timings(v) for k, v in value.items() if not k.startswith("decision_us")}
    return value


def cli_command() -> list[str]:
    script = Path(sys.executable).with_name("shmbroker")
    return [str(script)] if script.exists() else [sys.executable, "-m", "shmbroker.cli"]


def test_cli_bench_pack_prints_one_json_object(offline):
    proc = subprocess.run(cli_command() + ["bench", "pack", "--json", "--scale", str(SCALE)], cwd=ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    result = json.loads(lines[0])
    check_interface(result, "offline")
    check_invariants(result, streaming=False)
    # the workload and the simulation are deterministic: the CLI prints what run() returns
    assert without_timings(result) == without_timings(offline)


@pytest.mark.skipif(not TRACE.exists(),
                    reason=f"Mooncake trace not found at {TRACE} (the shared traces folder is optional)")
def test_trace_run_invariants():
    result = pack.run(trace=str(TRACE), scale=0.05)
    check_interface(result, "offline")
    assert result["items"] == int(12_031 * 0.05)
    assert result["workload"] == f"trace({TRACE.name})"
    check_invariants(result, streaming=False)


def test_the_padded_bound_is_below_every_padded_feeding(generating):
    padded = generating["padded"]
    bound = padded["lower_bound_padded_seconds"]
    assert 0 < bound <= padded["modeled_seconds"] and bound <= padded["fifo"]["modeled_seconds"]
    assert bound <= padded["engine_alone"]["modeled_seconds"]
    assert padded["modeled_vs_padded_bound"] == pytest.approx(padded["modeled_seconds"] / bound, abs=1e-3)


@pytest.mark.parametrize("family", ["templates", "chains", "oneoffs", "mixed"])
def test_workload_families_run_and_stay_above_the_padded_bound(family):
    out = pack.run(workload=family, scale=0.05, max_new_tokens=0)
    assert out["workload"].startswith(f"{family}(") and out["items"] == 400
    padded = out["padded"]
    for figures in (padded, padded["fifo"], padded["engine_alone"]):
        assert figures["modeled_seconds"] >= padded["lower_bound_padded_seconds"]
