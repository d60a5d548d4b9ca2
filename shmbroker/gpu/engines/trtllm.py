"""TensorRT-LLM's `LLM` API behind the engine interface (`base.py`): token ids in, greedy token ids out.

TensorRT-LLM pages its KV cache and, with block reuse on, computes per item only the blocks its radix
tree does not already hold, so the engine is `packed` (DESIGN.md "Words").

APIs followed (TensorRT-LLM 1.x LLM API, nvidia.github.io/TensorRT-LLM "API Reference" (LLM,
TorchLlmArgs, KvCacheConfig, SamplingParams) and the NVIDIA/TensorRT-LLM sources):
- `tensorrt_llm.LLM(model, skip_tokenizer_init=True, tensor_parallel_size, dtype, max_batch_size,
  max_num_tokens, max_input_len, max_seq_len, kv_cache_config, enable_iter_perf_stats, **kwargs)`;
- `tensorrt_llm.llmapi.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction=...)`;
- `LLM.generate(inputs, sampling_params, use_tqdm=False)`: a list of token-id lists is a batch of
  prompts, one `RequestOutput` back per prompt in order, its `outputs[0].token_ids` the generated ids;
- `tensorrt_llm.SamplingParams(max_tokens, top_k=1, detokenize=False, end_id, pad_id, ...)`: without a
  tokenizer `LLM._prepare_sampling_params` raises unless `end_id` is given, so the engine reads the
  end-of-sequence ids from the model directory (`packed_args.eos_token_ids`);
- `LLM.get_stats(timeout)` (beta): the iteration stats queued since the last call (dicts, JSON text in
  older versions), collected only with `enable_iter_perf_stats=True`; each holds `kvCacheStats` with
  `reusedBlocks`, `missedBlocks` (counted since the engine started) and `tokensPerBlock`.
The arguments themselves are computed in `packed_args.py`, importable without tensorrt_llm.

Cache figures: the engine keeps the counters of the latest stats entry seen and reports each batch's
growth, converted from TensorRT-LLM's blocks to the broker's `block_tokens`. Stats of a batch's last
iterations that arrive after `generate` returns are counted with the next batch (the counters are
cumulative, so nothing is lost). No stats (an engine without them): zeros.

`TRTLLM(settings, contract=..., llm=fake)` runs the same code over an injected LLM object (tests use a
test double); without `llm` it builds the real one.
"""

from __future__ import annotations

import time

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import KvCacheConfig

from .base import EngineOutcome
from .packed_args import (
    as_token_ids,
    eos_token_ids,
    finish,
    hits_between,
    plan_batch,
    trtllm_cache_tokens,
    trtllm_llm_kwargs,
    trtllm_sampling,
)

STATS_TIMEOUT_SECONDS = 0.05  # LLM.get_stats waits this long for queued stats after a batch


class TRTLLM:
    mode = "packed"

    def __init__(self, settings, *, block_tokens: int = 512, contract=None, llm=None, **_options):
        if contract is None:
            raise ValueError("engine 'trtllm' needs the consumer's contract (max_seq_len is derived from it)")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.settings = settings
        self.contract = contract
        self.block_tokens = block_tokens
        self.llm_kwargs = trtllm_llm_kwargs(settings, contract)
        if llm is None:
            kwargs = dict(self.llm_kwargs)
            kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
            llm = LLM(**kwargs)
        self.llm = llm
        self.eos_ids = eos_token_ids(settings.model) or _configured_eos(llm)
        self._seen = self._counters()  # the block-reuse counters after the last batch (None: not known)

    def _counters(self):
        get = getattr(self.llm, "get_stats", None)
        if get is None:
            return None
        try:
            return trtllm_cache_tokens(get(timeout=STATS_TIMEOUT_SECONDS))
        except Exception:  # noqa: BLE001 - no stats queued, or stats not collected: no figures
            return None

    def run(self, batch) -> EngineOutcome:
        if self.llm is None:
            raise RuntimeError("engine 'trtllm' is closed")
        plan = plan_batch(batch, max_new_tokens_max=self.settings.max_new_tokens,
                          max_input_len=self.contract.max_input_len)
        if not plan.rows:
            return EngineOutcome(finish(plan, batch, []))
        params = [SamplingParams(**trtllm_sampling(m, self.eos_ids)) for m in plan.max_new_tokens]
        start = time.perf_counter()
        outputs = self.llm.generate(plan.prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        results = finish(plan, batch, [out.outputs[0].token_ids for out in outputs])
        now = self._counters()
        hits = hits_between(self._seen, now, self.block_tokens)
        if now is not None:
            self._seen = now
        return EngineOutcome(results, hits.hit_blocks, hits.queried_blocks, seconds, reused_tokens=hits.reused_tokens)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()


def _configured_eos(llm) -> list[int]:
    """End-of-sequence ids from the configs the LLM loaded (a model from the Hugging Face hub has no
    local directory to read); private attributes of the LLM API, so looked up defensively."""
    for name in ("_generation_config", "_hf_model_config"):
        ids = as_token_ids(getattr(getattr(llm, name, None), "eos_token_id", None))
        if ids:
            return ids
    return []
