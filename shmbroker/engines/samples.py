"""A finished request's samples as one item's result, for the engines whose API returns a request's
completions as objects (vLLM's `RequestOutput.outputs`, TensorRT-LLM's `GenerationResult.outputs`):
each with its `index`, `token_ids` and `finish_reason` ('stop' or 'length' when it completed).

The result's tokens are its samples' one after another (by index); its extras (`request/extras.py`)
say each sample's length, whether it finished on a stop, and the prompt tokens the engine served
from its cache when the engine says. No engine package is imported here.
"""

from __future__ import annotations

import numpy as np

from ..request.extras import ExtrasError, Logprobs, encode_extras
from .base import ENGINE_ERROR, OK, ItemResult


def sample_logprobs(output, tokens: np.ndarray, k: int) -> Logprobs:
    """One output's logprobs (vLLM's `CompletionOutput.logprobs`: per generated token a mapping of
    token id to an object with `logprob` and `rank`, the sampled token's always there): each token's
    own, and the k top ones by rank. ValueError when the engine gave fewer."""
    per_token = list(output.logprobs or ())
    if len(per_token) != tokens.size:
        raise ValueError(f"the engine gave logprobs for {len(per_token)} of {tokens.size} tokens")
    token = np.empty(tokens.size, np.float32)
    ids = np.empty((tokens.size, k), np.uint32)
    top = np.empty((tokens.size, k), np.float32)
    for j, (t, position) in enumerate(zip(tokens.tolist(), per_token)):
        token[j] = position[t].logprob
        ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None and lp.rank <= k)
        if len(ranked) < k:
            raise ValueError(f"the engine gave {len(ranked)} of the top {k} logprobs of token {j}")
        ids[j] = [tid for _, tid, _ in ranked[:k]]
        top[j] = [lp for _, _, lp in ranked[:k]]
    return Logprobs(token, ids, top)


def samples_result(item_id: int, outputs, cached=None, copies: int = 1, top_logprobs: int | None = None) -> ItemResult:
    """The result of a finished request with these outputs; `copies`: each output stands for that
    many identical samples (a greedy request asked for n of them runs once); `top_logprobs`: the
    logprobs asked for (None: none), read from each output's `logprobs`."""
    try:
        samples = sorted(outputs, key=lambda o: getattr(o, "index", 0))
        tokens = [np.asarray(o.token_ids, dtype=np.uint32).reshape(-1) for o in samples]
    except (AttributeError, TypeError):
        samples = []
    if not samples:
        return ItemResult(item_id, ENGINE_ERROR, error="the engine finished it with no output")
    stopped = [getattr(o, "finish_reason", None) == "stop" for o in samples]
    tokens, stopped = tokens * copies, stopped * copies
    cached = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
    try:
        logprobs = None if top_logprobs is None else \
            [sample_logprobs(o, t, top_logprobs) for o, t in zip(samples, tokens[: len(samples)])] * copies
        extras = encode_extras([t.size for t in tokens], stopped, cached, logprobs)
    except (ValueError, ExtrasError, KeyError, AttributeError, TypeError) as exc:
        return ItemResult(item_id, ENGINE_ERROR, error=f"its logprobs: {exc}")
    return ItemResult(item_id, OK, np.concatenate(tokens), extras=extras)
