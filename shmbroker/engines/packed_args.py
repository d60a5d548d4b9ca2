"""What the paged-KV ("packed") engines, vLLM and TensorRT-LLM, are given and what their counters mean,
as plain data: no vllm, tensorrt_llm or torch import here.

Why a module of its own: `vllm.py` and `trtllm.py` import their packages at the top, so that a missing
package is an ImportError when `base.load_engine` loads them (it becomes EngineUnavailable naming the
extra to install). Everything they pass those packages is computed here and tested on any machine:

- the contract (docs/design.md "Words") turned into engine limits: `vllm_llm_kwargs`, `trtllm_llm_kwargs`;
- an embedding consumer's pooling runner: `pooling_kwargs`;
- one item's vLLM sampling: `vllm_sampling` (TensorRT-LLM's: `trtllm_params.py`, with the
  end-of-sequence ids `eos_token_ids` finds in the model directory, as no tokenizer is loaded);
- the engines' cumulative prefix-cache counters turned into one batch's hit and queried blocks in the
  broker's block size: `vllm_cache_tokens`, `trtllm_cache_tokens`, `hits_between`, `hits_from_metrics`;
- which items of a batch an engine runs and which it answers itself: `plan_batch`, `finish`;
- vLLM's per-request `num_cached_tokens` turned into blocks: `hits_from_requests`;
- a streaming engine's busy seconds while requests are outstanding: `BusyClock` (trtllm, openai).

Why the step token budget (vLLM `max_num_batched_tokens`, TensorRT-LLM `max_num_tokens`) is what it is:
a batch's input tokens are at most count x longest input <= `max_batch_tokens`, so that budget prefills a
whole batch in one step. vLLM refuses to start when the budget is below `max_model_len` unless chunked
prefill is on (`SchedulerConfig` "max_num_batched_tokens ... is smaller than max_model_len"). vLLM v1
turns chunked prefill on by default, but not for every model, platform or version, so unless the
settings ask for it explicitly (`extra.enable_chunked_prefill = true`) the budget is raised to
`max_model_len`: a prompt of max_input_len plus max_new_tokens is at most max_new_tokens over the
contract's figure, a small cost in activation memory for an engine that starts everywhere. TensorRT-LLM
only needs a whole prompt (<= max_input_len <= max_batch_tokens) to fit one step, so it gets the
contract's figure. Both engines get at least `max_batch_size` tokens a step (one decode token per
running sequence; vLLM checks it).
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..request.structured import FIELD_OF, SWITCH_OF

from .base import ENGINE_ERROR, INVALID, OK, TOO_LONG, ItemResult
from .options import embeds

# vLLM v1 counters, in tokens (docs.vllm.ai "Production Metrics"); the `gpu_` names are the older ones
# (vLLM 0.8-0.9), read only when the current ones are absent.
VLLM_QUERIES = ("vllm:prefix_cache_queries", "vllm:gpu_prefix_cache_queries")
VLLM_HITS = ("vllm:prefix_cache_hits", "vllm:gpu_prefix_cache_hits")


def max_model_len(settings, contract) -> int:
    """The longest sequence an engine holds: the longest input plus the longest generation (an
    embedding engine generates nothing)."""
    return int(contract.max_input_len) + (0 if embeds(settings) else int(settings.max_new_tokens))


def step_tokens(settings, contract, *, chunked_prefill: bool) -> int:
    """Tokens one engine step may compute (module docstring)."""
    budget = max(int(contract.max_batch_tokens), int(contract.max_batch_size))
    return budget if chunked_prefill else max(budget, max_model_len(settings, contract))


def vllm_llm_kwargs(settings, contract) -> dict:
    """Keyword arguments of `vllm.EngineArgs(...)` (the engine is `LLMEngine.from_engine_args`; `vllm.LLM`
    takes the same) for a consumer's contract; `settings.extra` is passed as given and wins over what
    is derived here. An embedding consumer gets vLLM's pooling runner (`pooling_kwargs`)."""
    kwargs = {
        "model": settings.model,
        "enable_prefix_caching": True,
        "max_num_seqs": int(contract.max_batch_size),
        "max_num_batched_tokens": step_tokens(settings, contract,
                                              chunked_prefill=settings.extra.get("enable_chunked_prefill") is True),
        "max_model_len": max_model_len(settings, contract),
        "dtype": settings.dtype,
        "gpu_memory_utilization": float(settings.gpu_memory_utilization),
        "tensor_parallel_size": int(settings.tensor_parallel_size),
        "enforce_eager": bool(settings.enforce_eager),
        "seed": int(settings.seed),
        # token ids in, token ids out; a model directory with a tokenizer has it loaded, so that
        # stop strings work (vLLM matches them in the detokenized text)
        "skip_tokenizer_init": not has_tokenizer(settings.model),
        "disable_log_stats": False,  # get_metrics() asserts stat logging is on (bench gen reads the counters)
        # a dict here, vLLM's StructuredOutputsConfig in the engine (vllm.py `build_engine`)
        "structured_outputs_config": {"backend": settings.structured_outputs_backend,
                                      "disable_any_whitespace": bool(settings.disable_any_whitespace)},
    }
    if embeds(settings):
        pooling_kwargs(kwargs)
    kwargs.update(settings.extra)
    return kwargs


