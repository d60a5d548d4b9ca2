"""Request options through a broker with a real vLLM consumer (`tests/support/vllm_sampling_check.py`
under `.venv-vllm`): each item's own `SamplingParams` from its options, checked against vLLM's own
engine running the same request alone with the same parameters.

- greedy, seeded sampling at temperature 0.8 (with top-p and top-k), penalties, a stop string (the
  model directory holds a tokenizer, so vLLM matches it in text) and stop ids: every output equals
  vLLM's own. vLLM's per-request seeds hold across batch compositions here: the broker's batches
  differ from the reference's one-at-a-time runs, and two broker runs fed in opposite orders agree;
- `n` samples are not carried yet: that item fails alone, `invalid`, naming the option.
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
            if (r["options"] or {}).get("n", 1) > 1:
                assert res["status"] == "invalid" and "'n'" in res["error"]
                continue
            assert res["status"] == "ok", (k, r["options"], res)
            assert res["tokens"] == ref[str(k)]["tokens"], (k, r["options"])
    first, second = report["first"]["results"], report["second"]["results"]
    assert all(first[k]["tokens"] == second[k]["tokens"] for k in first)
    greedy_of = report["greedy_of_sampled"]
    assert greedy_of and any(ref[k]["tokens"] != g for k, g in greedy_of.items())  # sampled, not greedy
    stop = len(reqs) - 2
    assert reqs[stop]["options"]["stop"] == [report["stop_word"]] and ref[str(stop)]["finish_reason"] == "stop"
    assert report["stop_word"] not in ref[str(stop)]["text"]
