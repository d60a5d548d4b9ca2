"""The OpenAI Batch file formats: request lines in, output and error lines out.

A request line (what a file written for the OpenAI Batch API holds):

    {"custom_id": "r-1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "temperature": 0.7,
              "max_completion_tokens": 64}}
    {"custom_id": "r-2", "method": "POST", "url": "/v1/completions",
     "body": {"model": "m", "prompt": [1, 2, 3] or "text", "max_tokens": 16, "seed": 7, "n": 2}}

`custom_id` (a non-empty string, unique in the file) is the key of the output.
- `/v1/chat/completions`: `messages` rendered with the model's chat template on this side
  (`request/chat.py`: the tokenizer directory's `tokenizer_config.json` or `chat_template.jinja`)
  and tokenized without added special tokens; `chat_template_kwargs` go to the template. It needs
  `--tokenizer` (a model's tokenizer directory).
- `/v1/completions`: `prompt` is token ids, or text when a tokenizer is given (`jobs/text.py`);
  a list of one prompt is that prompt; `logprobs` is a count there (OpenAI's legacy field).
- `/v1/responses`: a Responses API request read as a chat (`responses.py`), its output a `Response`.
- Request options (`request/options.py`: temperature, top_p, top_k, min_p, seed, stop,
  stop_token_ids, n, the penalties, min_tokens, ignore_eos, logprobs/top_logprobs, and a constraint
  from `response_format` / `structured_outputs`, `request/structured.py`) are checked and ride with
  the item; chat `tools` with a forced `tool_choice` are a constraint too (`tools.py`), their output
  `tool_calls`. `max_tokens` (or `max_completion_tokens`) is its max_new_tokens, 16 when absent as in
  the completions API. A field no engine here honours (`logit_bias`, `stream`, ...) or one this
  file format does not know is refused by name, never dropped: the line goes to the error file and
  the rest of the file runs.

An output line (a result that ran) has the API's body: `openai.types.Completion` for completions,
`openai.types.chat.ChatCompletion` for chat, one choice per sample with its finish reason, and
`usage` with `prompt_tokens_details.cached_tokens` when the engine reported its cache:

    {"id": "batch_req_<item id>", "custom_id": "r-1", "error": null,
     "response": {"status_code": 200, "request_id": "req_<item id>", "body": {"id": "chatcmpl-<item id>",
      "object": "chat.completion", "created": unix seconds, "model": "m",
      "choices": [{"index": 0, "message": {"role": "assistant", "content": "..."}, "logprobs": null,
                   "finish_reason": "stop"}],
      "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k,
                "prompt_tokens_details": {"cached_tokens": c}}}}}

An error line (the error file): an item the broker failed has its HTTP-style response (400 for
what the request asked wrongly, 500 for the broker's or the engine's fault) with the API's error
body; a cancelled item and a line that is not a request have no response and an `error` object
(`openai.types.BatchError`: code, message, line).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from ..request.chat import ChatError
from ..request.options import (
    GENERATE_OPTIONS,
    STRUCTURED_FIELDS,
    OptionsError,
    RequestOptions,
    parse_options,
    refused_fields,
)
from ..ring.items import DEFAULT_MODEL
from . import embeddings, responses, tools
from .embeddings import EMBEDDINGS, read_embeddings
from .prompts import U32_MAX, Prompt, token_ids
from .text import NO_TOKENIZER
from .store import CANCEL_REASONS

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
ENDPOINTS = (CHAT, COMPLETIONS, RESPONSES, EMBEDDINGS)
DEFAULT_MAX_TOKENS = 16  # the completions API's default
TOOL_KEYS = {"tools", "tool_choice", "parallel_tool_calls"}
# body fields each endpoint reads besides the request options
BODY_KEYS = {COMPLETIONS: {"model", "prompt", "max_tokens", *STRUCTURED_FIELDS},
             CHAT: {"model", "messages", "max_tokens", "max_completion_tokens", "chat_template_kwargs",
                    *STRUCTURED_FIELDS, *TOOL_KEYS},
             RESPONSES: responses.BODY_KEYS, EMBEDDINGS: embeddings.BODY_KEYS}
HTTP_STATUS = {"too_long": 400, "invalid": 400, "engine_error": 500, "corrupt": 500}
MAX_COMPLETION_LOGPROBS = 5  # the completions API's `logprobs` count




def is_request(row) -> bool:
    return isinstance(row, dict) and "custom_id" in row


class Tokenized(NamedTuple):
    """A request whose prompt is text still to tokenize: its Prompt (tokens None), the text and the
    tokenizer (`read_prompts` tokenizes many at once)."""

    prompt: Prompt
    text: str
    tokenizer: object


def parse_request(row: dict, number: int, tokenizer=None, model: str | None = None,
                  default_max_tokens: int | None = None) -> Prompt:
    """A Prompt from one request line (its `id` the custom_id), or an embeddings line's Prompts (one
    per input); ValueError says what is wrong. `model`, when given, is every item's model in place
    of the body's. `tokenizer`: a `jobs/text.py` Tokenizer or Tokenizers, asked for the line's
    model's (`of`), or None."""
    got = read_request(row, number, tokenizer, model, default_max_tokens)
    if isinstance(got, Tokenized):
        got.prompt.tokens = checked_tokens(got.tokenizer.encode(got.text), got.prompt.endpoint)
        return got.prompt
    return got


