"""What a result carries beside its tokens: its samples' lengths and finish reasons, and the prompt
tokens its engine served from a prefix cache (`usage.prompt_tokens_details.cached_tokens`).

A result whose engine reported any of it carries extras words after its tokens (ring/wire.py: the
result record's `extras` count; the producer's result ring record's meta[2]); one without carries
none, and reads as one sample of all its tokens, finish reason unknown.

| word | what                                                                          |
|------|-------------------------------------------------------------------------------|
| 0    | EXTRAS_MAGIC (high 8 bits), logprob columns c (bits 8..15: 0 without logprobs, |
|      | else 1 + top_logprobs), the number of samples n (low 8 bits: 1..MAX_N)         |
| 1    | cached prompt tokens, or NO_COUNT (the engine did not say)                    |
| 2..  | each sample's token count, bit 31 set when it finished on a stop (not length) |
| ...  | with logprobs, for each token of each sample in order: its logprob (float32   |
|      | bits), then c - 1 pairs of a top token id and its logprob (float32 bits)      |

A vector (an embedding item's result, request/options.py `Task.EMBED`) is carried as the result's
tokens: its float32 values' bits, one word each, bit-exact and covered by the record's checksum like
any tokens. Its extras are two words: VECTOR_MAGIC (high 8 bits), then the prompt tokens served from
the engine's cache, or NO_COUNT. How long a vector may be is a result record's limit: half of the
smaller of the GPU process's results ring (16 MiB: 2M values) and the producer's result ring
(`result_ring_bytes`), far above any model's width; the GPU process fails a larger result alone.

The samples' tokens are the result's tokens, one after another. A result's extras are at most
EXTRAS_MAX_WORDS words (the result record's count is 16 bits): logprobs of many tokens with many
top_logprobs can exceed it, and `encode_extras` then refuses them (ExtrasError, saying so).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .options import MAX_N

EXTRAS_MAGIC = 0xB6
VECTOR_MAGIC = 0xB7  # the extras of a vector
EXTRAS_MAX_WORDS = 0xFFFF  # the result record's extras count is 16 bits (ring/wire.py)
NO_COUNT = 0xFFFFFFFF
STOPPED = 1 << 31
FINISH_REASONS = ("length", "stop")  # by whether the sample stopped


class ExtrasError(ValueError):
    """Words that are not a result's extras."""


@dataclass(frozen=True)
class Logprobs:
    """One sample's logprobs: each token's (float32), and its top tokens' ids and logprobs (tokens x k)."""

    token: np.ndarray
    top_ids: np.ndarray
    top: np.ndarray


@dataclass(frozen=True)
class Extras:
    lengths: tuple[int, ...]  # each sample's token count
    stopped: tuple[bool, ...]  # each sample ended on a stop (EOS, a stop id or string), not its length
    cached_tokens: int | None = None
    logprobs: tuple[Logprobs, ...] | None = None  # one per sample, when asked for
    vector: bool = False  # the tokens are a vector's float32 values (one sample, all of them)

    @property
    def finish_reasons(self) -> tuple[str, ...]:
        return tuple(FINISH_REASONS[s] for s in self.stopped)


