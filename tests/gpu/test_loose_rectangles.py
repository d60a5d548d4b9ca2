"""A padded consumer of a real broker given prompts that share no prefix and generate: the policy
batches them loose (`pack/loose.py`), several families to a rectangle, and the GPU process's
guard passes every record (the record's rows say it is loose: `gpu/taken.engine_batch`)."""

from __future__ import annotations

import json
import secrets

import numpy as np
import pytest
from support.brokerproc import serve

from shmbroker.cli import main

pytestmark = pytest.mark.timeout(300)

CONFIG = """
segment_bytes = 4194304
index_items = 65536
block_tokens = 16
max_wait_seconds = 30.0

[[consumers]]
name = "p"
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 512
engine_settings = { mode = "padded", cache_tokens = 65536 }
"""


def test_one_off_prompts_that_generate_share_rectangles_and_pass_the_guard(tmp_path, capsys):
    rng = np.random.default_rng(11)
    n = 48
    max_new = rng.choice([4, 16, 64], n).tolist()
    rows = [{"id": f"q{i}", "tokens": rng.integers(0, 30_000, int(rng.integers(40, 200))).tolist(),
             "max_new_tokens": m} for i, m in enumerate(max_new)]
    path = tmp_path / "oneoffs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with serve(tmp_path, "loose", CONFIG) as broker:
        rc = main(["submit", str(path), "--name", f"loose-{secrets.token_hex(3)}", "--data-dir", broker.data_dir,
                   "--wait"])
        cap = capsys.readouterr()
        assert rc == 0, cap.err
        got = {r["id"]: r for r in map(json.loads, cap.out.splitlines())}
        assert sorted(got) == sorted(r["id"] for r in rows)
        for r in rows:
            assert got[r["id"]]["status"] == "ok" and len(got[r["id"]]["tokens"]) == r["max_new_tokens"]
        assert main(["status", "--data-dir", broker.data_dir, "--json"]) == 0
        consumer = json.loads(capsys.readouterr().out)["consumers"]["p"]
    assert consumer["items"] == n and consumer["guard_violations"] == 0
    # every prompt is a family of its own: alone, each would be a batch; loose, they share rectangles
    assert consumer["batches"] <= n // 2, consumer
