"""An OpenAI-compatible server's answers, read: the token ids of each choice (in the fields the
`openai` engine's module docstring lists) and its finish reason, the usage's cache figures, a failed
request's reason and the server's error text (an embeddings answer's vectors: `openai_embed.py`).

A request of P prompts asking n samples each is answered with P * n choices; choice c is sample
c % n of prompt c // n (vLLM's and OpenAI's numbering: each prompt's choices one after another).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import httpx
import numpy as np

from ..request.extras import ExtrasError, Logprobs, encode_extras

TOKEN_ID_PREFIX = "token_id:"
ASKED_FIELDS = '"return_token_ids": true, and "return_tokens_as_token_ids": true with "logprobs": 0'
READ_FIELDS = "choices[].token_ids, choices[].logprobs.tokens ('token_id:N'), choices[].output_ids"
NO_TOKEN_IDS = (f"the server returned no token ids: it must return them (request fields sent: {ASKED_FIELDS}; "
                f"response fields read: {READ_FIELDS})")
MESSAGE_CHARS_MAX = 500  # of a server's error text kept in an item's error



class RequestFailed(Exception):
    """A request that failed for good: its items fail with this reason; `down` (a connection error,
    a timeout, 408, 429 or 5xx after the retries): the server is down and the items are handed back
    instead, `always` (a connection error, 429, 503) or unless the server answered others since its
    last try was `sent` (monotonic; module docstring)."""

    def __init__(self, reason: str, status: int | None = None, *, down: bool = False, sent: float = 0.0,
                 always: bool = False):
        super().__init__(reason)
        self.status = status
        self.down = down
        self.sent = sent
        self.always = always


@dataclass
class Reply:
    """One request's answer: per prompt its tokens (its samples' one after another) and their extras
    words (request/extras.py), or an error text; the usage's cache figures."""

    tokens: list  # np.ndarray (uint32) or None per prompt
    errors: list  # str or None per prompt
    prompt_tokens: int = 0
    cached_tokens: int | None = None
    sub_replies: list = field(default_factory=list)  # a split request's halves, in order
    extras: list = field(default_factory=list)  # np.ndarray (uint32) or None per prompt; empty: none
    refused: list = field(default_factory=list)  # per prompt: the server refused it for its content (400/413/422)

    def extras_of(self, k: int):
        return self.extras[k] if k < len(self.extras) else None

    def refused_of(self, k: int) -> bool:
        return k < len(self.refused) and bool(self.refused[k])


def parse_reply(resp: httpx.Response, prompts: list, n: int = 1, top: int | None = None) -> tuple[Reply, bool]:
    """A 200 answer to a request for `prompts`, n samples each: (its Reply, whether any choice's
    tokens came from `token_ids`: the server needs no logprobs asked for). `top`: the logprobs asked
    for (each token's and `top` more; None: none), read from each choice's `logprobs`.
    RequestFailed: no answer to read."""
    data, choices = answer_list(resp, "choices")
    prompt_tokens, cached = usage_of(data, prompts)
    samples, from_ids = read_choices(choices, len(prompts), n, top)
    reply = Reply([None] * len(prompts), [None] * len(prompts), prompt_tokens, cached, extras=[None] * len(prompts))
    for k, got in enumerate(samples):
        if isinstance(got, str):
            reply.errors[k] = got
            continue
        reply.tokens[k] = np.concatenate([t for t, _, _ in got])
        # the usage's cached tokens are the request's: an item's own only when it is the request's one prompt
        try:
            reply.extras[k] = encode_extras([t.size for t, _, _ in got], [stop for _, stop, _ in got],
                                            cached if len(prompts) == 1 else None,
                                            None if top is None else [lp for _, _, lp in got])
        except ExtrasError as exc:
            reply.tokens[k], reply.errors[k] = None, f"its logprobs: {exc}"
    return reply, from_ids


def answer_list(resp: httpx.Response, key: str) -> tuple[dict, list]:
    """(a 200 answer's JSON object, its list under `key`: "choices", or an embeddings answer's
    "data"); RequestFailed when there is none to read."""
    try:
        data = resp.json()
    except ValueError as exc:
        raise RequestFailed(f"the server's answer is not JSON ({exc}): {resp.text[:MESSAGE_CHARS_MAX]!r}") from None
    rows = data.get(key) if isinstance(data, dict) else None
    if not isinstance(rows, list):
        raise RequestFailed(f"the server's answer has no {key}: {resp.text[:MESSAGE_CHARS_MAX]!r}")
    return data, rows


