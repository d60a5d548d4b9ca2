"""`/v1/embeddings` batch files through a real broker (`shmbroker supervise`, the simulated engine
with `task = "embed"`: each vector is a deterministic function of its prompt's tokens) with
`submit --job --wait`:

- strings, arrays of strings, token arrays and arrays of them, `float` and `base64`: every output
  line parses as `openai.types.CreateEmbeddingResponse`, its vectors in input order and each equal,
  bit for bit, to its input's own vector, `usage` counting the line's prompt tokens; every
  custom_id once;
- a line with a bad input fails alone (error file), naming it; one too long fails `too_long`,
  and `truncate_prompt_tokens` keeps its last tokens instead;
- SIGKILL of the GPU process, then of the whole broker and the submitter, mid-job: after `--resume`
  every line's vectors are complete and equal, once (lines of many inputs wait in `parts.bin`).
"""

from __future__ import annotations

import base64
import json
import random
import secrets
import signal
import subprocess
import sys

import numpy as np
import pytest
from support.bpetok import bpe_tokenizer_dir
from support.brokerproc import serve
from support.harness import wait_for

from shmbroker.cli import main
from shmbroker.engines.options import SimSettings
from shmbroker.engines.base import truncated
from shmbroker.engines.sim_embed import SimEmbedder
from shmbroker.jobs.text import Tokenizer
from shmbroker.request.options import Task

pytestmark = pytest.mark.timeout(240)

DIMS = 48
CONFIG = """
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "enc"
model = "enc"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 400
engine_settings = {{ mode = "padded", task = "embed", embed_dimensions = {dims}, matryoshka = true, pace_seconds = {pace}, batch_overhead_seconds = {overhead} }}
"""
WORDS = "the quick brown fox jumps over a lazy dog and runs far away into green hills".split()


def text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 40)))


def ids(rng: random.Random, longest: int = 380) -> list[int]:
    return [rng.randrange(1, 500) for _ in range(rng.randrange(1, longest))]


def write_lines(path, count: int, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        kind = i % 5
        inputs = [text(rng)] if kind == 0 else [text(rng) for _ in range(rng.randrange(2, 6))] if kind == 1 else \
            [ids(rng)] if kind == 2 else [ids(rng) for _ in range(rng.randrange(2, 9))]
        body = {"model": "enc", "input": inputs[0] if kind in (0, 2) else inputs}
        if kind == 4:
            body.update(input=[text(rng) for _ in range(3)], dimensions=16, user="u-1")
        if i % 2:
            body["encoding_format"] = "base64"
        rows.append({"custom_id": f"e-{i}", "method": "POST", "url": "/v1/embeddings", "body": body})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def expected(row: dict, tok: Tokenizer) -> tuple[list[np.ndarray], int]:
    """The vectors a line's inputs must get, and its prompt tokens."""
    body = row["body"]
    inputs = body["input"]
    if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)):
        inputs = [inputs]
    model = SimEmbedder(SimSettings(task=Task.EMBED, embed_dimensions=DIMS))
    tokens = [tok.encode(x, special_tokens=True) if isinstance(x, str) else np.array(x, np.uint32) for x in inputs]
    return [truncated(model.vector(t), body.get("dimensions")) for t in tokens], sum(t.size for t in tokens)


def check_outputs(out, rows: list[dict], tok: Tokenizer) -> None:
    from openai.types import CreateEmbeddingResponse

    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in lines) == sorted(r["custom_id"] for r in rows)  # each once
    by_id = {r["custom_id"]: r for r in lines}
    for row in rows:
        reply = by_id[row["custom_id"]]
        assert reply["error"] is None and reply["response"]["status_code"] == 200
        body = reply["response"]["body"]
        if row["body"].get("encoding_format") == "base64":  # the openai client decodes it so before its type
            assert all(isinstance(d["embedding"], str) for d in body["data"])
            body = {**body, "data": [{**d, "embedding": np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()}
                                     for d in body["data"]]}
        got = CreateEmbeddingResponse.model_validate(body)
        want, prompt_tokens = expected(row, tok)
        assert [d.index for d in got.data] == list(range(len(want)))
        assert got.usage.prompt_tokens == got.usage.total_tokens == prompt_tokens and got.model == "enc"
        for d, v in zip(got.data, want):
            vec = np.array(d.embedding, np.float32)
            assert vec.view(np.uint32).tolist() == v.view(np.uint32).tolist()  # bit-exact


