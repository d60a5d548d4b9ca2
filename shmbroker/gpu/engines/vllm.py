"""vLLM's offline `LLM` behind the engine interface (`base.py`): token ids in, greedy token ids out.

vLLM pages its KV cache and, with prefix caching on, computes per item only the blocks it does not
already hold, so the engine is `packed` (DESIGN.md "Words"): the scheduler sends it shape-pure batches
in family order and each item pays for its own suffix, with no padding.

APIs followed (vLLM v1: docs.vllm.ai "stable" pages and the vllm-project/vllm sources):
- `vllm.LLM(model=..., **EngineArgs)`; `LLM.generate(prompts, sampling_params, use_tqdm=False)` returns
  one `RequestOutput` per prompt in prompt order, its `outputs[0].token_ids` the generated ids;
- `vllm.inputs.TokensPrompt(prompt_token_ids=[...])`, with `skip_tokenizer_init=True` (no tokenizer);
- `vllm.SamplingParams(max_tokens=..., temperature=0.0, detokenize=False)`: greedy, ids only;
- `LLM.get_metrics()` (examples/offline_inference/metrics.py, vllm/v1/metrics/reader.py): Counter
  objects from the in-process Prometheus registry, among them `vllm:prefix_cache_queries` and
  `vllm:prefix_cache_hits` in tokens (design/metrics.md); it asserts "Stat logging disabled" unless the
  LLM is built with `disable_log_stats=False` (the offline LLM's default is True), which we pass.
The arguments themselves are computed in `packed_args.py`, importable without vllm.

Cache figures: the counters are cumulative; the engine keeps the last snapshot and reports each batch's
growth as hit/queried blocks of `block_tokens` and the hit tokens as `reused_tokens`. Without the
metrics API (an older vLLM, or stats turned off in `extra`) it falls back to the outputs'
`num_cached_tokens`, and to zeros without that.

`VLLM(settings, contract=..., llm=fake)` runs the same code over an injected LLM object (tests use a
test double); without `llm` it builds the real one.
"""

from __future__ import annotations

import time

from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

from .base import EngineOutcome
from .packed_args import (
    CacheHits,
    finish,
    hits_between,
    hits_from_requests,
    plan_batch,
    vllm_cache_tokens,
    vllm_llm_kwargs,
    vllm_sampling,
)


class VLLM:
    mode = "packed"

    def __init__(self, settings, *, block_tokens: int = 512, contract=None, llm=None, **_options):
        if contract is None:
            raise ValueError("engine 'vllm' needs the consumer's contract (max_model_len is derived from it)")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.settings = settings
        self.contract = contract
        self.block_tokens = block_tokens
        self.llm_kwargs = vllm_llm_kwargs(settings, contract)
        self.llm = llm if llm is not None else LLM(**self.llm_kwargs)
        self._seen = self._counters()  # the prefix-cache counters after the last batch (None: not known)

    def _counters(self):
        get = getattr(self.llm, "get_metrics", None)
        if get is None:
            return None
        try:
            return vllm_cache_tokens(get())
        except Exception:  # noqa: BLE001 - "Stat logging disabled" or an engine without the reader: no figures
            return None

    def run(self, batch) -> EngineOutcome:
        if self.llm is None:
            raise RuntimeError("engine 'vllm' is closed")
        plan = plan_batch(batch, max_new_tokens_max=self.settings.max_new_tokens,
                          max_input_len=self.contract.max_input_len)
        if not plan.rows:
            return EngineOutcome(finish(plan, batch, []))
        prompts = [TokensPrompt(prompt_token_ids=p) for p in plan.prompts]
        params = [SamplingParams(**vllm_sampling(m)) for m in plan.max_new_tokens]
        start = time.perf_counter()
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        results = finish(plan, batch, [out.outputs[0].token_ids for out in outputs])
        hits = self._hits(outputs, plan)
        return EngineOutcome(results, hits.hit_blocks, hits.queried_blocks, seconds, reused_tokens=hits.reused_tokens)

    def _hits(self, outputs, plan) -> CacheHits:
        now = self._counters()
        if now is not None:
            hits = hits_between(self._seen, now, self.block_tokens)
            self._seen = now
            return hits
        cached = [getattr(out, "num_cached_tokens", None) for out in outputs]
        return hits_from_requests(cached, [len(p) for p in plan.prompts], self.block_tokens)

    def close(self) -> None:
        llm, self.llm = self.llm, None
        shutdown = getattr(llm, "shutdown", None)
        if callable(shutdown):
            shutdown()