def read_request(row: dict, number: int, tokenizer=None, model: str | None = None,
                 default_max_tokens: int | None = None) -> Prompt | Tokenized | list[Prompt]:
    """`parse_request`, leaving a text prompt to tokenize (a Tokenized); an embeddings line's inputs
    are tokenized here, all at once."""
    unknown = sorted(set(row) - {"custom_id", "method", "url", "body"})
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} in a batch request")
    cid = row["custom_id"]
    if not isinstance(cid, str) or not cid:
        raise ValueError(f"'custom_id' must be a non-empty string, got {cid!r}")
    if row.get("method", "POST") != "POST":
        raise ValueError(f"'method' must be POST, got {row.get('method')!r}")
    url = row.get("url")
    if url not in ENDPOINTS:
        raise ValueError(f"'url' must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = row.get("body")
    if not isinstance(body, dict):
        raise ValueError("'body' must be a JSON object")
    refused = responses.refused_fields(body) if url == RESPONSES else \
        [k for k in refused_fields(body) if not (url == CHAT and k in TOOL_KEYS)]
    if refused:
        raise ValueError(f"body field(s) {', '.join(refused)} are not served: no engine here honours them")
    extra = sorted(set(body) - BODY_KEYS[url] - (set() if url in (RESPONSES, EMBEDDINGS) else set(GENERATE_OPTIONS)))
    if extra:
        raise ValueError(f"body field(s) {', '.join(extra)} are not known for {url}")
    name = body.get("model")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"'model' must be a non-empty string, got {name!r}")
    model = model if model is not None else name
    tokenizer = tokenizer.of(model) if tokenizer is not None else None
    if url == EMBEDDINGS:
        return read_embeddings(body, number, cid, model, tokenizer)
    call, forced = tools.forced_call(body) if url == CHAT else (None, None)
    if url == COMPLETIONS:
        tokens = completion_prompt(body, tokenizer)
    else:
        tokens = chat_text(body if url == CHAT else {"messages": responses.messages(body)}, tokenizer)
    max_tokens = body.get("max_output_tokens") if url == RESPONSES else \
        body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS if default_max_tokens is None else default_max_tokens
    if type(max_tokens) is not int or not 1 <= max_tokens <= U32_MAX:
        raise ValueError(f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    options = line_options(body, url, max_tokens, forced)
    prompt = Prompt(number, None if isinstance(tokens, str) else tokens, max_tokens, None, model, cid, options, url,
                    call.entry() if call is not None else None)
    return Tokenized(prompt, tokens, tokenizer) if isinstance(tokens, str) else prompt


def line_options(body: dict, url: str, max_tokens: int, forced=None):
    """A line's request options (None: none): its body's fields, a Responses request's `text.format`
    or a forced tool call's constraint (one constraint a line)."""
    given = option_fields(body, url) if url != RESPONSES else \
        {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    try:
        options = parse_options(given, max_tokens=max_tokens) if given else None
    except OptionsError as exc:
        raise ValueError(str(exc)) from None
    constraint = responses.text_format(body) if url == RESPONSES else forced
    if constraint is not None:
        if options is not None and options.structured is not None:
            raise ValueError("one constraint per request: a forced tool call and a response format are both given")
        options = replace(options or RequestOptions(), structured=constraint)
    return options if options else None


def option_fields(body: dict, url: str) -> dict:
    """The body's request options; the completions API's `logprobs` count as logprobs/top_logprobs."""
    fields = {k: body[k] for k in (*GENERATE_OPTIONS, *STRUCTURED_FIELDS) if k in body}
    if url == COMPLETIONS and "logprobs" in fields and fields["logprobs"] is not None:
        count = fields.pop("logprobs")
        if type(count) is not int or not 0 <= count <= MAX_COMPLETION_LOGPROBS:
            raise ValueError(f"'logprobs' of a completions request must be 0..{MAX_COMPLETION_LOGPROBS}, got {count!r}")
        fields.update(logprobs=True, top_logprobs=count)
    return fields


def completion_prompt(body: dict, tokenizer):
    """The prompt's token ids, or its text (tokenized by the caller, `Tokenized`)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"a text prompt needs {NO_TOKENIZER}")
        return prompt
    if isinstance(prompt, list) and prompt:
        return token_ids(prompt, "prompt")
    raise ValueError("'prompt' must be a non-empty list of token ids or a string")


def chat_text(body: dict, tokenizer) -> str:
    """The chat's prompt: its messages rendered with the model's chat template (tokenized by the caller)."""
    if tokenizer is None:
        raise ValueError(f"a chat request needs {NO_TOKENIZER} (its chat template is read there)")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    try:
        return tokenizer.chat_template().render(body.get("messages"), kwargs, body.get("tools"))
    except ChatError as exc:
        raise ValueError(str(exc)) from None


def checked_tokens(tokens: np.ndarray, endpoint: str) -> np.ndarray:
    """A text's token ids; ValueError when it tokenized to none."""
    if tokens.size == 0:
        raise ValueError("the chat renders to no tokens" if endpoint == CHAT else "the text prompt is empty once tokenized")
    return tokens


def output_row(r, cid, entry: dict, texts: list | None, token_text=None,
               cancel: tuple[str, str] = CANCEL_REASONS["cancelled"]) -> tuple[dict, bool]:
    """(row, is_error) of one result `r` (`client.Result`): an output line, or for a failed item an
    error line. `texts`: each sample's decoded text (None without a tokenizer); `token_text(id)`: one
    token's text, for logprobs (None: "token_id:<id>", as vLLM writes ids)."""
    item_id, status = r.item_id, r.status
    ids = {"id": f"batch_req_{item_id:x}", "custom_id": cid}
    if status == "ok":
        return ok_row(item_id, cid, ok_body(r, entry, texts, token_text)), False
    if status == "cancelled":
        return {**ids, "response": None, "error": {
            "code": cancel[0], "message": r.error if r.error and cancel == CANCEL_REASONS["cancelled"] else cancel[1]}}, True
    code = HTTP_STATUS.get(status, 500)
    body = {"error": {"message": r.error or status, "type": "invalid_request_error" if code == 400 else "server_error",
                      "param": None, "code": status}}
    return {**ids, "response": {"status_code": code, "request_id": f"req_{item_id:x}", "body": body}, "error": None}, True


def ok_row(item_id: int, cid, body: dict) -> dict:
    """The output line of a request that ran, around its body."""
    return {"id": f"batch_req_{item_id:x}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{item_id:x}", "body": body}, "error": None}


def ok_body(r, entry: dict, texts: list | None, token_text=None) -> dict:
    """The API's completion (or chat completion) body of a result that ran: a choice per sample."""
    samples = r.samples
    reasons = r.finish_reasons or tuple(
        "length" if len(s) >= int(entry.get("max_new", len(s))) else "stop" for s in samples)
    endpoint = entry.get("endpoint")
    chat = endpoint in (CHAT, RESPONSES)
    call = tools.ToolCall.of_entry(entry)
    logprobs = r.logprobs
    name = token_text or (lambda t: f"token_id:{t}")
    choices = []
    for k, (tokens, reason) in enumerate(zip(samples, reasons)):
        text = texts[k] if texts is not None else ""
        lp = None if logprobs is None else (chat_logprobs if chat else completion_logprobs)(tokens, logprobs[k], name)
        if call is not None:
            message, reason = tools.message(call, text, reason, r.item_id, k)
            choices.append({"index": k, "message": message, "logprobs": lp, "finish_reason": reason})
        elif chat:
            choices.append({"index": k, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": reason})
        else:
            choices.append({"index": k, "text": text, "token_ids": tokens.tolist(), "logprobs": lp,
                            "finish_reason": reason})
    n, k = int(entry.get("n", 0)), int(r.tokens.size)
    usage = {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}
    if r.cached_tokens is not None:
        usage["prompt_tokens_details"] = {"cached_tokens": r.cached_tokens}
    if endpoint == RESPONSES:
        return responses.response_body(r, entry, texts[0] if texts else "", reasons[0], usage)
    kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
    return {"id": f"{prefix}-{r.item_id:x}", "object": kind, "created": int(time.time()),
            "model": entry.get("model") or DEFAULT_MODEL, "choices": choices, "usage": usage}


def chat_logprobs(tokens, lp, name) -> dict:
    """A chat choice's `logprobs`: per token its text, logprob and UTF-8 bytes, and its top ones."""
    def entry(t, value) -> dict:
        text = name(int(t))
        return {"token": text, "logprob": float(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t, v), "top_logprobs": [entry(i, x) for i, x in zip(ids, top)]}
                        for t, v, ids, top in zip(tokens.tolist(), lp.token.tolist(), lp.top_ids.tolist(), lp.top.tolist())],
            "refusal": None}


def completion_logprobs(tokens, lp, name) -> dict:
    """A completion choice's `logprobs`: tokens, token_logprobs, top_logprobs (a text -> logprob map
    a token) and text_offset, as the completions API writes them."""
    texts = [name(int(t)) for t in tokens.tolist()]
    offsets = np.concatenate([[0], np.cumsum([len(x) for x in texts])[:-1]]).astype(int).tolist() if texts else []
    return {"tokens": texts, "token_logprobs": [float(v) for v in lp.token.tolist()],
            "top_logprobs": [top_map(ids, top, name) for ids, top in zip(lp.top_ids.tolist(), lp.top.tolist())],
            "text_offset": offsets}


def top_map(ids, top, name) -> dict:
    """One token's top logprobs as the completions API's text -> logprob map: two ids of one text
    keep the first (the likelier) one."""
    out: dict = {}
    for i, x in zip(ids, top):
        out.setdefault(name(int(i)), float(x))
    return out


def line_error_row(number: int, message: str, cid=None, code: str = "invalid_request") -> dict:
    """The error line of an input line that is not a request (or was never submitted: `code`)."""
    return {"id": f"batch_req_line{number}", "custom_id": cid, "response": None,
            "error": {"code": code, "message": message, "line": number, "param": None}}
