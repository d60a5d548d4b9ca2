"""Reading a prompts file for `submit`: its own JSONL, OpenAI Batch request lines, a Mooncake trace.

Each non-blank line gives a `Prompt` or a `LineError` (the line's number and what is wrong), so one
bad line costs only itself. A JSON object with a `custom_id` is an OpenAI Batch request
(`jobs/openai_batch.py`); any other is the broker's own format (`jobs/prompts.py`). Both may be mixed.
"""

from __future__ import annotations

import json
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from ..jobs.openai_batch import Tokenized, checked_tokens, is_request, read_request
from ..jobs.prompts import LineError, Prompt, parse_line
from ..ring.items import DEFAULT_MODEL

TRACE_CHUNK_LINES = 256  # trace lines synthesised at once
ENCODE_LINES = 512  # text prompts and chats tokenized at once


def read_prompts(path: str, default_max_new: int | None, tokenizer=None, model: str | None = None):
    """Prompt or LineError per non-blank line; `default_max_new` fills in a missing max_new_tokens
    (and an OpenAI line's missing max_tokens); `model`, when given, is every line's model
    (DEFAULT_MODEL: the default one). Text prompts and chats are tokenized ENCODE_LINES at a time
    with the tokenizer's own batch, on a thread of their own (the tokenizer leaves the GIL, so a
    chunk is tokenized while the next is read and rendered), the lines kept in order."""
    held: list = []  # Prompt, LineError or Tokenized, in line order
    waiting = 0
    ahead: deque = deque()  # (lines, their encodings) of chunks being tokenized, oldest first
    pool = None
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    got = _parse(line, number, default_max_new, tokenizer, model)
                except ValueError as exc:
                    msg = str(exc)
                    if isinstance(exc, json.JSONDecodeError):
                        msg = f"not JSON ({exc.msg} at column {exc.colno})"
                    got = LineError(path, number, msg, custom_id_of(line))
                got = got if isinstance(got, list) else [got]  # an embeddings line: a Prompt per input
                if not held and not ahead and not isinstance(got[0], Tokenized):
                    yield from got  # nothing waits to be tokenized before it
                    continue
                held.extend(got)
                waiting += isinstance(got[0], Tokenized)
                if waiting >= ENCODE_LINES:
                    pool = pool or ThreadPoolExecutor(1, thread_name_prefix="tokenize")
                    ahead.append((held, encodings(held, pool)))
                    held, waiting = [], 0
                    if len(ahead) > 1:
                        yield from tokenized(*ahead.popleft(), path)
        while ahead:
            yield from tokenized(*ahead.popleft(), path)
        yield from tokenized(held, encodings(held, None), path)
    finally:
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)


def encodings(held: list, pool) -> list:
    """[(line indices, their token ids, or a future of them)], one per tokenizer of the held lines'
    texts: each tokenizer's texts in one batch, on `pool` (None: here and now)."""
    by_tokenizer: dict = {}
    for k, got in enumerate(held):
        if isinstance(got, Tokenized):
            by_tokenizer.setdefault(id(got.tokenizer), []).append(k)
    out = []
    for ks in by_tokenizer.values():
        encode, texts = held[ks[0]].tokenizer.encode_many, [held[k].text for k in ks]
        out.append((ks, encode(texts) if pool is None else pool.submit(encode, texts)))
    return out


def tokenized(held: list, encoded: list, path: str):
    """The held lines in order, their texts' token ids from `encodings`."""
    for ks, many in encoded:
        for k, tokens in zip(ks, many if isinstance(many, list) else many.result()):
            p = held[k].prompt
            try:
                p.tokens = checked_tokens(tokens, p.endpoint)
                held[k] = p
            except ValueError as exc:
                held[k] = LineError(path, p.line, str(exc), p.id)
    yield from held


def _parse(line: str, number: int, default_max_new, tokenizer, model) -> Prompt | Tokenized | list[Prompt]:
    p = None
    if '"custom_id"' in line:
        row = json.loads(line)
        if is_request(row):
            p = read_request(row, number, tokenizer, model, default_max_new)
    if p is None:
        if default_max_new is not None and '"max_new_tokens"' not in line:
            row = json.loads(line)
            if isinstance(row, dict):
                row["max_new_tokens"] = default_max_new
                line = json.dumps(row)
        p = parse_line(line, number)
    if model is not None:
        for one in p if isinstance(p, list) else [p]:
            (one.prompt if isinstance(one, Tokenized) else one).model = None if model == DEFAULT_MODEL else model
    return p


def custom_id_of(line_text: str):
    """The custom_id (or native `id`) of a line, or None: for the error line of a line that failed."""
    try:
        row = json.loads(line_text)
    except ValueError:
        return None
    if isinstance(row, dict):
        cid = row.get("custom_id", row.get("id"))
        return cid if isinstance(cid, (str, int)) and not isinstance(cid, bool) else None
    return None


class TraceRow(NamedTuple):
    """A Mooncake trace line read and checked, its tokens not yet synthesised."""

    line: int
    input_length: int
    max_new: int
    hash_ids: list[int]


def read_trace(path: str, default_max_new: int | None):
    """Mooncake trace lines as Prompts (tokens synthesised as `workloads.trace.load` does), LineError per bad line."""
    from ..workloads.trace import TRACE_BLOCK_TOKENS, synthesise_items

    rows: list[TraceRow] = []

    def flush():
        tokens, offsets = synthesise_items([r.input_length for r in rows], [h for r in rows for h in r.hash_ids],
                                           [len(r.hash_ids) for r in rows], TRACE_BLOCK_TOKENS, 32_000)
        out = [Prompt(r.line, tokens[offsets[i] : offsets[i + 1]], r.max_new) for i, r in enumerate(rows)]
        rows.clear()
        return out

    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                n = int(row["input_length"])
                hashes = [int(x) for x in row["hash_ids"]]
                if "output_length" in row:
                    max_new = max(1, int(row["output_length"]))
                else:
                    max_new = default_max_new if default_max_new is not None else 1
            except (ValueError, KeyError, TypeError) as exc:
                yield LineError(path, number, f"not a Mooncake trace record ({type(exc).__name__}: {exc})")
                continue
            b = TRACE_BLOCK_TOKENS
            if n < 1 or not hashes or (len(hashes) - 1) * b >= n or len(hashes) * b < n:
                yield LineError(path, number, f"input_length {n} does not match {len(hashes)} blocks of {b} tokens")
                continue
            if not all(-(1 << 63) <= h < (1 << 63) for h in hashes):
                yield LineError(path, number, "hash_ids must be 64-bit integers")
                continue
            rows.append(TraceRow(number, n, max_new, hashes))
            if len(rows) >= TRACE_CHUNK_LINES:
                yield from flush()
    if rows:
        yield from flush()


def count_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())
