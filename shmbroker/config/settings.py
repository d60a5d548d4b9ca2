"""The broker's configuration file (`shmbroker.toml`) into frozen dataclasses, validated in one place.

`load(path)` reads the file with stdlib `tomllib`; `load(None)` is the built-in default (two
simulated consumers, `big` and `small`, as in `bench pack`). Unknown keys and impossible values
raise `ConfigError` naming the key, e.g.
`shmbroker.toml: consumers[1].max_batch_size: must be a positive integer, got 0`.

Every key, its default, its help and its check are declared once, on the field that holds it:
`broker.py` (the top-level keys, `[[consumers]]`/`[[tiers]]` as `Tier`, `[[gpus]]` as `Card`),
`engines/options.py` (each engine's `engine_settings`, read by `engines.py`) and
`cluster/options.py` with `cluster/subjects.py` (`[cluster]`, read by `cluster.py`).
docs/configuration.md lists them all (`shmbroker config --reference`, `reference.py`).

`[[tiers]]` and `[[gpus]]` are read here and used only by `supervise --gpus auto` (gpu/tiers.py);
without it `[[consumers]]` stands as written.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib

from .. import protocol
from ..control.stats import MAX_MODELS
from ..engines.options import SimSettings
from ..errors import ConfigError
from ..pack.contract import Contract
from ..ring.items import DEFAULT_MODEL, model_id
from .broker import GIB, BrokerConfig, Card, ConsumerConfig, Tier, key_field, key_name, required_keys, toml_keys
from .cluster import parse_cluster
from .http import parse_http
from .engines import ENGINE_CHECK, engine_settings
from .validator import Validator, parse_addr

# raised here, declared in errors.py; the declarations of broker.py and the engines' settings are
# read through this module too
__all__ = ["GIB", "BrokerConfig", "Card", "ConfigError", "ConsumerConfig", "SimSettings", "Tier", "parse_addr"]

CONFIG_FILE = "shmbroker.toml"  # the name a refusal gives a document that came from no file
TIER_KEYS = tuple(key_name(f) for f in toml_keys(Tier))
CONSUMER_KEYS = tuple(k for k in TIER_KEYS if k != "min_memory_gib")  # a consumer is a tier without a card size
CONTRACT_KEYS = ("max_batch_size", "max_batch_tokens", "max_input_len")


def default_consumers() -> tuple[ConsumerConfig, ...]:
    """`big` and `small` of the packing benchmark, both on the simulated engine."""
    return (
        ConsumerConfig("big", Contract(256, 131072, 131072), None, "sim", SimSettings()),
        ConsumerConfig("small", Contract(64, 16384, 16384), None, "sim", SimSettings(cache_tokens=256 << 10)),
    )


def load(path: str | os.PathLike | None = None, *, data_dir: str | None = None) -> BrokerConfig:
    """The configuration in `path` (TOML); None: the built-in default. `data_dir` overrides the file's."""
    if path is None:
        return BrokerConfig(data_dir=protocol.data_dir(data_dir), consumers=default_consumers())
    where = os.fspath(path)
    try:
        with open(where, "rb") as fh:
            raw = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such configuration file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{where}: not valid TOML: {exc}") from None
    return parse(raw, where, data_dir=data_dir)


SECRET_KEYS = ("password", "token")


def as_dict(cfg: BrokerConfig) -> dict:
    """The configuration as plain data (for `shmbroker config`); secrets are shown as "***"."""
    out = dataclasses.asdict(cfg)
    nats = (out.get("cluster") or {}).get("nats", {})
    for key in SECRET_KEYS:
        if nats.get(key) is not None:
            nats[key] = "***"
    if out.get("http"):  # the tenants, not their keys' hashes
        out["http"]["keys"] = {name: "***" for name, _ in out["http"].pop("key_hashes")}
    return out


def parse(raw: dict, where: str = CONFIG_FILE, *, data_dir: str | None = None) -> BrokerConfig:
    """Validate a parsed TOML document into a BrokerConfig: each top-level key by its field's check,
    then the tables."""
    v = Validator(where)
    v.no_unknown(raw, {f.name for f in toml_keys(BrokerConfig)}, "")
    out: dict = {}
    out["data_dir"] = protocol.data_dir(data_dir) if data_dir is not None else (
        v.string(raw, "data_dir") if "data_dir" in raw else protocol.data_dir(None))
    for f in toml_keys(BrokerConfig):
        if f.name in raw and f.name != "data_dir" and f.metadata["check"] is not None:
            out[f.name] = f.metadata["check"].read(v, raw, f.name)
    retry_min = out.get("engine_retry_min_seconds", BrokerConfig.engine_retry_min_seconds)
    if retry_min > out.get("engine_retry_max_seconds", BrokerConfig.engine_retry_max_seconds):
        v.fail("engine_retry_min_seconds", "must be <= engine_retry_max_seconds", retry_min)
    out["consumers"] = consumers(v, raw["consumers"]) if "consumers" in raw else default_consumers()
    if "tiers" in raw:
        out["tiers"] = tiers(v, raw["tiers"])
    if "gpus" in raw:
        out["gpus"] = gpus(v, raw["gpus"])
    if "cluster" in raw:
        out["cluster"] = parse_cluster(v, raw["cluster"], out.get("instance", BrokerConfig.instance))
    if "http" in raw:
        out["http"] = parse_http(v, raw["http"])
    if "tokenizers" in raw:
        served = {c.model_name or DEFAULT_MODEL for c in out["consumers"]} | {t.model or DEFAULT_MODEL for t in out.get("tiers", ())}
        out["tokenizers"] = tokenizers(v, raw["tokenizers"], served)
    return BrokerConfig(source=where, **out)


