"""The broker's configuration file (`shmbroker.toml`) into frozen dataclasses, validated in one place.

`load(path)` reads the file with stdlib `tomllib`; `load(None)` is the built-in
default (two simulated consumers, `big` and `small`, as in `bench pack`).
Unknown keys and impossible values raise `ConfigError` naming the key, e.g.
`shmbroker.toml: consumers[1].max_batch_size: must be a positive integer, got 0`.
The defaults live in `config.py`; every key is documented in the README.

    data_dir = "shmbroker-data"      # also $SHMBROKER_DATA_DIR
    metrics_addr = "127.0.0.1:9464"  # the Prometheus exporter ("" = none)
    instance = "main"
    ingest_processes = 1
    ingest_ring_bytes = 8388608
    result_ring_bytes = 16777216
    segment_bytes = 67108864
    fsync = "interval"               # never | interval | always
    fsync_interval_ms = 5.0
    block_tokens = 512
    max_wait_seconds = 30.0
    padding_tolerance = 0.0625
    poison_attempts = 3              # a batch a GPU process died on this often is split, its items run
                                     # alone; an item it died on this often alone fails (engine_error)
    batch_deadline_seconds = 300.0   # a batch's deadline: this floor + batch_deadline_token_seconds per
    batch_deadline_token_seconds = 0.01  # input and generated token, from the GPU process's last progress
    heartbeat_timeout_seconds = 120.0    # a process loop silent this long is hung: killed, restarted
    startup_timeout_seconds = 900.0      # ... and one not looping this long after its start
    restart_backoff_max_seconds = 5.0    # restarts back off from 0.1 s, doubling up to this
    crash_loop_restarts = 5              # this many deaths within crash_loop_window_seconds: a crash
    crash_loop_window_seconds = 60.0     # loop, reported by status, top and the metrics
    engine_retry_min_seconds = 1.0       # items an engine hands back while it is down are retried after
    engine_retry_max_seconds = 60.0      # this, doubling while it stays down, up to the max
    producer_retire_seconds = 30.0       # a name with nothing left to do leaves the table (rings freed)
    results_name_bytes = 1073741824      # one name's unread results keep at most this much of the shared
                                         # results log; past it they move to a log of the name's own

    [[consumers]]
    name = "big"
    max_batch_size = 256
    max_batch_tokens = 131072
    max_input_len = 131072
    model = "llama"                  # optional: the model name producers submit with
    engine = "sim"
    [consumers.engine_settings]      # sim: mode, cache_tokens, SimCost fields
    mode = "packed"
    cache_tokens = 2097152

`[cluster]` makes the broker a node of a cluster on NATS JetStream (its keys: cluster/options.py).

`[[tiers]]` (a consumer's keys plus `min_memory_gib`, the smallest card the tier fits) and
`[[gpus]]` (cards declared for when NVML cannot tell) are read here and used only by
`supervise --gpus auto` (gpu/tiers.py); without it `[[consumers]]` stands as written.

    [[tiers]]
    name = "big"
    min_memory_gib = 75              # a card with at least this much total memory
    max_batch_size = 256
    max_batch_tokens = 131072
    max_input_len = 32768
    engine = "hf"
    engine_settings = { model = "/models/llama" }

    [[gpus]]                         # only read when NVML is missing
    index = 0
    memory_gib = 80
    name = "A100"                    # optional
"""

from __future__ import annotations

import dataclasses
import os
import re
import tomllib
from dataclasses import dataclass, field

from .. import protocol
from ..cluster.options import ClusterConfig, parse_cluster
from ..control.stats import MAX_MODELS
from ..engines import options
from ..engines.catalogue import ENGINES as ENGINE_REGISTRY
from ..engines.options import SimSettings
from ..errors import ConfigError
from ..pack.contract import Contract
from ..pack.policy import DEFAULT_PADDING_TOLERANCE
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, LENGTH_MAX
from ..ring.items import model_id
from . import defaults as config
from .validator import Validator

