"""`/v1/responses` lines: a Responses API request read as a chat, and its output as a `Response`.

A request body's `input` (a string, or message items: `{"role", "content"}` with `"type":
"message"` or none, content a string or `input_text` / `output_text` parts) and `instructions`
(a system message before them) become the chat's messages, rendered with the model's chat template
as a chat line's are. `max_output_tokens` is the item's max_new_tokens; `temperature` and `top_p`
ride as request options; `text.format` (`json_schema` / `json_object` / `text`) is its constraint.
Fields the broker does not carry are refused by name (`REFUSED`: built-in tools, a stored
conversation, `store` true, ...), never dropped.

The output body parses as `openai.types.responses.Response`: one output message of one
`output_text`, status `completed`, or `incomplete` with reason `max_output_tokens` when the output
was cut there, and `usage` with the prompt tokens the engine served from its cache.
"""

from __future__ import annotations

import time

from ..request.chat import content_text
from ..request.structured import Constraint, Structured, StructuredError, schema_payload

BODY_KEYS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "text", "metadata",
             "user", "store"}
REFUSED = ("tools", "tool_choice", "parallel_tool_calls", "previous_response_id", "conversation", "prompt",
           "reasoning", "include", "background", "stream", "stream_options", "truncation", "max_tool_calls",
           "top_logprobs", "service_tier", "prompt_cache_key", "safety_identifier")
ROLES = ("system", "developer", "user", "assistant")
PART_TYPES = ("input_text", "output_text", "text")


def refused_fields(body: dict) -> list[str]:
    """The body's fields refused by name (REFUSED, and `store` unless false), in the body's order."""
    return [k for k in body if k in REFUSED or (k == "store" and body[k] is not False and body[k] is not None)]


def messages(body: dict) -> list[dict]:
    """The chat messages of a Responses request's `instructions` and `input`; ValueError says what is wrong."""
    out = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise ValueError(f"'instructions' must be a string, got {type(instructions).__name__}")
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        return [*out, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ValueError("'input' must be a string or a non-empty list of message items")
    for i, item in enumerate(given):
        if not isinstance(item, dict) or item.get("type", "message") != "message":
            kind = item.get("type") if isinstance(item, dict) else type(item).__name__
            raise ValueError(f"input[{i}] of type {kind!r} is not served: only message items are")
        role = item.get("role")
        if role not in ROLES:
            raise ValueError(f"input[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        out.append({"role": role, "content": content_text(item.get("content"), f"input[{i}]", PART_TYPES)})
    return out


def text_format(body: dict) -> Structured | None:
    """The constraint of `text.format` (None: plain text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format"}:
        raise ValueError("'text' must be an object holding only 'format'")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ValueError("'text.format' must be an object")
    kind = fmt.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Structured.of(Constraint.JSON_OBJECT, None)
        if kind == "json_schema":
            return Structured.of(Constraint.JSON, schema_payload({k: v for k, v in fmt.items() if k != "type"},
                                                                 "text.format"))
    except StructuredError as exc:
        raise ValueError(str(exc)) from None
    raise ValueError(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}")


def response_body(r, entry: dict, text: str, reason: str, usage: dict) -> dict:
    """The `Response` of a result that ran (one sample: the Responses API has no `n`). The prompt
    tokens not served from the engine's cache are the ones it computed and wrote there."""
    cut = reason == "length"
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    status = "incomplete" if cut else "completed"
    return {
        "id": f"resp_{r.item_id:x}", "object": "response", "created_at": int(time.time()),
        "model": entry.get("model") or "default", "status": status,
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "instructions": None, "metadata": None, "max_output_tokens": int(entry.get("max_new", 0)) or None,
        "output": [{"type": "message", "id": f"msg_{r.item_id:x}", "status": status, "role": "assistant",
                    "content": [{"type": "output_text", "text": text, "annotations": []}]}],
        "parallel_tool_calls": False, "tool_choice": "none", "tools": [],
        "usage": {"input_tokens": usage["prompt_tokens"],
                  "input_tokens_details": {"cached_tokens": cached,
                                           "cache_write_tokens": usage["prompt_tokens"] - cached},
                  "output_tokens": usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": usage["total_tokens"]},
    }
