"""Prompt files for `shmbroker submit`: one JSON object a line.

    {"tokens": [1, 2, 3], "max_new_tokens": 64, "prefix_len": 2, "model": "llama", "id": "q-17"}

`tokens` and `max_new_tokens` are required; `prefix_len` (0..len(tokens)),
`model` (a non-empty name) and `id` (a string or integer, handed back with the
item's result) are optional. `read_prompts(path)` yields a `Prompt` for every
good line and a `LineError` (file, line number, what is wrong) for every bad
one, so one bad line costs only itself and the rest of the file goes through.
Blank lines are skipped.
"""

from __future__ import annotations

import array
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..request.options import RequestOptions

U32_MAX = (1 << 32) - 1
KEYS = {"tokens", "max_new_tokens", "prefix_len", "model", "id"}


@dataclass
class Prompt:
    line: int
    tokens: np.ndarray  # uint32
    max_new_tokens: int
    prefix_len: int | None = None
    model: str | None = None
    id: str | int | None = None
    options: RequestOptions | None = None  # its request options (request/options.py)
    endpoint: str | None = None  # an OpenAI batch line's url; None: the broker's own line format
    reply: dict | None = None  # how its output is shaped beyond the endpoint's (a forced tool call: jobs/tools.py)


@dataclass
class LineError:
    path: str
    line: int
    message: str
    id: str | int | None = None  # the line's custom_id (or id) when it can be read

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def read_prompts(path: str | os.PathLike) -> Iterator[Prompt | LineError]:
    where = os.fspath(path)
    with open(where, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                yield parse_line(line, number)
            except ValueError as exc:
                yield LineError(where, number, str(exc))


def parse_line(line: str, number: int = 0) -> Prompt:
    """One prompt from one JSON line; ValueError says what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(row, dict):
        raise ValueError(f"expected a JSON object, got {type(row).__name__}")
    unknown = sorted(set(row) - KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(KEYS))})")
    if "tokens" not in row or "max_new_tokens" not in row:
        raise ValueError("'tokens' and 'max_new_tokens' are required")
    tokens = token_ids(row["tokens"], "tokens")
    max_new = row["max_new_tokens"]
    if type(max_new) is not int or not 1 <= max_new <= U32_MAX:
        raise ValueError(f"'max_new_tokens' must be a positive integer, got {max_new!r}")
    prefix = row.get("prefix_len")
    if prefix is not None and (type(prefix) is not int or not 0 <= prefix <= tokens.size):
        raise ValueError(f"'prefix_len' must be an integer in 0..{tokens.size}, got {prefix!r}")
    model = row.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"'model' must be a non-empty string, got {model!r}")
    ident = row.get("id")
    if ident is not None and type(ident) not in (str, int):
        raise ValueError(f"'id' must be a string or an integer, got {ident!r}")
    return Prompt(number, tokens, max_new, prefix, model, ident)


def token_ids(value, key: str) -> np.ndarray:
    """A JSON list of token ids as uint32; ValueError unless it is a non-empty list of integers in
    0..U32_MAX (no floats, no booleans), checked by C loops (the types' set, `array.array`'s own range
    check) rather than one in Python: 4 us for 100 tokens instead of 9."""
    if not isinstance(value, list) or not value:
        raise ValueError(f"'{key}' must be a non-empty list of token ids")
    if set(map(type, value)) != {int}:
        raise ValueError(f"'{key}' must hold integers in 0..{U32_MAX}")
    try:
        return np.frombuffer(array.array("I", value), np.uint32)
    except (OverflowError, TypeError):
        raise ValueError(f"'{key}' must hold integers in 0..{U32_MAX}") from None


assert array.array("I").itemsize == 4