def encode_extras(lengths, stopped, cached_tokens: int | None = None, logprobs=None) -> np.ndarray:
    """The extras words of a result (`lengths` and `stopped`: one per sample; `logprobs`: a Logprobs
    per sample, or None). ExtrasError when they do not fit a result (EXTRAS_MAX_WORDS)."""
    n = len(lengths)
    if not 1 <= n <= MAX_N or len(stopped) != n:
        raise ExtrasError(f"a result holds 1 to {MAX_N} samples, each with a finish: got {n} and {len(stopped)}")
    columns = 0 if logprobs is None else 1 + int(logprobs[0].top_ids.shape[1])
    width = 2 * columns - 1 if columns else 0  # words a token: its logprob, then (id, logprob) pairs
    total = 2 + n + width * int(sum(lengths))
    if total > EXTRAS_MAX_WORDS:
        raise ExtrasError(f"logprobs of {int(sum(lengths))} tokens with top_logprobs {columns - 1} take {total} words, "
                          f"more than a result carries ({EXTRAS_MAX_WORDS}): ask fewer top_logprobs or tokens")
    words = np.empty(total, np.uint32)
    words[0] = (EXTRAS_MAGIC << 24) | (columns << 8) | n
    words[1] = NO_COUNT if cached_tokens is None else min(int(cached_tokens), NO_COUNT - 1)
    words[2 : 2 + n] = np.asarray(lengths, np.uint32) | np.where(np.asarray(stopped, bool), np.uint32(STOPPED), np.uint32(0))
    if columns:
        if len(logprobs) != n or any(lp.token.size != length for lp, length in zip(logprobs, lengths)):
            raise ExtrasError("a result's logprobs must give one row per token of each sample")
        table = np.empty((int(sum(lengths)), width), np.uint32)
        table[:, 0] = np.concatenate([lp.token for lp in logprobs]).astype(np.float32).view(np.uint32)
        table[:, 1::2] = np.concatenate([lp.top_ids for lp in logprobs]).astype(np.uint32)
        table[:, 2::2] = np.concatenate([lp.top for lp in logprobs]).astype(np.float32).view(np.uint32)
        words[2 + n :] = table.ravel()
    return words


def vector_extras(cached_tokens: int | None = None) -> np.ndarray:
    """The extras words of a vector result (its values are the result's tokens, as float32 bits)."""
    cached = NO_COUNT if cached_tokens is None else min(int(cached_tokens), NO_COUNT - 1)
    return np.array([VECTOR_MAGIC << 24, cached], np.uint32)


def vector_words(vector) -> np.ndarray:
    """A vector's values as a result's token words: float32 bits (no copy of a contiguous float32 array)."""
    return np.ascontiguousarray(vector, "<f4").reshape(-1).view(np.uint32)


def words_of(extras: Extras) -> np.ndarray:
    """An Extras back as its words (what `decode_extras` read): a vector's, or samples' with their logprobs."""
    if extras.vector:
        return vector_extras(extras.cached_tokens)
    return encode_extras(extras.lengths, extras.stopped, extras.cached_tokens, extras.logprobs)


def decode_extras(words, num_tokens: int) -> Extras:
    """The extras of a result with `num_tokens` tokens; ExtrasError when the words are not extras."""
    w = np.asarray(words, np.uint32)
    if w.size == 2 and int(w[0]) == VECTOR_MAGIC << 24:
        return Extras((num_tokens,), (True,), None if int(w[1]) == NO_COUNT else int(w[1]), vector=True)
    if w.size < 3 or int(w[0]) >> 24 != EXTRAS_MAGIC:
        raise ExtrasError("these words are not a result's extras")
    n, columns = int(w[0]) & 0xFF, (int(w[0]) >> 8) & 0xFF
    width = 2 * columns - 1 if columns else 0
    if w.size != 2 + n + width * num_tokens:
        raise ExtrasError(f"a result's extras for {n} samples and {num_tokens} tokens are {w.size} words")
    lengths = tuple(int(x) & ~STOPPED for x in w[2 : 2 + n])
    if sum(lengths) != num_tokens:
        raise ExtrasError(f"the samples' lengths add up to {sum(lengths)}, the result holds {num_tokens} tokens")
    cached = int(w[1])
    logprobs = None
    if columns:
        table = w[2 + n :].reshape(num_tokens, width)
        ends = np.cumsum(lengths)
        logprobs = tuple(Logprobs(table[e - k : e, 0].copy().view(np.float32), table[e - k : e, 1::2].copy(),
                                  table[e - k : e, 2::2].copy().view(np.float32))
                         for k, e in zip(lengths, ends.tolist()))
    return Extras(lengths, tuple(bool(int(x) & STOPPED) for x in w[2 : 2 + n]), None if cached == NO_COUNT else cached,
                  logprobs)


def samples_of(tokens: np.ndarray, extras: Extras | None) -> list[np.ndarray]:
    """The samples' tokens (views of `tokens`); without extras, all of them as one sample."""
    if extras is None:
        return [tokens]
    ends = np.cumsum(extras.lengths)
    return [tokens[e - n : e] for n, e in zip(extras.lengths, ends.tolist())]
