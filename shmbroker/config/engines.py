"""Each engine's `engine_settings` table read into its settings dataclass (engines/options.py).

The dataclasses declare the keys and their defaults; this module checks a table's values and builds
one. The simulated engine's keys are read through the file's validator with the checks of
`SIM_CHECKS`; a real engine's are checked by their field's type (`real_settings`) and the rules
below, each refusal a ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import math

from ..engines.catalogue import ENGINES, entry
from ..engines.options import DTYPES, GUIDED_BACKENDS, REQUIRED, SIM_FAULT_TOKENS, SIM_KILLS, STRUCTURED_BACKENDS, SimSettings
from ..engines.cost import SimCost
from ..errors import ConfigError
from ..pack.contract import Mode
from ..request.options import MAX_DIMENSIONS, Task
from .validator import Choice, Flag, Integer, Number, Text, Validator

ENGINE_CHECK = Choice(tuple(ENGINES))  # a consumer's or a tier's `engine`
COST_KEYS = tuple(sorted(f.name for f in dataclasses.fields(SimCost)))  # keys of the sim's table, into SimCost
SIM_CHECKS = {  # the simulated engine's keys, in the order they are read
    "mode": Choice(tuple(Mode)),
    "task": Choice(tuple(Task)),
    "embed_dimensions": Integer(1, MAX_DIMENSIONS),
    "matryoshka": Flag(),
    "cache_tokens": Integer(0, 1 << 40),
    **{key: Flag() if key == "zero_cost" else Number(0.0, 3600.0) for key in COST_KEYS},
    "pace_seconds": Number(0.0, 3600.0),
    "start_seconds": Number(0.0, 3600.0),
    **{key: Integer(0, (1 << 32) - 1) for key in (*SIM_FAULT_TOKENS, "fail_after")},
    "poison_kill": Choice(SIM_KILLS),
    "tokenizer": Text(),
}
AT_LEAST_ONE = ("max_in_flight", "max_new_tokens", "tensor_parallel_size")
FRACTIONS = ("gpu_memory_utilization", "free_gpu_memory_fraction")  # in (0, 1]


def engine_settings(v: Validator, engine: str, raw, at: str):
    """The settings of `engine` from its table `raw` (at `at`, e.g. "consumers[0].engine_settings")."""
    if not isinstance(raw, dict):
        v.fail(at, "must be a table", raw)
    if engine == "sim":
        return sim_settings(v, raw, at)
    try:
        return real_settings(engine, raw, at)
    except ValueError as exc:
        raise ConfigError(f"{v.where}: {exc}") from None


def sim_settings(v: Validator, raw: dict, at: str) -> SimSettings:
    """The simulated engine's table: a key its dataclass leaves out keeps the field's default."""
    v.no_unknown(raw, set(SIM_CHECKS), at)
    values = {key: check.read(v, raw, key, at) for key, check in SIM_CHECKS.items() if key in raw}
    cost = SimCost(**{key: values.pop(key) for key in COST_KEYS if key in values})
    if "mode" in values:
        values["mode"] = Mode(values["mode"])
    if "task" in values:
        values["task"] = Task(values["task"])
    return SimSettings(cost=cost, **values)


def real_settings(engine: str, raw: dict, at: str):
    """engine_settings of a real engine: known keys, right types, sane values; ValueError naming the key."""
    cls = entry(engine).settings_class()
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in fields:
            raise ValueError(f"{at}: unknown key {key!r} for engine {engine!r} (known: {', '.join(sorted(fields))})")
    for key in REQUIRED.get(engine, ()):
        if not raw.get(key):
            raise ValueError(f"{at}.{key}: is required for engine {engine!r}")
    out = {key: typed(str(fields[key].type), value, f"{at}.{key}") for key, value in raw.items()}
    dtypes = DTYPES if engine == "hf" else DTYPES[:-1]  # float64: the hf engine only (exact tests)
    if out.get("dtype", "auto") not in dtypes:
        raise ValueError(f"{at}.dtype: must be one of {', '.join(dtypes)} for engine {engine!r}, got {out['dtype']!r}")
    if out.get("structured_outputs_backend", "auto") not in STRUCTURED_BACKENDS:
        raise ValueError(f"{at}.structured_outputs_backend: must be one of {', '.join(STRUCTURED_BACKENDS)}, "
                         f"got {out['structured_outputs_backend']!r}")
    if out.get("guided_decoding_backend", "xgrammar") not in GUIDED_BACKENDS:
        raise ValueError(f"{at}.guided_decoding_backend: must be one of {', '.join(GUIDED_BACKENDS)}, "
                         f"got {out['guided_decoding_backend']!r}")
    if out.get("disable_any_whitespace") and out.get("structured_outputs_backend", "auto") not in ("xgrammar", "guidance"):
        raise ValueError(f"{at}.disable_any_whitespace: vLLM honours it with structured_outputs_backend = \"xgrammar\" "
                         "or \"guidance\" only; name one of them")
    if "task" in out:
        if out["task"] not in tuple(Task):
            raise ValueError(f"{at}.task: must be one of {', '.join(Task)}, got {out['task']!r}")
        out["task"] = Task(out["task"])
        if out["task"] is Task.EMBED and engine == "trtllm":
            raise ValueError(f"{at}.task: engine 'trtllm' does not embed: TensorRT-LLM's LLM API has no pooling runner "
                             "(serve the model with `trtllm-serve embeddings` and use engine 'openai')")
    if engine == "hf" and bool(out.get("model")) == bool(out.get("config")):
        raise ValueError(f"{at}: engine 'hf' needs exactly one of model (a local directory) or config (a table)")
    for key in AT_LEAST_ONE:
        if key in out and out[key] < 1:
            raise ValueError(f"{at}.{key}: must be >= 1, got {out[key]!r}")
    if "timeout_seconds" in out and out["timeout_seconds"] <= 0:
        raise ValueError(f"{at}.timeout_seconds: must be > 0, got {out['timeout_seconds']!r}")
    for key in FRACTIONS:
        if key in out and not 0 < out[key] <= 1:
            raise ValueError(f"{at}.{key}: must be in (0, 1], got {out[key]!r}")
    return cls(**out)


def real_values(engine: str, name: str, kind: str) -> str:
    """What `real_settings` takes for key `name` (of type `kind`) of `engine`, in words (for the reference)."""
    if name == "dtype":
        return ", ".join(f"`{d}`" for d in (DTYPES if engine == "hf" else DTYPES[:-1]))
    if name in FRACTIONS:
        return "> 0 and <= 1"
    if name == "structured_outputs_backend":
        return ", ".join(f"`{b}`" for b in STRUCTURED_BACKENDS)
    if name == "guided_decoding_backend":
        return ", ".join(f"`{b}`" for b in GUIDED_BACKENDS)
    if name == "timeout_seconds":
        return "> 0"
    if name == "task":
        return ", ".join(f"`{t}`" for t in Task) + (" (`embed` refused)" if engine == "trtllm" else "")
    if name in AT_LEAST_ONE:
        return ">= 1"
    return ">= 0" if kind.startswith(("int", "float")) else ""


def typed(kind: str, value, where: str):
    """`value` checked against its field's type `kind` (bool, int and float >= 0, dict, else str)."""
    if kind.startswith("bool"):
        if not isinstance(value, bool):
            raise ValueError(f"{where}: must be true or false, got {value!r}")
    elif kind.startswith("int"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{where}: must be an integer >= 0, got {value!r}")
    elif kind.startswith("float"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{where}: must be a number >= 0, got {value!r}")
        return float(value)
    elif kind.startswith("dict"):
        if not isinstance(value, dict):
            raise ValueError(f"{where}: must be a table, got {value!r}")
    elif not isinstance(value, str):
        raise ValueError(f"{where}: must be a string, got {value!r}")
    return value
