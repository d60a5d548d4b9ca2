"""A finished request's samples as one item's result, for the engines whose API returns a request's
completions as objects (vLLM's `RequestOutput.outputs`, TensorRT-LLM's `GenerationResult.outputs`):
each with its `index`, `token_ids` and `finish_reason` ('stop' or 'length' when it completed).

The result's tokens are its samples' one after another (by index); its extras (`request/extras.py`)
say each sample's length, whether it finished on a stop, and the prompt tokens the engine served
from its cache when the engine says. No engine package is imported here.
"""

from __future__ import annotations

import numpy as np

from ..request.extras import encode_extras
from .base import ENGINE_ERROR, OK, ItemResult


def samples_result(item_id: int, outputs, cached=None, copies: int = 1) -> ItemResult:
    """The result of a finished request with these outputs; `copies`: each output stands for that
    many identical samples (a greedy request asked for n of them runs once)."""
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
    return ItemResult(item_id, OK, np.concatenate(tokens), extras=encode_extras([t.size for t in tokens], stopped, cached))
