"""The HTTP process's event loop never waits on disk or on the batches' runner: while the runner
describes a batch's 200 MB output file (fsynced, its lines counted), a cancel and the other
requests are each answered within half a second.

Against the real server (`shmbroker serve-http`, no broker needed) on a data directory made for
the test: one batch whose job has every result (the runner ends it at once and describes its
output, written just before the start so that the fsync has it all to write) and one still
running (its job's submitter, as `job.json` says, is this test process), which is cancelled."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from shmbroker.disk.durable import atomic_write
from shmbroker.httpapi.batches import BatchRecord, BatchStore, now
from shmbroker.httpapi.files import FileStore
from shmbroker.httpapi.objects import BATCH_PREFIX, FILE_PREFIX, new_id
from shmbroker.jobs import store
from shmbroker.ring.liveness import start_ticks

pytestmark = pytest.mark.timeout(240)
KEY = "loop-key-0123"
ANSWER_SECONDS = 0.5
CANCEL_SECONDS = 2.0  # it waits for its record's fsync, which may queue behind the output's on the disk
LINE = b"0123456\n"  # 8 bytes: many lines to count
CHUNK_LINES = 1 << 20
CHUNK = LINE * CHUNK_LINES  # 8 MiB
OUTPUT_CHUNKS = 25  # 200 MiB
INPUT_LINES = 4


def seed(data: Path) -> tuple[BatchRecord, BatchRecord]:
    """(a batch whose job has ended, a batch whose job runs), both of tenant `t`, on `data`."""
    files, batches = FileStore(data), BatchStore(data)
    rows = b"".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "default", "prompt": [1, 2, 3], "max_tokens": 2}}).encode() + b"\n"
                    for i in range(INPUT_LINES))
    input_id = new_id(FILE_PREFIX)
    files.path(input_id).write_bytes(rows)
    files.describe(input_id, "t", "in.jsonl", "batch", len(rows), INPUT_LINES)
    made = []
    for submitter in (None, os.getpid()):
        t = now()
        rec = BatchRecord(id=new_id(BATCH_PREFIX), owner="t", endpoint="/v1/completions", input_file_id=input_id,
                          completion_window="24h", created_at=t, expires_at=t + 86400,
                          output_file_id=new_id(FILE_PREFIX), error_file_id=new_id(FILE_PREFIX), phase="running",
                          in_progress_at=t)
        batches.save(rec)
        ended = submitter is None
        store.create(data, store.JobMeta(name=rec.id, input=str(files.path(input_id)), digest="0" * 64,
                                         lines=INPUT_LINES, format="openai",
                                         phase="completed" if ended else "in_progress", submitted=INPUT_LINES,
                                         submit_done=ended, submitter_pid=submitter or 0,
                                         submitter_start=start_ticks(submitter) if submitter else 0))
        if ended:
            atomic_write(store.job_dir(data, rec.id) / "counts.json",
                         json.dumps({"counts": {store.OK_LABEL: INPUT_LINES}}).encode())
        made.append(rec)
    return made[0], made[1]


def holds_open(pid: int, path: str) -> bool:
    """Process `pid` has `path` open."""
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
        except OSError:
            continue
    return False


def timed(took: dict, what: str, call):
    t0 = time.monotonic()
    answer = call()
    took[what] = time.monotonic() - t0
    return answer


def test_a_cancel_during_a_large_output_registration_stalls_no_request(tmp_path):
    data = tmp_path / "data"
    done, live = seed(data)
    output = FileStore(data).path(done.output_file_id)
    with open(output, "wb") as fh:  # the submitter's output: still in the page cache, not synced
        for _ in range(OUTPUT_CHUNKS):
            fh.write(CHUNK)
    cfg = tmp_path / "http.toml"
    cfg.write_text(f'data_dir = "{data}"\n[http]\naddr = "127.0.0.1:0"\n[http.keys]\nt = "{KEY}"\n')
    proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "serve-http", "--config", str(cfg)],
                            stderr=subprocess.PIPE, text=True)
    err: list[str] = []
    try:
        line = proc.stderr.readline()
        threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()  # drained: never blocks it
        m = re.search(r"http://([0-9.]+:[0-9]+)/v1", line)
        assert m, line
        url, auth = f"http://{m.group(1)}/v1", {"Authorization": f"Bearer {KEY}"}
        described = FileStore(data).dir / f"{done.output_file_id}.json"
        deadline = time.monotonic() + 60
        while not holds_open(proc.pid, os.path.realpath(output)):  # the runner is describing it
            assert not described.exists(), "the output was described before the test saw it: make it larger"
            assert time.monotonic() < deadline and proc.poll() is None, "".join(err)
            time.sleep(0.001)

        took: dict[str, float] = {}
        answers = {}

        other = httpx.Client(headers=auth, timeout=120)
        sender = threading.Thread(target=lambda: answers.update(
            cancel=timed(took, "cancel", lambda: other.post(f"{url}/batches/{live.id}/cancel"))))
        with other, httpx.Client(headers=auth, timeout=120) as web:
            sender.start()
            time.sleep(0.1)  # the cancel is in the server first
            for what in ("/batches", "/files", f"/batches/{done.id}", f"/batches/{live.id}", "/models"):
                answers[what] = timed(took, what, lambda: web.get(f"{url}{what}"))
            sender.join(120)
            assert all(a.status_code == 200 for a in answers.values()), {k: a.text for k, a in answers.items()}
            cancel_took = took.pop("cancel")
            assert max(took.values()) < ANSWER_SECONDS, took
            assert cancel_took < CANCEL_SECONDS, cancel_took
            assert answers["cancel"].json()["status"] == "cancelling"

            deadline = time.monotonic() + 120
            while (b := web.get(f"{url}/batches/{done.id}").json())["status"] != "completed":
                assert time.monotonic() < deadline, b
                time.sleep(0.1)
            assert b["output_file_id"] == done.output_file_id and b["error_file_id"] is None
            meta = json.loads(described.read_bytes())
            assert meta["bytes"] == OUTPUT_CHUNKS * len(CHUNK) and meta["lines"] == OUTPUT_CHUNKS * CHUNK_LINES
            deadline = time.monotonic() + 30
            while store.cancel_requested(data, live.id) is None:  # the runner cancelled its job
                assert time.monotonic() < deadline, "".join(err)
                time.sleep(0.05)
            assert web.get(f"{url}/batches/{live.id}").json()["status"] == "cancelling"
    finally:
        proc.terminate()
        code = proc.wait(60)
        output.unlink(missing_ok=True)
    assert code == 0, "".join(err)
