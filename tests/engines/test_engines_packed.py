"""The packed engines, vLLM and TensorRT-LLM (engines/vllm.py, trtllm.py, packed_args.py).

Neither package is installed on the CPU machines that run this suite, so most of it checks what needs
neither: the contract mapped to engine arguments, greedy sampling per item, the engines' cumulative
cache counters turned into one batch's blocks, settings validation, and the `EngineUnavailable`
message naming the extra. The engine classes are checked over test doubles: `FakeVLLM` stands in for
vLLM's stepping `LLMEngine` (add_request / step, injected with `engine=` or `llm=`; the real one runs
in tests/engines/test_vllm_real.py) and `FakeTRTLLM` for TensorRT-LLM's `LLM` (`llm=`), and stub modules stand in
for the packages themselves so the engine modules import. The last tests build the real engines on a
tiny random-weight model (load_format "dummy", no download, no tokenizer); they run only where the
package imports and a CUDA GPU is present.
"""

from __future__ import annotations

import asyncio
import collections
import importlib
import inspect
import json
import queue
import re
import sys
import threading
import time
import types
from types import SimpleNamespace

import numpy as np
import pytest

from shmbroker.config.settings import ConfigError, parse
from shmbroker.engines.base import ENGINE_ERROR, INVALID, OK, TOO_LONG, EngineBatch, EngineDead, EngineUnavailable
from shmbroker.engines.catalogue import SAMPLES, engine_mode, load_engine
from shmbroker.engines.options import TRTLLMSettings, VLLMSettings
from shmbroker.engines.packed_args import (
    CacheHits,
    CacheTokens,
    eos_token_ids,
    hits_between,
    hits_from_metrics,
    hits_from_requests,
    trtllm_cache_tokens,
    trtllm_llm_kwargs,
    vllm_cache_tokens,
    vllm_llm_kwargs,
    vllm_sampling,
)
from shmbroker.engines.trtllm_params import choice_regex, sampling_fields, trtllm_guided, trtllm_sampling, trtllm_unhonoured
from shmbroker.pack.contract import Contract
from shmbroker.request.extras import decode_extras
from shmbroker.request.options import RequestOptions
from shmbroker.request.structured import Constraint, Structured, Switch, compact_json

CONTRACT = Contract(64, 16384, 4096)


def batch_of(ids, prompts, max_new, options=None) -> EngineBatch:
    return EngineBatch(np.asarray(ids, np.uint64), [np.asarray(p, np.uint32) for p in prompts],
                       np.asarray(max_new, np.int64), options=options)


# ---------------------------------------------------------------------------------------------------
# the contract mapped to engine arguments


def test_vllm_kwargs_from_contract():
    settings = VLLMSettings(model="/models/m", dtype="bfloat16", max_new_tokens=256, gpu_memory_utilization=0.8,
                            tensor_parallel_size=2, enforce_eager=True, seed=7)
    kw = vllm_llm_kwargs(settings, CONTRACT)
    assert kw == {
        "model": "/models/m", "enable_prefix_caching": True, "max_num_seqs": 64, "max_num_batched_tokens": 16384,
        "max_model_len": 4096 + 256, "dtype": "bfloat16", "gpu_memory_utilization": 0.8, "tensor_parallel_size": 2,
        "enforce_eager": True, "seed": 7, "skip_tokenizer_init": True, "disable_log_stats": False,
        "structured_outputs_config": {"backend": "auto", "disable_any_whitespace": False},
    }


def test_vllm_step_budget_reaches_max_model_len_unless_chunked_prefill():
    contract = Contract(8, 4096, 4096)  # a prompt as long as the whole budget, plus generation
    plain = vllm_llm_kwargs(VLLMSettings(model="m", max_new_tokens=256), contract)
    assert plain["max_model_len"] == 4352
    assert plain["max_num_batched_tokens"] == 4352  # vLLM refuses a budget < max_model_len without chunking
    chunked = vllm_llm_kwargs(VLLMSettings(model="m", max_new_tokens=256, extra={"enable_chunked_prefill": True}),
                              contract)
    assert chunked["max_num_batched_tokens"] == 4096 and chunked["enable_chunked_prefill"] is True
    off = vllm_llm_kwargs(VLLMSettings(model="m", extra={"enable_chunked_prefill": False}), contract)
    assert off["max_num_batched_tokens"] == 4096 + 256
    # a budget below the batch size cannot decode every running sequence (vLLM checks it)
    assert vllm_llm_kwargs(VLLMSettings(model="m", max_new_tokens=8), Contract(64, 32, 32))["max_num_batched_tokens"] == 64


def test_vllm_extra_passes_through_and_wins():
    kw = vllm_llm_kwargs(VLLMSettings(model="m", extra={"load_format": "dummy", "max_num_seqs": 8}), CONTRACT)
    assert kw["load_format"] == "dummy" and kw["max_num_seqs"] == 8


def test_trtllm_kwargs_from_contract():
    settings = TRTLLMSettings(model="/models/m", dtype="float16", max_new_tokens=128, free_gpu_memory_fraction=0.7,
                              tensor_parallel_size=1)
    kw = trtllm_llm_kwargs(settings, CONTRACT)
    assert kw == {
        "model": "/models/m", "max_batch_size": 64, "max_num_tokens": 16384, "max_input_len": 4096,
        "max_seq_len": 4096 + 128, "kv_cache_config": {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.7},
        "skip_tokenizer_init": True, "tensor_parallel_size": 1, "dtype": "float16", "enable_iter_perf_stats": True,
    }


def test_trtllm_guided_decoding_backend_only_with_a_tokenizer(tmp_path):
    """The backend that compiles constraints is built from the tokenizer's vocabulary: passed only when
    the model directory holds one; `none` leaves it out; `extra` wins."""
    assert "guided_decoding_backend" not in trtllm_llm_kwargs(TRTLLMSettings(model=str(tmp_path)), CONTRACT)
    (tmp_path / "tokenizer.json").write_text("{}")
    model = str(tmp_path)
    assert trtllm_llm_kwargs(TRTLLMSettings(model=model), CONTRACT)["guided_decoding_backend"] == "xgrammar"
    kw = trtllm_llm_kwargs(TRTLLMSettings(model=model, guided_decoding_backend="llguidance"), CONTRACT)
    assert kw["guided_decoding_backend"] == "llguidance" and kw["skip_tokenizer_init"] is False
    assert "guided_decoding_backend" not in trtllm_llm_kwargs(TRTLLMSettings(model=model, guided_decoding_backend="none"),
                                                              CONTRACT)
    extra = TRTLLMSettings(model=model, extra={"guided_decoding_backend": "llguidance"})
    assert trtllm_llm_kwargs(extra, CONTRACT)["guided_decoding_backend"] == "llguidance"


def test_trtllm_step_budget_is_the_contracts():
    kw = trtllm_llm_kwargs(TRTLLMSettings(model="m", max_new_tokens=256), Contract(8, 4096, 4096))
    assert (kw["max_num_tokens"], kw["max_input_len"], kw["max_seq_len"]) == (4096, 4096, 4352)
    assert trtllm_llm_kwargs(TRTLLMSettings(model="m"), Contract(64, 32, 32))["max_num_tokens"] == 64


def test_trtllm_extra_kv_cache_config_merges():
    settings = TRTLLMSettings(model="m", extra={"kv_cache_config": {"tokens_per_block": 64}, "load_format": "dummy"})
    kw = trtllm_llm_kwargs(settings, CONTRACT)
    assert kw["kv_cache_config"] == {"enable_block_reuse": True, "free_gpu_memory_fraction": 0.9, "tokens_per_block": 64}
    assert kw["load_format"] == "dummy"
    assert settings.extra == {"kv_cache_config": {"tokens_per_block": 64}, "load_format": "dummy"}  # not consumed


def test_sampling_is_greedy_token_ids_only():
    assert vllm_sampling(5) == {"max_tokens": 5, "temperature": 0.0, "detokenize": False}
    assert trtllm_sampling(5, [2]) == {"max_tokens": 5, "top_k": 1, "detokenize": False, "end_id": 2, "pad_id": 2}
    assert trtllm_sampling(3, [2, 7])["stop_token_ids"] == [7]
    none = trtllm_sampling(3, [])
    assert none["end_id"] == -1 and none["ignore_eos"] is True


def test_trtllm_sampling_from_request_options():
    """Each option reaches `tensorrt_llm.SamplingParams` under the field TensorRT-LLM documents for it;
    greedy stays top_k=1 (no sampling field that would change it), a temperature above 0 samples."""
    greedy = RequestOptions(temperature=0.0, top_p=0.5, top_k=7, min_p=0.1, seed=3, repetition_penalty=1.2,
                            min_tokens=2, n=2)
    assert trtllm_sampling(8, [2], greedy) == {
        "max_tokens": 8, "top_k": 1, "detokenize": False, "end_id": 2, "pad_id": 2, "repetition_penalty": 1.2,
        "min_tokens": 2, "seed": 3}  # n: one greedy run stands for both samples
    sampled = RequestOptions(temperature=0.7, top_p=0.9, top_k=40, min_p=0.05, seed=-11, n=3, presence_penalty=0.5,
                             frequency_penalty=-0.5, stop_token_ids=(5, 9), stop=("END", "\n\n"))
    assert trtllm_sampling(8, [2, 9], sampled) == {
        "max_tokens": 8, "top_k": 40, "detokenize": False, "end_id": 2, "pad_id": 2, "presence_penalty": 0.5,
        "frequency_penalty": -0.5, "seed": -11, "stop": ["END", "\n\n"], "include_stop_str_in_output": True,
        "temperature": 0.7, "top_p": 0.9, "n": 3, "min_p": 0.05, "stop_token_ids": [9, 5]}
    plain = trtllm_sampling(4, [2], RequestOptions(temperature=1.0, top_k=-1))  # -1: no top-k, as in vLLM
    assert (plain["top_k"], plain["top_p"], plain["temperature"], plain["n"]) == (None, 1.0, 1.0, 1)
    ignoring = trtllm_sampling(4, [2, 9], RequestOptions(ignore_eos=True, stop_token_ids=(7,)))
    assert ignoring["ignore_eos"] is True and ignoring["stop_token_ids"] == [7]  # the model's EOS ids ignored
    assert trtllm_sampling(4, [2], RequestOptions(seed=5), frozenset({"random_seed"}))["random_seed"] == 5
    params = trt_sampling_params(TRT_SAMPLING_FIELDS)
    for opts in (greedy, sampled, RequestOptions(temperature=1.5, n=4), RequestOptions(ignore_eos=True)):
        params(**trtllm_sampling(8, [2, 9], opts))  # every name a field; never greedy with n > 1


