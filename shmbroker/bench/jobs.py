"""`shmbroker bench jobs`: a 100,000-item batch job through the default broker, as a user runs one.

Three parts, each through `shmbroker submit` in a subprocess on one broker with the built-in
configuration (only its exporter on a free port):

- **progress**: the same job file submitted with `--wait` under a pseudo-terminal (the rich
  display redrawing) and with stderr to a pipe (a plain line every few seconds), alternated
  `repeats` times; the slowdowns are the terminal runs' median over the pipe runs' median, of the
  whole command's wall time, of its submission alone (the "submitted N items in X s" line) and of
  the command's CPU time (user + system, from wait4: on two shared cores the least noisy of the three).
- **cancel**: the job and a second, smaller one submitted at once; the first is cancelled when half
  of its results are in. Every item of both is read back (`shmbroker results`): the other job's
  must be exact (each custom_id once, all ok), the cancelled one's each once, ok or cancelled.
- **resume**: the job with `--wait --out` SIGKILLed when half of it is submitted, then run again with
  `--resume`: the output must hold each custom_id exactly once, and the job be completed.

- **chat** (`jobs_chat.py`): a chat file of as many lines with a tokenizer against the same job as
  token ids: the client's lines/s and the chat job's slowdown.

The file is the seeded generator's (`workloads.synthetic`, short prompts in prefix families) in the
OpenAI Batch format with token-id prompts.
"""

from __future__ import annotations

import json
import os
import pty
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from ..jobs import store
from .broker import BenchBroker
from .jobs_chat import chat_against_ids

SUBMITTED_RE = re.compile(r"submitted (\d+) items.* in ([0-9.]+) s")
POLL_SECONDS = 0.05


def make_file(path: Path, num_items: int, seed: int, prefix: str) -> int:
    """The job file (OpenAI Batch request lines, token-id prompts); its prompt tokens."""
    from ..workloads.synthetic import generate

    wl = generate(num_items, seed=seed, num_families=max(8, num_items // 250), system_tokens_median=48,
                  turn_tokens_median=24, reply_tokens_median=8, max_len=512, p_continue=0.3)
    with open(path, "w") as fh:
        for i in range(len(wl)):
            toks = wl.tokens[wl.offsets[i] : wl.offsets[i + 1]].tolist()
            fh.write(json.dumps({"custom_id": f"{prefix}{i}", "method": "POST", "url": "/v1/completions",
                                 "body": {"model": "m", "prompt": toks, "max_tokens": int(min(16, wl.max_new_tokens[i]))}}) + "\n")
    return int(wl.lengths.sum())


def _cmd(*argv) -> list[str]:
    return [sys.executable, "-m", "shmbroker.cli", *map(str, argv)]


def _run(argv: list[str], tty: bool) -> tuple[float, float, str]:
    """Run a command to its end with stderr on a pseudo-terminal (`tty`) or a pipe; (wall seconds, its
    CPU seconds (user + system, from wait4), its stderr)."""
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "160", "LINES": "40"}
    if tty:
        master, slave = pty.openpty()
    else:
        master, slave = os.pipe()
    chunks: list[bytes] = []

    def drain():
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # a pty's master reads EIO once the last slave closed
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=slave, stdin=slave if tty else subprocess.DEVNULL, env=env)
    os.close(slave)
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    seconds = time.perf_counter() - t0
    reader.join(5)
    os.close(master)
    return seconds, usage.ru_utime + usage.ru_stime, b"".join(chunks).decode(errors="replace")


def _submit_seconds(err: str) -> float:
    m = SUBMITTED_RE.search(err)
    if m is None:
        raise RuntimeError(f"submit said no 'submitted ... in X s' line: {err[-2000:]}")
    return float(m.group(2))


def _submit_run(argv: list) -> tuple[float, float, str]:
    """`shmbroker ARGV` (a submit) with stderr to a pipe: (wall seconds, submission seconds, stderr)."""
    seconds, _cpu, err = _run(_cmd(*argv), False)
    return seconds, _submit_seconds(err), err


def progress(data_dir: str, path: Path, tmp: Path, repeats: int) -> dict:
    runs: dict[str, list[tuple[float, float, float]]] = {"tty": [], "pipe": []}
    for r in range(repeats):
        for side in ("pipe", "tty") if r % 2 == 0 else ("tty", "pipe"):
            name = f"progress-{side}-{r}"
            out = tmp / f"{name}.jsonl"
            seconds, cpu, err = _run(_cmd("submit", path, "--data-dir", data_dir, "--job", name, "--model", "default",
                                     "--wait", "--out", out, "--out-format", "openai"), side == "tty")
            lines = sum(1 for _ in open(out))
            if lines != store.view(data_dir, name)["total"]:
                raise RuntimeError(f"{name}: {lines} output lines: {err[-2000:]}")
            if side == "tty" and "\x1b[" not in err:
                raise RuntimeError("the terminal run drew no rich display")
            runs[side].append((seconds, _submit_seconds(err), cpu))
            out.unlink()
    out = {}
    for k, what in enumerate(("seconds", "submit_seconds", "cpu_seconds")):
        for side in ("tty", "pipe"):
            out[f"{side}_{what}"] = [round(r[k], 3) for r in runs[side]]
    med = {side: [statistics.median(r[k] for r in v) for k in range(3)] for side, v in runs.items()}
    out.update(slowdown=round(med["tty"][0] / med["pipe"][0], 4), submit_slowdown=round(med["tty"][1] / med["pipe"][1], 4),
               cpu_slowdown=round(med["tty"][2] / med["pipe"][2], 4))
    return out


