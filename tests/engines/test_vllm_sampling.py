"""Request options through a broker with a real vLLM consumer (`tests/support/vllm_sampling_check.py`
under `.venv-vllm`): each item's own `SamplingParams` from its options, checked against vLLM's own
engine running the same request alone with the same parameters.

- greedy, seeded sampling at temperature 0.8 (with top-p and top-k), penalties, a stop string (the
  model directory holds a tokenizer, so vLLM matches it in text) and stop ids: every output equals
  vLLM's own. vLLM's per-request seeds hold across batch compositions here: the broker's batches
  differ from the reference's one-at-a-time runs, and two broker runs fed in opposite orders agree;
- `n = 4` gives four distinct samples, each with its finish reason, equal to vLLM's own; every
  result says how many prompt tokens vLLM served from its prefix cache, and for the four samples
  of a four-block prompt that is the four blocks (vLLM reports them once for the request: the
  prompt was prefilled once and its blocks reused by the other samples).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from support.vllm_venv import vllm_python

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "tests" / "support" / "vllm_sampling_check.py"


@pytest.mark.timeout(900)
def test_request_options_reach_a_real_vllm_and_its_outputs_are_vllms_own(tmp_path):
    python = vllm_python()
    proc = subprocess.run([python, str(CHECK), str(tmp_path)], capture_output=True, text=True, timeout=840, cwd=ROOT)
    assert proc.returncode == 0, f"the check exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    reqs, ref = report["requests"], report["reference"]
    for run in ("first", "second"):
        got = report[run]["results"]
        assert report[run]["supervisor_exit"] == 0, report[run]["log_tail"]
        assert len(got) == len(reqs), report[run]["log_tail"]
        for k, r in enumerate(reqs):
            res = got[str(k)]
            assert res["status"] == "ok", (k, r["options"], res)
            assert res["samples"] == ref[str(k)]["samples"], (k, r["options"])
            assert res["finish_reasons"] == ref[str(k)]["finish_reasons"], (k, r["options"])
            assert res["cached_tokens"] is not None
        four = got[str(len(reqs) - 1)]
        assert len(four["samples"]) == 4 and len({tuple(x) for x in four["samples"]}) == 4
        # the prompt's four whole blocks were computed once and served from the cache to its other samples
        assert four["cached_tokens"] == 4 * 32
    first, second = report["first"]["results"], report["second"]["results"]
    assert all(first[k]["tokens"] == second[k]["tokens"] for k in first)
    greedy_of = report["greedy_of_sampled"]
    assert greedy_of and any(ref[k]["tokens"] != g for k, g in greedy_of.items())  # sampled, not greedy
    stop = len(reqs) - 2
    assert reqs[stop]["options"]["stop"] == [report["stop_word"]] and ref[str(stop)]["finish_reason"] == "stop"
    assert report["stop_word"] not in ref[str(stop)]["text"]
