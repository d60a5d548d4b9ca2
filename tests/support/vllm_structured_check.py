"""A chat batch file of structured-output lines through a broker with a real vLLM behind it (run by
tests/engines/test_vllm_structured.py under .venv-vllm; prints one JSON object, the last line):

    .venv-vllm/bin/python tests/support/vllm_structured_check.py WORK_DIR

The lines: `response_format` json_schema (three schemas: nested objects, enums, arrays, `$defs`),
json_object, vLLM's `structured_outputs` choice and regex, forced tool calls (a named function and
"required") and `/v1/responses` lines, and one line whose schema xgrammar cannot compile (a json_schema `text.format`, and plain text); every line at
temperature 0. The model is the tests' tiny random Llama with a byte-level BPE tokenizer trained
here (a word-level one cannot spell JSON) and a ChatML template that renders the tools.

1. The reference: every line through vLLM's own `LLM.chat`, one request at a time, with the
   structured-output parameters vLLM's server would build for it (the tool schemas by vLLM's own
   `get_json_schema_from_tools`), on an engine with the broker consumer's settings.
2. `shmbroker submit FILE --job --wait --out-format openai` against a broker whose consumer is
   engine = "vllm"; then, on the same broker, the file through its HTTP role with `openai`.
3. `vllm serve` on the same model and the same file against a broker whose consumer is
   engine = "openai" pointed at it.
The test asserts on the report; this script only runs and records.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support import vllm_chat_check as chat  # noqa: E402
from support.bpetok import bpe_tokenizer_dir  # noqa: E402

VOCAB = 512
MAX_NEW = 96
BLOCK = 32
CONTRACT = {"max_batch_size": 4, "max_batch_tokens": 2048, "max_input_len": 512}
EXTRA = {"block_size": BLOCK, "num_gpu_blocks_override": 128}
SETTINGS = {"dtype": "float32", "max_new_tokens": MAX_NEW, "gpu_memory_utilization": 0.15, "seed": 0,
            "enforce_eager": True, "structured_outputs_backend": "xgrammar", "disable_any_whitespace": True}
SERVED = chat.SERVED
WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SCHEMAS = [
    {"type": "object", "properties": {"name": WORD, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]}, "tags": {"type": "array", "items": WORD, "maxItems": 3},
        "inner": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -5, "maximum": 5}},
                  "required": ["x"], "additionalProperties": False}},
     "required": ["color", "tags", "inner"], "additionalProperties": False},
    {"type": "object", "$defs": {"point": {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["x", "y"], "additionalProperties": False}},
     "properties": {"points": {"type": "array", "items": {"$ref": "#/$defs/point"}, "minItems": 1, "maxItems": 2},
                    "label": {"enum": ["a", "b"]}},
     "required": ["points", "label"], "additionalProperties": False},
]
BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}, "required": ["a"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": WORD, "unit": {"enum": ["c", "f"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer", "minimum": 0, "maximum": 9}},
             "required": ["a", "b"], "additionalProperties": False}}}]


def tiny_model(path: Path) -> str:
    """The tests' tiny random Llama with the byte-level BPE tokenizer of `support/bpetok.py`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(bpe_tokenizer_dir(path, VOCAB))


