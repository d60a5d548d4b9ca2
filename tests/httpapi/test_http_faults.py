"""A batch answered 200 survives SIGKILLs: of the HTTP role (the supervisor restarts it, and its
runner resumes the batch's submitter), and of the whole broker (a new one salvages, and the batch
resumes). It completes with every custom_id exactly once in its output and error files."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from openai import OpenAI
from support.brokerproc import BrokerProc
from support.harness import sweep_shm, wait_for

pytestmark = pytest.mark.timeout(400)
KEY = "fault-key-0123"
LINES = 400
CONFIG = f"""
instance = "httpfault"
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "c"
max_batch_size = 8
max_batch_tokens = 8192
max_input_len = 1024
engine_settings = {{ mode = "packed", cache_tokens = 65536, pace_seconds = 6.0 }}

[http]
addr = "127.0.0.1:0"
[http.keys]
t = "{KEY}"
"""


def connect(broker) -> OpenAI:
    addr = json.loads((Path(broker.data_dir) / "broker.json").read_text())["http_addr"]
    return OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, max_retries=3)


def completed_lines(broker, batch_id: str) -> int:
    from shmbroker.jobs import store

    try:
        return store.view(broker.data_dir, batch_id)["results"]
    except store.JobError:
        return 0


def test_a_batch_survives_sigkill_of_the_http_role_and_of_the_broker(tmp_path):
    sweep_shm("httpfault")
    broker = BrokerProc(tmp_path, CONFIG).start()
    try:
        c = connect(broker)
        rows = [json.dumps({"custom_id": f"k{i}", "method": "POST", "url": "/v1/completions",
                            "body": {"model": "default", "prompt": [5 + i % 50, 7, 9, 11 + i % 3], "max_tokens": 8}})
                for i in range(LINES)]
        f = c.files.create(file=("f.jsonl", io.BytesIO(("\n".join(rows) + "\n").encode())), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")

        wait_for(lambda: completed_lines(broker, b.id) >= LINES // 8, 120, "no results came")
        broker.kill_role("http")  # the HTTP role and its submitter
        seen = completed_lines(broker, b.id)
        assert seen < LINES, "the batch ended before the kill: make the engine slower"
        wait_for(lambda: completed_lines(broker, b.id) >= seen + LINES // 8, 120, "the batch did not go on")
        c = connect(broker)
        status = c.batches.retrieve(b.id).status
        assert status in ("in_progress", "finalizing"), status

        broker.kill()  # the whole broker
        left = LINES - completed_lines(broker, b.id)
        assert left > 0, "the batch ended before the kill: make the engine slower"
        broker.start()
        c = connect(broker)
        wait_for(lambda: c.batches.retrieve(b.id).status == "completed", 240,
                 f"the batch did not complete ({left} lines left at the kill):\n{broker.log()}")
        b = c.batches.retrieve(b.id)
        assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (LINES, LINES, 0)
        out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
        assert sorted(r["custom_id"] for r in out) == sorted(f"k{i}" for i in range(LINES))  # each once
        assert b.error_file_id is None
    finally:
        broker.stop()
    assert sweep_shm("httpfault") == []