def test_trtllm_unhonoured_by_release_and_tokenizer():
    fields = sampling_fields(trt_sampling_params(TRT_SAMPLING_FIELDS))
    assert fields == frozenset(TRT_SAMPLING_FIELDS)
    assert trtllm_unhonoured(fields, tokenizer=True) == set()
    # the LLM API encodes stop strings with it; the guided decoding backend compiles against its vocabulary
    assert trtllm_unhonoured(fields, tokenizer=False) == {"stop", "structured"}
    assert trtllm_unhonoured(fields, tokenizer=True, guided=False) == {"structured"}  # no guided_decoding_backend
    no_guides = {k: v for k, v in TRT_SAMPLING_FIELDS.items() if k != "guided_decoding"}
    assert trtllm_unhonoured(sampling_fields(trt_sampling_params(no_guides)), tokenizer=True) == {"structured"}
    older = {k: v for k, v in TRT_SAMPLING_FIELDS.items() if k not in ("seed", "min_p")} | {"random_seed": None}
    assert trtllm_unhonoured(sampling_fields(trt_sampling_params(older)), tokenizer=True) == {"min_p"}
    assert sampling_fields(StubSamplingParams) is None  # takes any keyword: nothing known missing


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
CHOICES = ["yes", "no (maybe)", "a|b", "1+1=2?"]
CONSTRAINTS = {  # one of each kind, and the GuidedDecodingParams fields TensorRT-LLM is given for it
    "json": (Structured.of(Constraint.JSON, compact_json(SCHEMA)), {"json": '{"type":"object","properties":'
                                                                           '{"name":{"type":"string"}},'
                                                                           '"required":["name"]}'}),
    "json_object": (Structured.of(Constraint.JSON_OBJECT, None), {"json_object": True}),
    "regex": (Structured.of(Constraint.REGEX, b"[a-z]+@[a-z]+\\.com"), {"regex": "[a-z]+@[a-z]+\\.com"}),
    "choice": (Structured.of(Constraint.CHOICE, compact_json(CHOICES)),
               {"regex": "(yes|no\\ \\(maybe\\)|a\\|b|1\\+1=2\\?)"}),
    "grammar": (Structured.of(Constraint.GRAMMAR, b'root ::= "a" | "b"'), {"grammar": 'root ::= "a" | "b"'}),
}


@pytest.mark.parametrize("kind", CONSTRAINTS)
def test_trtllm_constraint_as_guided_decoding_params(kind):
    s, want = CONSTRAINTS[kind]
    assert trtllm_guided(s) == want
    kwargs = trtllm_sampling(8, [2], RequestOptions(structured=s), frozenset(TRT_SAMPLING_FIELDS))
    assert kwargs["guided_decoding"] == want and kwargs["top_k"] == 1  # the rest as without a constraint
    built = trtllm_sampling(8, [2], RequestOptions(structured=s), None, StubGuidedDecodingParams)["guided_decoding"]
    assert isinstance(built, StubGuidedDecodingParams) and built.kwargs == want
    trt_sampling_params(TRT_SAMPLING_FIELDS)(**kwargs)  # a field of SamplingParams


def test_trtllm_choice_regex_matches_each_choice_alone():
    pattern = re.compile(choice_regex(CHOICES))
    assert all(pattern.fullmatch(c) for c in CHOICES)
    assert not any(pattern.fullmatch(w) for w in ("a", "ab", "11=2", "no maybe", "yes|no (maybe)", ""))
    assert choice_regex(["only"]) == "(only)"


def test_trtllm_constraint_switches_have_no_field():
    """disable_any_whitespace and disable_additional_properties are accepted and pass nothing: TensorRT-LLM's
    GuidedDecodingParams has no field for them (the output is still valid JSON)."""
    s = Structured.of(Constraint.JSON, compact_json(SCHEMA),
                      Switch.DISABLE_ANY_WHITESPACE | Switch.DISABLE_ADDITIONAL_PROPERTIES)
    assert trtllm_guided(s) == CONSTRAINTS["json"][1]


def test_eos_token_ids_from_model_directory(tmp_path):
    assert eos_token_ids(str(tmp_path)) == []
    assert eos_token_ids("org/not-a-directory") == []
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    assert eos_token_ids(str(tmp_path)) == [2]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [128001, 128009]}))
    assert eos_token_ids(tmp_path) == [128001, 128009]
    (tmp_path / "generation_config.json").write_text("{not json")
    assert eos_token_ids(str(tmp_path)) == [2]


# ---------------------------------------------------------------------------------------------------
# cache counters -> one batch's blocks


def metric(name, value, **labels):
    return SimpleNamespace(name=name, labels=labels, value=value)


def test_vllm_counters_summed_over_engines_current_names_first():
    snapshot = [metric("vllm:prefix_cache_queries", 100, engine="0"), metric("vllm:prefix_cache_queries", 28, engine="1"),
                metric("vllm:prefix_cache_hits", 64, engine="0"), metric("vllm:num_requests_running", 3.0),
                metric("vllm:gpu_prefix_cache_queries", 999), metric("vllm:gpu_prefix_cache_hits", 999)]
    assert vllm_cache_tokens(snapshot) == CacheTokens(128, 64)
    old = [metric("vllm:gpu_prefix_cache_queries", 40), metric("vllm:gpu_prefix_cache_hits", 16)]
    assert vllm_cache_tokens(old) == CacheTokens(40, 16)
    assert vllm_cache_tokens([metric("vllm:prefix_cache_queries", 5)]) is None
    assert vllm_cache_tokens([]) is None


def test_hits_from_metrics_deltas_in_blocks():
    before = [metric("vllm:prefix_cache_queries", 1000), metric("vllm:prefix_cache_hits", 200)]
    after = [metric("vllm:prefix_cache_queries", 1000 + 2048 + 100), metric("vllm:prefix_cache_hits", 200 + 1536)]
    assert hits_from_metrics(before, after, 512) == CacheHits(hit_blocks=3, queried_blocks=4, reused_tokens=1536)
    assert hits_from_metrics(before, [], 512) == CacheHits(0, 0, 0)  # nothing known after: zeros
    assert hits_from_metrics([], after, 1) == CacheHits(1736, 3148, 1736)  # nothing before: from zero


def test_hits_between_edge_cases():
    assert hits_between(CacheTokens(10, 5), None, 16) == CacheHits()
    assert hits_between(CacheTokens(500, 400), CacheTokens(64, 32), 16) == CacheHits(2, 4, 32)  # restarted: from zero
    assert hits_between(CacheTokens(0, 0), CacheTokens(30, 40), 16) == CacheHits(1, 1, 30)  # hits never exceed queries
    assert hits_from_requests([16, 0], [40, 20], 16) == CacheHits(1, 3, 16)
    assert hits_from_requests([16, None], [40, 20], 16) == CacheHits()
    assert hits_from_requests([], [], 16) == CacheHits()


def test_trtllm_counters_from_latest_stats_entry():
    entries = [{"iter": 1, "kvCacheStats": {"reusedBlocks": 1, "missedBlocks": 3, "tokensPerBlock": 32}},
               json.dumps({"iter": 2, "kvCacheStats": {"reusedBlocks": 4, "missedBlocks": 6, "tokensPerBlock": 32}}),
               {"iter": 3}, "not json"]
    assert trtllm_cache_tokens(entries) == CacheTokens((4 + 6) * 32, 4 * 32)
    assert trtllm_cache_tokens([{"iter": 1}]) is None
    assert trtllm_cache_tokens([]) is None
    assert trtllm_cache_tokens(None) is None


# ---------------------------------------------------------------------------------------------------
# settings and loading


def consumer_config(engine: str, engine_settings: dict) -> dict:
    return {"consumers": [{"name": "gpu0", "max_batch_size": 64, "max_batch_tokens": 16384, "max_input_len": 4096,
                           "engine": engine, "engine_settings": engine_settings}]}


@pytest.mark.parametrize("engine, cls", [("vllm", VLLMSettings), ("trtllm", TRTLLMSettings)])
def test_settings_parse(engine, cls):
    cfg = parse(consumer_config(engine, {"model": "/models/m", "max_new_tokens": 64, "extra": {"load_format": "dummy"}}))
    (consumer,) = cfg.consumers
    assert consumer.engine == engine and isinstance(consumer.engine_settings, cls)
    assert consumer.engine_settings.max_new_tokens == 64 and consumer.engine_settings.extra == {"load_format": "dummy"}
    assert engine_mode(engine, consumer.engine_settings) == "packed"  # the registry entry declares it
    assert consumer.contract == CONTRACT


def test_trtllm_settings_guided_decoding_backend():
    assert TRTLLMSettings().guided_decoding_backend == "xgrammar"
    cfg = parse(consumer_config("trtllm", {"model": "m", "guided_decoding_backend": "llguidance"}))
    assert cfg.consumers[0].engine_settings.guided_decoding_backend == "llguidance"
    with pytest.raises(ConfigError, match=r"guided_decoding_backend: must be one of xgrammar, llguidance, none"):
        parse(consumer_config("trtllm", {"model": "m", "guided_decoding_backend": "outlines"}))


@pytest.mark.parametrize("engine", ["vllm", "trtllm"])
def test_settings_refuse_missing_model_and_unknown_keys(engine):
    with pytest.raises(ConfigError, match=r"consumers\[0\]\.engine_settings\.model: is required"):
        parse(consumer_config(engine, {"max_new_tokens": 64}))
    with pytest.raises(ConfigError, match="unknown key 'warp'"):
        parse(consumer_config(engine, {"model": "m", "warp": 9}))
    with pytest.raises(ConfigError, match="max_new_tokens"):
        parse(consumer_config(engine, {"model": "m", "max_new_tokens": 0}))


