"""`shmbroker serve-http` beside a running broker: the API alone, on the broker's data directory."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time

import pytest
from openai import OpenAI
from support.brokerproc import serve

pytestmark = pytest.mark.timeout(180)


def test_serve_http_beside_a_running_broker(tmp_path):
    with serve(tmp_path, "srv") as broker:
        cfg = tmp_path / "http.toml"
        cfg.write_text(f'data_dir = "{broker.data_dir}"\n[http]\naddr = "127.0.0.1:0"\n[http.keys]\nme = "serve-key-01"\n')
        proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "serve-http", "--config", str(cfg)],
                                stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stderr.readline()
            m = re.search(r"http://([0-9.]+:[0-9]+)/v1", line)
            assert m, line
            c = OpenAI(base_url=f"http://{m.group(1)}/v1", api_key="serve-key-01", max_retries=0)
            assert {x.id for x in c.models.list()} == {"default"}
            rows = [json.dumps({"custom_id": f"s{i}", "method": "POST", "url": "/v1/completions",
                                "body": {"model": "default", "prompt": [1, 2, 3, 4 + i], "max_tokens": 3}}) for i in range(20)]
            f = c.files.create(file=("s.jsonl", io.BytesIO(("\n".join(rows) + "\n").encode())), purpose="batch")
            b = c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
            deadline = time.monotonic() + 90
            while b.status != "completed":
                assert time.monotonic() < deadline and b.status in ("validating", "in_progress", "finalizing"), b
                time.sleep(0.2)
                b = c.batches.retrieve(b.id)
            assert b.request_counts.completed == 20
        finally:
            proc.terminate()
            assert proc.wait(30) == 0
