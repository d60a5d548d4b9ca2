"""`bench http`: a chat batch file through the OpenAI Files and Batches API of the default broker,
driven by the `openai` package, against the same file as `submit --job --wait` in the same run.

The file: `lines` `/v1/chat/completions` lines of about `line_bytes` each (a system message shared
by a family of lines and a user message of random words), rendered with a word-level tokenizer and
a ChatML template (`jobs_chat.make_tokenizer`) that the broker's `[tokenizers]` table declares.
Figures:

- `upload_mb_per_s`: the file's MB (10^6 bytes) over `files.create`'s seconds;
- `validate_lines_per_s`: lines over the seconds the batch was `validating` (polled every 20 ms);
- `batch_seconds`: `batches.create` to a poll that sees `completed` (polled every 100 ms);
- `submit_job_seconds`: `shmbroker submit FILE --job --wait --out F --out-format openai`, the same
  file on the same broker; `vs_submit_job` = batch_seconds / submit_job_seconds. The two alternate
  `repeats` times (default 4, each side first half the time), a batch uploading the file anew; figures are medians;
- `download_mb_per_s`: the output file streamed with `files.with_streaming_response.content`;
- `server_rss_mb_idle`, `server_rss_mb_max`: the HTTP process's resident memory before the upload,
  and its most (sampled every 20 ms) during the upload and the download.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .broker import BenchBroker
from .chaos_score import rss_bytes
from .jobs_chat import SYSTEM_WORDS, VOCAB, make_tokenizer

KEY = "bench-http-key"
FAMILIES = 256


def make_file(path: Path, lines: int, line_bytes: int, seed: int) -> int:
    """The chat file; its bytes."""
    rng = np.random.default_rng(seed)
    systems = [" ".join(f"w{t}" for t in rng.integers(0, VOCAB, SYSTEM_WORDS * 4)) for _ in range(FAMILIES)]
    words = max(8, (line_bytes - 200 - len(systems[0])) // 6)
    with open(path, "w") as fh:
        for i in range(lines):
            user = " ".join(f"w{t}" for t in rng.integers(0, VOCAB, words))
            fh.write(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                 "body": {"model": "default", "max_tokens": 8, "temperature": 0.7, "seed": i,
                                          "messages": [{"role": "system", "content": systems[i % FAMILIES]},
                                                       {"role": "user", "content": user}]}}) + "\n")
    return path.stat().st_size


def rss_mb(pid: int) -> float:
    return rss_bytes(pid) / (1 << 20)


class RssPeak:
    """The most resident memory of `pid` while sampling (a thread, every 20 ms)."""

    def __init__(self, pid: int):
        self.pid, self.peak, self._on = pid, 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while True:
            self._on.wait()
            self.peak = max(self.peak, rss_mb(self.pid))
            time.sleep(0.02)

    def sampling(self, on: bool) -> None:
        (self._on.set if on else self._on.clear)()
        if on:
            self.peak = max(self.peak, rss_mb(self.pid))


def run(*, lines: int = 50_000, line_bytes: int = 2_000, repeats: int = 4, seed: int = 0, say=lambda line: None) -> dict:
    from openai import OpenAI

    tmp = Path(tempfile.mkdtemp(prefix="shmb-http-"))
    try:
        tok = make_tokenizer(tmp / "tokenizer")
        path = tmp / "batch.jsonl"
        size = make_file(path, lines, line_bytes, seed)
        say(f"http: {lines:,} chat lines, {size / 1e6:.1f} MB")
        config = (f'[tokenizers]\ndefault = "{tok}"\n\n[http]\naddr = "127.0.0.1:0"\nmax_file_lines = {lines}\n'
                  f'max_file_bytes = {max(size, 200_000_000)}\n[http.keys]\nbench = "{KEY}"\n')
        broker = BenchBroker(str(tmp), config)
        try:
            info = broker.wait_ready()
            addr = json.loads((Path(broker.data_dir) / "broker.json").read_text())["http_addr"]
            client = OpenAI(base_url=f"http://{addr}/v1", api_key=KEY, max_retries=0, timeout=600)
            peak = RssPeak(broker.role_pids(info)["http"])
            idle = rss_mb(peak.pid)
            out = {"lines": lines, "file_bytes": size, "repeats": repeats, "server_rss_mb_idle": round(idle, 1)}
            runs: dict[str, list] = {"submit": [], "batch": []}
            for r in range(max(1, repeats)):  # alternated, each side first once
                for side in ("submit", "batch") if r % 2 == 0 else ("batch", "submit"):
                    if side == "submit":
                        runs["submit"].append(round(_submit_job(broker.data_dir, path, tmp, r), 3))
                    else:
                        runs["batch"].append(_batch(client, path, size, lines, peak))
                    say(f"http: run {r}: {side} done")
            out["submit_job_seconds_each"] = runs["submit"]
            out["batch_seconds_each"] = [b["batch_seconds"] for b in runs["batch"]]
            out.update({k: round(statistics.median(b[k] for b in runs["batch"]), 3) for k in runs["batch"][0]})
            out["submit_job_seconds"] = statistics.median(runs["submit"])
            out["vs_submit_job"] = round(out["batch_seconds"] / out["submit_job_seconds"], 4)
            out["server_rss_mb_max"] = round(peak.peak, 1)
            out["server_rss_mb_over_idle"] = round(peak.peak - idle, 1)
        finally:
            broker.stop()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _submit_job(data_dir: str, path: Path, tmp: Path, r: int) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "shmbroker.cli", "submit", str(path), "--data-dir", data_dir,
                           "--job", f"bench-submit-{r}", "--wait", "--out", str(tmp / "submit-out.jsonl"),
                           "--out-format", "openai"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"submit --job exited {done.returncode}: {done.stderr.decode(errors='replace')[-2000:]}")
    os.unlink(tmp / "submit-out.jsonl")
    return seconds


def _batch(client, path: Path, size: int, lines: int, peak: RssPeak) -> dict:
    peak.sampling(True)
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        f = client.files.create(file=fh, purpose="batch")
    upload = time.perf_counter() - t0
    peak.sampling(False)
    t0 = time.perf_counter()
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    while b.status == "validating":
        time.sleep(0.02)
        b = client.batches.retrieve(b.id)
    validate = time.perf_counter() - t0
    while b.status not in ("completed", "failed", "cancelled", "expired"):
        time.sleep(0.1)
        b = client.batches.retrieve(b.id)
    seconds = time.perf_counter() - t0
    if b.status != "completed" or b.request_counts.completed != lines:
        raise RuntimeError(f"the batch ended {b.status} with {b.request_counts}")
    peak.sampling(True)
    t0 = time.perf_counter()
    got = 0
    with client.files.with_streaming_response.content(b.output_file_id) as r:
        for chunk in r.iter_bytes(1 << 20):
            got += len(chunk)
    download = time.perf_counter() - t0
    peak.sampling(False)
    return {"upload_mb_per_s": round(size / 1e6 / upload, 1), "validate_lines_per_s": round(lines / validate, 1),
            "batch_seconds": round(seconds, 3), "output_bytes": got, "download_mb_per_s": round(got / 1e6 / download, 1)}
