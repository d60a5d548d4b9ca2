"""How the simulated engine honours an item's request options (it is a simulator, named as one).

Its generated ids are a seeded function of a key and the step (`Sim.generated_many`). Without
options the key is the item's id and its prompt's digest, as ever. With options:
- `temperature` 0 is greedy decoding: the key is the prompt's digest alone, so the same prompt gives
  the same tokens in any item, any batch and any order;
- a `seed` makes sampling reproducible: the key is the prompt's digest and the seed;
- `stop_token_ids` end the output at the first such id generated once `min_tokens` are out (the
  stop id kept, as vLLM keeps one that is not special);
- the rest are accepted and change nothing: `stop` strings need text and `ignore_eos` an EOS,
  which a simulator has not, and the penalties and top-p/k/min-p only reshape a distribution it
  does not model.
`logprobs` (with `top_logprobs` k) are modeled too: each token's logprob and its k top tokens are a
seeded function of the token and its position (the token itself first among them), not of any
distribution, so a test can tell them apart and check they travel intact.
`n` samples are n outputs from keys derived from the item's (the first is its key: n = 1 is as
without n), each with its own stop; the result carries them one after another, with their lengths
and finish reasons in its extras (`request/extras.py`). The item finishes when its longest output does: its decode steps are its real output's, not max_new_tokens,
so early stops shorten the modeled time as they shorten a real engine's.
"""

from __future__ import annotations

import numpy as np

from ..request.extras import Logprobs, decode_extras, encode_extras

GREEDY_SALT = np.uint64(0xD6E8FEB86659FD93)
SEED_SALT = np.uint64(0xA0761D6478BD642F)
ITEM_SALT = np.uint64(0x9E3779B97F4A7C15)
SAMPLE_SALT = np.uint64(0xE7037ED1A0B428DB)


def item_keys(item_ids: np.ndarray, digests: np.ndarray) -> np.ndarray:
    """The default keys: item id and prompt digest."""
    return np.asarray(item_ids, np.uint64) * ITEM_SALT ^ np.asarray(digests, np.uint64)


def sample_key(item_id: int, digest: int, opts) -> int:
    """The key an item's tokens are generated from, given its options (module docstring)."""
    with np.errstate(over="ignore"):
        if opts is not None and opts.seed is not None:
            seed = np.array([opts.seed], np.int64).view(np.uint64)[0]
            return int(np.uint64(digest) * SEED_SALT ^ seed)
        if opts is not None and opts.temperature == 0.0:
            return int(np.uint64(digest) * GREEDY_SALT)
        return int(item_keys(np.array([item_id], np.uint64), np.array([digest], np.uint32))[0])


def stop_at(tokens: np.ndarray, opts) -> int | None:
    """The output length when a stop id ends the generated `tokens` (all max_new_tokens of them); None
    when none does (the output is all of them, finished by its length)."""
    if opts is None or not opts.stop_token_ids or not tokens.size:
        return None
    hits = np.flatnonzero(np.isin(tokens, np.array(opts.stop_token_ids, np.uint32)))
    floor = opts.min_tokens or 0
    hits = hits[hits + 1 > floor] if floor else hits
    return int(hits[0]) + 1 if hits.size else None


def output_length(tokens: np.ndarray, opts) -> int:
    """How many of the generated `tokens` (all max_new_tokens of them) the item returns."""
    at = stop_at(tokens, opts)
    return int(tokens.size) if at is None else at


def sample_keys(key: int, n: int) -> np.ndarray:
    """The keys of an item's n samples: the first is the item's key (n = 1 is as without n)."""
    with np.errstate(over="ignore"):
        return np.uint64(key) ^ (np.arange(n, dtype=np.uint64) * SAMPLE_SALT)


def sampled_result(item_id: int, key: int, max_new: int, opts, generate) -> tuple[np.ndarray, np.ndarray]:
    """(every sample's tokens, one after another; the extras words) of an item with options;
    `generate(keys, counts)`: the engine's tokens for these keys (`Sim.generated_many`'s flat)."""
    n = opts.samples
    out = generate(sample_keys(key, n), np.full(n, max_new, np.int64)).reshape(n, max_new)
    ends = [stop_at(row, opts) for row in out]
    lengths = [max_new if e is None else e for e in ends]
    tokens = np.concatenate([row[:k] for row, k in zip(out, lengths)]) if n else np.zeros(0, np.uint32)
    logprobs = [modeled_logprobs(row[:k], opts.top_logprobs or 0) for row, k in zip(out, lengths)] \
        if opts.logprobs else None
    return tokens.astype(np.uint32), encode_extras(lengths, [e is not None for e in ends], None, logprobs)


def modeled_logprobs(tokens: np.ndarray, k: int) -> Logprobs:
    """The simulator's logprobs of a sample's tokens (module docstring): token j's is -(1 + (t_j + j)
    % 1000) / 1000, its top tokens t_j, t_j + 1, ... with logprobs falling by 0.5 each."""
    t = tokens.astype(np.int64)
    own = (-(1 + (t + np.arange(t.size)) % 1000) / 1000).astype(np.float32)
    ids = ((t[:, None] + np.arange(k)) % (1 << 32)).astype(np.uint32)
    top = (own[:, None] - 0.5 * np.arange(k)).astype(np.float32)
    return Logprobs(own, ids, top)


def with_cached(res, cached: np.ndarray) -> None:
    """Give each result of `res` (a BatchResults, changed in place) the prompt tokens its engine
    served from its cache, as vLLM reports them: in its extras, beside its samples' lengths and
    finishes (a plain result's one sample ends at its length)."""
    for i, c in enumerate(cached.tolist()):
        words = res.extras.get(i)
        if words is None:
            res.extras[i] = encode_extras([int(res.offsets[i + 1] - res.offsets[i])], [False], c)
        else:
            e = decode_extras(words, int(res.offsets[i + 1] - res.offsets[i]))
            res.extras[i] = encode_extras(e.lengths, e.stopped, c, e.logprobs)
