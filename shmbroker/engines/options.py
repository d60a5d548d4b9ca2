"""Each real engine's settings (`[consumers.engine_settings]`), as frozen dataclasses, validated here.

This module imports nothing heavy: the configuration is checked by `settings.py` (and by
`shmbroker config`) without torch, vllm, tensorrt_llm or httpx. The engine modules
(`hf.py`, `vllm.py`, `trtllm.py`, `openai.py`) import their packages only when a GPU process
loads them (`base.load_engine`).

An engine's mode is not a setting: its registry entry declares it (`registry.py`), except for the
simulated engine, which models either and takes its mode from `SimSettings.mode`.

`parse(engine, raw, at)` returns the settings dataclass or raises ValueError naming the key
(`settings.py` turns that into a ConfigError with the file's name).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from ..config import defaults as config
from ..config.validator import Validator
from ..pack.contract import Mode
from .sim import SimCost

DTYPES = ("auto", "float32", "float16", "bfloat16", "float64")


@dataclass(frozen=True)
class SimSettings:
    """The simulated engine of one consumer: its mode, its cache, its cost model, and its pace:
    `pace_seconds` wall seconds per modeled second (0: as fast as the CPU runs it, the modeled
    seconds reported, not spent). A paced engine finishes each item when the modeled clock says,
    so consumers of different sizes split a backlog as real cards would (supervise, demo).

    Faults, for tests of what the broker does when an engine misbehaves (each off when None; a
    `*_token` marks an item by a token id its prompt holds):
    `poison_token`: adding such an item kills the process (`poison_kill`: "abort" = SIGABRT,
    "segfault" = SIGSEGV, "exit" = exit status 137 as after the OOM killer); `hang_token`: such an
    item never finishes (the engine runs the others); `block_token`: once such an item was added,
    the next poll never returns (the process hangs); `fail_token`: add refuses such an item (it
    raises ValueError); `fail_after`: a dead engine, once this many items were added every poll
    raises RuntimeError."""

    mode: Mode = Mode.PACKED
    cache_tokens: int = 2 << 20
    cost: SimCost = SimCost()
    pace_seconds: float = config.DEFAULT_SIM_PACE_SECONDS
    poison_token: int | None = None
    poison_kill: str = "abort"
    hang_token: int | None = None
    block_token: int | None = None
    fail_token: int | None = None
    fail_after: int | None = None


SIM_FAULT_TOKENS = ("poison_token", "hang_token", "block_token", "fail_token")
SIM_KILLS = ("abort", "segfault", "exit")


@dataclass(frozen=True)
class HFSettings:
    """transformers on torch. `model`: a local directory (never downloaded); or `config`: a
    transformers config as a table (e.g. { model_type = "llama", hidden_size = 64, ... }) built with
    random weights seeded by `seed` (benchmarks, tests)."""

    model: str | None = None
    config: dict | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on the CPU
    device: str = "auto"  # auto: cuda when torch sees a GPU, else cpu; or "cpu", "cuda", "cuda:1"
    seed: int = 0
    attn_implementation: str = "sdpa"
    reuse_prefix: bool = True  # compute a batch's shared prefix once and reuse its KV for every item
    keep_prefix: bool = True  # keep the last prefix's KV for the next batch of the same family
    threads: int = 0  # torch CPU threads (0: torch's default)


@dataclass(frozen=True)
class VLLMSettings:
    """Offline `vllm.LLM`; the contract gives max_num_seqs, max_num_batched_tokens, max_model_len."""

    model: str = ""
    dtype: str = "auto"
    max_new_tokens: int = 256  # the longest generation an item may ask for (max_model_len = input + this)
    gpu_memory_utilization: float = 0.9
    tensor_parallel_size: int = 1
    enforce_eager: bool = False
    seed: int = 0
    extra: dict = field(default_factory=dict)  # more `LLM(...)` keyword arguments, passed as given


@dataclass(frozen=True)
class TRTLLMSettings:
    """TensorRT-LLM's `LLM` API; the contract gives max_batch_size, max_num_tokens, max_input_len."""

    model: str = ""
    dtype: str = "auto"
    max_new_tokens: int = 256  # max_seq_len = max_input_len + this
    free_gpu_memory_fraction: float = 0.9
    tensor_parallel_size: int = 1
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class OpenAISettings:
    """Any OpenAI-compatible completions server (vLLM serve, SGLang, TGI, trtllm-serve)."""

    base_url: str = "http://127.0.0.1:8000/v1"
    model: str = ""
    api_key_env: str = ""  # the environment variable holding the API key ("" = none)
    max_in_flight: int = 64  # requests in flight at once: about the server's batch size (its max_num_seqs)
    max_items_per_request: int = 0  # 0: automatic, 1 to 4 (openai.default_items_per_request)
    timeout_seconds: float = 120.0
    retries: int = 3
    backoff_seconds: float = 0.5  # doubled after each failed try