def lines() -> list[dict]:
    """The file's lines: (url, body)."""
    out = []
    for k in range(12):
        user = [{"role": "user", "content": f"record {k}: the quick brown fox"}]
        body = {"model": SERVED, "messages": user, "max_completion_tokens": MAX_NEW, "temperature": 0.0}
        kind = k % 6
        if kind < 3:
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": f"s{kind}", "schema": SCHEMAS[kind], "strict": True}}
        elif kind == 3:
            body["response_format"] = {"type": "json_object"}
        elif kind == 4:
            body["structured_outputs"] = {"choice": ["yes", "no", "maybe"]}
        else:
            body["structured_outputs"] = {"regex": "[a-z]{3,8}-[0-9]{2}"}
        out.append(("/v1/chat/completions", body))
    for k in range(4):
        user = [{"role": "user", "content": f"call {k}: the lazy dog"}]
        choice = "required" if k == 3 else {"type": "function", "function": {"name": TOOLS[k % 2]["function"]["name"]}}
        body = {"model": SERVED, "messages": user, "tools": TOOLS, "tool_choice": choice,
                "max_completion_tokens": MAX_NEW, "temperature": 0.0}
        if k == 3:  # one call: a random model would repeat calls until max_tokens
            body["parallel_tool_calls"] = False
        out.append(("/v1/chat/completions", body))
    for k in range(2):
        body = {"model": SERVED, "input": f"respond {k}: jumps over", "instructions": "be brief",
                "max_output_tokens": MAX_NEW, "temperature": 0.0}
        if k == 0:
            body["text"] = {"format": {"type": "json_schema", "name": "resp", "schema": SCHEMAS[0], "strict": True}}
        out.append(("/v1/responses", body))
    out.append(("/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "bad"}],
                                         "response_format": {"type": "json_schema", "json_schema": {
                                             "name": "bad", "schema": BAD_SCHEMA}}, "max_completion_tokens": 8}))
    return out


def batch_file(path: Path, reqs) -> Path:
    path.write_text("".join(json.dumps({"custom_id": f"line-{k}", "method": "POST", "url": url, "body": b}) + "\n"
                            for k, (url, b) in enumerate(reqs)))
    return path


def constraint(url: str, body: dict):
    """(the StructuredOutputsParams vLLM's server builds for the line, its tools)."""
    from vllm.entrypoints.openai.chat_completion.protocol import (
        ChatCompletionNamedToolChoiceParam,
        ChatCompletionToolsParam,
    )
    from vllm.sampling_params import StructuredOutputsParams
    from vllm.tool_parsers.utils import get_json_schema_from_tools

    if url == "/v1/responses":
        fmt = (body.get("text") or {}).get("format")
        return (StructuredOutputsParams(json=fmt["schema"]) if fmt else None), None
    if "tools" in body:
        choice = body["tool_choice"]
        tools = [ChatCompletionToolsParam.model_validate(t) for t in body["tools"]]
        if isinstance(choice, dict):
            choice = ChatCompletionNamedToolChoiceParam.model_validate(choice)
        schema = get_json_schema_from_tools(choice, tools, body.get("parallel_tool_calls"))
        return StructuredOutputsParams(json=schema), body["tools"]
    rf = body.get("response_format")
    if rf is not None:
        return (StructuredOutputsParams(json_object=True) if rf["type"] == "json_object"
                else StructuredOutputsParams(json=rf["json_schema"]["schema"])), None
    return StructuredOutputsParams(**body["structured_outputs"]), None


def messages_of(url: str, body: dict) -> list[dict]:
    if url == "/v1/responses":
        return [{"role": "system", "content": body["instructions"]}, {"role": "user", "content": body["input"]}]
    return body["messages"]


