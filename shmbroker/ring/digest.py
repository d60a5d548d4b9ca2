"""Fold records read zero-copy from a ring into a count and checksum (delivery checks, benchmarks).

The checksum of a record is (Σ t, Σ t·(i+1)) over its tokens t at index i,
in uint32 arithmetic that wraps (so it vectorises to 8 lanes), added into
uint64 totals: order inside a record matters. `expected_digest` computes the
same on plain arrays.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from .layout import HEADER_BYTES, RECORD_HEADER_WORDS, RW64_KEY, RW_NUM_TOKENS

OUT_OF_ORDER = -1  # digest_records: a key broke the expected sequence


@kernel
def _sums(tokens):
    s1 = np.uint32(0)
    s2 = np.uint32(0)
    for i in range(tokens.size):
        t = tokens[i]
        s1 = np.uint32(s1 + t)  # numba widens uint32 arithmetic: truncate each step
        s2 = np.uint32(s2 + t * np.uint32(i + 1))
    return s1, s2


@kernel
def digest_records(words, words64, positions, count, next_key, acc):
    """Fold `count` records at `positions` into acc = [records, tokens, Σt, Σt·(i+1)].

    Keys must run next_key, next_key+1, ...: returns the key expected next,
    or OUT_OF_ORDER.
    """
    for r in range(count):
        pos = positions[r]
        key = np.int64(words64[(pos >> 1) + RW64_KEY])
        if key != next_key:
            return OUT_OF_ORDER
        next_key += 1
        n = words[pos + RW_NUM_TOKENS]
        base = pos + RECORD_HEADER_WORDS
        s1, s2 = _sums(words[base : base + n])
        acc[0] += np.uint64(1)
        acc[1] += np.uint64(n)
        acc[2] += np.uint64(s1)
        acc[3] += np.uint64(s2)
    return next_key


def expected_digest(items: list[np.ndarray] | np.ndarray, repeats: int = 1) -> np.ndarray:
    """acc for `items` (a list of arrays, or a 2-D array of rows) sent `repeats` times."""
    acc = np.zeros(4, np.uint64)
    for item in items:
        t = np.asarray(item, np.uint32)
        acc[0] += np.uint64(1)
        acc[1] += np.uint64(t.size)
        acc[2] += np.uint64(t.sum(dtype=np.uint32))
        acc[3] += np.uint64((t * np.arange(1, t.size + 1, dtype=np.uint32)).sum(dtype=np.uint32))
    return acc * np.uint64(repeats)


@kernel
def digest_tokens(tokens, acc):
    """Fold one array of tokens into acc, as digest_records folds a record."""
    s1, s2 = _sums(tokens)
    acc[0] += np.uint64(1)
    acc[1] += np.uint64(tokens.size)
    acc[2] += np.uint64(s1)
    acc[3] += np.uint64(s2)


class DeliveryCheck:
    """Checks one ring's records as they are read zero-copy: keys 0, 1, 2, ... folded into `acc`."""

    def __init__(self, ring) -> None:
        data = ring.buf[HEADER_BYTES:]
        self._words = data.view(np.uint32)
        self._words64 = data.view(np.uint64)
        self.next_key = 0
        self.acc = np.zeros(4, np.uint64)

    def __call__(self, positions: np.ndarray, count: int) -> None:
        nxt = digest_records(self._words, self._words64, positions, count, self.next_key, self.acc)
        if nxt == OUT_OF_ORDER:
            raise AssertionError(f"records out of order after key {self.next_key}")
        self.next_key = nxt
