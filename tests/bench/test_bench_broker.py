"""Small runs of `bench e2e` and `bench restart`, so that they cannot rot (the figures are the benchmarks')."""

from __future__ import annotations

import pytest

from shmbroker.bench import e2e, restart


@pytest.mark.timeout(180)
def test_bench_e2e_small_run_checks_every_item_and_reports_its_fields():
    out = e2e.run(items_per_producer=4096, mpqueue_items=2000, pairs=1)
    for key in ("items_per_s", "tokens_per_s", "submit_to_result_us_p50", "submit_to_result_us_p99",
                "disk_bound_items_per_s", "mpqueue_items_per_s"):
        assert out[key] > 0, key
    assert out["items"] == 2 * 4096  # every item came back exactly once, ok (the producers check)
    assert out["tokens_per_s"] == pytest.approx(out["items_per_s"] * 256, rel=1e-3)
    assert out["submit_to_result_us_p50"] <= out["submit_to_result_us_p99"]
    assert out["disk_bytes_per_item"] == 64 + 256 * 4 + 48
    # the observed run: the exporter scraped, top drew, and the exported tokens are the producers'
    assert out["observed_items_per_s"] > 0 and out["observed_vs_plain"] > 0
    assert len(out["plain_runs_items_per_s"]) == len(out["observed_runs_items_per_s"]) == 1
    assert out["scrapes"] >= 1 and out["top_bytes"] > 0
    assert out["exported_tokens"] == 2 * 4096 * 256 and out["exported_tokens_match"] is True


@pytest.mark.timeout(180)
def test_bench_e2e_schema_run_compares_items_with_a_shared_schema_to_plain_ones():
    out = e2e.run(items_per_producer=2048, mpqueue_items=1000, pairs=1, schema=True)
    assert out["items"] == 2 * 2048  # every item came back exactly once, ok, in both kinds of run
    assert out["schema_items_per_s"] > 0 and out["schema_vs_plain"] > 0
    assert len(out["plain_runs_items_per_s"]) == len(out["schema_runs_items_per_s"]) == 1
    assert out["schema_option_words"] == 6  # the presence word and the constraint's five: not the schema's bytes
    assert "observed_items_per_s" not in out


@pytest.mark.timeout(180)
def test_bench_e2e_embed_run_moves_vectors_beside_plain_runs():
    out = e2e.run(items_per_producer=2048, mpqueue_items=1000, pairs=1, embed=256)
    assert out["items"] == 2 * 2048  # every vector came back exactly once, ok (the producers check each status)
    assert out["embed_items_per_s"] > 0 and out["embed_vs_plain"] > 0 and out["embed_dimensions"] == 256
    assert out["embed_result_bytes_per_item"] == 40 + 4 * (256 + 2)
    assert len(out["plain_runs_items_per_s"]) == len(out["embed_runs_items_per_s"]) == 1
    with pytest.raises(ValueError, match="no generation option"):
        e2e.run(items_per_producer=2048, mpqueue_items=1000, pairs=1, embed=256, options=True)


@pytest.mark.timeout(180)
def test_bench_restart_small_run_serves_the_recovered_backlog():
    out = restart.run(tokens=3_000_000)
    assert out["backlog_tokens"] == 3_000_000
    assert out["backlog_items"] > 0
    assert 0 < out["first_batch_seconds"] <= out["drain_seconds"]
    assert set(out["peak_rss_bytes"]) >= {"sched", "results", "ingest-0", "supervisor"}
    assert out["index_bytes_per_item"] > 0
