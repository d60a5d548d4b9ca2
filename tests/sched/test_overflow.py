"""The scheduler's memory beyond its index is bounded: what the index cannot hold waits on disk,
live or recovered; only a full disk keeps it in memory, at most `overflow_items`."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from support.brokerproc import BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.ingest.sources import BATCH_RECORDS

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


def test_items_beyond_a_full_index_wait_on_disk_not_in_memory_and_all_come_back(tmp_path):
    """Before: every announcement that came while the index was full was kept in the scheduler's
    memory, with its block hashes (here up to 6000 - 1024 items in `overflow_items`), and past
    `overflow_items` the scheduler took no more: producers waited with a disk that had room."""
    count = 6000
    with BrokerProc(tmp_path, config=CONFIG.replace("pace_seconds = 50.0", f"pace_seconds = {PACE}")) as broker:
        with Producer("flood", data_dir=broker.data_dir, timeout_seconds=30.0) as p:
            flat = np.arange(count * 8, dtype=np.uint32) % 30_000
            ids = set(p.submit_many(flat, np.arange(count + 1, dtype=np.int64) * 8, max_new_tokens=1).tolist())
            most_waiting = most_in_memory = 0
            waiting_dir = Path(broker.data_dir) / "sched" / "waiting"
            got: list[int] = []
            deadline = time.monotonic() + 120
            while len(got) < count:
                assert time.monotonic() < deadline, f"{len(got)} of {count}"
                s = _sched(broker)
                most_waiting = max(most_waiting, s["waiting_items"])
                most_in_memory = max(most_in_memory, s["overflow_items"])
                got.extend(r.item_id for r in p.results(timeout_seconds=0.5))
        assert len(got) == count and set(got) == ids  # each once, through the disk and back
        assert most_waiting >= count - 1024 - 2 * 4096, most_waiting  # the flood beyond the index: on disk
        assert most_in_memory <= BATCH_RECORDS, most_in_memory  # in memory at most what the index could not take of one announcement
        assert s["held_back"] == 0, s  # producers never waited on a disk with room
        assert waiting_dir.stat().st_mode & 0o777 == 0o700
        deadline = time.monotonic() + 10
        while list(waiting_dir.glob("*.bin")):  # read to their end: the files go
            assert time.monotonic() < deadline
            time.sleep(0.2)


def _ingested(broker) -> int:
    out = subprocess.run([sys.executable, "-m", "shmbroker.cli", "status", "--json", "--data-dir", broker.data_dir],
                         capture_output=True, text=True, timeout=60).stdout
    return json.loads(out)["ingest"].get("items", 0)


PACE = 0.5
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
            if s.get("waiting_items", 0) > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert s["waiting_items"] >= count - 1024 - 256, s  # on disk, read back as the index frees room
        assert s["overflow_items"] == 0, s  # nothing of it in memory beyond the index
        assert s["pending_items"] >= max(s["waiting_items"], count - 256), s  # and it all counts as pending
        assert {f.stat().st_mode & 0o777 for f in (Path(broker.data_dir) / "sched" / "waiting").glob("*.bin")} == {0o600}
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
        while list((Path(broker.data_dir) / "sched" / "waiting").glob("*.bin")):  # drained: the scratch files go
            assert time.monotonic() < deadline
            time.sleep(0.2)
    finally:
        broker.stop()


def test_the_waiting_queue_reads_rows_back_by_number_across_files_and_a_full_disk(tmp_path, monkeypatch):
    """Rows go to files of CHUNK_ROWS, numbered in arrival order and read back by number in any
    order; a file goes once every row below the oldest waiting one is taken; a full disk keeps the
    rows in memory, and the disk is tried again once none of them waits."""
    import errno

    from shmbroker.ring.wire import LOC_DTYPE
    from shmbroker.spill import waiting as W

    monkeypatch.setattr(W, "CHUNK_ROWS", 100)
    q = W.WaitingQueue(tmp_path, 1 << 20)

    def locs(first, n):
        rows = np.zeros(n, LOC_DTYPE)
        rows["item_id"] = np.arange(first, first + n)
        return rows

    assert q.append(locs(0, 250), 7) == 0
    assert q.tail == 250 and q.in_memory == 0 and q.files == 3
    waiting_dir = tmp_path / "sched" / "waiting"
    assert waiting_dir.stat().st_mode & 0o777 == 0o700
    assert {f.stat().st_mode & 0o777 for f in waiting_dir.glob("*.bin")} == {0o600}  # the files are the owner's
    real = W.os.pwrite
    monkeypatch.setattr(W.os, "pwrite", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
    assert q.append(locs(250, 30), 8) == 250  # the disk is full: in memory
    monkeypatch.setattr(W.os, "pwrite", real)
    q.append(locs(280, 20), 9)  # room again, but rows wait in memory: memory too
    assert q.tail == 300 and q.in_memory == 50 and q.head_arrival_ns(0) == 7 and q.head_arrival_ns(260) == 8
    spread = np.array([5, 105, 205, 255, 290, 0, 299], np.int64)
    assert q.gather(spread)["item_id"].tolist() == spread.tolist()  # any order, any piece
    q.taken(spread)
    assert q.in_memory == 47
    q.forget_below(100)  # rows 0..99 all taken: the first file goes
    assert q.files == 2
    rest = np.setdiff1d(np.arange(100, 300), spread)
    assert q.gather(rest)["item_id"].tolist() == rest.tolist()
    q.taken(rest)
    q.forget_below(300)
    assert q.files == 0 and q.in_memory == 0 and not q.pieces
    assert q.append(locs(300, 5), 10) == 300  # none waits in memory: the disk again
    assert q.in_memory == 0 and q.files == 1 and q.head_arrival_ns(300) == 10
    q.close()
    assert not (tmp_path / "sched" / "waiting").exists()
