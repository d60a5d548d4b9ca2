"""The scheduler's memory beyond its index is bounded: past `overflow_items` it takes no more
announcements, and ingest then producers wait (issue 14, hole 15)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

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


def _ingested(broker) -> int:
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--json", "--data-dir", broker.data_dir],
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)["ingest"].get("items", 0)


FAST = CONFIG.replace("pace_seconds = 50.0", "pace_seconds = 0.0")


def test_a_restart_keeps_what_the_index_cannot_hold_on_disk_not_in_memory(tmp_path):
    """Before: a restart put the whole pending backlog beyond the index in the scheduler's memory
    (here 6000 - 1024 items in `overflow_items`, with their block hashes), whatever overflow_items said."""
    count = 6000
    roomy = CONFIG.replace("index_items = 1024", "index_items = 65536").replace("overflow_items = 1024",
                                                                                 "overflow_items = 65536")
    broker = BrokerProc(tmp_path, config=roomy)
    broker.start()
    try:
        with Producer("old", data_dir=broker.data_dir, timeout_seconds=30.0) as p:
            flat = np.arange(count * 8, dtype=np.uint32) % 30_000
            ids = set(p.submit_many(flat, np.arange(count + 1, dtype=np.int64) * 8, max_new_tokens=1).tolist())
        deadline = time.monotonic() + 60
        while _ingested(broker) < count:
            assert time.monotonic() < deadline
            time.sleep(0.3)
        broker.kill()
        broker.config_path.write_text(CONFIG)  # the slow consumer, an index of 1024
        broker.start()
        deadline = time.monotonic() + 30
        while True:
            s = _sched(broker)
            if s.get("recovered_waiting", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert s["recovered_waiting"] >= count - 1024 - 256, s  # on disk, read back as the index frees room
        assert s["overflow_items"] == 0, s  # nothing of it in memory beyond the index
        assert s["pending_items"] >= max(s["recovered_waiting"], count - 256), s  # and it all counts as pending
        assert (Path(broker.data_dir) / "sched" / "recovered.bin").stat().st_mode & 0o777 == 0o600
        broker.kill()
        broker.config_path.write_text(FAST)
        broker.start()
        with Producer("old", data_dir=broker.data_dir, timeout_seconds=30.0) as p:
            got: list[int] = []
            deadline = time.monotonic() + 120
            while len(got) < count:
                assert time.monotonic() < deadline, f"{len(got)} of {count}"
                got.extend(r.item_id for r in p.results(timeout_seconds=1.0))
        assert len(got) == count and set(got) == ids
        deadline = time.monotonic() + 10
        while (Path(broker.data_dir) / "sched" / "recovered.bin").exists():  # drained: the scratch file goes
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        broker.stop()
