"""A small run of `shmbroker bench jobs` (so the benchmark cannot rot): its checks hold at any size."""

from __future__ import annotations

import json

from shmbroker.cli import main


def test_bench_jobs_small_run(capsys):
    assert main(["bench", "jobs", "--json", "--items", "3000", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["items"] == 3000
    p = out["progress"]
    assert len(p["tty_seconds"]) == len(p["pipe_seconds"]) == 1 and p["slowdown"] > 0 and p["submit_slowdown"] > 0
    c = out["cancel"]
    assert c["other_exact"] and c["victim_each_once"] and c["victim_accounted"]
    assert c["victim_status"] == ("completed" if c["completed_before_cancel"] else "cancelled")
    r = out["resume"]
    assert r["each_custom_id_once"] and r["output_lines"] == 3000 and r["resume_exit"] == 0
    assert (r["status"], r["completed"]) == ("completed", 3000)
