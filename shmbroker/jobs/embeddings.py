"""`/v1/embeddings` batch lines: each input an item, the line's vectors one response.

    {"custom_id": "e-1", "method": "POST", "url": "/v1/embeddings",
     "body": {"model": "enc", "input": ["a text", "another"], "encoding_format": "base64", "dimensions": 256}}

- `input`: a string, an array of strings, an array of token ids, or an array of token-id arrays,
  at most MAX_INPUTS. Each input is its own item (`Prompt`, max_new_tokens 0, the option `embed`),
  ordered by the broker on its own; the line's response waits for its last vector.
- Text is tokenized on the producer's side with the model's tokenizer (`[tokenizers]` or
  `--tokenizer`), with the tokenizer's special tokens, as an embedding model reads its inputs.
- `encoding_format`: `float` (the default) or `base64` (little-endian float32, as OpenAI writes it).
- `dimensions`: a Matryoshka cut, for an engine whose model declares it (else the items fail
  `invalid`, naming the option). `truncate_prompt_tokens` (vLLM's): an input longer than k tokens
  keeps its last k, as vLLM truncates; without it a longer input than its consumer's max_input_len
  fails `too_long`, and its line with it. `user` is read and ignored, as the API does.

The output body is the API's `CreateEmbeddingResponse`: `data` (one embedding per input, by
index), `model`, and `usage` (`prompt_tokens`, `total_tokens`). A line whose input fails is an
error line naming that input, as the API answers a request with one bad input.
"""

from __future__ import annotations

import base64

import numpy as np

from ..request.options import embedding
from ..ring.items import DEFAULT_MODEL
from .prompts import U32_MAX, Prompt, token_ids
from .text import NO_TOKENIZER

EMBEDDINGS = "/v1/embeddings"
BODY_KEYS = {"model", "input", "encoding_format", "dimensions", "user", "truncate_prompt_tokens"}
FORMATS = ("float", "base64")
MAX_INPUTS = 2048  # inputs a line (the API's limit)


def read_embeddings(body: dict, number: int, cid: str, model: str | None, tokenizer) -> list[Prompt]:
    """The line's items, one per input, in order; ValueError says what is wrong with the line."""
    fmt = body.get("encoding_format", "float")
    if fmt not in FORMATS:
        raise ValueError(f"'encoding_format' must be one of {', '.join(FORMATS)}, got {fmt!r}")
    dims = body.get("dimensions")
    if dims is not None and (type(dims) is not int or dims < 1):
        raise ValueError(f"'dimensions' must be a positive integer, got {dims!r}")
    keep = body.get("truncate_prompt_tokens")
    if keep is not None and (type(keep) is not int or not 1 <= keep <= U32_MAX):
        raise ValueError(f"'truncate_prompt_tokens' must be a positive token count, got {keep!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise ValueError(f"'user' must be a string, got {user!r}")
    inputs = _inputs(body.get("input"), tokenizer)
    options = embedding(dims)
    reply = {"parts": len(inputs), "format": fmt}
    return [Prompt(number, t[-keep:] if keep is not None and t.size > keep else t, 0, None, model, cid, options,
                   EMBEDDINGS, {**reply, "part": k})
            for k, t in enumerate(inputs)]


def _inputs(value, tokenizer) -> list[np.ndarray]:
    """The token ids of each input (texts encoded with `tokenizer`, a jobs/text.py Tokenizer or None)."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(type(v) is int for v in value)):
        value = [value]  # one text, or one input's token ids
    if not isinstance(value, list) or not value:
        raise ValueError("'input' must be a string, an array of strings, an array of token ids or an array of "
                         "token-id arrays, not empty")
    if len(value) > MAX_INPUTS:
        raise ValueError(f"'input' holds {len(value)} inputs; at most {MAX_INPUTS} a request")
    if all(isinstance(v, str) for v in value):
        if tokenizer is None:
            raise ValueError(f"a text input needs {NO_TOKENIZER}")
        if not all(value):
            raise ValueError(f"input {[bool(v) for v in value].index(False)} is an empty string")
        out = tokenizer.encode_many(value, special_tokens=True)
        empty = [k for k, t in enumerate(out) if not t.size]
        if empty:
            raise ValueError(f"input {empty[0]} is empty once tokenized")
        return out
    if all(isinstance(v, list) for v in value):
        return [token_ids(v, f"input[{k}]") for k, v in enumerate(value)]
    raise ValueError("'input' must not mix texts and token arrays")


def vector_json(vector: np.ndarray, fmt: str):
    """An embedding as the API writes it: a list of floats (each float32 exactly, as a double), or base64."""
    if fmt == "base64":
        return base64.b64encode(np.ascontiguousarray(vector, "<f4").tobytes()).decode("ascii")
    return vector.tolist()


def embeddings_body(vectors: list, prompt_tokens: int, entry: dict) -> dict:
    """The API's CreateEmbeddingResponse of a line's vectors (in input order)."""
    fmt = entry.get("format", "float")
    return {"object": "list", "model": entry.get("model") or DEFAULT_MODEL,
            "data": [{"object": "embedding", "index": k, "embedding": vector_json(v, fmt)} for k, v in enumerate(vectors)],
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}
