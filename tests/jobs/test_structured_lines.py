"""Batch lines that carry a schema: `response_format` and `structured_outputs` on chat and
completions lines, forced tool calls, and `/v1/responses` lines; read with errors that name the
field, and their outputs shaped as the API's types."""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.chattok import tokenizer_dir

from shmbroker.jobs.openai_batch import RESPONSES, ok_body, parse_request
from shmbroker.jobs.text import Tokenizer
from shmbroker.jobs.tools import ToolCall, forced_call
from shmbroker.request.structured import Constraint

TOOLS = [{"type": "function", "function": {"name": "get", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "put", "parameters": {
             "type": "object", "$defs": {"v": {"type": "integer"}}, "properties": {"v": {"$ref": "#/$defs/v"}}}}}]
USER = [{"role": "user", "content": "w1 w2"}]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(tokenizer_dir(tmp_path_factory.mktemp("tok")))


def line(url, body, cid="r"):
    return {"custom_id": cid, "method": "POST", "url": url, "body": body}


def test_a_schema_line_carries_its_constraint(tok):
    body = {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {
        "name": "s", "schema": {"type": "object"}}}, "temperature": 0.0}
    p = parse_request(line("/v1/chat/completions", body), 1, tok)
    assert p.options.structured.kind == Constraint.JSON and p.options.temperature == 0.0
    p = parse_request(line("/v1/completions", {"prompt": [1, 2], "structured_outputs": {"choice": ["a", "b"]}}), 2)
    assert p.options.structured.kind == Constraint.CHOICE and p.reply is None


def test_forced_tool_calls_are_decoded_under_vllms_schemas():
    call, s = forced_call({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get"}}})
    assert call == ToolCall("get") and json.loads(s.payload) == TOOLS[0]["function"]["parameters"]
    call, s = forced_call({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False})
    schema = json.loads(s.payload)
    assert call == ToolCall(None) and schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get"], ["put"]]
    assert schema["$defs"] == {"v": {"type": "integer"}}  # the functions' $defs lifted to the top, as vLLM does
    assert forced_call({"tools": TOOLS, "tool_choice": "none"}) == (None, None)
    for body, words in [({"tools": TOOLS}, "auto"), ({"tools": TOOLS, "tool_choice": "auto"}, "auto"),
                        ({"tool_choice": "required"}, "needs 'tools'"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
                        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "function tools"),
                        ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "twice")]:
        with pytest.raises(ValueError, match=words):
            forced_call(body)


class _Result:
    def __init__(self, tokens, reasons, item_id=0x2A):
        self.item_id, self.status, self.error = item_id, "ok", None
        self.samples = [np.asarray(t, np.uint32) for t in tokens]
        self.tokens = np.concatenate(self.samples)
        self.finish_reasons, self.cached_tokens, self.logprobs = reasons, 3, None


def test_a_forced_call_comes_back_as_tool_calls(tok):
    from openai.types.chat import ChatCompletion

    entry = {"endpoint": "/v1/chat/completions", "n": 5, "max_new": 16, "model": "m", **ToolCall("get").entry()}
    body = ok_body(_Result([[1, 2]], ("stop",)), entry, ['{"city":"x"}'])
    c = ChatCompletion.model_validate(body).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert c.message.tool_calls[0].function.name == "get" and json.loads(c.message.tool_calls[0].function.arguments) == {"city": "x"}
    entry = {**entry, **ToolCall(None).entry()}
    body = ok_body(_Result([[1]], ("stop",)), entry, ['[{"name":"get","parameters":{"city":"y"}},{"name":"put","parameters":{}}]'])
    calls = ChatCompletion.model_validate(body).choices[0].message.tool_calls
    assert [(t.function.name, json.loads(t.function.arguments)) for t in calls] == [("get", {"city": "y"}), ("put", {})]
    assert len({t.id for t in calls}) == 2
    cut = ChatCompletion.model_validate(ok_body(_Result([[1]], ("length",)), entry, ['[{"name":"ge'])).choices[0]
    assert cut.finish_reason == "length" and cut.message.content == '[{"name":"ge' and not cut.message.tool_calls


def test_a_responses_line_reads_as_a_chat_and_answers_a_response(tok):
    from openai.types.responses import Response

    body = {"model": "m", "instructions": "w3", "input": [{"role": "user", "content": [{"type": "input_text", "text": "w1"}]}],
            "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
            "text": {"format": {"type": "json_schema", "name": "r", "schema": {"type": "object"}, "strict": True}}}
    p = parse_request(line(RESPONSES, body), 1, tok)
    assert p.max_new_tokens == 9 and p.options.temperature == 0.5 and p.options.top_p == 0.9
    assert p.options.structured.kind == Constraint.JSON
    assert tok.encode(tok.chat_template().render([{"role": "system", "content": "w3"}, {"role": "user", "content": "w1"}])).tolist() == p.tokens.tolist()
    entry = {"endpoint": RESPONSES, "n": int(p.tokens.size), "max_new": 9, "model": "m"}
    r = Response.model_validate(ok_body(_Result([[4, 5]], ("stop",)), entry, ['{"a":1}']))
    assert r.status == "completed" and r.output[0].content[0].text == '{"a":1}'
    assert r.usage.input_tokens == p.tokens.size and r.usage.input_tokens_details.cached_tokens == 3
    assert r.usage.output_tokens == 2
    cut = Response.model_validate(ok_body(_Result([[4]], ("length",)), entry, ["{"]))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    for extra, words in [({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                         ({"tools": [{"type": "web_search"}]}, "tools"), ({"input": [{"type": "function_call_output"}]}, "function_call_output"),
                         ({"text": {"format": {"type": "xml"}}}, "text.format.type"), ({"seed": 3}, "not known")]:
        with pytest.raises(ValueError, match=words):
            parse_request(line(RESPONSES, {**body, **extra}), 1, tok)
    assert parse_request(line(RESPONSES, {**body, "store": False, "input": "w1"}), 1, tok).tokens.size
