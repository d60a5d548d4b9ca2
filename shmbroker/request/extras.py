"""What a result carries beside its tokens: its samples' lengths and finish reasons, and the prompt
tokens its engine served from a prefix cache (`usage.prompt_tokens_details.cached_tokens`).

A result whose engine reported any of it carries extras words after its tokens (ring/wire.py: the
result record's `extras` count; the producer's result ring record's meta[2]); one without carries
none, and reads as one sample of all its tokens, finish reason unknown.

| word | what                                                                          |
|------|-------------------------------------------------------------------------------|
| 0    | EXTRAS_MAGIC (high 8 bits), the number of samples n (low 8 bits: 1..MAX_N)    |
| 1    | cached prompt tokens, or NO_COUNT (the engine did not say)                    |
| 2..  | each sample's token count, bit 31 set when it finished on a stop (not length) |

The samples' tokens are the result's tokens, one after another.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import MAX_N

EXTRAS_MAGIC = 0xB6
NO_COUNT = 0xFFFFFFFF
STOPPED = 1 << 31
FINISH_REASONS = ("length", "stop")  # by whether the sample stopped


class ExtrasError(ValueError):
    """Words that are not a result's extras."""


@dataclass(frozen=True)
class Extras:
    lengths: tuple[int, ...]  # each sample's token count
    stopped: tuple[bool, ...]  # each sample ended on a stop (EOS, a stop id or string), not its length
    cached_tokens: int | None = None

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        return tuple(FINISH_REASONS[s] for s in self.stopped)


def encode_extras(lengths, stopped, cached_tokens: int | None = None) -> np.ndarray:
    """The extras words of a result (`lengths` and `stopped`: one per sample)."""
    n = len(lengths)
    if not 1 <= n <= MAX_N or len(stopped) != n:
        raise ExtrasError(f"a result holds 1 to {MAX_N} samples, each with a finish: got {n} and {len(stopped)}")
    words = np.empty(2 + n, np.uint32)
    words[0] = (EXTRAS_MAGIC << 24) | n
    words[1] = NO_COUNT if cached_tokens is None else min(int(cached_tokens), NO_COUNT - 1)
    words[2:] = np.asarray(lengths, np.uint32) | np.where(np.asarray(stopped, bool), np.uint32(STOPPED), np.uint32(0))
    return words


def decode_extras(words, num_tokens: int) -> Extras:
    """The extras of a result with `num_tokens` tokens; ExtrasError when the words are not extras."""
    w = np.asarray(words, np.uint32)
    if w.size < 3 or int(w[0]) >> 24 != EXTRAS_MAGIC:
        raise ExtrasError("these words are not a result's extras")
    n = int(w[0]) & 0xFF
    if w.size != 2 + n:
        raise ExtrasError(f"a result's extras for {n} samples are {w.size} words")
    lengths = tuple(int(x) & ~STOPPED for x in w[2:])
    if sum(lengths) != num_tokens:
        raise ExtrasError(f"the samples' lengths add up to {sum(lengths)}, the result holds {num_tokens} tokens")
    cached = int(w[1])
    return Extras(lengths, tuple(bool(int(x) & STOPPED) for x in w[2:]), None if cached == NO_COUNT else cached)


def samples_of(tokens: np.ndarray, extras: Extras | None) -> list[np.ndarray]:
    """The samples' tokens (views of `tokens`); without extras, all of them as one sample."""
    if extras is None:
        return [tokens]
    ends = np.cumsum(extras.lengths)
    return [tokens[e - n : e] for n, e in zip(extras.lengths, ends.tolist())]
