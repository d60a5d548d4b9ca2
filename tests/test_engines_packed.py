"""The packed engines, vLLM and TensorRT-LLM (gpu/engines/vllm.py, trtllm.py, packed_args.py).

Neither package is installed on the CPU machines that run this suite, so most of it checks what needs
neither: the contract mapped to engine arguments, greedy sampling per item, the engines' cumulative
cache counters turned into one batch's blocks, settings validation, and the `EngineUnavailable`
message naming the extra. The engine classes' `run` is checked over test doubles: `FakeVLLM` and
`FakeTRTLLM` stand in for the packages' `LLM` objects (injected with `llm=`), and stub modules stand in
for the packages themselves so the engine modules import. The last tests build the real engines on a
tiny random-weight model (load_format "dummy", no download, no tokenizer); they run only where the
package imports and a CUDA GPU is present.
"""

from __future__ import annotations

import importlib
import json
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

from shmbroker.gpu.engines.base import ENGINE_ERROR, INVALID, OK, TOO_LONG, EngineBatch, EngineUnavailable, load_engine
from shmbroker.gpu.engines.options import TRTLLMSettings, VLLMSettings
from shmbroker.gpu.engines.packed_args import (
    CacheHits,
    CacheTokens,
    eos_token_ids,
    hits_between,
    hits_from_metrics,
    hits_from_requests,
    trtllm_cache_tokens,
    trtllm_llm_kwargs,
    trtllm_sampling,
    vllm_cache_tokens,
    vllm_llm_kwargs,
    vllm_sampling,
)
from shmbroker.pack.contract import Contract
from shmbroker.settings import ConfigError, parse

CONTRACT = Contract(64, 16384, 4096)


def batch_of(ids, prompts, max_new) -> EngineBatch:
    return EngineBatch(np.asarray(ids, np.uint64), [np.asarray(p, np.uint32) for p in prompts],
                       np.asarray(max_new, np.int64))


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
    assert consumer.engine_settings.mode == "packed"
    assert consumer.contract == CONTRACT


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
    monkeypatch.delitem(sys.modules, f"shmbroker.gpu.engines.{engine}", raising=False)
    with pytest.raises(EngineUnavailable, match=rf"pip install 'shmbroker\[{engine}\]'"):
        load_engine(engine, settings, block_tokens=16, contract=CONTRACT)
    sys.modules.pop(f"shmbroker.gpu.engines.{engine}", None)


# ---------------------------------------------------------------------------------------------------
# stub packages, so that the engine modules import without vllm / tensorrt_llm


class StubSamplingParams:
    """Stands in for the packages' SamplingParams: keeps its keyword arguments as attributes."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self.__dict__.update(kwargs)


class StubLLM:
    """Stands in for the packages' LLM class; tests inject a test double, so building it is an error."""

    def __init__(self, **kwargs):
        raise AssertionError(f"a test built the real LLM with {kwargs}")


def import_engine(monkeypatch, engine: str, modules: dict):
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, f"shmbroker.gpu.engines.{engine}", raising=False)
    return importlib.import_module(f"shmbroker.gpu.engines.{engine}")


def forget_engine(module) -> None:
    """Drop an engine module imported over stubs, so a later import gets the real package's."""
    name = module.__name__
    if sys.modules.get(name) is module:
        del sys.modules[name]
    package = sys.modules["shmbroker.gpu.engines"]
    if getattr(package, name.rpartition(".")[2], None) is module:
        delattr(package, name.rpartition(".")[2])


@pytest.fixture
def vllm_engine(monkeypatch):
    """shmbroker.gpu.engines.vllm imported over a stub `vllm` package; forgotten afterwards."""
    pkg = types.ModuleType("vllm")
    pkg.LLM, pkg.SamplingParams = StubLLM, StubSamplingParams
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = dict  # a TypedDict in vLLM: TokensPrompt(prompt_token_ids=...) is a dict
    pkg.inputs = inputs
    module = import_engine(monkeypatch, "vllm", {"vllm": pkg, "vllm.inputs": inputs})
    yield module
    forget_engine(module)