__all__ = ["ConfigError"]  # raised here; declared in errors.py

ENGINES = tuple(ENGINE_REGISTRY)
INSTANCE_RE = re.compile(r"[A-Za-z0-9_-]{1,32}")
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
RING_BYTES_MIN = 1 << 16
SEGMENT_BYTES_MIN = 1 << 20


FAILURE_SECONDS_KEYS = ("batch_deadline_seconds", "batch_deadline_token_seconds", "heartbeat_timeout_seconds",
                        "startup_timeout_seconds", "restart_backoff_max_seconds", "crash_loop_window_seconds",
                        "engine_retry_min_seconds", "engine_retry_max_seconds")


GIB = 1 << 30


@dataclass(frozen=True)
class Tier:
    """What a card with at least `min_memory_gib` of memory runs (one `[[tiers]]` table; gpu/tiers.py
    picks one per card)."""

    name: str
    min_memory_gib: float  # the smallest card it fits, in GiB (2^30 bytes) of total memory
    engine: str
    engine_settings: object  # SimSettings, or the engine's own (engines/options.py)
    max_batch_size: int
    max_batch_tokens: int
    max_input_len: int
    model: str | None = None  # the model name producers submit with; None: the default model


@dataclass(frozen=True)
class Card:
    """One GPU: NVML's (nvidia-smi's) index, its name, its total memory (or one `[[gpus]]` table)."""

    index: int
    name: str
    memory_bytes: int
    uuid: str | None = None


@dataclass(frozen=True)
class ConsumerConfig:
    name: str
    contract: Contract
    model_name: str | None
    engine: str
    engine_settings: SimSettings  # or the engine's own (engines/options.py)
    # the card (NVML's index) the GPU process pins itself to with CUDA_VISIBLE_DEVICES; None: not pinned
    # (set by `supervise --gpus auto`, gpu/tiers.py)
    device: int | None = None

    @classmethod
    def on_card(cls, card: Card, tier: Tier) -> ConsumerConfig:
        """`card<index>`: the tier's engine, settings and contract, pinned to the card."""
        contract = Contract(tier.max_batch_size, tier.max_batch_tokens, tier.max_input_len, model_id(tier.model))
        return cls(f"card{card.index}", contract, tier.model, tier.engine, tier.engine_settings, device=card.index)


@dataclass(frozen=True)
class BrokerConfig:
    data_dir: str
    instance: str = config.DEFAULT_INSTANCE
    ingest_processes: int = 1
    ingest_ring_bytes: int = config.DEFAULT_INGEST_RING_BYTES
    result_ring_bytes: int = config.DEFAULT_RESULT_RING_BYTES
    segment_bytes: int = config.DEFAULT_SEGMENT_BYTES
    fsync: str = config.DEFAULT_FSYNC
    fsync_interval_ms: float = config.DEFAULT_FSYNC_INTERVAL_MS
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_wait_seconds: float = config.DEFAULT_MAX_WAIT_SECONDS
    padding_tolerance: float = DEFAULT_PADDING_TOLERANCE
    index_items: int = config.DEFAULT_INDEX_ITEMS
    overflow_items: int = config.DEFAULT_OVERFLOW_ITEMS
    metrics_addr: str = config.DEFAULT_METRICS_ADDR  # "" = no exporter
    # failures (config.py has each default and what it means)
    poison_attempts: int = config.DEFAULT_POISON_ATTEMPTS
    batch_deadline_seconds: float = config.DEFAULT_BATCH_DEADLINE_SECONDS
    batch_deadline_token_seconds: float = config.DEFAULT_BATCH_DEADLINE_TOKEN_SECONDS
    heartbeat_timeout_seconds: float = config.DEFAULT_HEARTBEAT_TIMEOUT_SECONDS
    startup_timeout_seconds: float = config.DEFAULT_STARTUP_TIMEOUT_SECONDS
    restart_backoff_max_seconds: float = config.DEFAULT_RESTART_BACKOFF_MAX_SECONDS
    crash_loop_restarts: int = config.DEFAULT_CRASH_LOOP_RESTARTS
    crash_loop_window_seconds: float = config.DEFAULT_CRASH_LOOP_WINDOW_SECONDS
    engine_retry_min_seconds: float = config.DEFAULT_ENGINE_RETRY_MIN_SECONDS
    engine_retry_max_seconds: float = config.DEFAULT_ENGINE_RETRY_MAX_SECONDS
    producer_retire_seconds: float = config.DEFAULT_PRODUCER_RETIRE_SECONDS
    results_name_bytes: int = config.DEFAULT_RESULTS_NAME_BYTES
    consumers: tuple[ConsumerConfig, ...] = field(default_factory=tuple)
    source: str = "built-in default"
    tiers: tuple[Tier, ...] = ()  # [[tiers]]: a card's memory -> engine and contract (`supervise --gpus auto`)
    gpus: tuple[Card, ...] = ()  # [[gpus]]: cards declared for when NVML cannot tell
    cluster: ClusterConfig | None = None  # [cluster]: this broker is a node of a cluster (cluster/options.py)


