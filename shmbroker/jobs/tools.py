"""Tools on chat lines: rendered into the chat template, and a forced tool call decoded under a JSON
schema, as vLLM does it.

A chat line's `tools` (function tools: `{"type": "function", "function": {"name", "description",
"parameters"}}`) go to the model's chat template as its `tools` variable (transformers'
`apply_chat_template(tools=...)`). `tool_choice`:
- a named function (`{"type": "function", "function": {"name": f}}`): the output is decoded under
  the function's `parameters` schema, and is that call's arguments;
- `"required"`: under vLLM's schema of an array of at least one `{"name", "parameters"}` object, one
  `anyOf` branch per function (`maxItems` 1 when `parallel_tool_calls` is false); each element is a
  call;
- `"none"`: the tools are rendered and the output is text;
- `"auto"` (the API's default when tools are given) needs the model's own tool-call parser: refused
  by name.
The call is the output's shape, not a request option: the line's entry keeps it (`ToolCall.entry`)
and `message` turns the output into `tool_calls` with ids and JSON arguments, finish reason
`tool_calls`. An output cut short by max_tokens stays text (finish reason `length`).
"""

from __future__ import annotations

import json
from typing import NamedTuple

from ..request.structured import Constraint, Structured, compact_json

NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


class ToolCall(NamedTuple):
    """A forced call: the function named (None: `required`, any of the tools)."""

    name: str | None

    def entry(self) -> dict:
        return {"tool": self.name} if self.name is not None else {"tool": None, "required": True}

    @classmethod
    def of_entry(cls, entry: dict) -> ToolCall | None:
        return cls(entry["tool"]) if "tool" in entry else None


def check_tools(tools) -> list[dict]:
    """The line's tools, checked: function tools with a name and an object schema of parameters."""
    if not isinstance(tools, list) or not tools:
        raise ValueError("'tools' must be a non-empty list of function tools")
    names = set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}: only function "
                             "tools are served")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64 or not set(name) <= NAME_CHARS:
            raise ValueError(f"tools[{i}].function.name must be 1 to 64 of a-z, A-Z, 0-9, _ and -, got {name!r}")
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} is given twice")
        names.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return tools


def forced_call(body: dict) -> tuple[ToolCall | None, Structured | None]:
    """(the forced call, its constraint) of a chat body's `tools` and `tool_choice`; (None, None)
    without tools or with `tool_choice` "none"; ValueError names what is refused."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise ValueError("'tool_choice' needs 'tools'")
        return None, None
    tools = check_tools(tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise ValueError(f"'parallel_tool_calls' must be true or false, got {parallel!r}")
    if choice == "none":
        return None, None
    if choice is None or choice == "auto":
        raise ValueError("'tool_choice' \"auto\" (the default with tools) is not served: it needs the model's own "
                         "tool-call parser; give \"required\" or a named function")
    by_name = {t["function"]["name"]: t["function"].get("parameters") or EMPTY_PARAMETERS for t in tools}
    if choice == "required":
        return ToolCall(None), Structured.of(Constraint.JSON, compact_json(required_schema(by_name, parallel)))
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise ValueError("'tool_choice' must be \"none\", \"required\" or {\"type\": \"function\", \"function\": "
                         f"{{\"name\": ...}}}}, got {choice!r}")
    if name not in by_name:
        raise ValueError(f"'tool_choice' names function {name!r}, which is not in 'tools'")
    return ToolCall(name), Structured.of(Constraint.JSON, compact_json(by_name[name]))


def required_schema(by_name: dict, parallel: bool | None) -> dict:
    """vLLM's schema of `tool_choice` "required": an array of calls, each one function's name and
    parameters (`$defs` of the functions' parameters lifted to the top)."""
    defs: dict = {}
    branches = []
    for name, params in by_name.items():
        params = dict(params)
        for k, v in (params.pop("$defs", None) or {}).items():
            if k in defs and defs[k] != v:
                raise ValueError(f"tools define '$defs' {k!r} twice, differently")
            defs[k] = v
        branches.append({"properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                         "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": branches}}
    if parallel is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def message(call: ToolCall, text: str, reason: str, item_id: int, sample: int) -> tuple[dict, str]:
    """(the chat message, its finish reason) of a forced call's output `text`."""
    calls = None
    if reason == "stop":
        if call.name is not None:
            calls = [(call.name, text)]
        else:
            try:
                got = json.loads(text)
                calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in got]
            except (ValueError, TypeError, KeyError):
                calls = None
    if not calls:
        return {"role": "assistant", "content": text, "tool_calls": []}, reason
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{item_id:x}_{sample}_{k}", "type": "function", "function": {"name": name, "arguments": args}}
        for k, (name, args) in enumerate(calls)]}, "tool_calls"