@pytest.fixture
def trtllm_engine(monkeypatch):
    """shmbroker.gpu.engines.trtllm imported over a stub `tensorrt_llm` package; forgotten afterwards."""
    pkg = types.ModuleType("tensorrt_llm")
    pkg.LLM, pkg.SamplingParams = StubLLM, StubSamplingParams
    llmapi = types.ModuleType("tensorrt_llm.llmapi")
    llmapi.KvCacheConfig = StubSamplingParams
    pkg.llmapi = llmapi
    module = import_engine(monkeypatch, "trtllm", {"tensorrt_llm": pkg, "tensorrt_llm.llmapi": llmapi})
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
    """Test double for `vllm.LLM`: answers `generate` with `generated_for` ids, keeps vLLM v1's
    prefix-cache counters (tokens) and reports them through `get_metrics`."""

    def __init__(self, block: int = 16):
        self.cache = PrefixCacheModel(block)
        self.calls: list = []
        self.closed = 0

    def generate(self, prompts, sampling_params, use_tqdm=True):
        assert use_tqdm is False
        assert len(prompts) == len(sampling_params)
        self.calls.append((prompts, sampling_params))
        outputs = []
        for prompt, params in zip(prompts, sampling_params):
            ids = prompt["prompt_token_ids"]
            assert all(type(t) is int for t in ids)
            cached = self.cache.query(ids)
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=generated_for(ids, params.max_tokens))],
                                           num_cached_tokens=cached))
        return outputs

    def get_metrics(self):
        return [metric("vllm:prefix_cache_queries", self.cache.queried_tokens, engine="0"),
                metric("vllm:prefix_cache_hits", self.cache.hit_tokens, engine="0"),
                metric("vllm:num_requests_running", 0.0)]

    def shutdown(self):
        self.closed += 1


class FakeVLLMStatsOff(FakeVLLM):
    """A vLLM built with disable_log_stats=True: get_metrics asserts, outputs still carry num_cached_tokens."""

    def get_metrics(self):
        raise AssertionError("Stat logging disabled")


class FakeVLLMNoFigures:
    """A vLLM without the metrics API and without num_cached_tokens (an old version)."""

    def generate(self, prompts, sampling_params, use_tqdm=True):
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=generated_for(p["prompt_token_ids"], s.max_tokens))])
                for p, s in zip(prompts, sampling_params)]


class FakeTRTLLM:
    """Test double for `tensorrt_llm.LLM`: answers `generate` (token-id lists) with `generated_for` ids;
    queues one iteration-stats dict per call, cumulative kvCacheStats in blocks of `per_block` tokens,
    drained by `get_stats` as the LLM API does."""

    def __init__(self, per_block: int = 32):
        self.cache = PrefixCacheModel(per_block)
        self.per_block = per_block
        self.calls: list = []
        self.queue: list = []
        self.closed = 0

    def generate(self, inputs, sampling_params, use_tqdm=True):
        assert use_tqdm is False
        assert isinstance(inputs, list) and all(isinstance(p, list) for p in inputs)
        self.calls.append((inputs, sampling_params))
        outputs = []
        for ids, params in zip(inputs, sampling_params):
            self.cache.query(ids)
            outputs.append(SimpleNamespace(outputs=[SimpleNamespace(token_ids=generated_for(ids, params.max_tokens))]))
        reused = self.cache.hit_tokens // self.per_block
        missed = (self.cache.queried_tokens - self.cache.hit_tokens) // self.per_block
        self.queue.append({"iter": len(self.calls), "kvCacheStats": {
            "reusedBlocks": reused, "missedBlocks": missed, "tokensPerBlock": self.per_block}})
        return outputs

    def get_stats(self, timeout=2):
        drained, self.queue = self.queue, []
        return drained

    def shutdown(self):
        self.closed += 1


PREFIX = list(range(1000, 1064))  # 64 shared tokens: 4 blocks of 16, 2 of 32


# ---------------------------------------------------------------------------------------------------
# VLLM.run over FakeVLLM


def test_vllm_run_maps_outputs_back_in_order(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=8), block_tokens=16, contract=CONTRACT, llm=fake)
    assert engine.mode == "packed"
    assert engine.llm_kwargs == vllm_llm_kwargs(VLLMSettings(model="m", max_new_tokens=8), CONTRACT)
    prompts = [PREFIX + [1, 2, 3], PREFIX + [4], PREFIX + [5, 6]]
    out = engine.run(batch_of([70, 30, 110], prompts, [3, 8, 1]))
    assert [r.item_id for r in out.results] == [70, 30, 110]
    assert [r.status for r in out.results] == [OK, OK, OK]
    for r, p, m in zip(out.results, prompts, [3, 8, 1]):
        assert r.tokens.dtype == np.uint32
        assert r.tokens.tolist() == generated_for(p, m)
    ((sent, params),) = fake.calls
    assert [s["prompt_token_ids"] for s in sent] == prompts
    assert [p.kwargs for p in params] == [vllm_sampling(3), vllm_sampling(8), vllm_sampling(1)]
    assert out.engine_seconds >= 0.0