def default_consumers() -> tuple[ConsumerConfig, ...]:
    """`big` and `small` of the packing benchmark, both on the simulated engine."""
    return (
        ConsumerConfig("big", Contract(256, 131072, 131072), None, "sim", SimSettings("packed", 2 << 20)),
        ConsumerConfig("small", Contract(64, 16384, 16384), None, "sim", SimSettings("packed", 256 << 10)),
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
    return out


def parse(raw: dict, where: str = config.DEFAULT_CONFIG_FILE, *, data_dir: str | None = None) -> BrokerConfig:
    """Validate a parsed TOML document into a BrokerConfig."""
    v = Validator(where)
    known = {f.name for f in dataclasses.fields(BrokerConfig)} - {"source"}
    v.no_unknown(raw, known, "")
    out: dict = {}
    out["data_dir"] = protocol.data_dir(data_dir) if data_dir is not None else (
        v.string(raw, "data_dir") if "data_dir" in raw else protocol.data_dir(None))
    if "instance" in raw:
        out["instance"] = v.pattern(raw, "instance", INSTANCE_RE, "1-32 letters, digits, '_' or '-'")
    if "ingest_processes" in raw:
        out["ingest_processes"] = v.integer(raw, "ingest_processes", 1, 64)
    for key in ("ingest_ring_bytes", "result_ring_bytes"):
        if key in raw:
            out[key] = v.integer(raw, key, RING_BYTES_MIN, 1 << 34, multiple_of=4096)
    if "segment_bytes" in raw:
        out["segment_bytes"] = v.integer(raw, "segment_bytes", SEGMENT_BYTES_MIN, 1 << 40, multiple_of=4096)
    if "fsync" in raw:
        out["fsync"] = v.choice(raw, "fsync", ("never", "interval", "always"))
    if "fsync_interval_ms" in raw:
        out["fsync_interval_ms"] = v.number(raw, "fsync_interval_ms", 0.0, 60_000.0, low_open=True)
    if "block_tokens" in raw:
        out["block_tokens"] = v.integer(raw, "block_tokens", 1, 1 << 16)
    if "max_wait_seconds" in raw:
        out["max_wait_seconds"] = v.number(raw, "max_wait_seconds", 0.0, 1e9, low_open=True)
    if "padding_tolerance" in raw:
        out["padding_tolerance"] = v.number(raw, "padding_tolerance", 0.0, 1e6)
    if "index_items" in raw:
        out["index_items"] = v.integer(raw, "index_items", 1024, 1 << 28)
    if "overflow_items" in raw:
        out["overflow_items"] = v.integer(raw, "overflow_items", 1024, 1 << 30)
    if "poison_attempts" in raw:
        out["poison_attempts"] = v.integer(raw, "poison_attempts", 1, 1000)
    if "producer_retire_seconds" in raw:
        out["producer_retire_seconds"] = v.number(raw, "producer_retire_seconds", 0.0, 1e9)
    if "results_name_bytes" in raw:
        out["results_name_bytes"] = v.integer(raw, "results_name_bytes", 1 << 16, 1 << 50)
    if "crash_loop_restarts" in raw:
        out["crash_loop_restarts"] = v.integer(raw, "crash_loop_restarts", 1, 1 << 20)
    for key in FAILURE_SECONDS_KEYS:
        if key in raw:
            out[key] = v.number(raw, key, 0.0, 1e9, low_open=key != "batch_deadline_token_seconds")
    if out.get("engine_retry_min_seconds", config.DEFAULT_ENGINE_RETRY_MIN_SECONDS) > out.get(
            "engine_retry_max_seconds", config.DEFAULT_ENGINE_RETRY_MAX_SECONDS):
        v.fail("engine_retry_min_seconds", "must be <= engine_retry_max_seconds",
               out.get("engine_retry_min_seconds", config.DEFAULT_ENGINE_RETRY_MIN_SECONDS))
    if "metrics_addr" in raw:
        value = raw["metrics_addr"]
        if not isinstance(value, str):
            v.fail("metrics_addr", 'must be "host:port" (or "" for no exporter)', value)
        if value:
            try:
                parse_addr(value)
            except ValueError as exc:
                v.fail("metrics_addr", str(exc), value)
        out["metrics_addr"] = value
    if "consumers" in raw:
        items = raw["consumers"]
        if not isinstance(items, list) or not items or not all(isinstance(c, dict) for c in items):
            v.fail("consumers", "must be a non-empty array of tables ([[consumers]])", items)
        out["consumers"] = tuple(_consumer(v, c, f"consumers[{i}]") for i, c in enumerate(items))
        names = [c.name for c in out["consumers"]]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            v.fail("consumers", f"names must be unique, repeated: {', '.join(dupes)}", names)
        models = {c.contract.model for c in out["consumers"]}
        if len(models) > MAX_MODELS:
            v.fail("consumers", f"at most {MAX_MODELS} distinct models (the statistics count each)", len(models))
    else:
        out["consumers"] = default_consumers()
    if "tiers" in raw:
        out["tiers"] = _tiers(v, raw["tiers"])
    if "gpus" in raw:
        out["gpus"] = _gpus(v, raw["gpus"])
    if "cluster" in raw:
        out["cluster"] = parse_cluster(v, raw["cluster"], out.get("instance", config.DEFAULT_INSTANCE))
    return BrokerConfig(source=where, **out)


def parse_addr(text: str) -> tuple[str, int]:
    """"host:port" or "[v6-host]:port" -> (host, port); port 0 picks a free port."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError('must be "host:port" with a port in 0..65535 (or "" for no exporter)')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, int(port)


def _consumer(v: Validator, raw: dict, at: str) -> ConsumerConfig:
    v.no_unknown(raw, {"name", "max_batch_size", "max_batch_tokens", "max_input_len", "model", "engine",
                       "engine_settings"}, at)
    for key in ("name", "max_batch_size", "max_batch_tokens", "max_input_len"):
        if key not in raw:
            v.fail(f"{at}.{key}", "is required", None)
    name = v.pattern(raw, "name", NAME_RE, "1-64 letters, digits, '_', '.' or '-'", at)
    contract, model, engine, settings = _contract_engine(v, raw, at)
    return ConsumerConfig(name, contract, model, engine, settings)


def _tiers(v: Validator, items) -> tuple[Tier, ...]:
    if not isinstance(items, list) or not items or not all(isinstance(t, dict) for t in items):
        v.fail("tiers", "must be a non-empty array of tables ([[tiers]])", items)
    tiers = []
    for i, raw in enumerate(items):
        at = f"tiers[{i}]"
        v.no_unknown(raw, {"name", "min_memory_gib", "max_batch_size", "max_batch_tokens", "max_input_len", "model",
                           "engine", "engine_settings"}, at)
        for key in ("name", "min_memory_gib", "max_batch_size", "max_batch_tokens", "max_input_len"):
            if key not in raw:
                v.fail(f"{at}.{key}", "is required", None)
        name = v.pattern(raw, "name", NAME_RE, "1-64 letters, digits, '_', '.' or '-'", at)
        memory = v.number(raw, "min_memory_gib", 0.0, 1 << 20, at=at)
        contract, model, engine, settings = _contract_engine(v, raw, at)
        tiers.append(Tier(name, memory, engine, settings, contract.max_batch_size, contract.max_batch_tokens,
                          contract.max_input_len, model))
    names = [t.name for t in tiers]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        v.fail("tiers", f"names must be unique, repeated: {', '.join(dupes)}", names)
    sizes = [t.min_memory_gib for t in tiers]
    same = sorted({s for s in sizes if sizes.count(s) > 1})
    if same:
        v.fail("tiers", "min_memory_gib must differ between tiers (a card would fit two equally), repeated: "
               + ", ".join(f"{s:g}" for s in same), None)
    models = {t.model for t in tiers}
    if len(models) > MAX_MODELS:
        v.fail("tiers", f"at most {MAX_MODELS} distinct models (the statistics count each)", len(models))
    return tuple(tiers)


def _gpus(v: Validator, items) -> tuple[Card, ...]:
    if not isinstance(items, list) or not items or not all(isinstance(g, dict) for g in items):
        v.fail("gpus", "must be a non-empty array of tables ([[gpus]])", items)
    cards = []
    for i, raw in enumerate(items):
        at = f"gpus[{i}]"
        v.no_unknown(raw, {"index", "memory_gib", "name"}, at)
        for key in ("index", "memory_gib"):
            if key not in raw:
                v.fail(f"{at}.{key}", "is required", None)
        index = v.integer(raw, "index", 0, 1023, at=at)
        memory = v.number(raw, "memory_gib", 0.0, 1 << 20, low_open=True, at=at)
        name = v.string(raw, "name", at) if "name" in raw else "GPU"
        cards.append(Card(index, name, int(memory * GIB)))
    indexes = [c.index for c in cards]
    dupes = sorted({n for n in indexes if indexes.count(n) > 1})
    if dupes:
        v.fail("gpus", f"indexes must be unique, repeated: {', '.join(map(str, dupes))}", indexes)
    return tuple(cards)


def _contract_engine(v: Validator, raw: dict, at: str):
    """(contract, model name, engine, engine settings) of a consumer or a tier."""
    bs = v.integer(raw, "max_batch_size", 1, 1 << 20, at=at)
    bt = v.integer(raw, "max_batch_tokens", 1, 1 << 31, at=at)
    mi = v.integer(raw, "max_input_len", 1, LENGTH_MAX, at=at)
    if mi > bt:
        v.fail(f"{at}.max_input_len", f"must be <= max_batch_tokens ({bt}): a longer item could never be batched", mi)
    model = v.string(raw, "model", at) if "model" in raw else None
    contract = Contract(bs, bt, mi, model_id(model))
    engine = v.choice(raw, "engine", ENGINES, at) if "engine" in raw else "sim"
    settings = raw.get("engine_settings", {})
    if not isinstance(settings, dict):
        v.fail(f"{at}.engine_settings", "must be a table", settings)
    if engine == "sim":
        return contract, model, engine, options.sim_settings(v, settings, f"{at}.engine_settings")
    try:
        parsed = options.parse(engine, settings, f"{at}.engine_settings")
    except ValueError as exc:
        raise ConfigError(f"{v.where}: {exc}") from None
    return contract, model, engine, parsed