def pooling_kwargs(kwargs: dict) -> None:
    """An embedding engine's arguments, in place: `runner="pooling"` with vLLM's `convert="auto"`
    (`embed` for a *ForCausalLM, none for a model that pools already: vLLM's
    `ModelConfig._get_default_convert_type`); prefix caching and chunked prefill left to vLLM's
    default for the model (`is_prefix_caching_supported`: on for causal last-token pooling, off for
    bidirectional attention or mean/CLS pooling, whose vectors a cached prefix cannot give); no
    structured outputs (nothing is generated)."""
    kwargs.update(runner="pooling", convert="auto")
    del kwargs["enable_prefix_caching"], kwargs["structured_outputs_config"]


# request options (request/options.py) that are `vllm.SamplingParams` fields of the same name and meaning
VLLM_SAME_NAME = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                  "repetition_penalty", "min_tokens", "ignore_eos", "n")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def has_tokenizer(model: str) -> bool:
    """Does the model directory hold a tokenizer (vLLM then loads it)?"""
    return bool(model) and os.path.isdir(model) and any(os.path.isfile(os.path.join(model, f)) for f in TOKENIZER_FILES)


def vllm_sampling(max_new_tokens: int, options=None) -> dict:
    """`vllm.SamplingParams(...)` of one item: greedy and token ids only unless its request options
    (a `RequestOptions`) say otherwise; stop strings need the detokenized text."""
    kwargs = {"max_tokens": int(max_new_tokens), "temperature": 0.0, "detokenize": False}
    if options is None:
        return kwargs
    given = options.given()
    kwargs.update({k: given[k] for k in VLLM_SAME_NAME if k in given})
    if options.stop_token_ids:
        kwargs["stop_token_ids"] = list(options.stop_token_ids)
    if options.stop:
        kwargs["stop"] = list(options.stop)
        kwargs["detokenize"] = True
    if options.logprobs:  # the sampled token's logprob, and top_logprobs more (vLLM's `logprobs`)
        kwargs["logprobs"] = int(options.top_logprobs or 0)
    if options.structured is not None:  # a dict here, `StructuredOutputsParams` in the engine
        kwargs["structured_outputs"] = structured_fields(options.structured)
    return kwargs


def structured_fields(s) -> dict:
    """vLLM's `StructuredOutputsParams(...)` fields of a constraint (request/structured.py), its
    payload read: the one constraint field and the switches given."""
    fields = {FIELD_OF[s.kind]: s.value()}
    for name, bit in SWITCH_OF.items():
        if s.has(bit):
            fields[name] = True
    return fields


