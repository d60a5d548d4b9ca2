"""A small run of `bench scale`, so that it cannot rot (the figures are the benchmark's)."""

from __future__ import annotations

import pytest

from shmbroker.bench import scale
from shmbroker.bench.scale_index import synthetic_shapes


@pytest.mark.timeout(300)
def test_bench_scale_small_run_reports_each_order_and_the_index():
    out = scale.run(scale=0.002, indexed=(5000,))
    assert out["items"] == 2000 and out["all_ok"] is True  # every item of the three runs came back ok
    for run in ("grouped", "full_index", "small_index"):
        assert 0 < out[f"{run}_hit_rate"] < 1 and out[f"{run}_seconds"] > 0, run
    assert out["small_index_items"] == 1024  # the configuration's least: about half this backlog
    assert out["small_index_vs_grouped"] == pytest.approx(out["small_index_hit_rate"] / out["grouped_hit_rate"], abs=1e-3)
    assert 10 < out["bytes_per_waiting_item"] < 200 and out["sched_rss_mb"] > 0
    assert out["indexed_items"] == 5000 and out["bytes_per_indexed_item"] > 0
    assert out["decision_us_p99_padded"] > 0 and out["decision_us_p99_packed"] > 0
    assert {(r["items"], r["mode"]) for r in out["index_runs"]} == {(5000, "padded"), (5000, "packed")}


def test_the_index_workload_shares_documents_within_groups_only():
    shapes = synthetic_shapes(3000, 1)
    first = {int(shapes.hashes[shapes.hash_offsets[i]]) for i in range(len(shapes))}
    assert 3000 / 17 < len(first) < 3000 / 2  # one first block a document: groups of 2..16
    ends = {int(shapes.hashes[shapes.hash_offsets[i + 1] - 1]) for i in range(len(shapes))}
    assert len(ends) == 3000  # every item ends in blocks of its own
