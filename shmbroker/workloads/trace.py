"""Replay Mooncake-format traces: one JSON object a line with `timestamp` (ms),
`input_length`, `output_length` and `hash_ids` (one per 512-token block, the
last block possibly partial).

Token ids are synthesised from the hash ids: block id h gives the same
`block_tokens` tokens wherever it appears (token j of block h is a 64-bit mix
of (h, j) modulo the vocabulary), the last block is cut to the remaining
length, so equal hashes give equal blocks and lengths are exact.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..jit import kernel
from .synthetic import Workload

TRACE_BLOCK_TOKENS = 512


@kernel
def _mix(x):
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


@kernel
def synthesise(hash_ids, hash_offsets, lengths, block_tokens, vocab, out, out_offsets):
    for i in range(lengths.size):
        base = out_offsets[i]
        for p in range(lengths[i]):
            b = p // block_tokens
            h = np.uint64(hash_ids[hash_offsets[i] + b])
            out[base + p] = np.uint32(_mix(h * np.uint64(block_tokens) + np.uint64(p % block_tokens)
                                           + np.uint64(0x9E3779B97F4A7C15)) % np.uint64(vocab))


def synthesise_items(lengths: list, ids: list, counts: list, block_tokens: int, vocab: int):
    """(flat uint32 tokens, int64 offsets) of items of `lengths` tokens whose blocks are the hash ids
    `ids` (item i has counts[i] of them, in order)."""
    lengths_a = np.array(lengths, np.int64)
    hash_offsets = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=hash_offsets[1:])
    offsets = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths_a, out=offsets[1:])
    tokens = np.empty(int(offsets[-1]), np.uint32)
    synthesise(np.array(ids, np.int64), hash_offsets, lengths_a, block_tokens, vocab, tokens, offsets)
    return tokens, offsets


def load(path: str | os.PathLike, *, limit: int | None = None, vocab: int = 32_000,
         block_tokens: int = TRACE_BLOCK_TOKENS) -> Workload:
    lengths, outs, times, ids, counts = [], [], [], [], []
    with open(path) as fh:
        for lineno, line in enumerate(fh, 1):
            if limit is not None and len(lengths) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                n = int(row["input_length"])
                h = [int(x) for x in row["hash_ids"]]
                out_len = int(row.get("output_length", 1))
                ts = float(row.get("timestamp", 0.0))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
            if n < 1 or not h or (len(h) - 1) * block_tokens >= n or len(h) * block_tokens < n:
                raise ValueError(f"{path}:{lineno}: input_length {n} does not match {len(h)} blocks of "
                                 f"{block_tokens}")
            lengths.append(n)
            outs.append(max(1, out_len))
            times.append(ts / 1000.0)
            ids.extend(h)
            counts.append(len(h))
    tokens, offsets = synthesise_items(lengths, ids, counts, block_tokens, vocab)
    count = len(lengths)
    return Workload(tokens, offsets, np.array(times, np.float64), np.array(outs, np.int64),
                    np.zeros(count, np.int64), np.zeros(count, np.int64), f"trace({os.path.basename(path)})")
