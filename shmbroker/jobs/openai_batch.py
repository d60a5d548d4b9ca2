"""The OpenAI Batch file formats: request lines in, output and error lines out.

A request line (what a file written for the OpenAI Batch API holds):

    {"custom_id": "r-1", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": [1, 2, 3] or "text", "max_tokens": 16}}

`custom_id` (a non-empty string, unique in the file) is the key of the output; only
`/v1/completions` is served (a chat request needs the model's chat template, which the broker never
knows). `body.prompt` is token ids, or text when a tokenizer is given (`jobs/text.py`); a list of
one prompt is that prompt. `body.max_tokens` defaults as the API's does (16). Other body fields
(temperature, stop, ...) belong to the engine's settings, not to an item: they are refused, so a
file is never run other than as written.

An output line (a result that ran), as the API writes it (`openai.types.Completion` is its body):

    {"id": "batch_req_<item id>", "custom_id": "r-1", "error": null,
     "response": {"status_code": 200, "request_id": "req_<item id>", "body": {"id": "cmpl-<item id>",
      "object": "text_completion", "created": unix seconds, "model": "m",
      "choices": [{"index": 0, "text": "...", "token_ids": [...], "logprobs": null, "finish_reason": "length"}],
      "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}}}}

An error line (the error file): an item the broker failed has its HTTP-style response (400 for
what the request asked wrongly, 500 for the broker's or the engine's fault) with the API's error
body; a cancelled item and a line that is not a request have no response and an `error` object
(`openai.types.BatchError`: code, message, line).
"""

from __future__ import annotations

import time

from .prompts import U32_MAX, Prompt, token_ids

ENDPOINT = "/v1/completions"
DEFAULT_MAX_TOKENS = 16  # the completions API's default
BODY_KEYS = {"model", "prompt", "max_tokens"}
HTTP_STATUS = {"too_long": 400, "invalid": 400, "engine_error": 500, "corrupt": 500}


def is_request(row) -> bool:
    return isinstance(row, dict) and "custom_id" in row


def parse_request(row: dict, number: int, tokenizer=None, model: str | None = None,
                  default_max_tokens: int | None = None) -> Prompt:
    """A Prompt from one request line (its `id` the custom_id); ValueError says what is wrong.
    `model`, when given, is every item's model in place of the body's."""
    unknown = sorted(set(row) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in a batch request")
    cid = row["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"'custom_id' must be a non-empty string, got {cid!r}")
    if row.get("method", "POST") != "POST":
        raise ValueError(f"'method' must be POST, got {row.get('method')!r}")
    if row.get("url") != ENDPOINT:
        raise ValueError(f"'url' must be {ENDPOINT} (the only endpoint served), got {row.get('url')!r}")
    body = row.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    extra = sorted(set(body) - BODY_KEYS)
    if extra:
        raise ValueError(f"body key(s) {', '.join(extra)} are not served (only {', '.join(sorted(BODY_KEYS))})")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs --tokenizer (a tokenizer.json or a directory holding one)")
        tokens = tokenizer.encode(prompt)
        if tokens.size == 0:
            raise ValueError("the text prompt is empty once tokenized")
    elif isinstance(prompt, list) and prompt:
        tokens = token_ids(prompt, "prompt")
    else:
        raise ValueError("'prompt' must be a non-empty list of token ids or a string")
    max_tokens = body.get("max_tokens", DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens)
    if type(max_tokens) is not int or not 1 <= max_tokens <= U32_MAX:
        raise ValueError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    name = body.get("model")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"'model' must be a non-empty string, got {name!r}")
    return Prompt(number, tokens, max_tokens, None, model if model is not None else name, cid)


def output_row(item_id: int, cid, status: str, tokens: list[int], error: str | None, entry: dict,
               text: str | None) -> tuple[dict, bool]:
    """(row, is_error) of one result: an output line, or for a failed item an error line."""
    ids = {"id": f"batch_req_{item_id:x}", "custom_id": cid}
    if status == "ok":
        n, k = int(entry.get("n", 0)), len(tokens)
        finish = "length" if k >= int(entry.get("max_new", k)) else "stop"
        choice = {"index": 0, "text": text if text is not None else "", "token_ids": tokens, "logprobs": None,
                  "finish_reason": finish}
        body = {"id": f"cmpl-{item_id:x}", "object": "text_completion", "created": int(time.time()),
                "model": entry.get("model") or "default", "choices": [choice],
                "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}}
        return {**ids, "response": {"status_code": 200, "request_id": f"req_{item_id:x}", "body": body}, "error": None}, False
    if status == "cancelled":
        return {**ids, "response": None, "error": {"code": "batch_cancelled", "message": error or "the job was cancelled"}}, True
    code = HTTP_STATUS.get(status, 500)
    body = {"error": {"message": error or status, "type": "invalid_request_error" if code == 400 else "server_error",
                      "param": None, "code": status}}
    return {**ids, "response": {"status_code": code, "request_id": f"req_{item_id:x}", "body": body}, "error": None}, True


def line_error_row(number: int, message: str, cid=None, code: str = "invalid_request") -> dict:
    """The error line of an input line that is not a request (or was never submitted: `code`)."""
    return {"id": f"batch_req_line{number}", "custom_id": cid, "response": None,
            "error": {"code": code, "message": message, "line": number, "param": None}}