def trtllm_llm_kwargs(settings, contract) -> dict:
    """Keyword arguments of `tensorrt_llm.LLM(...)`; `kv_cache_config` is a dict the engine turns into
    `tensorrt_llm.llmapi.KvCacheConfig`. `settings.extra` wins, its `kv_cache_config` table merged key by key.
    `guided_decoding_backend` (what compiles constraints) is passed only with a tokenizer loaded: the LLM
    API builds the backend from the tokenizer's vocabulary (llmapi/llm.py), and cannot without one."""
    extra = dict(settings.extra)
    kv_cache = {"enable_block_reuse": True, "free_gpu_memory_fraction": float(settings.free_gpu_memory_fraction)}
    kv_cache.update(extra.pop("kv_cache_config", None) or {})
    tokenizer = has_tokenizer(settings.model)
    kwargs = {
        "model": settings.model,
        "max_batch_size": int(contract.max_batch_size),
        # a context must fit one step unless chunked: prompts are <= max_input_len <= this budget
        "max_num_tokens": step_tokens(settings, contract, chunked_prefill=True),
        "max_input_len": int(contract.max_input_len),
        "max_seq_len": max_model_len(settings, contract),
        "kv_cache_config": kv_cache,
        # token ids in and out; a model directory with a tokenizer has it loaded, so that stop strings
        # work (the LLM API encodes them into the token ids it matches)
        "skip_tokenizer_init": not tokenizer,
        "tensor_parallel_size": int(settings.tensor_parallel_size),
        "dtype": settings.dtype,
        "enable_iter_perf_stats": True,  # LLM.get_stats() reports iteration stats (kvCacheStats) only with it
    }
    if tokenizer and settings.guided_decoding_backend != "none":
        kwargs["guided_decoding_backend"] = settings.guided_decoding_backend
    kwargs.update(extra)
    return kwargs


def as_token_ids(value) -> list[int]:
    """An `eos_token_id` as configs write it (an int, a list of ints, or nothing) as a list."""
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, (int, np.integer)):
        return [int(value)]
    try:
        return [int(v) for v in value if isinstance(v, (int, np.integer)) and not isinstance(v, bool)]
    except TypeError:
        return []


def eos_token_ids(model) -> list[int]:
    """End-of-sequence ids of a local model directory: generation_config.json's, else config.json's;
    [] when the model is not a local directory or names none."""
    if not isinstance(model, (str, os.PathLike)) or not os.path.isdir(model):
        return []
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(model, name), encoding="utf-8") as fh:
                ids = as_token_ids(json.load(fh).get("eos_token_id"))
        except (OSError, ValueError, AttributeError):
            continue
        if ids:
            return ids
    return []


class CacheTokens(NamedTuple):
    """An engine's cumulative prefix-cache counters, in tokens, since it started."""

    queried_tokens: int
    hit_tokens: int


class CacheHits(NamedTuple):
    """One batch's figures for `EngineOutcome`, in the broker's blocks (`block_tokens`)."""

    hit_blocks: int = 0
    queried_blocks: int = 0
    reused_tokens: int = 0


