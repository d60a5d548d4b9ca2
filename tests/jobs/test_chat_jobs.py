"""Chat batch files with request options, as users write them for the OpenAI Batch API, through a
real broker (`shmbroker supervise`, the simulated engine) with `submit --job --tokenizer DIR`:
every line rendered with the model's chat template as transformers renders it, carried with its
options, and written back as `chat.completion` bodies the `openai` package parses; bad lines go
to the error file with their line numbers and the rest runs."""

from __future__ import annotations

import json
import secrets

import numpy as np
import pytest
from support.brokerproc import serve
from support.chattok import WORDS, tokenizer_dir

from shmbroker.cli import main
from shmbroker.engines.sim import Sim
from shmbroker.engines.sim_requests import sample_key, sampled_result
from shmbroker.request.extras import decode_extras
from shmbroker.request.options import parse_options

pytestmark = pytest.mark.timeout(180)

CONFIG = """
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "fast"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 1024
engine_settings = { mode = "packed", cache_tokens = 262144 }
"""
def run_job(tmp_path, lines: list, prefix: str, config: str, *args: str):
    """The lines as a job through a broker of `config`, `submit --wait --out-format openai` (with
    `args`); (its exit code, the output file)."""
    src = tmp_path / "chat.jsonl"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.jsonl"
    (tmp_path / "b").mkdir()
    with serve(tmp_path / "b", prefix, config) as broker:
        code = main(["submit", str(src), "--data-dir", broker.data_dir, "--job", f"{prefix}-" + secrets.token_hex(3),
                     *args, "--wait", "--out", str(out), "--out-format", "openai"])
    return code, out