def test_vllm_run_fails_overlong_generations_per_item(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=8), block_tokens=16,
                              contract=Contract(4, 256, 128), llm=fake)
    prompts = [[1, 2], [3, 4], [5], [], list(range(129)), [6]]
    out = engine.run(batch_of([1, 2, 3, 4, 5, 6], prompts, [8, 9, 0, 1, 1, 2]))
    assert [r.status for r in out.results] == [OK, ENGINE_ERROR, OK, INVALID, TOO_LONG, OK]
    assert "max_new_tokens 9 > the engine's max_new_tokens 8" in out.results[1].error
    assert out.results[2].tokens.size == 0  # asked for no tokens: answered without running
    assert out.results[0].tokens.tolist() == generated_for([1, 2], 8)
    assert out.results[5].tokens.tolist() == generated_for([6], 2)
    ((sent, params),) = fake.calls
    assert [s["prompt_token_ids"] for s in sent] == [[1, 2], [6]]
    assert [p.max_tokens for p in params] == [8, 2]


def test_vllm_run_nothing_to_run_calls_no_engine(vllm_engine):
    fake = FakeVLLM()
    engine = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=4), contract=CONTRACT, llm=fake)
    out = engine.run(batch_of([9], [[1, 2]], [5]))
    assert out.results[0].status == ENGINE_ERROR and fake.calls == []
    assert (out.hit_blocks, out.queried_blocks, out.reused_tokens) == (0, 0, 0)


def test_vllm_reports_prefix_cache_deltas(vllm_engine):
    fake = FakeVLLM(block=16)
    fake.cache.query(list(range(5000, 5100)))  # counters already moved before the engine was built
    engine = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=4), block_tokens=16, contract=CONTRACT, llm=fake)
    first = engine.run(batch_of([1, 2], [PREFIX + [1] * 20, PREFIX + [2] * 20], [2, 2]))
    # item 2 reuses the 4 prefix blocks item 1 computed
    assert (first.queried_blocks, first.hit_blocks, first.reused_tokens) == ((84 + 84) // 16, 4, 64)
    second = engine.run(batch_of([3], [PREFIX + [1] * 20], [2]))
    assert (second.queried_blocks, second.hit_blocks, second.reused_tokens) == (84 // 16, 5, 80)


def test_vllm_cache_figures_without_metrics(vllm_engine):
    engine = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=4), block_tokens=16, contract=CONTRACT,
                              llm=FakeVLLMStatsOff(block=16))
    out = engine.run(batch_of([1, 2], [PREFIX + [1], PREFIX + [2]], [1, 1]))
    assert (out.queried_blocks, out.hit_blocks, out.reused_tokens) == (130 // 16, 4, 64)  # from num_cached_tokens
    bare = vllm_engine.VLLM(VLLMSettings(model="m", max_new_tokens=4), block_tokens=16, contract=CONTRACT,
                            llm=FakeVLLMNoFigures())
    out = bare.run(batch_of([1, 2], [PREFIX + [1], PREFIX + [2]], [1, 1]))
    assert [r.status for r in out.results] == [OK, OK]
    assert (out.queried_blocks, out.hit_blocks, out.reused_tokens) == (0, 0, 0)


def test_vllm_output_count_mismatch_raises(vllm_engine):
    class Short(FakeVLLM):
        def generate(self, prompts, sampling_params, use_tqdm=True):
            return super().generate(prompts, sampling_params, use_tqdm)[:-1]

    engine = vllm_engine.VLLM(VLLMSettings(model="m"), contract=CONTRACT, llm=Short())
    with pytest.raises(RuntimeError, match="1 outputs for 2 prompts"):  # the consumer then retries item by item
        engine.run(batch_of([1, 2], [[1], [2]], [1, 1]))


def test_vllm_needs_contract_and_closes_once(vllm_engine):
    with pytest.raises(ValueError, match="contract"):
        vllm_engine.VLLM(VLLMSettings(model="m"), llm=FakeVLLM())
    fake = FakeVLLM()
    engine = vllm_engine.VLLM(VLLMSettings(model="m"), contract=CONTRACT, llm=fake)
    engine.close()
    engine.close()
    assert fake.closed == 1
    with pytest.raises(RuntimeError, match="closed"):
        engine.run(batch_of([1], [[1]], [1]))


def test_vllm_engine_through_load_engine(vllm_engine):
    fake = FakeVLLM()
    engine = load_engine("vllm", VLLMSettings(model="m"), block_tokens=16, contract=CONTRACT, llm=fake)
    assert isinstance(engine, vllm_engine.VLLM) and engine.llm is fake


# ---------------------------------------------------------------------------------------------------
# TRTLLM.run over FakeTRTLLM


def test_trtllm_run_maps_outputs_back_in_order(trtllm_engine, tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 9]}))
    fake = FakeTRTLLM()
    settings = TRTLLMSettings(model=str(tmp_path), max_new_tokens=8)
    engine = trtllm_engine.TRTLLM(settings, block_tokens=16, contract=CONTRACT, llm=fake)
    assert engine.mode == "packed" and engine.eos_ids == [2, 9]
    assert engine.llm_kwargs == trtllm_llm_kwargs(settings, CONTRACT)
    prompts = [PREFIX + [1, 2, 3], PREFIX + [4], PREFIX + [5, 6]]
    out = engine.run(batch_of([70, 30, 110], prompts, [3, 8, 1]))
    assert [r.item_id for r in out.results] == [70, 30, 110]
    assert [r.tokens.tolist() for r in out.results] == [generated_for(p, m) for p, m in zip(prompts, [3, 8, 1])]
    ((sent, params),) = fake.calls
    assert sent == prompts
    assert [p.kwargs for p in params] == [trtllm_sampling(m, [2, 9]) for m in (3, 8, 1)]