def job_args(src, data_dir, name, tok, out):
    return ["submit", str(src), "--data-dir", data_dir, "--job", name, "--tokenizer", str(tok), "--wait",
            "--out", str(out), "--out-format", "openai"]


def test_embeddings_lines_come_back_in_order_bit_exact_and_bad_ones_alone(tmp_path):
    tokdir = bpe_tokenizer_dir(tmp_path / "tok")
    tok = Tokenizer(tokdir)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_lines(src, 300)
    bad = [{"custom_id": "mixed", "url": "/v1/embeddings", "body": {"model": "enc", "input": ["a", [1, 2]]}},
           {"custom_id": "fmt", "url": "/v1/embeddings", "body": {"model": "enc", "input": "a", "encoding_format": "hex"}},
           {"custom_id": "long", "url": "/v1/embeddings", "body": {"model": "enc", "input": [[7] * 10, [8] * 450]}},
           {"custom_id": "temp", "url": "/v1/embeddings", "body": {"model": "enc", "input": "a", "temperature": 1}}]
    cut = {"custom_id": "cut", "method": "POST", "url": "/v1/embeddings",
           "body": {"model": "enc", "input": [[9] * 450, [3, 4]], "truncate_prompt_tokens": 300}}
    with src.open("a") as fh:
        fh.write("".join(json.dumps(x) + "\n" for x in [*bad, cut]))
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "ej", CONFIG.format(dims=DIMS, pace=0.0, overhead=0.0)) as broker:
        name = "j-" + secrets.token_hex(3)
        assert main(job_args(src, broker.data_dir, name, tokdir, out)) == 1  # bad lines refused, the rest ran
        assert not (tmp_path / "b" / "data" / "jobs" / name / "parts.bin").exists()  # nothing waits at the end
    errors = {e["custom_id"]: e for e in map(json.loads, (tmp_path / "out.errors.jsonl").read_text().splitlines())}
    assert sorted(errors) == ["fmt", "long", "mixed", "temp"]
    assert "mix" in errors["mixed"]["error"]["message"] and "encoding_format" in errors["fmt"]["error"]["message"]
    assert "temperature" in errors["temp"]["error"]["message"]
    long_body = errors["long"]["response"]["body"]["error"]
    assert errors["long"]["response"]["status_code"] == 400 and long_body["code"] == "too_long"
    assert long_body["message"].startswith("input 1: 450 tokens")
    check_outputs(out, rows + [{**cut, "body": {"model": "enc", "input": [[9] * 300, [3, 4]]}}], tok)


def test_an_embeddings_job_survives_sigkills_of_the_gpu_process_the_broker_and_its_submitter(tmp_path):
    tokdir = bpe_tokenizer_dir(tmp_path / "tok")
    tok = Tokenizer(tokdir)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_lines(src, 400, seed=2)
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "ek", CONFIG.format(dims=DIMS, pace=1.0, overhead=0.03)) as broker:
        name = "j-" + secrets.token_hex(3)
        args = job_args(src, broker.data_dir, name, tokdir, out)
        p = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", *args], stderr=subprocess.DEVNULL)
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 40, 90, "forty lines written")
        broker.kill_role("gpu-enc")
        wait_for(lambda: len(out.read_text().splitlines()) >= 120, 90, "lines written after the GPU process's restart")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        assert (tmp_path / "b" / "data" / "jobs" / name / "parts.bin").exists()  # lines' vectors held
        broker.kill()  # SIGKILL: every broker process at once
        broker.start()
        assert main([*args, "--resume"]) == 0
    check_outputs(out, rows, tok)


def test_the_native_format_writes_a_line_of_vectors_whole(tmp_path):
    tokdir = bpe_tokenizer_dir(tmp_path / "tok")
    tok = Tokenizer(tokdir)
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    rows = write_lines(src, 40, seed=3)
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "en", CONFIG.format(dims=DIMS, pace=0.0, overhead=0.0)) as broker:
        args = job_args(src, broker.data_dir, "j-native", tokdir, out)
        assert main(args[: args.index("--out-format")]) == 0
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == sorted(r["custom_id"] for r in rows)
    for row in rows:
        want, tokens = expected(row, tok)
        line = got[row["custom_id"]]
        assert line["status"] == "ok" and line["prompt_tokens"] == tokens
        assert [np.array(v, np.float32).view(np.uint32).tolist() for v in line["embeddings"]] == \
            [v.view(np.uint32).tolist() for v in want]
