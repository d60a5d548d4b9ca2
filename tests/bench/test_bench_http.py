"""A small run of `shmbroker bench http` (so the benchmark cannot rot)."""

from __future__ import annotations

import json

from shmbroker.cli import main


def test_bench_http_small_run(capsys):
    assert main(["bench", "http", "--json", "--items", "1500", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["lines"] == 1500 and out["file_bytes"] > 1500 * 1000
    assert len(out["batch_seconds_each"]) == len(out["submit_job_seconds_each"]) == 1
    for key in ("upload_mb_per_s", "validate_lines_per_s", "batch_seconds", "submit_job_seconds", "vs_submit_job",
                "download_mb_per_s"):
        assert out[key] > 0, key
    assert out["server_rss_mb_max"] >= out["server_rss_mb_idle"] > 0