def tokenizers(v: Validator, raw, served: set) -> dict:
    """`[tokenizers]`: model name -> an existing tokenizer directory (or tokenizer.json), absolute;
    each name a model that a consumer or tier serves."""
    if not isinstance(raw, dict):
        v.fail("tokenizers", "must be a table of model name = tokenizer directory", raw)
    out = {}
    for model, path in raw.items():
        if model not in served:
            v.fail(f"tokenizers.{model}", f"no consumer or tier serves this model (served: {', '.join(sorted(served))})",
                   model)
        if not isinstance(path, str) or not path:
            v.fail(f"tokenizers.{model}", "must be a path (a tokenizer directory or its tokenizer.json)", path)
        full = os.path.abspath(os.path.expanduser(path))
        if not (os.path.isfile(full) or os.path.isfile(os.path.join(full, "tokenizer.json"))):
            v.fail(f"tokenizers.{model}", "no tokenizer.json there", path)
        out[model] = full
    return out


def tables_of(v: Validator, items, name: str) -> list[dict]:
    """The array of tables `[[name]]`: a non-empty list of tables, else a refusal."""
    if not isinstance(items, list) or not items or not all(isinstance(t, dict) for t in items):
        v.fail(name, f"must be a non-empty array of tables ([[{name}]])", items)
    return items


def check_unique(v: Validator, name: str, what: str, values: list) -> None:
    dupes = sorted({n for n in values if values.count(n) > 1})
    if dupes:
        v.fail(name, f"{what} must be unique, repeated: {', '.join(map(str, dupes))}", values)


def check_models(v: Validator, name: str, models: set) -> None:
    if len(models) > MAX_MODELS:
        v.fail(name, f"at most {MAX_MODELS} distinct models (the statistics count each)", len(models))


def read_key(v: Validator, cls, raw: dict, key: str, at: str):
    """`raw[key]` through the check of the field of `cls` (`Tier`, `Card`) that declares the key."""
    return key_field(cls, key).metadata["check"].read(v, raw, key, at)


def require(v: Validator, raw: dict, keys: tuple[str, ...], at: str) -> None:
    for key in keys:
        if key not in raw:
            v.fail(f"{at}.{key}", "is required", None)


def consumers(v: Validator, items) -> tuple[ConsumerConfig, ...]:
    """`[[consumers]]`: one GPU process each, names unique, at most MAX_MODELS models."""
    out = []
    for i, raw in enumerate(tables_of(v, items, "consumers")):
        at = f"consumers[{i}]"
        v.no_unknown(raw, set(CONSUMER_KEYS), at)
        require(v, raw, tuple(k for k in required_keys(Tier) if k in CONSUMER_KEYS), at)
        name = read_key(v, Tier, raw, "name", at)
        tier = tier_of(v, raw, at, name, 0.0)
        contract = Contract(tier.max_batch_size, tier.max_batch_tokens, tier.max_input_len, model_id(tier.model))
        out.append(ConsumerConfig(name, contract, tier.model, tier.engine, tier.engine_settings))
    check_unique(v, "consumers", "names", [c.name for c in out])
    check_models(v, "consumers", {c.contract.model for c in out})
    return tuple(out)


def tiers(v: Validator, items) -> tuple[Tier, ...]:
    """`[[tiers]]`: names and card sizes unique, at most MAX_MODELS models."""
    out = []
    for i, raw in enumerate(tables_of(v, items, "tiers")):
        at = f"tiers[{i}]"
        v.no_unknown(raw, set(TIER_KEYS), at)
        require(v, raw, required_keys(Tier), at)
        name = read_key(v, Tier, raw, "name", at)
        out.append(tier_of(v, raw, at, name, read_key(v, Tier, raw, "min_memory_gib", at)))
    check_unique(v, "tiers", "names", [t.name for t in out])
    sizes = [t.min_memory_gib for t in out]
    same = sorted({s for s in sizes if sizes.count(s) > 1})
    if same:
        v.fail("tiers", "min_memory_gib must differ between tiers (a card would fit two equally), repeated: "
               + ", ".join(f"{s:g}" for s in same), None)
    check_models(v, "tiers", {t.model for t in out})
    return tuple(out)


def tier_of(v: Validator, raw: dict, at: str, name: str, memory_gib: float) -> Tier:
    """The contract, model, engine and engine settings of a consumer's or a tier's table."""
    size, tokens, longest = (read_key(v, Tier, raw, key, at) for key in CONTRACT_KEYS)
    if longest > tokens:
        v.fail(f"{at}.max_input_len", f"must be <= max_batch_tokens ({tokens}): a longer item could never be batched",
               longest)
    model = read_key(v, Tier, raw, "model", at) if "model" in raw else None
    engine = ENGINE_CHECK.read(v, raw, "engine", at) if "engine" in raw else key_field(Tier, "engine").metadata["fill"]
    settings = engine_settings(v, engine, raw.get("engine_settings", {}), f"{at}.engine_settings")
    return Tier(name, memory_gib, engine, settings, size, tokens, longest, model)


def gpus(v: Validator, items) -> tuple[Card, ...]:
    """`[[gpus]]`: cards declared for when NVML cannot tell, indexes unique."""
    out = []
    for i, raw in enumerate(tables_of(v, items, "gpus")):
        at = f"gpus[{i}]"
        v.no_unknown(raw, {key_name(f) for f in toml_keys(Card)}, at)
        require(v, raw, required_keys(Card), at)
        index = read_key(v, Card, raw, "index", at)
        memory = read_key(v, Card, raw, "memory_gib", at)
        name = read_key(v, Card, raw, "name", at) if "name" in raw else key_field(Card, "name").metadata["fill"]
        out.append(Card(index, name, int(memory * GIB)))
    check_unique(v, "gpus", "indexes", [c.index for c in out])
    return tuple(out)