def _wait(check, timeout_seconds: float, what: str):
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(POLL_SECONDS)
    raise RuntimeError(f"{what}: not within {timeout_seconds:.0f} s")


def _view(data_dir: str, name: str) -> dict | None:
    try:
        return store.view(data_dir, name)
    except store.JobError:
        return None


def _results(data_dir: str, name: str, out: Path) -> list[dict]:
    subprocess.run(_cmd("results", "--name", name, "--data-dir", data_dir, "--out", out, "--timeout", "2"),
                   check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in open(out)]


def cancel(data_dir: str, path: Path, other: Path, num_items: int, num_other: int, tmp: Path) -> dict:
    a, b = "cancel-victim", "cancel-other"
    procs = [subprocess.Popen(_cmd("submit", f, "--data-dir", data_dir, "--job", n, "--model", "default"),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for f, n in ((path, a), (other, b))]
    at = _wait(lambda: (v := _view(data_dir, a)) is not None and v["results"] >= num_items // 2 and v, 600, "half way")
    t0 = time.perf_counter()
    refused = subprocess.run(_cmd("cancel", a, "--data-dir", data_dir), stderr=subprocess.DEVNULL).returncode == 1
    # refused: the job completed before the cancel came (a small run)
    va = _wait(lambda: (v := store.view(data_dir, a))["status"] in ("cancelled", "completed") and v, 600,
               "the victim cancelled")
    cancel_seconds = time.perf_counter() - t0
    vb = _wait(lambda: (v := store.view(data_dir, b))["status"] == "completed" and v, 600, "the other job completed")
    for p in procs:
        p.wait(60)
    ra, rb = _results(data_dir, a, tmp / "a.jsonl"), _results(data_dir, b, tmp / "b.jsonl")
    ids_b = [r["id"] for r in rb]
    other_exact = (len(ids_b) == num_other and set(ids_b) == {f"o{i}" for i in range(num_other)}
                   and all(r["status"] == "ok" for r in rb) and vb["completed"] == num_other)
    ids_a = [r["id"] for r in ra]
    victim_once = len(ids_a) == len(set(ids_a))
    statuses = {s: sum(r["status"] == s for r in ra) for s in {r["status"] for r in ra}}
    return {"results_at_cancel": at["results"], "victim": {k: va[k] for k in ("total", "submitted", "completed", "failed", "cancelled")},
            "victim_statuses": statuses, "victim_each_once": victim_once, "victim_status": va["status"],
            "completed_before_cancel": refused,
            "victim_accounted": va["completed"] + va["failed"] + va["cancelled"] == va["total"],
            "cancel_to_cancelled_seconds": round(cancel_seconds, 3), "other_items": num_other, "other_exact": other_exact}


def resume(data_dir: str, path: Path, num_items: int, tmp: Path) -> dict:
    name = "resume"
    out = tmp / "resume.jsonl"
    argv = _cmd("submit", path, "--data-dir", data_dir, "--job", name, "--model", "default", "--wait", "--out", out,
                "--out-format", "openai")
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait(lambda: (v := _view(data_dir, name)) is not None and v["submitted"] >= num_items // 2, 600, "half submitted")
    p.send_signal(signal.SIGKILL)
    p.wait(30)
    killed = store.view(data_dir, name)
    lines_before = sum(1 for _ in open(out)) if out.exists() else 0
    t0 = time.perf_counter()
    again = subprocess.run(argv + ["--resume"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - t0
    ids = [json.loads(line)["custom_id"] for f in (out, tmp / "resume.errors.jsonl") if f.exists() for line in open(f)]
    v = store.view(data_dir, name)
    m = SUBMITTED_RE.search(again.stderr)
    return {"killed_at_submitted": killed["submitted"], "killed_at_results": killed["results"],
            "output_lines_before": lines_before, "resume_exit": again.returncode, "resume_seconds": round(seconds, 3),
            "resubmitted": int(m.group(1)) if m else None, "output_lines": len(ids),
            "each_custom_id_once": len(ids) == len(set(ids)) == num_items and set(ids) == {f"r{i}" for i in range(num_items)},
            "status": v["status"], "completed": v["completed"], "results_counted": v["results"]}


def run(*, num_items: int = 100_000, repeats: int = 3, seed: int = 0, say=lambda line: None) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="shmb-jobs-"))
    try:
        path, other = tmp / "job.jsonl", tmp / "other.jsonl"
        tokens = make_file(path, num_items, seed, "r")
        num_other = max(1, num_items // 5)
        make_file(other, num_other, seed + 1, "o")
        broker = BenchBroker(str(tmp), "")  # the built-in configuration, its exporter on a free port
        try:
            broker.wait_ready()
            say(f"jobs: {num_items:,} items ({tokens:,} tokens) in {path.stat().st_size / 1e6:.0f} MB; progress runs")
            out = {"items": num_items, "tokens": tokens, "file_bytes": path.stat().st_size, "repeats": repeats}
            out["progress"] = progress(broker.data_dir, path, tmp, repeats)
            say(f"jobs: progress slowdown {out['progress']['slowdown']}; cancel run")
            out["cancel"] = cancel(broker.data_dir, path, other, num_items, num_other, tmp)
            say("jobs: resume run")
            out["resume"] = resume(broker.data_dir, path, num_items, tmp)
            say("jobs: chat file against token ids")
            out["chat"] = chat_against_ids(broker.data_dir, tmp, num_items, seed + 2, repeats, _submit_run)
        finally:
            broker.stop()
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
