"""A tiny run of `shmbroker bench backlog`, so that it cannot rot.

No speed thresholds: shared machines drift. Only the fields, their
positivity, the benchmark's own verification of what it read back and
recovered, and the drained disk bound (a property, not a speed) are asserted.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from shmbroker import cli
from shmbroker.bench import backlog as bench_backlog
from shmbroker.disk.durable import RESERVE_BYTES
from shmbroker.spill.layout import PENDING_DTYPE

pytestmark = pytest.mark.timeout(120)

SCALE = 0.002
POSITIVE_FLOATS = (
    "disk_write_bytes_per_s",
    "append_bytes_per_s",
    "append_tokens_per_s",
    "append_vs_disk",
    "append_never_bytes_per_s",
    "read_tokens_per_s",
    "read_bytes_per_s",
    "pages_per_batch",
    "extents_per_batch",
    "pages_per_batch_fifo",
    "extents_per_batch_fifo",
    "recovery_seconds",
)
POSITIVE_INTS = (
    "recovery_tokens",
    "disk_bytes_after_drain",
    "disk_bytes_before_drain",
    "segment_bytes",
    "writers",
    "cpus",
    "volume_bytes",
)


def test_cli_bench_backlog_json_small_run_is_verified(capsys):
    assert cli.main(["bench", "backlog", "--json", "--scale", str(SCALE)]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    result = json.loads(lines[0])
    for key in POSITIVE_FLOATS:
        assert isinstance(result[key], float) and math.isfinite(result[key]) and result[key] > 0, (key, result[key])
    for key in POSITIVE_INTS:
        assert isinstance(result[key], int) and result[key] > 0, (key, result[key])
    assert result["verified"] is True
    plan = bench_backlog._plan(SCALE)
    assert result["segment_bytes"] == plan["segment_bytes"]
    assert result["recovery_tokens"] >= plan["recovery_tokens"]
    assert result["recovery_segments"] > result["recovery_writers"]  # hand-built sealed segments were recovered too
    assert result["append_tokens_per_s"] * 4 == pytest.approx(result["append_bytes_per_s"])
    assert result["pages_per_batch"] >= result["pages_per_batch_min"] > 0
    assert result["extents_per_batch"] <= result["records_per_batch"]
    # a drained backlog keeps at most its writers' newest segments (plus the ack file, markers and the
    # bookkeeping files' space reserve, `durable.RESERVE_BYTES`)
    assert result["disk_bytes_after_drain"] <= result["writers"] * (result["segment_bytes"] + (64 << 10)) + RESERVE_BYTES
    assert result["recovery_disk_bytes_after_drain"] <= (result["recovery_writers"] * (result["segment_bytes"] + (64 << 10))
                                                         + RESERVE_BYTES)
    assert result["disk_bytes_after_drain"] < result["disk_bytes_before_drain"]
    assert not bench_backlog.data_root().exists()


def test_layout_stats_counts_pages_and_extents():
    recs = np.zeros(3, PENDING_DTYPE)
    # segment 0: [64, 528) then [528, 4592): one extent over pages 0-1; segment 9: [64, 168): page 0
    recs["segment"] = [0, 0, 9]
    recs["offset"] = [64, 528, 64]
    recs["num_tokens"] = [100, 1000, 10]
    bounds = np.array([0, 3])
    assert bench_backlog._layout_stats(recs, bounds) == (3.0, 2.0)
    # the same records as three batches of one: no sharing across batches
    assert bench_backlog._layout_stats(recs, np.array([0, 1, 2, 3])) == (4 / 3, 1.0)


def test_shape_batches_are_one_shape_and_within_caps():
    rng = np.random.default_rng(3)
    recs = np.zeros(5000, PENDING_DTYPE)
    recs["seq"] = np.arange(recs.size)
    recs["prefix_key"] = rng.integers(0, 4, recs.size)
    recs["shape_band"] = rng.integers(6, 9, recs.size)
    recs["num_tokens"] = rng.integers(64, 4097, recs.size)
    ordered, bounds = bench_backlog._shape_batches(recs)
    assert bounds[0] == 0 and bounds[-1] == recs.size and (np.diff(bounds) > 0).all()
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        batch = ordered[lo:hi]
        assert len(np.unique(batch[["model", "prefix_key", "shape_band"]])) == 1
        assert batch.size <= bench_backlog.READ_BATCH_ITEMS
        assert int(batch["num_tokens"].sum()) <= bench_backlog.READ_BATCH_TOKENS
        assert (np.diff(batch["seq"].astype(np.int64)) > 0).all()
