"""The `openai` engine's embeddings (`task = "embed"`): a request's body and its answer, read.

`POST {base_url}/embeddings`, OpenAI's Embeddings API (vLLM: `EmbeddingCompletionRequest`,
vllm/entrypoints/pooling/embed/protocol.py): `input` a list of token-id arrays, one per item (a
request groups several items as the engine groups completions), `encoding_format: "base64"`, and
`dimensions` when the items ask for a cut (a request's items share their options).

Why base64: each vector comes back as the base64 of its float32 values, little-endian (OpenAI's
format, which its Python client reads with numpy's float32; vLLM's defaults, `embed_dtype` float32
and `endianness` native, give the same bytes on every host it runs on), so the values are decoded
bit-exact and no float text is parsed; a server that answers a list of floats anyway is read too.
The answer's `data[k].index` names its input; `usage.prompt_tokens_details.cached_tokens`, where a
server reports it, is an item's own only when its request holds it alone (as for completions).
"""

from __future__ import annotations

import base64
import binascii

import httpx
import numpy as np

from ..request.extras import vector_extras, vector_words
from .openai_reply import Reply, answer_list, usage_of


def embeddings_body(model: str, prompts: list, options=None) -> dict:
    """The body of one embeddings request for these token-id prompts."""
    body = {"model": model, "input": prompts, "encoding_format": "base64"}
    if options is not None and options.dimensions is not None:
        body["dimensions"] = int(options.dimensions)
    return body


def decoded_vector(value) -> np.ndarray:
    """One `embedding` as float32 values: base64 of little-endian float32, or a list of numbers;
    ValueError for anything else."""
    if isinstance(value, str):
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            raise ValueError("its embedding is not base64") from None
        if len(raw) % 4:
            raise ValueError(f"its embedding is {len(raw)} bytes, not whole float32 values")
        vector = np.frombuffer(raw, "<f4")
    elif isinstance(value, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value):
        vector = np.array(value, np.float32)
    else:
        raise ValueError("its embedding is neither base64 nor a list of numbers")
    if vector.size == 0:
        raise ValueError("its embedding is empty")
    return vector


def parse_embeddings(resp: httpx.Response, prompts: list) -> Reply:
    """A 200 answer to an embeddings request for `prompts`: per prompt its vector's words and extras
    (request/extras.py), or the error that fails it. RequestFailed: no answer to read."""
    data, rows = answer_list(resp, "data")
    prompt_tokens, cached = usage_of(data, prompts)
    n = len(prompts)
    reply = Reply([None] * n, ["the server returned no embedding for it"] * n, prompt_tokens, cached,
                  extras=[None] * n)
    extras = vector_extras(cached if n == 1 else None)
    for row in rows:
        index = row.get("index") if isinstance(row, dict) else None
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < n:
            continue
        try:
            reply.tokens[index] = vector_words(decoded_vector(row.get("embedding")))
        except ValueError as exc:
            reply.errors[index] = str(exc)
            continue
        reply.errors[index], reply.extras[index] = None, extras
    return reply
