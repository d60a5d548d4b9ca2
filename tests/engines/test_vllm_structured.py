"""Structured outputs through a broker with a real vLLM behind it (`tests/support/vllm_structured_check.py`
under `.venv-vllm`), three ways: a `vllm` consumer with `submit`; the same broker's HTTP role driven by
the `openai` package; an `openai` consumer in front of a real `vllm serve`.

- every chat output line parses as `ChatCompletion`, every `/v1/responses` line as `Response`;
- every output equals vLLM's own `LLM.chat` with the same structured-output parameters at
  temperature 0 (the tool schemas built by vLLM's own `get_json_schema_from_tools`);
- every json_schema output parses and validates against its own line's schema, every choice is one
  of its choices, every regex output matches, every forced tool call's arguments validate against
  its function's parameters (`finish_reason` "tool_calls"); a json_object output that ended (`stop`)
  parses as an object (the random model may write a key until max_tokens: then it equals vLLM's own);
- the line whose schema the backend cannot compile fails alone, `invalid`, with xgrammar's message,
  as an error line (400); every other line runs;
- through HTTP both batches (chat and responses) end `completed`.
"""

from __future__ import annotations

import json
import re

import pytest
from support.vllm_venv import check_report


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return check_report("vllm_structured_check.py", tmp_path_factory.mktemp("vllm-structured"), 1500)


def _validate(value, schema) -> None:
    import jsonschema

    jsonschema.validate(value, schema)


def _check_line(url: str, body: dict, reply: dict, want: dict) -> None:
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    if url == "/v1/responses":
        r = Response.model_validate(reply)
        assert r.status == ("completed" if want["finish_reason"] == "stop" else "incomplete")
        text = r.output[0].content[0].text
        assert text == want["text"]
        assert r.usage.input_tokens == want["prompt_tokens"] and r.usage.input_tokens_details.cached_tokens >= 0
        fmt = (body.get("text") or {}).get("format")
        if fmt:
            _validate(json.loads(text), fmt["schema"])
        return
    c = ChatCompletion.model_validate(reply)
    assert c.usage.prompt_tokens == want["prompt_tokens"]
    choice = c.choices[0]
    if "tools" in body:
        assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, (body, reply)
        params = {t["function"]["name"]: t["function"]["parameters"] for t in body["tools"]}
        args = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
        for name, value in args:
            _validate(value, params[name])
        if isinstance(body["tool_choice"], dict):
            assert [n for n, _ in args] == [body["tool_choice"]["function"]["name"]]
            assert choice.message.tool_calls[0].function.arguments == want["text"]
        else:
            assert [{"name": n, "parameters": v} for n, v in args] == json.loads(want["text"])
        return
    text = choice.message.content
    assert text == want["text"] and choice.finish_reason == want["finish_reason"], (body, text, want)
    rf, so = body.get("response_format"), body.get("structured_outputs")
    if rf and rf["type"] == "json_schema":
        assert choice.finish_reason == "stop"
        _validate(json.loads(text), rf["json_schema"]["schema"])
    elif rf:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(text), dict)
    elif "choice" in so:
        assert text in so["choice"]
    else:
        assert re.fullmatch(so["regex"], text)


@pytest.mark.timeout(1600)
@pytest.mark.parametrize("way", ["vllm_engine", "http", "vllm_serve"])
def test_structured_lines_through_a_real_vllm_validate_and_equal_vllms_own_chat(report, way):
    reqs, ref, run = report["requests"], report["reference"], report[way]
    assert run["supervisor_exit"] == 0, run["log_tail"]
    if way == "http":
        assert [b["status"] for b in run["batches"]] == ["completed", "completed"], (run["batches"], run["log_tail"])
    else:
        assert run["submit_exit"] == 0, run["log_tail"]
    got = {row["custom_id"]: row for row in run["out"]}
    assert sorted(got) == sorted(ref), (run["errors"], run["log_tail"])
    (bad,) = run["errors"]  # the uncompilable schema's line, alone
    assert bad["custom_id"] == f"line-{len(reqs) - 1}" and bad["response"]["status_code"] == 400, bad
    error = bad["response"]["body"]["error"]
    assert error["code"] == "invalid" and "grammar" in error["message"] and "parenthesis" in error["message"], error
    for cid, want in ref.items():
        url, body = reqs[int(cid.removeprefix("line-"))]
        _check_line(url, body, got[cid]["response"]["body"], want)
    schema_lines = [c for c, (u, b) in zip(ref, reqs) if "response_format" in b and b["response_format"]["type"] != "json_object"]
    assert len(schema_lines) >= 6 and all(ref[c]["finish_reason"] == "stop" for c in schema_lines)
