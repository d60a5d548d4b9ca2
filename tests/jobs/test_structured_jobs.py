"""Structured-output batch files through a real broker (`shmbroker supervise`, the simulated engine
with a byte-level BPE tokenizer: it writes text that meets each constraint) with `submit --job`:

- json_schema, json_object, choice, forced tool calls and `/v1/responses` lines come back as the
  API's types, each output valid for its own line's constraint;
- a thousand lines sharing a schema store it once (`payloads/`), and the job survives a SIGKILL of
  the whole broker and of its submitter: after a restart and `--resume`, every line's output still
  validates;
- a payload whose bytes rotted fails its items `corrupt`, never unconstrained, and one that was never
  stored too; a schema over `max_payload_bytes` fails its line alone, naming the limit.
"""

from __future__ import annotations

import json
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.bpetok import bpe_tokenizer_dir
from support.brokerproc import serve
from support.harness import wait_for

from shmbroker.cli import main
from shmbroker.client.producer import Producer
from shmbroker.disk.payloads import DIR_NAME
from shmbroker.request.options import RequestOptions, parse_options
from shmbroker.request.structured import Constraint, Structured, digest_of

pytestmark = pytest.mark.timeout(240)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "minLength": 2}, "age": {"type": "integer", "minimum": 3}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green"]}, "tags": {"type": "array", "items": {"type": "string"},
                                                                                      "minItems": 2}}},
    {"type": "object", "$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
     "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/p"}, "minItems": 1}}, "required": ["points"]},
]
TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONFIG = """
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2
max_payload_bytes = 4096

[[consumers]]
name = "sim"
max_batch_size = 16
max_batch_tokens = 65536
max_input_len = 2048
engine_settings = {{ mode = "packed", cache_tokens = 262144, pace_seconds = {pace}, tokenizer = "{tok}" }}
"""


def body_of(i: int) -> tuple[str, dict]:
    user = [{"role": "user", "content": f"the quick brown fox {i}"}]
    base = {"model": "default", "messages": user, "max_completion_tokens": 64}
    kind = i % 6
    if kind < 3:
        return "/v1/chat/completions", {**base, "response_format": {"type": "json_schema", "json_schema": {
            "name": f"s{kind}", "schema": SCHEMAS[kind], "strict": True}}}
    if kind == 3:
        return "/v1/chat/completions", {**base, "structured_outputs": {"choice": ["yes", "no", "maybe"]}, "n": 2}
    if kind == 4:
        return "/v1/chat/completions", {**base, "tools": TOOLS, "tool_choice": "required" if i % 12 == 4 else {
            "type": "function", "function": {"name": "get"}}}
    return "/v1/responses", {"model": "default", "input": f"jumps over {i}", "max_output_tokens": 64,
                             "text": {"format": {"type": "json_object"}}}


def write_file(path, count: int):
    bodies = [body_of(i) for i in range(count)]
    path.write_text("".join(json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": u, "body": b}) + "\n"
                            for i, (u, b) in enumerate(bodies)))
    return bodies


def check_outputs(out, bodies) -> None:
    import jsonschema
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == sorted(f"c-{i}" for i in range(len(bodies)))
    for i, (url, body) in enumerate(bodies):
        reply = got[f"c-{i}"]["response"]["body"]
        if url == "/v1/responses":
            r = Response.model_validate(reply)
            assert r.status == "completed" and isinstance(json.loads(r.output[0].content[0].text), dict)
            continue
        c = ChatCompletion.model_validate(reply)
        if "tools" in body:
            (choice,) = c.choices
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                assert call.function.name == "get"
                jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
        elif "structured_outputs" in body:
            assert len(c.choices) == 2 and all(ch.message.content in ("yes", "no", "maybe") for ch in c.choices)
        else:
            (choice,) = c.choices
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content), body["response_format"]["json_schema"]["schema"])


def submit_args(src, data_dir, name, tok, out):
    return ["submit", str(src), "--data-dir", data_dir, "--job", name, "--tokenizer", str(tok), "--wait",
            "--out", str(out), "--out-format", "openai"]


def test_structured_lines_come_back_valid_and_a_shared_schema_is_stored_once(tmp_path):
    tok = bpe_tokenizer_dir(tmp_path / "tok")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = write_file(src, 1200)
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "sj", CONFIG.format(pace=0.0, tok=tok)) as broker:
        assert main(submit_args(src, broker.data_dir, "j-" + secrets.token_hex(3), tok, out)) == 0
        payloads = sorted((Path(broker.data_dir) / DIR_NAME).iterdir())
    check_outputs(out, bodies)
    # three schemas, the choices, the named and the required call's schemas: six payloads for 1,200 lines
    assert len(payloads) == 6, payloads
    assert sum(p.stat().st_size for p in payloads) < 4096