REQUIRED = {"vllm": ("model",), "trtllm": ("model",), "openai": ("model",)}


def parse(engine: str, raw: dict, at: str):
    """engine_settings of a real engine: known keys, right types, sane values."""
    from .catalogue import entry

    cls = entry(engine).settings_class()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ValueError(f"{at}: unknown key {key!r} for engine {engine!r} (known: {', '.join(sorted(fields))})")
    for key in REQUIRED.get(engine, ()):
        if not raw.get(key):
            raise ValueError(f"{at}.{key}: is required for engine {engine!r}")
    out = {}
    for key, value in raw.items():
        kind = str(fields[key].type)
        where = f"{at}.{key}"
        if kind.startswith("bool"):
            if not isinstance(value, bool):
                raise ValueError(f"{where}: must be true or false, got {value!r}")
        elif kind.startswith("int"):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{where}: must be an integer >= 0, got {value!r}")
        elif kind.startswith("float"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}: must be a number >= 0, got {value!r}")
            value = float(value)
        elif kind.startswith("dict"):
            if not isinstance(value, dict):
                raise ValueError(f"{where}: must be a table, got {value!r}")
        elif not isinstance(value, str):
            raise ValueError(f"{where}: must be a string, got {value!r}")
        out[key] = value
    dtypes = DTYPES if engine == "hf" else DTYPES[:-1]  # float64: the hf engine only (exact tests)
    if out.get("dtype", "auto") not in dtypes:
        raise ValueError(f"{at}.dtype: must be one of {', '.join(dtypes)} for engine {engine!r}, got {out['dtype']!r}")
    if engine == "hf" and bool(out.get("model")) == bool(out.get("config")):
        raise ValueError(f"{at}: engine 'hf' needs exactly one of model (a local directory) or config (a table)")
    for key in ("max_in_flight", "retries", "max_new_tokens", "tensor_parallel_size"):
        if key in out and key != "retries" and out[key] < 1:
            raise ValueError(f"{at}.{key}: must be >= 1, got {out[key]!r}")
    if "timeout_seconds" in out and out["timeout_seconds"] <= 0:
        raise ValueError(f"{at}.timeout_seconds: must be > 0, got {out['timeout_seconds']!r}")
    for key in ("gpu_memory_utilization", "free_gpu_memory_fraction"):
        if key in out and not 0 < out[key] <= 1:
            raise ValueError(f"{at}.{key}: must be in (0, 1], got {out[key]!r}")
    return cls(**out)


def sim_settings(v: Validator, raw: dict, at: str) -> SimSettings:
    """engine_settings of the simulated engine (a consumer's or a tier's), read through the settings' validator."""
    cost_keys = {f.name for f in dataclasses.fields(SimCost)}
    faults = set(SIM_FAULT_TOKENS) | {"fail_after", "poison_kill"}
    v.no_unknown(raw, {"mode", "cache_tokens", "pace_seconds"} | cost_keys | faults, at)
    mode = Mode(v.choice(raw, "mode", tuple(Mode), at)) if "mode" in raw else Mode.PACKED
    cache = v.integer(raw, "cache_tokens", 0, 1 << 40, at=at) if "cache_tokens" in raw else 2 << 20
    cost = {}
    for key in sorted(cost_keys & raw.keys()):
        if key == "zero_cost":
            if not isinstance(raw[key], bool):
                v.fail(f"{at}.{key}", "must be true or false", raw[key])
            cost[key] = raw[key]
        else:
            cost[key] = v.number(raw, key, 0.0, 3600.0, at=at)
    extra = {"pace_seconds": v.number(raw, "pace_seconds", 0.0, 3600.0, at=at)} if "pace_seconds" in raw else {}
    for key in (*SIM_FAULT_TOKENS, "fail_after"):
        if key in raw:
            extra[key] = v.integer(raw, key, 0, (1 << 32) - 1, at=at)
    if "poison_kill" in raw:
        extra["poison_kill"] = v.choice(raw, "poison_kill", SIM_KILLS, at)
    return SimSettings(mode, cache, SimCost(**cost), **extra)