def usage_of(data: dict, prompts: list) -> tuple[int, int | None]:
    """An answer's (prompt tokens, cached prompt tokens or None) from its `usage`: the prompts' own
    length when the server gives none, `prompt_tokens_details.cached_tokens` when it reports them."""
    usage = data.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else None
    prompt_tokens = usage.get("prompt_tokens")
    if not isinstance(prompt_tokens, int):
        prompt_tokens = sum(len(p) for p in prompts)
    return prompt_tokens, cached


def read_choices(choices: list, num_prompts: int, n: int, top: int | None = None) -> tuple[list, bool]:
    """Per prompt: its n samples as (tokens, stopped, Logprobs or None) in sample order, or the error
    text that fails it; and whether any tokens came from `token_ids`."""
    got: list = [[None] * n for _ in range(num_prompts)]
    errors: list = [None] * num_prompts
    from_ids = False
    for choice in choices:
        index = choice.get("index") if isinstance(choice, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < num_prompts * n:
            continue
        k, j = divmod(index, n)
        reason = choice.get("finish_reason")
        if reason in ("abort", "error"):
            errors[k] = f"the server ended it with finish_reason {reason!r}"
            continue
        out, from_token_ids = choice_tokens(choice)
        from_ids |= from_token_ids
        if out is None:
            errors[k] = errors[k] or NO_TOKEN_IDS
            continue
        try:
            got[k][j] = (out, reason == "stop", None if top is None else choice_logprobs(choice, out, top))
        except ValueError as exc:
            errors[k] = f"its logprobs: {exc}"
    result = []
    for k in range(num_prompts):
        if errors[k] is None and any(s is None for s in got[k]):
            errors[k] = "the server returned no choice for it" if n == 1 else \
                f"the server returned {sum(s is not None for s in got[k])} of its {n} choices"
        result.append(errors[k] if errors[k] is not None else got[k])
    return result, from_ids


def choice_logprobs(choice: dict, tokens: np.ndarray, top: int) -> Logprobs:
    """A completions choice's `logprobs` (asked with `return_tokens_as_token_ids`): each token's
    `token_logprobs`, and its `top_logprobs` map's `top` likeliest as (token id, logprob).
    ValueError when the server gave fewer."""
    lp = choice.get("logprobs")
    own = lp.get("token_logprobs") if isinstance(lp, dict) else None
    tops = lp.get("top_logprobs") if isinstance(lp, dict) else None
    if not isinstance(own, list) or len(own) != tokens.size or (top and not isinstance(tops, list)):
        raise ValueError("the server gave no logprobs for every token (choices[].logprobs.token_logprobs)")
    ids = np.empty((tokens.size, top), np.uint32)
    values = np.empty((tokens.size, top), np.float32)
    for j in range(tokens.size if top else 0):
        ranked = sorted(((float(v), key) for key, v in (tops[j] or {}).items()), reverse=True)[:top]
        if len(ranked) < top or not all(key.startswith(TOKEN_ID_PREFIX) for _, key in ranked):
            raise ValueError(f"the server gave {len(ranked)} of the top {top} logprobs of token {j} as token ids")
        ids[j] = [int(key[len(TOKEN_ID_PREFIX):]) for _, key in ranked]
        values[j] = [v for v, _ in ranked]
    return Logprobs(np.array([float(v) if v is not None else float("-inf") for v in own], np.float32), ids, values)


def choice_tokens(choice: dict) -> tuple:
    """(uint32 token ids or None, whether they came from `token_ids`): the fields in the order the
    module docstring gives."""
    ids = choice.get("token_ids")
    if isinstance(ids, list) and (out := as_tokens(ids)) is not None:
        return out, True
    logprobs = choice.get("logprobs")
    strings = logprobs.get("tokens") if isinstance(logprobs, dict) else None
    if isinstance(strings, list) and all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in strings):
        try:
            return as_tokens([int(t[len(TOKEN_ID_PREFIX):]) for t in strings]), False
        except ValueError:
            pass
    ids = choice.get("output_ids")
    if isinstance(ids, list):
        return as_tokens(ids), False
    return None, False


def as_tokens(ids: list):
    """uint32 token ids, or None when the list holds anything but ids."""
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 32 for t in ids):
        return None
    return np.array(ids, np.uint32)


def server_message(resp: httpx.Response) -> str:
    """The server's error text: OpenAI's {"error": {"message"}}, vLLM/SGLang's {"message"}, FastAPI's
    {"detail"}, else the body."""
    try:
        data = resp.json()
    except ValueError:
        return resp.text[:MESSAGE_CHARS_MAX] or resp.reason_phrase
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:MESSAGE_CHARS_MAX]
        for key in ("message", "detail", "error"):
            if data.get(key):
                value = data[key]
                return (value if isinstance(value, str) else json.dumps(value))[:MESSAGE_CHARS_MAX]
    return json.dumps(data)[:MESSAGE_CHARS_MAX]
