"""vLLM engines that die, through a real vLLM (`.venv-vllm`; skipped, saying why, without it).

1. `tests/support/vllm_death_check.py`: the adapter over a real in-process engine wrapped in a test
   double that starts raising after a few steps (vLLM's EngineDeadError; a repeated CUDA error; a
   repeated error with no words of death) fails no item and raises EngineDead; a poison request that
   makes every step raise while it is in the engine fails alone, engine_error, and the rest run ok.
2. `shmbroker bench faults`: a broker whose vLLM engine core (its own process, as vLLM runs it by
   default) is SIGKILLed mid-run: the GPU process exits within 2 s of the kill, results resume once
   a fresh one has loaded its engine, and every item comes back ok exactly once;
3. the same through the HTTP role's Batch API with a chat file.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.vllm_venv import vllm_python

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "support" / "vllm_death_check.py"


@pytest.mark.timeout(600)
def test_a_dying_vllm_engine_fails_no_item_and_a_poison_item_fails_alone(tmp_path):
    python = vllm_python()
    proc = subprocess.run([python, str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert proc.returncode == 0, f"the check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    for case in ("engine_dead", "cuda", "generic"):
        r = report[case]
        assert r["dead"] is not None, (case, r)
        statuses = [v["status"] for v in r["results"].values()]
        assert "engine_error" not in statuses, (case, r)
        assert r["unanswered"] >= 1, (case, r)  # handed back with the death, neither answered nor failed
    assert "EngineDeadError" in report["engine_dead"]["dead"]
    assert "illegal memory access" in report["cuda"]["dead"]
    assert "3 times in a row" in report["generic"]["dead"]
    poison = report["poison"]
    assert poison["dead"] is None and poison["unanswered"] == 0, poison
    bad = {k: v for k, v in poison["results"].items() if v["status"] != "ok"}
    assert list(bad) == ["1003"], bad
    assert bad["1003"]["status"] == "engine_error" and "a kernel failed on this prompt" in bad["1003"]["error"]


@pytest.mark.timeout(900)
def test_killing_the_vllm_engine_core_costs_a_restart_and_no_item(tmp_path):
    python = vllm_python()
    shmbroker = str(Path(python).parent / "shmbroker")
    proc = subprocess.run([shmbroker, "bench", "faults", "--json"], capture_output=True, text=True, timeout=840,
                          cwd=tmp_path)
    assert proc.returncode == 0, f"bench faults exited {proc.returncode}:\n{proc.stderr[-6000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["distinct"] == r["items"] and r["ok"] == r["items"], r
    assert r["engine_deaths"] == 1, r
    assert r["kill_to_exit_seconds"] is not None and r["kill_to_exit_seconds"] < 2.0, r
    # the restart is a fresh process's start and model load, and little more
    load = r["engine_load_seconds"]["after_death"]
    assert r["kill_to_next_result_seconds"] is not None and r["kill_to_next_result_seconds"] < load + 10.0, r
    assert 0 < r["engine_restart_seconds"] < load + 10.0, r


KILL_CHECK = ROOT / "tests" / "support" / "vllm_kill_check.py"


@pytest.mark.timeout(900)
def test_a_chat_batch_over_http_outlives_a_killed_engine_core(tmp_path):
    """The HTTP role's batch of 150 chat lines; the engine core SIGKILLed after 40 items: the GPU
    process sees it within 2 s (not at the heartbeat timeout), the card is back in the time a fresh
    process takes to load its engine (the restart: engine_load_seconds) and a few seconds more, and
    the batch completes with every line ok exactly once."""
    python = vllm_python()
    proc = subprocess.run([python, str(KILL_CHECK), str(tmp_path)], capture_output=True, text=True, timeout=840,
                          cwd=ROOT)
    assert proc.returncode == 0, f"the check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["killed"] and r["status"] == "completed", r["log_tail"]
    ids = [o["custom_id"] for o in r["out"]]
    assert sorted(ids) == sorted(f"line-{k}" for k in range(r["lines"])), "every line exactly once"
    assert all(o["response"]["status_code"] == 200 for o in r["out"]) and r["errors"] == [], r["errors"][:3]
    c = r["consumer"]
    assert c["ok"] >= r["lines"] and c["engine_errors"] == 0 and c["engine_deaths"] == 1, c
    assert r["kill_to_exit_seconds"] is not None and r["kill_to_exit_seconds"] < 2.0, r["kill_to_exit_seconds"]
    load = c["engine_load_ns"] / 1e9
    assert r["kill_to_next_ok_seconds"] is not None and r["kill_to_next_ok_seconds"] < load + 10.0, (r, load)
    assert r["supervisor_exit"] == 0, r["log_tail"]