def hits_between(before: CacheTokens | None, after: CacheTokens | None, block_tokens: int) -> CacheHits:
    """The counters' growth over one batch. No `after`: nothing known (zeros). No `before`: the counters
    from zero (the engine reported nothing earlier). A counter that went back (a restarted engine)
    counts from zero too."""
    if after is None:
        return CacheHits()
    assert block_tokens >= 1
    if before is None or after.queried_tokens < before.queried_tokens or after.hit_tokens < before.hit_tokens:
        before = CacheTokens(0, 0)
    queried = after.queried_tokens - before.queried_tokens
    hit = min(after.hit_tokens - before.hit_tokens, queried)
    return CacheHits(hit // block_tokens, queried // block_tokens, hit)


def _sum_named(metrics, names) -> int | None:
    """The sum over label sets of the first of `names` that `metrics` holds; None when none is there."""
    for name in names:
        values = [m.value for m in metrics if getattr(m, "name", None) == name and hasattr(m, "value")]
        if values:
            return int(sum(values))
    return None


def vllm_cache_tokens(metrics) -> CacheTokens | None:
    """vLLM's prefix-cache counters from `LLM.get_metrics()` (a list of `vllm.v1.metrics.reader` metrics,
    each with `name`, `labels`, `value`), summed over label sets (engines); None when they are absent."""
    queries = _sum_named(metrics, VLLM_QUERIES)
    hits = _sum_named(metrics, VLLM_HITS)
    if queries is None or hits is None:
        return None
    return CacheTokens(queries, hits)


def hits_from_metrics(before_metrics, after_metrics, block_tokens: int) -> CacheHits:
    """One batch's hits from two `LLM.get_metrics()` snapshots (vLLM)."""
    return hits_between(vllm_cache_tokens(before_metrics), vllm_cache_tokens(after_metrics), block_tokens)


def hits_from_requests(cached_tokens, prompt_tokens, block_tokens: int) -> CacheHits:
    """One batch's hits from per-request figures (vLLM `RequestOutput.num_cached_tokens`), when the
    metrics are not available; zeros unless every request has one."""
    if not cached_tokens or any(isinstance(c, bool) or not isinstance(c, (int, np.integer)) for c in cached_tokens):
        return CacheHits()
    return hits_between(None, CacheTokens(int(sum(prompt_tokens)), int(sum(cached_tokens))), block_tokens)


def trtllm_cache_tokens(stats) -> CacheTokens | None:
    """TensorRT-LLM's block-reuse counters from `LLM.get_stats()` entries (dicts, or JSON text in older
    versions): the latest entry's `kvCacheStats`, whose reusedBlocks and missedBlocks count since the
    engine started, in its own blocks of tokensPerBlock. None when no entry has them."""
    latest = None
    for entry in stats or ():
        if isinstance(entry, (str, bytes)):
            try:
                entry = json.loads(entry)
            except ValueError:
                continue
        kv = entry.get("kvCacheStats") if isinstance(entry, dict) else None
        if isinstance(kv, dict) and "reusedBlocks" in kv and "tokensPerBlock" in kv:
            latest = kv
    if latest is None:
        return None
    per_block = int(latest["tokensPerBlock"])
    reused = int(latest["reusedBlocks"])
    missed = int(latest.get("missedBlocks", 0))
    return CacheTokens((reused + missed) * per_block, reused * per_block)


@dataclass
class Plan:
    """The items of a batch an engine runs (`rows`, in batch order, with their prompts and generation
    lengths) and the results it gives without running (`results[row]` set)."""

    rows: list
    prompts: list  # [list of int], one per row
    max_new_tokens: list  # [int], one per row
    results: list  # [ItemResult | None], one per batch item


def plan_batch(batch, *, max_new_tokens_max: int, max_input_len: int, embed: bool = False) -> Plan:
    """Split a batch: an item without tokens is invalid, one longer than max_input_len too long, one
    asking more than the engine's max_new_tokens fails alone (the engine's max_model_len has no room
    for it), one asking none is answered with no tokens; the rest run. `embed`: every item runs for
    its vector (it asks for no tokens)."""
    n = len(batch)
    results: list = [None] * n
    rows, prompts, max_new = [], [], []
    for i in range(n):
        item_id = int(batch.item_ids[i])
        tokens = batch.tokens[i]
        m = int(batch.max_new_tokens[i])
        if tokens.size == 0:
            results[i] = ItemResult(item_id, INVALID, error="no tokens")
        elif tokens.size > max_input_len:
            results[i] = ItemResult(item_id, TOO_LONG, error=f"{tokens.size} tokens > max_input_len {max_input_len}")
        elif m > max_new_tokens_max and not embed:
            results[i] = ItemResult(item_id, ENGINE_ERROR, error=(
                f"max_new_tokens {m} > the engine's max_new_tokens {max_new_tokens_max} "
                "(raise engine_settings.max_new_tokens)"))
        elif m <= 0 and not embed:
            results[i] = ItemResult(item_id, OK)
        else:
            rows.append(i)
            prompts.append(np.asarray(tokens).tolist())
            max_new.append(m)
    return Plan(rows, prompts, max_new, results)


def finish(plan: Plan, batch, generated) -> list:
    """The batch's results in its order: the planned ones, and for each run row its generated ids."""
    if len(generated) != len(plan.rows):
        raise RuntimeError(f"the engine returned {len(generated)} outputs for {len(plan.rows)} prompts")
    results = list(plan.results)
    for row, ids in zip(plan.rows, generated):
        results[row] = ItemResult(int(batch.item_ids[row]), OK, np.asarray(ids, dtype=np.uint32).reshape(-1))
    return results


class BusyClock:
    """A streaming engine's busy seconds (`EngineOutcome.engine_seconds`): the wall seconds during which
    at least one of its requests is outstanding, taken (and reset) by each poll; thread-safe (requests
    begin and end on other threads: the `openai` engine's pool, the `trtllm` engine's event loop)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._running = 0
        self._since = 0.0  # when the current busy stretch began (or was last taken)
        self._seconds = 0.0

    def begin(self) -> None:
        with self._lock:
            if self._running == 0:
                self._since = time.perf_counter()
            self._running += 1

    def end(self) -> None:
        with self._lock:
            self._running -= 1
            if self._running == 0:
                self._seconds += time.perf_counter() - self._since

    def take(self) -> float:
        with self._lock:
            seconds = self._seconds
            if self._running:
                now = time.perf_counter()
                seconds += now - self._since
                self._since = now
            self._seconds = 0.0
            return seconds
