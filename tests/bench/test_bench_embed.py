"""A small run of `shmbroker bench embed`, so that the benchmark cannot rot: its JSON fields, every
vector of the broker and of the fixed batches equal to sentence-transformers' own, the broker's
padding within its tolerance; and `--engine` values it has no part for refused with words."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace

import pytest

pytest.importorskip("torch", reason="bench embed runs the hf engine (the test extra installs torch)")
pytest.importorskip("sentence_transformers", reason="bench embed compares with sentence-transformers (test extra)")

from shmbroker.bench import embed  # noqa: E402

FIELDS = ("broker_seconds", "fixed_batches_seconds", "sentence_transformers_seconds", "vs_fixed_batches",
          "vs_sentence_transformers", "padding_waste", "tokens_per_s", "vectors_equal")


@pytest.mark.timeout(240)
def test_a_small_run_reports_every_field_and_equal_vectors():
    run = subprocess.run([sys.executable, "-m", "shmbroker.cli", "bench", "embed", "--json", "--scale", "0.0004"],
                         capture_output=True, text=True, timeout=230)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    for key in FIELDS:
        assert key in report, key
    assert report["vectors_equal"] is True
    assert report["min_cosine_broker"] >= embed.COSINE_MIN and report["min_cosine_fixed_batches"] >= embed.COSINE_MIN
    assert report["items"] == 80 and report["dims"] == 256 and report["torch_threads"] == 1
    # a rectangle's longest is at most (1 + tolerance) x its shortest: its waste is below tolerance / (1 + tolerance)
    assert 0.0 <= report["padding_waste"] <= report["padding_tolerance"]
    assert report["broker_batches"] >= report["items"] / report["max_batch_size"]
    for key in ("broker_seconds", "fixed_batches_seconds", "sentence_transformers_seconds", "tokens_per_s"):
        assert report[key] > 0
    assert report["vs_fixed_batches"] == pytest.approx(report["broker_seconds"] / report["fixed_batches_seconds"],
                                                       rel=1e-2)


def test_an_engine_without_a_part_is_refused_with_words(monkeypatch):
    with pytest.raises(ValueError, match="must be hf or vllm"):
        embed.from_args(Namespace(engine="sim", scale=1.0, threads=1, seed=0))
    monkeypatch.setitem(sys.modules, "shmbroker.bench.embed_vllm", None)  # import -> ImportError naming it
    with pytest.raises(ValueError, match="no vLLM part|does not import"):
        embed.from_args(Namespace(engine="vllm", scale=1.0, threads=1, seed=0))