def test_trtllm_run_fails_overlong_generations_per_item(trtllm_engine):
    fake = FakeTRTLLM()
    engine = trtllm_engine.TRTLLM(TRTLLMSettings(model="org/hub-model", max_new_tokens=8), contract=CONTRACT, llm=fake)
    assert engine.eos_ids == []  # no local directory, no configs on the double: generate max_new_tokens
    out = engine.run(batch_of([1, 2, 3], [[1, 2], [3, 4], [5]], [8, 100, 2]))
    assert [r.status for r in out.results] == [OK, ENGINE_ERROR, OK]
    assert "max_new_tokens 100" in out.results[1].error
    ((sent, params),) = fake.calls
    assert sent == [[1, 2], [5]]
    assert [(p.max_tokens, p.end_id, p.ignore_eos) for p in params] == [(8, -1, True), (2, -1, True)]


def test_trtllm_eos_from_loaded_configs(trtllm_engine):
    fake = FakeTRTLLM()
    fake._generation_config = SimpleNamespace(eos_token_id=[128001, 128009])
    engine = trtllm_engine.TRTLLM(TRTLLMSettings(model="org/hub-model"), contract=CONTRACT, llm=fake)
    assert engine.eos_ids == [128001, 128009]


def test_trtllm_reports_block_reuse_deltas(trtllm_engine):
    fake = FakeTRTLLM(per_block=32)
    engine = trtllm_engine.TRTLLM(TRTLLMSettings(model="m", max_new_tokens=4), block_tokens=16, contract=CONTRACT,
                                  llm=fake)
    first = engine.run(batch_of([1, 2], [PREFIX + [1] * 32, PREFIX + [2] * 32], [2, 2]))
    # 96-token prompts: 3 blocks of 32 each; the second reuses the 2 prefix blocks -> 64 tokens, 4 of our blocks
    assert (first.queried_blocks, first.hit_blocks, first.reused_tokens) == (2 * 96 // 16, 4, 64)
    fake.get_stats()  # stats drained elsewhere: the counters are cumulative, the next batch still adds up
    second = engine.run(batch_of([3], [PREFIX + [1] * 32], [2]))
    assert (second.queried_blocks, second.hit_blocks, second.reused_tokens) == (96 // 16, 6, 96)
    third = engine.run(batch_of([4], [[7] * 10], [1]))
    assert (third.queried_blocks, third.hit_blocks) == (0, 0)  # a partial block: the double counts none


def test_trtllm_without_stats_reports_zeros(trtllm_engine):
    class NoStats(FakeTRTLLM):
        def get_stats(self, timeout=2):
            raise RuntimeError("stats not collected")

    engine = trtllm_engine.TRTLLM(TRTLLMSettings(model="m"), contract=CONTRACT, llm=NoStats())
    out = engine.run(batch_of([1, 2], [PREFIX, PREFIX], [1, 1]))
    assert [r.status for r in out.results] == [OK, OK]
    assert (out.hit_blocks, out.queried_blocks, out.reused_tokens) == (0, 0, 0)


def test_trtllm_needs_contract_and_closes_once(trtllm_engine):
    with pytest.raises(ValueError, match="contract"):
        trtllm_engine.TRTLLM(TRTLLMSettings(model="m"), llm=FakeTRTLLM())
    fake = FakeTRTLLM()
    engine = load_engine("trtllm", TRTLLMSettings(model="m"), block_tokens=16, contract=CONTRACT, llm=fake)
    assert isinstance(engine, trtllm_engine.TRTLLM)
    engine.close()
    engine.close()
    assert fake.closed == 1


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