@pytest.mark.parametrize("engine, package, settings", [
    ("vllm", "vllm", VLLMSettings(model="m")),
    ("trtllm", "tensorrt_llm", TRTLLMSettings(model="m")),
])
def test_load_engine_without_package_names_the_extra(monkeypatch, engine, package, settings):
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` raises ImportError, installed or not
    monkeypatch.delitem(sys.modules, f"shmbroker.engines.{engine}", raising=False)
    with pytest.raises(EngineUnavailable, match=rf"pip install 'shmbroker\[{engine}\]'"):
        load_engine(engine, settings, block_tokens=16, contract=CONTRACT)
    sys.modules.pop(f"shmbroker.engines.{engine}", None)


# ---------------------------------------------------------------------------------------------------
# stub packages, so that the engine modules import without vllm / tensorrt_llm


class StubSamplingParams:
    """Stands in for the packages' SamplingParams: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


# `tensorrt_llm.SamplingParams`' fields and defaults, as its source declares them (tensorrt_llm/sampling_params.py)
TRT_SAMPLING_FIELDS = {
    "end_id": None, "pad_id": None, "max_tokens": 32, "bad": None, "bad_token_ids": None, "stop": None,
    "stop_token_ids": None, "include_stop_str_in_output": False, "embedding_bias": None, "logits_processor": None,
    "apply_batched_logits_processor": False, "n": 1, "best_of": None, "use_beam_search": False, "top_k": None,
    "top_p": None, "top_p_min": None, "top_p_reset_ids": None, "top_p_decay": None, "seed": None, "temperature": None,
    "min_tokens": None, "beam_search_diversity_rate": None, "repetition_penalty": None, "presence_penalty": None,
    "frequency_penalty": None, "length_penalty": None, "early_stopping": None, "no_repeat_ngram_size": None,
    "min_p": None, "beam_width_array": None, "logprobs": None, "prompt_logprobs": None, "return_context_logits": False,
    "return_generation_logits": False, "exclude_input_from_output": True, "return_encoder_output": False,
    "return_perf_metrics": False, "additional_model_outputs": None, "lookahead_config": None, "guided_decoding": None,
    "ignore_eos": False, "detokenize": True, "add_special_tokens": True, "truncate_prompt_tokens": None,
    "skip_special_tokens": True, "spaces_between_special_tokens": True,
}


def trt_sampling_params(fields: dict):
    """A stand-in for `tensorrt_llm.SamplingParams` with exactly these keyword-only fields (its signature
    says them, as the real dataclass's does): another name is a TypeError, and n > 1 with greedy decoding
    is refused as the LLM API's `_validate` does (older releases: top_k 1 or unset and top_p 0 or unset
    are greedy; newer ones: also temperature 0, or all three unset). `kwargs`: the names given."""

    class TRTSamplingParams:
        __signature__ = inspect.Signature([inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, default=v)
                                           for k, v in fields.items()])

        def __init__(self, **kwargs):
            unknown = sorted(set(kwargs) - set(fields))
            if unknown:
                raise TypeError(f"SamplingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
            self.kwargs = kwargs
            self.__dict__.update(fields)
            self.__dict__.update(kwargs)
            self.best_of = self.best_of or self.n
            top_k, top_p, temperature = self.top_k, self.top_p, getattr(self, "temperature", None)
            greedy = (top_k in (None, 1) and top_p in (None, 0.0)) or top_k == 1 or top_p == 0.0 or temperature == 0
            if self.best_of > 1 and greedy:
                raise ValueError("Greedy decoding in the LLM API does not allow multiple returns.")

    return TRTSamplingParams


# `tensorrt_llm.llmapi.GuidedDecodingParams`' fields and defaults (tensorrt_llm/sampling_params.py)
TRT_GUIDED_FIELDS = {"json": None, "regex": None, "grammar": None, "json_object": False, "structural_tag": None}


class StubGuidedDecodingParams:
    """Stands in for `tensorrt_llm.llmapi.GuidedDecodingParams`: its keyword-only fields, another name a
    TypeError, more than one guide a ValueError (its `_validate`). `kwargs`: the names given."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(TRT_GUIDED_FIELDS))
        if unknown:
            raise TypeError(f"GuidedDecodingParams.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.kwargs = kwargs
        self.__dict__.update(TRT_GUIDED_FIELDS, **kwargs)
        guides = sum(bool(getattr(self, k)) for k in TRT_GUIDED_FIELDS)
        if guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {guides}.")


class StubCppExecutorError(RuntimeError):
    """Stands in for `tensorrt_llm.executor.CppExecutorError` (executor/executor.py): the executor's
    internal error, on which trtllm-serve stops."""


class StubRequestError(RuntimeError):
    """Stands in for `tensorrt_llm.executor.utils.RequestError`: a request's own failure, raised by its
    `aresult()`."""


class StubLLM:
    """Stands in for the packages' LLM class; tests inject a test double, so building it is an error."""

    def __init__(self, **kwargs):
        raise AssertionError(f"a test built the real LLM with {kwargs}")


class StubClientError(ValueError):
    """Stands in for `vllm.exceptions.VLLMClientError`: a request vLLM judges wrong."""


class StubLLMEngine:
    """Stands in for `vllm.LLMEngine`: `from_engine_args` builds a FakeVLLM that keeps its arguments."""

    built: list = []

    @classmethod
    def from_engine_args(cls, args):
        fake = FakeVLLM()
        fake.args = args
        cls.built.append(fake)
        return fake


def import_engine(monkeypatch, engine: str, modules: dict):
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, f"shmbroker.engines.{engine}", raising=False)
    return importlib.import_module(f"shmbroker.engines.{engine}")


def forget_engine(module) -> None:
    """Drop an engine module imported over stubs, so a later import gets the real package's."""
    name = module.__name__
    if sys.modules.get(name) is module:
        del sys.modules[name]
    package = sys.modules["shmbroker.engines"]
    if getattr(package, name.rpartition(".")[2], None) is module:
        delattr(package, name.rpartition(".")[2])


@pytest.fixture
def vllm_engine(monkeypatch):
    """shmbroker.engines.vllm imported over a stub `vllm` package; forgotten afterwards."""
    pkg = types.ModuleType("vllm")
    pkg.LLM, pkg.SamplingParams = StubLLM, StubSamplingParams
    pkg.EngineArgs, pkg.LLMEngine = StubSamplingParams, StubLLMEngine
    StubLLMEngine.built = []
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM: TokensPrompt(prompt_token_ids=...) is a dict
    pkg.inputs = inputs
    config = types.ModuleType("vllm.config")
    config.StructuredOutputsConfig = StubSamplingParams
    sampling = types.ModuleType("vllm.sampling_params")
    sampling.StructuredOutputsParams = StubSamplingParams
    exceptions = types.ModuleType("vllm.exceptions")
    exceptions.VLLMClientError = StubClientError
    module = import_engine(monkeypatch, "vllm", {"vllm": pkg, "vllm.inputs": inputs, "vllm.config": config,
                                                 "vllm.sampling_params": sampling, "vllm.exceptions": exceptions})
    yield module
    forget_engine(module)


@pytest.fixture
def trtllm_engine(monkeypatch):
    """shmbroker.engines.trtllm imported over a stub `tensorrt_llm` package; forgotten afterwards."""
    pkg = types.ModuleType("tensorrt_llm")
    pkg.LLM, pkg.SamplingParams = StubLLM, trt_sampling_params(TRT_SAMPLING_FIELDS)
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig, llmapi.GuidedDecodingParams = StubSamplingParams, StubGuidedDecodingParams
    pkg.llmapi = llmapi
    executor = types.ModuleType("tensorrt_llm.executor")
    executor.CppExecutorError = StubCppExecutorError
    pkg.executor = executor
    module = import_engine(monkeypatch, "trtllm", {"tensorrt_llm": pkg, "tensorrt_llm.llmapi": llmapi,
                                                   "tensorrt_llm.executor": executor})
    yield module
    forget_engine(module)


def generated_for(prompt, count: int) -> list[int]:
    """What the test doubles generate: count ids derived from the prompt's last token."""
    return [(int(prompt[-1]) * 7 + k + 1) % 50_000 for k in range(count)]


class PrefixCacheModel:
    """Whole blocks of `block` tokens are cached once an earlier prompt computed them (a prompt's
    longest cached prefix is a hit), like a paged engine with prefix caching and an unbounded cache."""

    def __init__(self, block: int):
        self.block = block
        self.cached: set = set()
        self.queried_tokens = 0
        self.hit_tokens = 0

    def query(self, ids) -> int:
        hit, hitting = 0, True
        for end in range(self.block, len(ids) + 1, self.block):
            key = tuple(ids[:end])
            if hitting and key in self.cached:
                hit += self.block
            else:
                hitting = False
                self.cached.add(key)
        self.queried_tokens += len(ids)
        self.hit_tokens += hit
        return hit


class FakeVLLM:
    """Test double for vLLM's in-process `LLMEngine`: `add_request` queues a request; each `step` admits
    waiting requests first come first served up to `max_running` (querying a prefix-cache model, so
    `num_cached_tokens` is what an unbounded cache would hold), decodes one token of every running one
    and returns those that reached their max_tokens as finished RequestOutputs (`generated_for` ids),
    so items of different lengths finish out of order. `max_model_len` makes `add_request` refuse a
    longer prompt in vLLM's words; a prompt holding `poison` makes every step it runs in raise."""

    def __init__(self, block: int = 16, *, max_running: int = 4, vocab: int | None = None,
                 max_model_len: int | None = None, poison: int | None = None, cached_figures: bool = True):
        self.cache = PrefixCacheModel(block)
        self.max_running = max_running
        self.max_model_len = max_model_len
        self.poison = poison
        self.cached_figures = cached_figures
        self.added: list = []  # (request id, prompt ids, params), in add order
        self.waiting: list = []
        self.running: dict = {}  # request id -> [ids, params, generated so far, cached tokens]
        self.aborted: list = []
        self.steps = 0
        self.closed = 0
        if vocab is not None:
            self.model_config = SimpleNamespace(get_vocab_size=lambda: vocab)

    def add_request(self, request_id, prompt, params):
        assert isinstance(request_id, str)
        ids = prompt["prompt_token_ids"]
        assert all(type(t) is int for t in ids)
        if self.max_model_len is not None and len(ids) > self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                             f"of {self.max_model_len}.")
        self.added.append((request_id, ids, params))
        self.waiting.append((request_id, ids, params))

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self):
        self.steps += 1
        while self.waiting and len(self.running) < self.max_running:
            rid, ids, params = self.waiting.pop(0)
            self.running[rid] = [ids, params, 0, self.cache.query(ids)]
        if self.poison is not None and any(self.poison in r[0] for r in self.running.values()):
            raise RuntimeError("index out of bounds in the model kernel")
        done = []
        for rid, r in list(self.running.items()):
            r[2] += 1
            if r[2] >= r[1].max_tokens:
                del self.running[rid]
                out = SimpleNamespace(request_id=rid, finished=True,
                                      outputs=[SimpleNamespace(token_ids=generated_for(r[0], r[1].max_tokens))])
                if self.cached_figures:
                    out.num_cached_tokens = r[3]
                done.append(out)
        return done

    def abort_request(self, request_ids):
        self.aborted.extend(request_ids)
        self.waiting = [w for w in self.waiting if w[0] not in request_ids]
        for rid in request_ids:
            self.running.pop(rid, None)

    def shutdown(self):
        self.closed += 1


FAIL_AT_SUBMIT = 49_999  # FakeTRTLLM.generate_async refuses a prompt holding this id (ValueError)
FAIL_IN_FLIGHT = 49_998  # ... a prompt holding this id fails after admission (its aresult raises)
TIMES_OUT = 49_997  # ... a prompt holding this id ends with finish_reason "timeout"
REQUEST_ERROR = 49_996  # ... a prompt holding this id fails in flight with a RequestError, every time
# ... a request whose guided_decoding regex holds this fails in flight with a RequestError, as TensorRT-LLM fails
# one whose constraint its backend cannot compile (xgrammar has no lookahead)
UNCOMPILABLE = "(?="


def sample_of(token_ids, k: int) -> list[int]:
    """The test double's sample k of a request (sample 0: its ids as they are)."""
    return [(int(t) + 7919 * k) % 50_000 for t in token_ids]


def stopped_at(ids: list, reason, params) -> tuple[list, object]:
    """(ids, finish reason) of a sample that may meet one of the params' stop ids."""
    stops = set(getattr(params, "stop_token_ids", None) or ())
    at = next((i for i, t in enumerate(ids) if t in stops), None)
    if at is None or reason != "length":
        return ids, reason
    return ids[: at + 1] if getattr(params, "include_stop_str_in_output", False) else ids[:at], "stop"


class FakeRequestOutput:
    """Test double for `tensorrt_llm.llmapi.RequestOutput` (a GenerationResult): one output per sample the
    params ask (`n`), each with its `index`, `token_ids` and `finish_reason` once done; `aresult()` (and
    `await`) waits for it, available only when the future was made inside a running event loop, as in
    the LLM API (its queue is then an AsyncQueue, woken from the executor's thread with
    call_soon_threadsafe); `result(timeout)` raises queue.Empty on timeout."""

    def __init__(self, request_id: int, prompt: list, params):
        self.request_id = request_id
        self.prompt_token_ids = prompt
        self.params = params
        self.outputs = [SimpleNamespace(index=k, token_ids=[], finish_reason=None) for k in range(params.n)]
        self.generated = 0  # tokens decoded so far
        self.error = None
        self._finished = threading.Event()
        try:
            self._loop = asyncio.get_running_loop()
            self._event = asyncio.Event()
        except RuntimeError:
            self._loop = self._event = None

    @property
    def finished(self) -> bool:
        return self._finished.is_set()

    def complete(self, token_ids, finish_reason="length", error=None) -> None:
        """From the double's stepping thread: sample k's ids are `token_ids` shifted by k (`sample_of`), each
        ending at its first stop id with finish_reason "stop" (the id kept when the params say
        include_stop_str_in_output, cut otherwise, as the LLM API does)."""
        for k, out in enumerate(self.outputs):
            out.token_ids, out.finish_reason = stopped_at(sample_of(token_ids, k), finish_reason, self.params)
        self.error = error
        self._finished.set()
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._event.set)
            except RuntimeError:  # the loop is closed
                pass

    async def aresult(self):
        assert self._event is not None, ("The asyncio event loop was not present during initialization, "
                                         "so async operations are not available.")
        await self._event.wait()
        if self.error is not None:
            raise self.error
        return self

    def __await__(self):
        return self.aresult().__await__()

    def result(self, timeout=None):
        if not self._finished.wait(timeout):
            raise queue.Empty
        if self.error is not None:
            raise self.error
        return self


class FakeIterationStats:
    """Test double for the executor's IterationResult, what `LLM.get_stats_async` returns: an async iterator
    over the stats entries queued since the last read, ending after `timeout` seconds without one and
    then done until the next submission (`mark_undone`)."""

    def __init__(self, loop):
        self.entries: collections.deque = collections.deque()
        self.loop = loop
        self.event = asyncio.Event() if loop is not None else None
        self.done = False
        self.timeout = 2.0

    def put(self, entry: dict) -> None:
        self.entries.append(entry)
        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(self.event.set)
            except RuntimeError:
                pass

    def mark_undone(self) -> None:
        self.done = False

    def drain(self) -> list:
        out = list(self.entries)
        self.entries.clear()
        return out

    def __aiter__(self):
        return self

    async def __anext__(self):
        assert self.event is not None, "made outside an event loop: no async iteration"
        if self.done:
            raise StopAsyncIteration
        deadline = time.monotonic() + self.timeout
        while not self.entries:
            self.event.clear()
            if self.entries:
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.done = True
                raise StopAsyncIteration
            try:
                await asyncio.wait_for(self.event.wait(), remaining)
            except asyncio.TimeoutError:
                pass
        return self.entries.popleft()


async def _no_stats():
    if False:  # an empty async iterator, as the executor returns before any submission
        yield


class FakeTRTLLM:
    """Test double for `tensorrt_llm.LLM`, batching in flight. `generate_async(prompt, sampling_params)`
    queues one request and returns its FakeRequestOutput (after the executor's IPC round trip: here it
    waits for `submit_gate`, open unless a test closes it). A stepping thread admits queued requests in
    submission order, up to `max_running` at once (prefill: PrefixCacheModel in blocks of `per_block`),
    and every `step_seconds` decodes one token of each running request, so a request finishes
    max_tokens steps after its admission: out of submission order when lengths differ, with the params' n
    samples (FakeRequestOutput; `calls` keeps each request's SamplingParams). Each step queues
    one iteration-stats dict (cumulative kvCacheStats in blocks), read by `get_stats_async` or drained
    by `get_stats`. FAIL_AT_SUBMIT, FAIL_IN_FLIGHT, REQUEST_ERROR and TIMES_OUT in a prompt make its
    request fail at submission, fail in flight, or end with finish_reason "timeout"; `guides` keeps each
    request's `guided_decoding` (a GuidedDecodingParams or None), and one whose regex holds UNCOMPILABLE
    fails in flight with a RequestError; `shutdown` ends what is in flight "cancelled", as the LLM API does.
    An executor that dies: with `fails_after`, every request from that submission index on fails in
    flight with `failure()` (and with `shuts_down` the executor shuts itself down then, as it does on a
    serious error: `_check_health()` turns false); with `refuses_after`, every submission from that
    index on raises RuntimeError("LLM is shutting down"), what `LLM.generate_async` raises then."""

    def __init__(self, per_block: int = 32, *, max_running: int = 4, step_seconds: float = 0.002,
                 fails_after: int | None = None, failure=None, shuts_down: bool = False,
                 refuses_after: int | None = None):
        self.cache = PrefixCacheModel(per_block)
        self.per_block = per_block
        self.max_running = max_running
        self.step_seconds = step_seconds
        self.submit_gate = threading.Event()
        self.submit_gate.set()
        self.calls: list = []  # (prompt, sampling params) per generate_async, in submission order
        self.in_loop: list = []  # per generate_async: whether it ran inside a running event loop
        self.guides: list = []  # per generate_async: its SamplingParams' guided_decoding
        self.finished_order: list = []  # request ids (submission index) as they finished
        self.running_max = 0
        self.steps = 0
        self.stats: FakeIterationStats | None = None
        self.closed = 0
        self.fails_after, self.failure, self.shuts_down = fails_after, failure, shuts_down
        self.refuses_after = refuses_after
        self.shut_down = False  # the executor shut itself down (a serious error)
        self._lock = threading.Lock()
        self._waiting: collections.deque = collections.deque()
        self._running: list = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def generate_async(self, inputs, sampling_params=None, streaming=False):
        assert streaming is False and sampling_params is not None
        assert isinstance(inputs, list) and inputs and all(type(t) is int for t in inputs)
        if self.closed or self.shut_down or (self.refuses_after is not None and len(self.calls) >= self.refuses_after):
            raise RuntimeError("LLM is shutting down")
        self.submit_gate.wait()
        if FAIL_AT_SUBMIT in inputs:
            raise ValueError(f"token id {FAIL_AT_SUBMIT} is out of vocabulary")
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self.in_loop.append(loop is not None)
        if self.stats is None:  # made at the first submission, in that thread's mode, as the executor does
            self.stats = FakeIterationStats(loop)
        else:
            self.stats.mark_undone()
        with self._lock:
            future = FakeRequestOutput(len(self.calls), inputs, sampling_params)
            self.calls.append((inputs, sampling_params))
            self.guides.append(getattr(sampling_params, "guided_decoding", None))
            self._waiting.append(future)
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="fake-trtllm", daemon=True)
            thread.start()
            self._thread = thread
        self._wake.set()
        return future

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                idle = not self._waiting and not self._running
            if idle:
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            time.sleep(self.step_seconds)
            self._step()

    def _step(self) -> None:
        with self._lock:
            while self._waiting and len(self._running) < self.max_running:
                future = self._waiting.popleft()
                self.cache.query(future.prompt_token_ids)
                self._running.append(future)
            self.running_max = max(self.running_max, len(self._running))
            for future in self._running:
                future.generated += 1
            done = [f for f in self._running if f.generated >= f.params.max_tokens]
            self._running = [f for f in self._running if f.generated < f.params.max_tokens]
            self.steps += 1
            reused = self.cache.hit_tokens // self.per_block
            missed = (self.cache.queried_tokens - self.cache.hit_tokens) // self.per_block
            entry = {"iter": self.steps, "kvCacheStats": {"reusedBlocks": reused, "missedBlocks": missed,
                                                          "tokensPerBlock": self.per_block}}
        self.stats.put(entry)
        for future in done:
            self.finished_order.append(future.request_id)
            prompt = future.prompt_token_ids
            if self.fails_after is not None and future.request_id >= self.fails_after:
                self.shut_down = self.shut_down or self.shuts_down
                future.complete([], None, self.failure())
            elif UNCOMPILABLE in (getattr(future.params.guided_decoding, "regex", None) or ""):
                future.complete([], None, StubRequestError(f"request {future.request_id}: Regex parsing error: "
                                                           "assertions are not supported"))
            elif REQUEST_ERROR in prompt:
                future.complete([], None, StubRequestError(f"request {future.request_id}: token {REQUEST_ERROR} "
                                                           "is not in the model's embedding table"))
            elif FAIL_IN_FLIGHT in prompt:
                future.complete([], None, RuntimeError("Encountered an error in forwardAsync function"))
            elif TIMES_OUT in prompt:
                future.complete(generated_for(prompt, 1), "timeout")
            else:
                future.complete(generated_for(prompt, future.params.max_tokens))

    def get_stats_async(self, timeout=2):
        if self.stats is None:
            return _no_stats()
        self.stats.timeout = timeout
        return self.stats

    def get_stats(self, timeout=2):
        return self.stats.drain() if self.stats is not None else []

    def _check_health(self) -> bool:
        """The LLM API's liveness check (llmapi/llm.py): false once the executor is shut down."""
        return not (self.closed or self.shut_down)

    def shutdown(self):
        self.closed += 1
        self.submit_gate.set()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            left, self._waiting, self._running = list(self._waiting) + self._running, collections.deque(), []
        for future in left:
            future.complete([], "cancelled")


PREFIX = list(range(1000, 1064))  # 64 shared tokens: 4 blocks of 16, 2 of 32


# ---------------------------------------------------------------------------------------------------
# VLLM (streaming: add / poll) over FakeVLLM


def vllm_over(module, fake, *, max_new_tokens=8, block_tokens=16, contract=CONTRACT):
    return module.VLLM(VLLMSettings(model="m", max_new_tokens=max_new_tokens), block_tokens=block_tokens,
                       contract=contract, engine=fake)


def sampling_kwargs(params) -> dict:
    return {k: v for k, v in params.kwargs.items() if k != "output_kind"}


def test_vllm_run_maps_outputs_back_in_order(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_over(vllm_engine, fake)
    assert engine.llm_kwargs == vllm_llm_kwargs(VLLMSettings(model="m", max_new_tokens=8), CONTRACT)
    prompts = [PREFIX + [1, 2, 3], PREFIX + [4], PREFIX + [5, 6]]
    out = engine.run(batch_of([70, 30, 110], prompts, [3, 8, 1]))
    assert [r.item_id for r in out.results] == [70, 30, 110]
    assert [r.status for r in out.results] == [OK, OK, OK]
    for r, p, m in zip(out.results, prompts, [3, 8, 1]):
        assert r.tokens.dtype == np.uint32
        assert r.tokens.tolist() == generated_for(p, m)
    assert [(rid, ids) for rid, ids, _ in fake.added] == [("70", prompts[0]), ("30", prompts[1]), ("110", prompts[2])]
    assert [sampling_kwargs(p) for _, _, p in fake.added] == [vllm_sampling(3), vllm_sampling(8), vllm_sampling(1)]
    assert out.engine_seconds >= 0.0 and engine.pending() == 0


def test_vllm_streams_results_as_items_finish(vllm_engine):
    fake = FakeVLLM(max_running=2)
    engine = vllm_over(vllm_engine, fake)
    engine.add(batch_of([1, 2, 3], [[1], [2], [3]], [5, 1, 2]))  # 3 waits inside the engine (2 running)
    assert fake.steps == 0 and engine.pending() == 3  # add only queues
    first = engine.poll(1.0)
    assert [r.item_id for r in first.results] == [2] and fake.steps == 1  # the short one, out of order
    assert engine.pending() == 2
    engine.add(batch_of([4], [[4]], [1]))  # topped up while 1 and 3 run
    got = {}
    while engine.pending():
        got.update((r.item_id, r.tokens.tolist()) for r in engine.poll(1.0).results)
    assert got == {1: generated_for([1], 5), 3: generated_for([3], 2), 4: generated_for([4], 1)}
    assert engine.poll(0.5).results == []  # nothing in flight: returns at once, steps nothing
    assert fake.steps == 5


def test_vllm_fails_overlong_generations_per_item(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_over(vllm_engine, fake, contract=Contract(4, 256, 128))
    prompts = [[1, 2], [3, 4], [5], [], list(range(129)), [6]]
    out = engine.run(batch_of([1, 2, 3, 4, 5, 6], prompts, [8, 9, 0, 1, 1, 2]))
    assert [r.status for r in out.results] == [OK, ENGINE_ERROR, OK, INVALID, TOO_LONG, OK]
    assert "max_new_tokens 9 > the engine's max_new_tokens 8" in out.results[1].error
    assert out.results[2].tokens.size == 0  # asked for no tokens: answered without running
    assert out.results[0].tokens.tolist() == generated_for([1, 2], 8)
    assert out.results[5].tokens.tolist() == generated_for([6], 2)
    assert [(ids, p.max_tokens) for _, ids, p in fake.added] == [([1, 2], 8), ([6], 2)]


def test_vllm_constraints_become_structured_outputs_params_and_a_refused_one_fails_alone(vllm_engine):
    from shmbroker.request.options import parse_options

    fake = FakeVLLM()
    engine = vllm_over(vllm_engine, fake)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    bodies = [{"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}},
              {"structured_outputs": {"choice": ["x", "y"], "disable_any_whitespace": True}},
              {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "bad"}}]
    options = [parse_options(b) for b in bodies]
    real_add = fake.add_request

    def add_request(rid, prompt, params):  # vLLM's backend refuses what it cannot compile, at add
        if params.structured_outputs.kwargs.get("regex") == "bad":
            raise vllm_engine.CLIENT_ERRORS[0]("Failed to transform the regex into a grammar")
        return real_add(rid, prompt, params)

    fake.add_request = add_request
    engine.add(batch_of([1, 2, 3, 4], [[5], [6], [7], [8]], [2, 2, 2, 2], options=options))
    out = {}
    while engine.pending():
        out.update((r.item_id, r) for r in engine.poll(1.0).results)
    assert {i: r.status for i, r in out.items()} == {1: OK, 2: OK, 3: OK, 4: INVALID}
    assert "grammar" in out[4].error
    assert [p.structured_outputs.kwargs for _, _, p in fake.added] == [
        {"json": json.dumps(schema, separators=(",", ":"))}, {"choice": ["x", "y"], "disable_any_whitespace": True},
        {"json_object": True}]


def test_vllm_items_refused_at_add_fail_alone(vllm_engine):
    fake = FakeVLLM(vocab=100, max_model_len=40)
    engine = vllm_over(vllm_engine, fake)
    engine.add(batch_of([1, 2, 3, 4], [[5, 6], [7] * 41, [8, 100], [9]], [2, 2, 2, 2]))
    out = {}
    while engine.pending():
        out.update((r.item_id, r) for r in engine.poll(1.0).results)
    assert {i: r.status for i, r in out.items()} == {1: OK, 2: TOO_LONG, 3: ENGINE_ERROR, 4: OK}
    assert "maximum model length" in out[2].error
    assert "token id 100 is out of the model's vocabulary of 100" in out[3].error
    assert [rid for rid, _, _ in fake.added] == ["1", "4"]  # the out-of-vocabulary item never reached vLLM
    assert out[4].tokens.tolist() == generated_for([9], 2)


def test_vllm_step_failure_fails_only_the_item_that_causes_it(vllm_engine):
    fake = FakeVLLM(max_running=8, poison=666)
    engine = vllm_over(vllm_engine, fake)
    prompts = [[1, 2], [3, 666], [4], [5, 6, 7]]
    engine.add(batch_of([1, 2, 3, 4], prompts, [3, 3, 1, 2]))
    first = engine.poll(1.0)  # the step of all four raises: each runs again alone, in order
    assert [r.item_id for r in first.results] == [1]
    engine.add(batch_of([5], [[8]], [1]))  # added meanwhile: waits until the lone runs are over
    assert fake.added[-1][0] != "5"
    got = {r.item_id: r for r in first.results}
    while engine.pending():
        got.update((r.item_id, r) for r in engine.poll(1.0).results)
    assert {i: r.status for i, r in got.items()} == {1: OK, 2: ENGINE_ERROR, 3: OK, 4: OK, 5: OK}
    assert "index out of bounds" in got[2].error
    for i, p, m in zip([1, 3, 4, 5], [[1, 2], [4], [5, 6, 7], [8]], [3, 1, 2, 1]):
        assert got[i].tokens.tolist() == generated_for(p, m)
    # item 2 failed alone: charged once a one-token probe showed the engine answers other work
    assert [rid for rid, _, _ in fake.added] == ["1", "2", "3", "4", "1", "2", "shmbroker-probe", "3", "4", "5"]
    assert fake.added[6][1] == [0] and fake.added[6][2].max_tokens == 1
    assert not fake.has_unfinished_requests()


class DyingVLLM(FakeVLLM):
    """Test double: a FakeVLLM whose every step raises `error` once `after` steps ran."""

    def __init__(self, after: int, error: Exception, **kw):
        super().__init__(**kw)
        self.after, self.error = after, error

    def step(self):
        if self.steps >= self.after:
            self.steps += 1
            raise self.error
        return super().step()


@pytest.mark.parametrize("error, words", [
    (RuntimeError("CUDA error: an illegal memory access was encountered"), "illegal memory access"),
    (RuntimeError("the model runner failed"), "3 times in a row"),
], ids=["cuda", "streak"])
def test_vllm_a_dead_engine_fails_no_item(vllm_engine, error, words):
    """Every step raising after a few: poll raises EngineDead (at once for an error every later call
    repeats; after a streak of three otherwise: the group, a lone item, the probe), and no item is
    answered engine_error: what the engine held is left to the GPU process to hand back."""
    from shmbroker.engines.base import EngineDead

    fake = DyingVLLM(2, error, max_running=8)
    engine = vllm_over(vllm_engine, fake)
    engine.add(batch_of([1, 2, 3, 4], [[1, 2], [3], [4], [5, 6, 7]], [1, 5, 5, 5]))
    got = []
    with pytest.raises(EngineDead, match=words):
        for _ in range(20):
            got.extend(engine.poll(0.1).results)
    assert [(r.item_id, r.status) for r in got] == [(1, OK)]


def test_vllm_gone_reads_its_multiprocess_clients_engine_dead_mark(vllm_engine):
    fake = FakeVLLM()
    fake.engine_core = SimpleNamespace(resources=SimpleNamespace(engine_dead=False))
    engine = vllm_over(vllm_engine, fake)
    assert engine.gone() is None
    fake.engine_core.resources.engine_dead = True  # what vLLM's MPClientEngineMonitor sets when the core exits
    assert "engine-core process is gone" in engine.gone()
    assert vllm_over(vllm_engine, FakeVLLM()).gone() is None  # in-process: no engine core to lose


def test_vllm_prefix_cache_figures_from_num_cached_tokens(vllm_engine):
    fake = FakeVLLM(block=16, max_running=1)
    engine = vllm_over(vllm_engine, fake, max_new_tokens=4)
    first = engine.run(batch_of([1, 2], [PREFIX + [1] * 20, PREFIX + [2] * 20], [2, 2]))
    # item 2 reuses the 4 prefix blocks item 1 computed
    assert (first.queried_blocks, first.hit_blocks, first.reused_tokens) == ((84 + 84) // 16, 4, 64)
    second = engine.run(batch_of([3], [PREFIX + [1] * 20], [2]))
    assert (second.queried_blocks, second.hit_blocks, second.reused_tokens) == (84 // 16, 5, 80)
    bare = vllm_over(vllm_engine, FakeVLLM(cached_figures=False))  # an engine without num_cached_tokens
    out = bare.run(batch_of([1, 2], [PREFIX + [1], PREFIX + [2]], [1, 1]))
    assert [r.status for r in out.results] == [OK, OK]
    assert (out.queried_blocks, out.hit_blocks, out.reused_tokens) == (0, 0, 0)


def test_vllm_nothing_to_run_calls_no_engine(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_over(vllm_engine, fake, max_new_tokens=4)
    engine.add(batch_of([9], [[1, 2]], [5]))
    assert engine.pending() == 1
    out = engine.poll(5.0)
    assert [r.status for r in out.results] == [ENGINE_ERROR] and fake.added == [] and fake.steps == 0
    assert (out.hit_blocks, out.queried_blocks, out.reused_tokens) == (0, 0, 0) and engine.pending() == 0


def test_vllm_needs_contract_and_closes_once(vllm_engine):
    with pytest.raises(ValueError, match="contract"):
        vllm_engine.VLLM(VLLMSettings(model="m"), engine=FakeVLLM())
    fake = FakeVLLM()
    engine = vllm_over(vllm_engine, fake)
    engine.add(batch_of([1], [[1]], [3]))
    engine.close()
    engine.close()
    assert fake.closed == 1 and fake.aborted == ["1"]  # what was in flight is aborted
    with pytest.raises(RuntimeError, match="closed"):
        engine.add(batch_of([2], [[1]], [1]))
    with pytest.raises(RuntimeError, match="closed"):
        engine.poll(0.0)


def test_vllm_engine_through_load_engine(vllm_engine):
    fake = FakeVLLM()
    engine = load_engine("vllm", VLLMSettings(model="m"), block_tokens=16, contract=CONTRACT, llm=fake)
    assert isinstance(engine, vllm_engine.VLLM) and engine.engine is fake and engine.llm is fake
    assert engine.mode == "packed"
    assert engine.run(batch_of([4], [[1, 2]], [2])).results[0].tokens.tolist() == generated_for([1, 2], 2)


def test_vllm_builds_the_in_process_engine_from_its_arguments(vllm_engine, monkeypatch):
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    settings = VLLMSettings(model="m", max_new_tokens=4, extra={"block_size": 32, "num_gpu_blocks_override": 64})
    engine = load_engine("vllm", settings, block_tokens=32, contract=CONTRACT)
    (built,) = StubLLMEngine.built
    kwargs = dict(built.args.kwargs)
    so = kwargs.pop("structured_outputs_config")  # a dict in the arguments, vLLM's config object in the engine
    assert so.kwargs == {"backend": "auto", "disable_any_whitespace": False}
    assert built is engine.engine and {**kwargs, "structured_outputs_config": so.kwargs} == vllm_llm_kwargs(settings, CONTRACT)
    assert built.args.kwargs["block_size"] == 32 and built.args.kwargs["max_num_seqs"] == 64
    import os

    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"  # the engine core in this process
    engine.close()
    assert built.closed == 1


# ---------------------------------------------------------------------------------------------------
# TRTLLM (add / poll, and run on top) over FakeTRTLLM


@pytest.fixture
def trtllm(trtllm_engine):
    """Build TRTLLM engines over test doubles; every one closed afterwards."""
    made = []

    def make(fake, settings=None, **options):
        options.setdefault("contract", CONTRACT)
        made.append(load_engine("trtllm", settings or TRTLLMSettings(model="m", max_new_tokens=1024), llm=fake,
                                **options))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def arrivals(engine, count: int, deadline_seconds: float = 10.0) -> list:
    """Poll until `count` results came back: the results in the order they came."""
    got: list = []
    deadline = time.monotonic() + deadline_seconds
    while len(got) < count and time.monotonic() < deadline:
        got.extend(engine.poll(0.5).results)
    return got


def cache_figures(engine, outcomes: list, want: tuple, deadline_seconds: float = 5.0) -> tuple:
    """(queried_blocks, hit_blocks, reused_tokens) summed over `outcomes` and the polls after them until the
    sum reaches `want` or the deadline passes (the stats reach the engine a little after the results)."""
    outcomes = list(outcomes)
    deadline = time.monotonic() + deadline_seconds

    def total():
        return (sum(o.queried_blocks for o in outcomes), sum(o.hit_blocks for o in outcomes),
                sum(o.reused_tokens for o in outcomes))

    while total() != want and time.monotonic() < deadline:
        time.sleep(0.02)
        outcomes.append(engine.poll(0.0))
    return total()


def test_trtllm_run_maps_outputs_back_in_order(trtllm, trtllm_engine, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    fake = FakeTRTLLM()
    settings = TRTLLMSettings(model=str(tmp_path), max_new_tokens=8)
    engine = trtllm(fake, settings, block_tokens=16)
    assert isinstance(engine, trtllm_engine.TRTLLM)
    assert engine.mode == "packed" and engine.eos_ids == [2, 9]
    assert engine.llm_kwargs == trtllm_llm_kwargs(settings, CONTRACT)
    prompts = [PREFIX + [1, 2, 3], PREFIX + [4], PREFIX + [5, 6]]
    out = engine.run(batch_of([70, 30, 110], prompts, [3, 8, 1]))
    assert [r.item_id for r in out.results] == [70, 30, 110]
    assert [r.status for r in out.results] == [OK, OK, OK]
    assert all(r.tokens.dtype == np.uint32 for r in out.results)
    assert [r.tokens.tolist() for r in out.results] == [generated_for(p, m) for p, m in zip(prompts, [3, 8, 1])]
    assert [sent for sent, _ in fake.calls] == prompts  # one generate_async per item, in the batch's order
    assert [p.kwargs for _, p in fake.calls] == [trtllm_sampling(m, [2, 9]) for m in (3, 8, 1)]
    assert fake.in_loop == [True] * 3  # made inside the engine's event loop: their aresult is awaitable
    assert out.engine_seconds > 0


def test_trtllm_results_come_back_as_they_finish_out_of_order(trtllm):
    """Continuous batching: a short generation added after a long one comes back first, each result as its
    request finishes, not when the batch is done."""
    fake = FakeTRTLLM(max_running=8, step_seconds=0.005)
    engine = trtllm(fake)
    prompts = [PREFIX + [k] for k in range(4)]
    lengths = [200, 2, 20, 1]
    engine.add(batch_of([10, 11, 12, 13], prompts, lengths))
    assert engine.pending() == 4
    first = arrivals(engine, 1)
    assert 13 in [r.item_id for r in first] and 10 not in [r.item_id for r in first]
    assert fake.steps < 200 and engine.pending() == 4 - len(first)  # back while the long one still runs
    rest = arrivals(engine, 4 - len(first))
    order = [r.item_id for r in first + rest]
    assert order == [13, 11, 12, 10]  # as they finished (by generation length), not in the order added
    by_id = {r.item_id: r for r in first + rest}
    for item_id, p, m in zip([10, 11, 12, 13], prompts, lengths):
        assert by_id[item_id].status == OK and by_id[item_id].tokens.tolist() == generated_for(p, m)
    assert [sent for sent, _ in fake.calls] == prompts  # submitted in the order added
    assert engine.pending() == 0 and engine.poll(0.0).results == []


def test_trtllm_many_outstanding_across_adds(trtllm):
    """Three adds of four items, all submitted at once (the engine's window is TensorRT-LLM's queue): it runs
    max_running of them, admits the next as one finishes, and a later add's short item overtakes an
    earlier add's long one."""
    fake = FakeTRTLLM(max_running=4, step_seconds=0.003)
    engine = trtllm(fake)
    lengths = [[30, 30, 30, 30], [5, 5, 5, 5], [1, 1, 1, 1]]
    ids = [[100 + 10 * b + k for k in range(4)] for b in range(3)]
    started = time.monotonic()
    for b in range(3):
        engine.add(batch_of(ids[b], [PREFIX + [b, k] for k in range(4)], lengths[b]))
    assert time.monotonic() - started < 0.5 and engine.pending() == 12
    got = arrivals(engine, 12)
    assert sorted(r.item_id for r in got) == sorted(i for row in ids for i in row)
    assert all(r.status == OK for r in got)
    assert fake.running_max == 4  # the double's admission limit, never more
    assert len(fake.calls) == 12 and fake.finished_order[:4] == [0, 1, 2, 3]  # FIFO admission: first add first
    fake2 = FakeTRTLLM(max_running=8, step_seconds=0.003)
    engine2 = trtllm(fake2)
    engine2.add(batch_of([1], [PREFIX + [1]], [40]))
    engine2.add(batch_of([2], [PREFIX + [2]], [2]))
    assert [r.item_id for r in arrivals(engine2, 2)] == [2, 1]  # the later add's short item comes back first


def test_trtllm_add_does_not_wait_for_submission(trtllm):
    """generate_async waits for the executor's acknowledgement (an IPC round trip): that happens on the
    engine's loop, not in add. The double holds every submission until released: add returns anyway."""
    fake = FakeTRTLLM()
    fake.submit_gate.clear()
    engine = trtllm(fake)
    done = threading.Event()
    thread = threading.Thread(target=lambda: (engine.add(batch_of(list(range(6)), [PREFIX + [k] for k in range(6)],
                                                                  [1] * 6)), done.set()), daemon=True)
    thread.start()
    returned = done.wait(10.0)
    submitted = len(fake.calls)
    fake.submit_gate.set()
    thread.join(10.0)
    assert returned and submitted == 0  # add came back before TensorRT-LLM took any
    assert [r.status for r in arrivals(engine, 6)] == [OK] * 6
    assert len(fake.calls) == 6


def test_trtllm_run_fails_overlong_generations_per_item(trtllm):
    fake = FakeTRTLLM()
    engine = trtllm(fake, TRTLLMSettings(model="org/hub-model", max_new_tokens=8))
    assert engine.eos_ids == []  # no local directory, no configs on the double: generate max_new_tokens
    out = engine.run(batch_of([1, 2, 3], [[1, 2], [3, 4], [5]], [8, 100, 2]))
    assert [r.status for r in out.results] == [OK, ENGINE_ERROR, OK]
    assert "max_new_tokens 100" in out.results[1].error
    assert [sent for sent, _ in fake.calls] == [[1, 2], [5]]
    assert [(p.max_tokens, p.end_id, p.ignore_eos) for _, p in fake.calls] == [(8, -1, True), (2, -1, True)]


def test_trtllm_failures_stay_with_their_items(trtllm):
    """Refused at submission, failed in flight, ended by a timeout, no tokens, too long: each fails alone."""
    fake = FakeTRTLLM()
    engine = trtllm(fake, contract=Contract(64, 16384, 128))
    prompts = [[1, 2], [3, FAIL_AT_SUBMIT], [4, FAIL_IN_FLIGHT], [5, TIMES_OUT], [], list(range(129)), [6]]
    out = engine.run(batch_of([1, 2, 3, 4, 5, 6, 7], prompts, [3] * 7))
    assert [r.status for r in out.results] == [OK, ENGINE_ERROR, ENGINE_ERROR, ENGINE_ERROR, INVALID, TOO_LONG, OK]
    assert out.results[1].error == f"ValueError: token id {FAIL_AT_SUBMIT} is out of vocabulary"
    assert out.results[2].error == "RuntimeError: Encountered an error in forwardAsync function"
    assert out.results[3].error == "TensorRT-LLM ended the request (timeout)"
    assert out.results[0].tokens.tolist() == generated_for([1, 2], 3)
    assert out.results[6].tokens.tolist() == generated_for([6], 3)
    assert engine.pending() == 0


def test_trtllm_options_reach_sampling_params_and_samples_come_back(trtllm, tmp_path):
    """One SamplingParams per item from its options (the double refuses a name TensorRT-LLM does not
    document); n samples come back one after another, each with its finish reason."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    fake = FakeTRTLLM()
    engine = trtllm(fake, TRTLLMSettings(model=str(tmp_path), max_new_tokens=64))
    assert engine.honours == SAMPLES - {"stop", "structured"}  # no tokenizer here
    prompts = [PREFIX + [k] for k in range(4)]
    stop_id = generated_for(prompts[3], 6)[3]
    sets = [None, RequestOptions(temperature=0.8, top_p=0.95, seed=7, n=3),
            RequestOptions(temperature=0.0, n=2), RequestOptions(stop_token_ids=(stop_id,), min_tokens=1)]
    batch = batch_of([1, 2, 3, 4], prompts, [6, 6, 6, 6])
    batch.options = sets
    out = engine.run(batch)
    assert [r.status for r in out.results] == [OK] * 4
    params = [p for _, p in fake.calls]
    assert [p.kwargs for p in params] == [trtllm_sampling(6, [2], o, engine.fields) for o in sets]
    assert (params[1].temperature, params[1].top_p, params[1].seed, params[1].n) == (0.8, 0.95, 7, 3)
    assert (params[2].top_k, params[2].n) == (1, 1)  # greedy: run once
    assert params[3].stop_token_ids == [stop_id] and params[3].include_stop_str_in_output is True
    want = generated_for(prompts[1], 6)
    extras = [decode_extras(r.extras, r.tokens.size) for r in out.results]
    assert out.results[0].tokens.tolist() == generated_for(prompts[0], 6) and extras[0].lengths == (6,)
    assert out.results[1].tokens.tolist() == want + sample_of(want, 1) + sample_of(want, 2)
    assert extras[1].lengths == (6, 6, 6) and extras[1].finish_reasons == ("length",) * 3
    assert out.results[2].tokens.tolist() == generated_for(prompts[2], 6) * 2 and extras[2].lengths == (6, 6)
    assert out.results[3].tokens.tolist() == generated_for(prompts[3], 6)[:4]  # the stop id kept
    assert extras[3].finish_reasons == ("stop",) and extras[3].cached_tokens is None  # the LLM API says none


def test_trtllm_options_an_older_release_lacks_and_stop_strings_with_a_tokenizer(trtllm, trtllm_engine, tmp_path,
                                                                                 monkeypatch):
    older = {k: v for k, v in TRT_SAMPLING_FIELDS.items() if k not in ("seed", "min_p")} | {"random_seed": None}
    monkeypatch.setattr(trtllm_engine, "SamplingParams", trt_sampling_params(older))
    (tmp_path / "tokenizer.json").write_text("{}")
    fake = FakeTRTLLM()
    engine = trtllm(fake, TRTLLMSettings(model=str(tmp_path), max_new_tokens=8))
    assert engine.llm_kwargs["skip_tokenizer_init"] is False  # loaded: the LLM API encodes stop strings with it
    assert "stop" in engine.honours and "min_p" not in engine.honours and "seed" in engine.honours
    batch = batch_of([1], [PREFIX], [3])
    batch.options = [RequestOptions(temperature=1.0, seed=9, stop=("END",))]
    out = engine.run(batch)
    assert out.results[0].status == OK
    assert fake.calls[0][1].random_seed == 9 and fake.calls[0][1].stop == ["END"]


def test_trtllm_constraints_reach_guided_decoding_and_a_refused_one_fails_alone(trtllm, tmp_path):
    """With a tokenizer the LLM is built with a guided decoding backend and every constraint kind reaches
    TensorRT-LLM as a GuidedDecodingParams (a choice as its regex); a constraint TensorRT-LLM refuses fails
    its item alone, engine_error, charged once the next request completes."""
    (tmp_path / "tokenizer.json").write_text("{}")
    fake = FakeTRTLLM()
    engine = trtllm(fake, TRTLLMSettings(model=str(tmp_path), max_new_tokens=8))
    assert engine.llm_kwargs["guided_decoding_backend"] == "xgrammar" and "structured" in engine.honours
    bad = Structured.of(Constraint.REGEX, f"{UNCOMPILABLE}a)b".encode())
    sets = [RequestOptions(structured=s) for s, _ in CONSTRAINTS.values()]
    sets[2:2] = [RequestOptions(structured=bad), None]
    prompts = [PREFIX + [k] for k in range(len(sets))]
    batch = batch_of(list(range(len(sets))), prompts, [3] * len(sets))
    batch.options = sets
    out = engine.run(batch)
    assert [r.status for r in out.results] == [OK, OK, ENGINE_ERROR, OK, OK, OK, OK]
    assert "Regex parsing error" in out.results[2].error and "StubRequestError" in out.results[2].error
    assert out.results[6].tokens.tolist() == generated_for(prompts[6], 3)
    guides = fake.guides[: len(sets)]
    assert all(isinstance(g, StubGuidedDecodingParams) for i, g in enumerate(guides) if i != 3)
    want = [w for _, w in CONSTRAINTS.values()]
    want[2:2] = [{"regex": f"{UNCOMPILABLE}a)b"}, None]
    assert [None if g is None else g.kwargs for g in guides] == want
    assert engine.streak.count == 0 and engine.pending() == 0 and engine.gone() is None


def test_trtllm_checks_a_constraint_with_xgrammar_first_and_one_it_cannot_compile_never_reaches_the_library(
        trtllm, tmp_path):
    """With the xgrammar backend each distinct constraint is compiled once against the model directory's
    tokenizer before TensorRT-LLM sees it: one that cannot compile fails its item `invalid` at add (a run
    of them never reads as a dead engine), the others reach the library as ever."""
    pytest.importorskip("xgrammar")
    from support.bpetok import bpe_tokenizer_dir

    bpe_tokenizer_dir(tmp_path)
    fake = FakeTRTLLM()
    engine = trtllm(fake, TRTLLMSettings(model=str(tmp_path), max_new_tokens=8))
    bad = RequestOptions(structured=Structured.of(Constraint.JSON, compact_json(
        {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}})))
    good = RequestOptions(structured=CONSTRAINTS["json"][0])
    sets = [bad, good, bad, bad, bad, good]
    batch = batch_of(list(range(6)), [PREFIX + [k] for k in range(6)], [3] * 6)
    batch.options = sets
    out = engine.run(batch)
    assert [r.status for r in out.results] == [INVALID, OK, INVALID, INVALID, INVALID, OK]
    assert "parenthesis" in out.results[0].error
    assert [g.kwargs for g in fake.guides] == [CONSTRAINTS["json"][1]] * 2  # only the good ones reached it
    assert engine.streak.count == 0 and engine.gone() is None


def test_trtllm_without_a_tokenizer_builds_no_guided_decoding_backend(trtllm):
    engine = trtllm(FakeTRTLLM(), TRTLLMSettings(model="org/hub-model"))
    assert "guided_decoding_backend" not in engine.llm_kwargs and "structured" not in engine.honours


def test_trtllm_refused_sampling_params_fail_their_item_alone(trtllm, trtllm_engine, monkeypatch):
    class Refusing:
        def __init__(self, **kwargs):
            if kwargs.get("temperature"):
                raise ValueError("temperature is not supported by this backend")
            self.__dict__.update(TRT_SAMPLING_FIELDS, **kwargs)

    monkeypatch.setattr(trtllm_engine, "SamplingParams", Refusing)
    engine = trtllm(FakeTRTLLM())
    batch = batch_of([1, 2], [PREFIX, PREFIX + [1]], [2, 2])
    batch.options = [RequestOptions(temperature=0.5), None]
    out = engine.run(batch)
    assert [r.status for r in out.results] == [ENGINE_ERROR, OK]
    assert "temperature is not supported" in out.results[0].error


def test_trtllm_eos_from_loaded_configs(trtllm):
    fake = FakeTRTLLM()
    fake._generation_config = SimpleNamespace(eos_token_id=[128001, 128009])
    engine = trtllm(fake, TRTLLMSettings(model="org/hub-model"))
    assert engine.eos_ids == [128001, 128009]


def test_trtllm_reports_block_reuse_deltas(trtllm):
    fake = FakeTRTLLM(per_block=32, max_running=1)  # one at a time: the second prompt finds the first's blocks
    engine = trtllm(fake, block_tokens=16)
    first = engine.run(batch_of([1, 2], [PREFIX + [1] * 32, PREFIX + [2] * 32], [2, 2]))
    # 96-token prompts: 3 blocks of 32 each; the second reuses the 2 prefix blocks -> 64 tokens, 4 of our blocks
    assert cache_figures(engine, [first], (2 * 96 // 16, 4, 64)) == (2 * 96 // 16, 4, 64)
    second = engine.run(batch_of([3], [PREFIX + [1] * 32], [2]))
    assert cache_figures(engine, [second], (96 // 16, 6, 96)) == (96 // 16, 6, 96)
    third = engine.run(batch_of([4], [[7] * 10], [1]))
    assert cache_figures(engine, [third], (0, 0, 0), deadline_seconds=0.3) == (0, 0, 0)  # a partial block: none


def test_trtllm_without_stats_reports_zeros(trtllm):
    class StatsOff(FakeTRTLLM):
        def get_stats_async(self, timeout=2):
            raise RuntimeError("stats not collected")

    class NoStatsApi(FakeTRTLLM):
        get_stats_async = None

    for fake in (StatsOff(), NoStatsApi()):
        engine = trtllm(fake)
        out = engine.run(batch_of([1, 2], [PREFIX, PREFIX], [1, 1]))
        assert [r.status for r in out.results] == [OK, OK]
        assert cache_figures(engine, [out], (1, 1, 1), deadline_seconds=0.3) == (0, 0, 0)


def test_trtllm_needs_contract_and_closes_once(trtllm_engine):
    with pytest.raises(ValueError, match="contract"):
        trtllm_engine.TRTLLM(TRTLLMSettings(model="m"), llm=FakeTRTLLM())
    fake = FakeTRTLLM(step_seconds=0.01)
    engine = load_engine("trtllm", TRTLLMSettings(model="m", max_new_tokens=1000), block_tokens=16,
                         contract=CONTRACT, llm=fake)
    assert isinstance(engine, trtllm_engine.TRTLLM)
    engine.add(batch_of([1, 2], [PREFIX, PREFIX + [1]], [1000, 1000]))  # still running at close
    started = time.monotonic()
    engine.close()
    engine.close()
    assert time.monotonic() - started < 5.0
    assert fake.closed == 1
    assert not engine._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add(batch_of([3], [PREFIX], [1]))


def until_dead(engine, deadline_seconds: float = 10.0) -> tuple[list, EngineDead]:
    """Poll until the engine raises EngineDead: (the results that came before it, the EngineDead)."""
    got: list = []
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        try:
            got.extend(engine.poll(0.2).results)
        except EngineDead as dead:
            return got, dead
    raise AssertionError(f"no EngineDead within {deadline_seconds} s; results: {got}")


CUDA_LOST = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("knobs, why", [
    # the executor's internal error type, on which trtllm-serve stops
    ({"fails_after": 4, "failure": lambda: StubCppExecutorError("Encountered an error in forwardAsync function")},
     "is dead: StubCppExecutorError: Encountered an error"),
    # a serious error shuts the executor down: its health check turns false
    ({"fails_after": 4, "failure": lambda: RuntimeError("MPI worker exited with code 1"), "shuts_down": True},
     "is dead: TensorRT-LLM's executor is shut down (LLM._check_health() is false)"),
    # a shut-down executor refuses every submission in these words
    ({"refuses_after": 4}, "is dead: RuntimeError: LLM is shutting down"),
    # a lost CUDA context: every request fails in the same words
    ({"fails_after": 4, "failure": lambda: RuntimeError(CUDA_LOST)}, f"is dead: RuntimeError: {CUDA_LOST}"),
    # no death in the words or the health check: ENGINE_FAILURES_MAX failures in a row
    ({"fails_after": 4, "failure": lambda: StubRequestError("no reason given")}, "'trtllm' failed 3 times in a row"),
], ids=["executor-error", "shut-down", "refused", "cuda", "streak"])
def test_trtllm_a_dead_executor_fails_no_item(trtllm, knobs, why):
    """After 4 requests the executor dies: poll raises EngineDead; no item is engine_error, and the 8
    items not yet answered are neither answered nor failed (they stay pending, to be handed back)."""
    fake = FakeTRTLLM(max_running=4, **knobs)
    engine = trtllm(fake)
    engine.add(batch_of([0, 1, 2, 3], [PREFIX + [k] for k in range(4)], [3] * 4))
    first = arrivals(engine, 4)
    assert [r.status for r in first] == [OK] * 4 and engine.gone() is None
    # the 8 in one add: the loop may judge the death while it submits them, and a later add raises it
    ids = [10 * b + k for b in (1, 2) for k in range(4)]
    engine.add(batch_of(ids, [PREFIX + [i // 10, i % 10] for i in ids], [3] * 8))
    got, dead = until_dead(engine)
    assert got == [] and why in str(dead)
    assert engine.pending() == 8 and engine.gone() == str(dead)
    assert all(p != [0] for p, _ in fake.calls)  # no probe: nothing was charged
    with pytest.raises(EngineDead):
        engine.poll(0.0)
    with pytest.raises(EngineDead):
        engine.add(batch_of([99], [PREFIX], [1]))


def test_trtllm_a_poison_request_fails_alone(trtllm):
    """A request that always fails with a RequestError: charged engine_error when the next request
    completes after it; alone (nothing else in flight), once a one-token probe completes."""
    fake = FakeTRTLLM(max_running=4)
    engine = trtllm(fake)
    prompts = [PREFIX + [k] for k in range(6)]
    prompts[2] = PREFIX + [REQUEST_ERROR]
    out = engine.run(batch_of(list(range(6)), prompts, [3] * 6))
    assert [r.status for r in out.results] == [OK, OK, ENGINE_ERROR, OK, OK, OK]
    assert "StubRequestError" in out.results[2].error and "embedding table" in out.results[2].error
    assert [p for p, _ in fake.calls] == prompts  # no probe: item 3 completed after it
    alone = engine.run(batch_of([7], [PREFIX + [REQUEST_ERROR]], [3]))
    assert alone.results[0].status == ENGINE_ERROR
    probe, params = fake.calls[-1]
    assert probe == [0] and params.max_tokens == 1  # PROBE_TOKENS, one new token, after the lone failure
    assert len(fake.calls) == 8 and engine.streak.count == 0 and engine.pending() == 0
    assert engine.gone() is None


def test_trtllm_gone_reads_the_llm_apis_health_check(trtllm):
    fake = FakeTRTLLM()
    engine = trtllm(fake)
    assert engine.gone() is None
    fake.shut_down = True
    assert "_check_health() is false" in engine.gone()
    older = FakeTRTLLM()
    older._check_health = None  # a release without the check: only what the requests say
    assert trtllm(older).gone() is None


# ---------------------------------------------------------------------------------------------------
# the real engines: a tiny random-weight llama, where the package imports and a CUDA GPU is present

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "intermediate_size": 256,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "bos_token_id": 1,
    "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 10000.0,
}


def need_gpu():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("the real engine needs a CUDA GPU; none is visible")


def tiny_model(tmp_path) -> str:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    return str(tmp_path)


def check_real_engine(engine, block_tokens: int, *, stats_lag: bool = False) -> None:
    """Two runs of two prompts sharing 64 tokens: results in order, within max_new_tokens, and the
    second run finds the prefix cached. stats_lag: the engine's figures may reach it one batch late
    (TensorRT-LLM's iteration stats), so a third small batch collects them."""
    prefix = [int(t) for t in np.arange(64) % 500 + 3]
    prompts = [prefix + [10, 11, 12], prefix + [20, 21]]
    first = engine.run(batch_of([5, 6], prompts, [4, 3]))
    assert [r.item_id for r in first.results] == [5, 6]
    assert [r.status for r in first.results] == [OK, OK], [r.error for r in first.results]
    assert 1 <= first.results[0].tokens.size <= 4 and 1 <= first.results[1].tokens.size <= 3
    again = engine.run(batch_of([7, 8], prompts, [4, 3]))
    assert [r.status for r in again.results] == [OK, OK], [r.error for r in again.results]
    outcomes = [again]
    if stats_lag:
        outcomes.append(engine.run(batch_of([9], [[400, 401, 402]], [1])))
    assert sum(o.queried_blocks for o in outcomes) >= 2 * 64 // block_tokens
    assert sum(o.hit_blocks for o in outcomes) >= 64 // block_tokens
    assert sum(o.reused_tokens for o in outcomes) >= 64


def test_real_vllm_tiny_generation(tmp_path):
    pytest.importorskip("vllm", reason="vllm is not installed (pip install 'shmbroker[vllm]')")
    need_gpu()
    settings = VLLMSettings(model=tiny_model(tmp_path), dtype="bfloat16", max_new_tokens=8, gpu_memory_utilization=0.3,
                            enforce_eager=True, extra={"load_format": "dummy"})
    engine = load_engine("vllm", settings, block_tokens=16, contract=Contract(4, 1024, 256))
    try:
        check_real_engine(engine, 16)
    finally:
        engine.close()


def test_real_trtllm_tiny_generation(tmp_path):
    pytest.importorskip("tensorrt_llm", reason="tensorrt_llm is not installed (pip install 'shmbroker[trtllm]')")
    need_gpu()
    settings = TRTLLMSettings(model=tiny_model(tmp_path), dtype="bfloat16", max_new_tokens=8,
                              free_gpu_memory_fraction=0.3, extra={"load_format": "dummy"})
    engine = load_engine("trtllm", settings, block_tokens=16, contract=Contract(4, 1024, 256))
    try:
        check_real_engine(engine, 16, stats_lag=True)
    finally:
        engine.close()