def test_a_rotted_or_missing_payload_fails_its_items_corrupt_and_an_oversized_one_its_line(tmp_path):
    tok = bpe_tokenizer_dir(tmp_path / "tok")
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "sc", CONFIG.format(pace=0.0, tok=tok)) as broker:
        d = broker.data_dir
        with Producer("rot", data_dir=d) as p:
            opts = parse_options({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}})
            s = opts.structured
            assert p.put_payload(s.payload) == s.digest
            path = Path(d) / DIR_NAME / f"{s.digest.hex()}.bin"
            raw = bytearray(path.read_bytes())
            raw[-5] ^= 0x20  # a flipped bit in the schema's text
            path.write_bytes(bytes(raw))
            prompt = np.arange(1, 40, dtype=np.uint32)
            rotted = p.submit(prompt, max_new_tokens=16, options=opts)
            missing = p.submit(prompt, max_new_tokens=16, options=RequestOptions(
                structured=Structured(Constraint.JSON, digest_of(b'{"type":"object"}'))))
            fine = p.submit(prompt, max_new_tokens=16, options={"structured_outputs": {"choice": ["a", "b"]}})
            got = {}
            wait_for(lambda: got.update({r.item_id: r for r in p.results(0.5)}) or len(got) == 3, 60, "three results")
        assert got[rotted].status == "corrupt" and "do not hash to its digest" in got[rotted].error
        assert got[missing].status == "corrupt" and "is not in" in got[missing].error
        assert got[fine].status == "ok"
        big = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40} for i in range(100)}}
        src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
        lines = [{"custom_id": "big", "url": "/v1/chat/completions", "body": {
                     "messages": [{"role": "user", "content": "a"}], "response_format": {
                         "type": "json_schema", "json_schema": {"name": "big", "schema": big}}}},
                 {"custom_id": "ok", "url": "/v1/chat/completions", "body": {
                     "messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}}}]
        src.write_text("".join(json.dumps(x) + "\n" for x in lines))
        assert main(submit_args(src, d, "j-big", tok, out)) == 1  # one line refused, the other ran
        errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
        assert [e["custom_id"] for e in errors] == ["big"] and "max_payload_bytes = 4096" in errors[0]["error"]["message"]
        assert [json.loads(x)["custom_id"] for x in out.read_text().splitlines()] == ["ok"]


def test_a_structured_job_survives_a_sigkill_of_the_whole_broker_and_its_submitter(tmp_path):
    tok = bpe_tokenizer_dir(tmp_path / "tok")
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    bodies = write_file(src, 240)
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "sk", CONFIG.format(pace=0.5, tok=tok)) as broker:
        name = "j-" + secrets.token_hex(3)
        args = submit_args(src, broker.data_dir, name, tok, out)
        p = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", *args], stderr=subprocess.DEVNULL)
        wait_for(lambda: out.exists() and len(out.read_text().splitlines()) >= 20, 90, "twenty results written")
        p.send_signal(signal.SIGKILL)
        p.wait(10)
        broker.kill()  # SIGKILL: every broker process at once
        broker.start()
        assert main([*args, "--resume"]) == 0
    check_outputs(out, bodies)


def test_one_item_with_its_own_large_schema_runs(tmp_path):
    """A 50 KB schema of one item alone (under the default max_payload_bytes, 1 MiB): stored, read back
    and honoured like a shared one."""
    import jsonschema
    from tokenizers import Tokenizer

    tok = bpe_tokenizer_dir(tmp_path / "tok")
    big = {"type": "object", "required": ["p0", "p1"],
           "properties": {f"p{i}": {"type": "string", "description": "w" * 120} for i in range(400)}}
    config = CONFIG.format(pace=0.0, tok=tok).replace("max_payload_bytes = 4096\n", "")
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", "sl", config) as broker:
        with Producer("large", data_dir=broker.data_dir) as p:
            opts = parse_options({"response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": big}}})
            assert len(opts.structured.payload) > 50_000
            item = p.submit(np.arange(1, 30, dtype=np.uint32), max_new_tokens=64, options=opts)
            got = []
            wait_for(lambda: got.extend(p.results(0.5)) or got, 60, "its result")
        stored = list((Path(broker.data_dir) / DIR_NAME).iterdir())
    (r,) = got
    assert r.item_id == item and r.status == "ok"
    jsonschema.validate(json.loads(Tokenizer.from_file(str(tok / "tokenizer.json")).decode(r.tokens.tolist())), big)
    assert len(stored) == 1 and stored[0].stat().st_size == len(opts.structured.payload) + 48