def chat_line(i: int, body: dict) -> str:
    return json.dumps({"custom_id": f"c-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})


def test_a_chat_batch_file_with_options_runs_and_reads_back_with_the_openai_types(tmp_path, capsys):
    from openai.types.chat import ChatCompletion
    from transformers import AutoTokenizer

    tok_dir = tokenizer_dir(tmp_path)
    rng = np.random.default_rng(4)
    bodies = []
    for i in range(40):
        messages = [{"role": "system", "content": "w1 w2 w3"},
                    {"role": "user", "content": " ".join(rng.choice(WORDS, 12).tolist())}]
        body = {"model": "default", "messages": messages, "max_completion_tokens": 6, "temperature": 0.7, "seed": i}
        if i % 4 == 0:
            body["n"] = 2
        bodies.append(body)
    lines = [chat_line(i, b) for i, b in enumerate(bodies)]
    lines.append(chat_line(40, {"messages": [{"role": "user", "content": "w1"}], "response_format": {"type": "json"}}))
    lines.append(chat_line(41, {"messages": [{"role": "robot", "content": "w1"}]}))
    code, out = run_job(tmp_path, lines, "cj", CONFIG, "--model", "default", "--tokenizer", str(tok_dir))
    err = capsys.readouterr().err
    assert code == 1, err  # two lines refused
    assert "chat.jsonl:41: 'response_format.type' must be text, json_object or json_schema" in err
    assert "chat.jsonl:42: messages[0].role must be one of" in err
    hf = AutoTokenizer.from_pretrained(str(tok_dir))
    got = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(got) == sorted(f"c-{i}" for i in range(40))
    for i, body in enumerate(bodies):
        row = got[f"c-{i}"]
        reply = ChatCompletion.model_validate(row["response"]["body"])
        prompt = hf.apply_chat_template(body["messages"], tokenize=True, add_generation_prompt=True)
        prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
        assert reply.usage.prompt_tokens == len(prompt)
        assert len(reply.choices) == body.get("n", 1)
        # the simulated engine's samples for this prompt under this seed, decoded
        item_id = int(row["id"].removeprefix("batch_req_"), 16)
        opts = parse_options({k: body[k] for k in ("temperature", "seed", "n") if k in body})
        key = sample_key(item_id, Sim.digest(np.array(prompt, np.uint32)), opts)
        tokens, extras = sampled_result(item_id, key, 6, opts, lambda keys, counts: Sim.generated_many(
            np.repeat(np.array([item_id], np.uint64), keys.size), counts, keys=keys).flat)
        want = decode_extras(extras, tokens.size)
        # decoded after the prompt's last ids, as an engine's incremental detokenizer writes its output
        head = hf.decode(prompt[-5:], skip_special_tokens=True)
        texts = [hf.decode(prompt[-5:] + t.tolist(), skip_special_tokens=True)[len(head):]
                 for t in np.split(tokens, np.cumsum(want.lengths)[:-1])]
        assert [c.message.content for c in reply.choices] == texts
        assert [c.finish_reason for c in reply.choices] == list(want.finish_reasons)
        assert reply.object == "chat.completion" and reply.choices[0].message.role == "assistant"
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert sorted(e["error"]["line"] for e in errors) == [41, 42]


def test_the_brokers_tokenizers_table_serves_chat_lines_without_a_tokenizer_flag(tmp_path, capsys):
    """A model's tokenizer declared once in the broker's configuration (`[tokenizers]`) renders and
    decodes a chat file submitted without --tokenizer; a line of a model with none is refused alone,
    saying where a tokenizer comes from."""
    from openai.types.chat import ChatCompletion
    from transformers import AutoTokenizer

    tok_dir = tokenizer_dir(tmp_path)
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    lines = [chat_line(i, {"messages": messages, "max_tokens": 4, "seed": i, "temperature": 1.0})  # the default model
             for i in range(3)]
    lines.append(chat_line(3, {"model": "other", "messages": messages}))
    code, out = run_job(tmp_path, lines, "ct", CONFIG + f'\n[tokenizers]\ndefault = "{tok_dir}"\n')
    err = capsys.readouterr().err
    assert code == 1, err
    assert "chat.jsonl:4: a chat request needs --tokenizer" in err and "[tokenizers]" in err
    want = AutoTokenizer.from_pretrained(str(tok_dir)).apply_chat_template(messages, add_generation_prompt=True)
    want = len(want if isinstance(want, list) else want["input_ids"])
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted(r["custom_id"] for r in rows) == ["c-0", "c-1", "c-2"], err
    for row in rows:
        reply = ChatCompletion.model_validate(row["response"]["body"])
        assert reply.usage.prompt_tokens == want
        assert reply.usage.completion_tokens == 4 and isinstance(reply.choices[0].message.content, str)


def test_logprobs_come_back_in_both_endpoints_as_the_api_writes_them(tmp_path):
    """Chat lines asking logprobs (with top_logprobs, and n = 2) and a completions line asking a
    logprobs count: the simulated engine's modeled logprobs come back per token, with its top tokens,
    in the API's two shapes, each parsed by the openai package's own types."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    from shmbroker.engines.sim_requests import modeled_logprobs
    from shmbroker.jobs.text import Tokenizer

    tok_dir = tokenizer_dir(tmp_path)
    tok = Tokenizer(tok_dir)
    messages = [{"role": "user", "content": "w7 w8 w9"}]
    lines = [chat_line(0, {"messages": messages, "max_tokens": 5, "logprobs": True, "top_logprobs": 3, "seed": 1,
                           "temperature": 1.0, "n": 2}),
             chat_line(1, {"messages": messages, "max_tokens": 4, "logprobs": True}),
             json.dumps({"custom_id": "t-2", "method": "POST", "url": "/v1/completions",
                         "body": {"prompt": [5, 6, 7], "max_tokens": 4, "logprobs": 2}})]
    code, out = run_job(tmp_path, lines, "lp", CONFIG, "--tokenizer", str(tok_dir))
    assert code == 0
    rows = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    two = ChatCompletion.model_validate(rows["c-0"]["response"]["body"])
    assert len(two.choices) == 2
    for choice in two.choices:
        content = choice.logprobs.content
        assert 1 <= len(content) <= 5 and all(len(c.top_logprobs) == 3 for c in content)
        for c in content:
            assert c.top_logprobs[0].logprob == c.logprob and c.bytes == list(c.token.encode())
            assert c.top_logprobs[1].logprob == pytest.approx(c.logprob - 0.5)
    one = ChatCompletion.model_validate(rows["c-1"]["response"]["body"])
    assert all(c.top_logprobs == [] for c in one.choices[0].logprobs.content)
    done = Completion.model_validate(rows["t-2"]["response"]["body"])
    lp = done.choices[0].logprobs
    tokens = np.array(rows["t-2"]["response"]["body"]["choices"][0]["token_ids"], np.uint32)
    want = modeled_logprobs(tokens, 2)
    assert lp.token_logprobs == pytest.approx(want.token.tolist())
    assert lp.tokens == [tok.token_text(t) for t in tokens.tolist()]
    # a text -> logprob map a token, as the API writes it (two ids of one text keep one entry)
    for d, top in zip(lp.top_logprobs, want.top.tolist()):
        assert max(d.values()) == pytest.approx(top[0]) and all(any(v == pytest.approx(x) for x in top) for v in d.values())
    assert lp.text_offset[0] == 0 and len(lp.text_offset) == tokens.size