def reference(model: str, reqs) -> dict:
    """custom_id -> vLLM's own LLM.chat answer: its text, finish reason and prompt length."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, SamplingParams
    from vllm.config import StructuredOutputsConfig

    from shmbroker.engines.vllm import llvmlite_scan_workaround

    llvmlite_scan_workaround()
    llm = LLM(**engine_args(model), structured_outputs_config=StructuredOutputsConfig(
        backend=SETTINGS["structured_outputs_backend"], disable_any_whitespace=SETTINGS["disable_any_whitespace"]))
    out = {}
    try:
        for k, (url, body) in enumerate(reqs):
            if body.get("response_format", {}).get("json_schema", {}).get("schema") == BAD_SCHEMA:
                continue  # its backend cannot compile it: vLLM refuses the request (the broker's error line)
            so, tools = constraint(url, body)
            params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, structured_outputs=so)
            (res,) = llm.chat([messages_of(url, body)], params, use_tqdm=False, tools=tools)
            c = res.outputs[0]
            out[f"line-{k}"] = {"text": c.text, "finish_reason": c.finish_reason,
                                "prompt_tokens": len(res.prompt_token_ids)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return out


def engine_args(model: str) -> dict:
    return dict(model=model, enable_prefix_caching=False, max_num_seqs=CONTRACT["max_batch_size"],
                max_model_len=CONTRACT["max_input_len"] + MAX_NEW,
                max_num_batched_tokens=max(CONTRACT["max_batch_tokens"], CONTRACT["max_input_len"] + MAX_NEW),
                dtype=SETTINGS["dtype"], gpu_memory_utilization=SETTINGS["gpu_memory_utilization"],
                seed=SETTINGS["seed"], enforce_eager=True, **EXTRA)


def broker_config(model: str) -> str:
    extra = ", ".join(f"{k} = {v}" for k, v in EXTRA.items())
    settings = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SETTINGS.items())
    contract = "\n".join(f"{k} = {v}" for k, v in CONTRACT.items())
    return (f'instance = "vllmstruct{os.getpid()}"\nblock_tokens = {BLOCK}\ningest_ring_bytes = 1048576\n'
            f"result_ring_bytes = 1048576\nsegment_bytes = 4194304\nindex_items = 65536\nmax_wait_seconds = 1.0\n\n"
            f'[[consumers]]\nname = "cpu"\nengine = "vllm"\nmodel = "{SERVED}"\n{contract}\n\n'
            f"[consumers.engine_settings]\nmodel = {json.dumps(model)}\n{settings}\nextra = {{ {extra} }}\n"
            f'\n[tokenizers]\n"{SERVED}" = {json.dumps(model)}\n\n'
            f'[http]\naddr = "127.0.0.1:0"\n\n[http.keys]\ncheck = "{chat.HTTP_KEY}"\n')


def through_engine(work: Path, config: str, src: Path, model: str) -> tuple[dict, dict]:
    """(the file through `submit`, the file through the HTTP role as two batches, one per endpoint:
    a batch's lines all name its endpoint), each with the broker's exit code and log."""
    from support.brokerproc import BrokerProc

    broker = BrokerProc(work, config)
    broker.start(ready_timeout_seconds=180)
    try:
        run = chat.submitted(broker.data_dir, work, src, model, None)
        http = {"out": [], "errors": [], "batches": [], "submitter_log": ""}
        for url in ("/v1/chat/completions", "/v1/responses"):
            part = work / f"http-{url.rsplit('/', 1)[-1]}.jsonl"
            part.write_text("".join(x + "\n" for x in src.read_text().splitlines() if json.loads(x)["url"] == url))
            got = chat.through_http(broker.data_dir, part, endpoint=url)
            http["out"] += got["out"]
            http["errors"] += got["errors"]
            http["batches"].append(got["batch"])
            http["submitter_log"] += got["submitter_log"]
    finally:
        exit_code = broker.stop(120)
    for r in (run, http):
        r.update(supervisor_exit=exit_code, log_tail=r.pop("submitter_log", "") + broker.log()[-3000:])
    return run, http


def serve_patch():
    """`vllm_chat_check.vllm_serve` with this check's contract and structured-output settings."""
    chat.CONTRACT.update(CONTRACT)
    chat.MAX_NEW = MAX_NEW
    chat.EXTRA.update(EXTRA)
    chat.SETTINGS.update({k: SETTINGS[k] for k in ("dtype", "seed", "gpu_memory_utilization")})


def main(work: str) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    work_dir = Path(work)
    model = tiny_model(work_dir / "model")
    reqs = lines()
    src = batch_file(work_dir / "structured.jsonl", reqs)
    ref = reference(model, reqs)
    engine, http = through_engine(work_dir / "engine", broker_config(model), src, model)
    serve_patch()
    served = chat.through_served(work_dir, model, src, ["--structured-outputs-config", json.dumps({
        "backend": SETTINGS["structured_outputs_backend"], "disable_any_whitespace": SETTINGS["disable_any_whitespace"]}),
        "--enforce-eager"])
    print(json.dumps({"requests": reqs, "reference": ref, "vllm_engine": engine, "http": http,
                      "vllm_serve": served}))
    return 0


if __name__ == "__main__":
    chat.run(main)
