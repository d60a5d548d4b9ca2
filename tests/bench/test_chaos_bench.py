"""`shmbroker bench chaos`, short: processes and readers SIGKILLed at random, every item once."""

from __future__ import annotations

import json

import pytest

from shmbroker import cli


@pytest.mark.timeout(600)
def test_bench_chaos_short_run_loses_and_duplicates_nothing(capsys):
    assert cli.main(["bench", "chaos", "--seconds", "12", "--seed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["items"] > 100 and out["kills"] >= 3
    assert (out["lost"], out["duplicated"], out["wrong"], out["failed"]) == (0, 0, 0, 0), out
    assert out["final_stop_code"] == 0 and out["shm_left_bytes"] == 0
    assert out["memory_growth_ratio"] is not None


@pytest.mark.timeout(600)
def test_bench_chaos_on_a_small_filesystem_that_fills_up_loses_nothing(capsys):
    assert cli.main(["bench", "chaos", "--seconds", "12", "--seed", "5", "--fs-mib", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    if not out["small_fs"]["mounted"]:
        pytest.skip(f"no tmpfs could be mounted here: {out['small_fs']['why_not']}")
    assert out["small_fs"]["fills"] >= 1 and out["small_fs"]["min_free_bytes"] <= 1 << 20  # it was full
    assert out["items"] > 100 and out["kills"] >= 3
    assert (out["lost"], out["duplicated"], out["wrong"], out["failed"]) == (0, 0, 0, 0), out
    assert out["final_stop_code"] == 0 and out["shm_left_bytes"] == 0
