"""The scheduler's memory beyond its index is bounded: past `overflow_items` it takes no more
announcements, and ingest then producers wait (issue 14, hole 15)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
from brokerproc import BrokerProc

from shmbroker.client import Producer

CONFIG = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 1024
overflow_items = 1024

[[consumers]]
name = "slow"
max_batch_size = 4
max_batch_tokens = 4096
max_input_len = 1024
engine_settings = { mode = "padded", cache_tokens = 4096, pace_seconds = 50.0 }
"""


def _sched(broker) -> dict:
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--json", "--data-dir", broker.data_dir],
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)["scheduler"]


def test_overflow_is_bounded_and_the_rest_waits_upstream(tmp_path):
    """Before: every announcement that came while the index was full was kept in a list in the
    scheduler's memory, however many."""
    count = 6000
    with BrokerProc(tmp_path, config=CONFIG) as broker:
        with Producer("flood", data_dir=broker.data_dir, timeout_seconds=30.0) as p:
            flat = np.arange(count * 8, dtype=np.uint32) % 30_000
            p.submit_many(flat, np.arange(count + 1, dtype=np.int64) * 8, max_new_tokens=1)
            deadline = time.monotonic() + 60
            while True:
                s = _sched(broker)
                if s.get("held_back", 0) > 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            assert s["held_back"] > 0, s
            assert s["overflow_items"] <= 1024 + 4096, s  # the bound, and at most one announcement more
            assert s["pending_items"] < count  # the rest waits upstream, on disk and in the rings
