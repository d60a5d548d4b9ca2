"""The configuration reference, docs/configuration.md, generated from the settings' fields.

Every key of `shmbroker.toml` is a dataclass field that carries its default and its one-line help
(`broker.py`'s `BrokerConfig`, `Tier`, `Card`; each engine's settings, engines/options.py; the
cluster's, cluster/options.py and cluster/subjects.py); what a key takes comes from the check that
reads it. `markdown()` lists them all: `shmbroker config --reference > docs/configuration.md`
writes the page, and tests/config/test_reference.py fails when the page and the fields differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import NamedTuple

from ..cluster.options import ClusterConfig, NatsOptions, NodeSettings
from ..cluster.subjects import ClusterNames, StreamSettings
from ..engines.catalogue import ENGINES
from ..engines.options import REQUIRED
from . import settings
from .broker import BrokerConfig, Card, Tier, key_name, toml_keys
from .cluster import CLUSTER_CHECKS, SERVER_SCHEMES
from .http import HttpConfig
from .engines import ENGINE_CHECK, SIM_CHECKS, real_values

REGENERATE = "python -m shmbroker.cli config --reference > docs/configuration.md"
TYPES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean", "dict": "table",
         "object": "table", "tuple[str, ...]": "string or array of strings", "Mode": "string"}
SIZES = ((30, "GiB"), (20, "MiB"), (10, "KiB"))


class Row(NamedTuple):
    """One key of a table of the reference."""

    key: str
    kind: str
    default: str
    values: str
    meaning: str


def value_text(value, name: str = "") -> str:
    """A default as the file would write it (a size in bytes also in KiB, MiB or GiB)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, tuple | list):
        return "`[" + ", ".join(f'"{v}"' for v in value) + "]`"
    if isinstance(value, dict):
        return "`{" + ", ".join(f"{k} = {v!r}" for k, v in value.items()) + "}`"
    if isinstance(value, int) and name.endswith("_bytes"):
        unit = next(((shift, u) for shift, u in SIZES if value >= 1 << shift and value % (1 << shift) == 0), None)
        return f"{value} ({value >> unit[0]} {unit[1]})" if unit else str(value)
    return repr(value)


def default_text(f: dataclasses.Field, required: bool = False) -> str:
    meta = f.metadata
    if required or meta.get("required"):
        return "required"
    if "default_text" in meta:
        return meta["default_text"]
    if "fill" in meta:
        return value_text(meta["fill"])
    if f.default is not MISSING:
        return value_text(f.default, f.name)
    if f.default_factory is not MISSING:
        return value_text(f.default_factory(), f.name)
    return "none"


def kind_text(f: dataclasses.Field) -> str:
    kind = f.metadata.get("type", str(f.type).removesuffix(" | None"))
    return TYPES.get(kind, kind)


def row(f: dataclasses.Field, values: str = "", *, required: bool = False) -> Row:
    check = f.metadata.get("check")
    values = values or (check.describe() if check is not None else "")
    return Row(key_name(f), kind_text(f), default_text(f, required), values, f.metadata["help"])


def top_level_rows() -> list[Row]:
    rows = []
    for f in toml_keys(BrokerConfig):
        table = f.metadata.get("table")
        if table is None:
            rows.append(row(f))
        else:
            rows.append(Row(table, "array of tables" if table.startswith("[[") else "table", default_text(f), "",
                            f.metadata["help"] + ("" if f.metadata.get("flat") else "; below")))
    return rows


def tier_rows(keys) -> list[Row]:
    """`[[tiers]]`'s keys, or `[[consumers]]`' (`keys`: those of the table)."""
    return [row(f, ENGINE_CHECK.describe() if f.name == "engine" else "") for f in toml_keys(Tier) if key_name(f) in keys]


def engine_rows(engine: str, cls) -> list[Row]:
    """The keys of `engine`'s `engine_settings`; a field holding a dataclass gives its fields as keys."""
    rows = []
    for f in dataclasses.fields(cls):
        parts = dataclasses.fields(f.default) if dataclasses.is_dataclass(f.default) else (f,)
        for part in parts:
            if "help" not in part.metadata:
                continue
            if engine == "sim":
                rows.append(row(part, SIM_CHECKS[part.name].describe()))
            else:
                rows.append(row(part, real_values(engine, part.name, str(part.type)),
                                required=part.name in REQUIRED.get(engine, ())))
    return rows


def cluster_rows(holder) -> list[Row]:
    servers = "`" + "` or `".join(f"{s}host:port" for s in SERVER_SCHEMES) + "` URLs"
    return [row(f, servers if f.name == "servers" else CLUSTER_CHECKS[f.name].describe()) for f in toml_keys(holder)]


def table(rows: list[Row]) -> list[str]:
    out = ["| key | type | default | takes | meaning |", "|---|---|---|---|---|"]
    for r in rows:
        cells = (f"`{r.key}`", r.kind, r.default, r.values, r.meaning)
        out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return out + [""]


def first_paragraph(cls) -> str:
    """The first paragraph of a class's docstring, on one line."""
    return " ".join((cls.__doc__ or "").strip().split("\n\n")[0].split())


def engine_sections() -> list[str]:
    out = []
    for name, e in ENGINES.items():
        cls = e.settings_class()
        mode = "the settings' `mode`" if e.mode not in ("padded", "packed") else f"`{e.mode}`"
        extra = f"; needs `pip install 'shmbroker[{e.extra}]'`" if e.extra else ""
        out += [f"### `engine = \"{name}\"` (`{cls.__name__}`)", "",
                f"{first_paragraph(cls)} Mode: {mode}{extra}.", ""] + table(engine_rows(name, cls))
    return out


def cluster_sections() -> list[str]:
    out = []
    for title, holder in (("The connection", NatsOptions), ("Names", ClusterNames),
                          ("Streams", StreamSettings), ("The node", NodeSettings)):
        out += [f"### {title} (`{holder.__name__}`, shown as `cluster.{cluster_part(holder)}`)", "",
                first_paragraph(holder), ""] + table(cluster_rows(holder))
    return out


def cluster_part(holder) -> str:
    """The name of the ClusterConfig field that holds `holder` (`shmbroker config` shows the table so)."""
    return next(f.name for f in dataclasses.fields(ClusterConfig) if f.type == holder.__name__)


def markdown() -> str:
    """docs/configuration.md: an introduction, a minimal file, then every key's table."""
    lines = [*INTRO, "## Top-level keys", "", *table(top_level_rows()),
             "## `[[consumers]]`", "", CONSUMERS_TEXT, "", *table(tier_rows(settings.CONSUMER_KEYS)),
             "## `engine_settings`", "", ENGINE_SETTINGS_TEXT, "", *engine_sections(),
             "## `[[tiers]]`", "", TIERS_TEXT, "", *table(tier_rows(settings.TIER_KEYS)),
             "## `[[gpus]]`", "", GPUS_TEXT, "", *table([row(f) for f in toml_keys(Card)]),
             "## `[cluster]`", "", CLUSTER_TEXT, "", *cluster_sections(),
             "## `[http]`", "", first_paragraph(HttpConfig) + " " + HTTP_TEXT, "",
             *table([row(f) for f in toml_keys(HttpConfig)])]
    return "\n".join(lines).rstrip("\n") + "\n"


EXAMPLE = '''\
# shmbroker.toml: one GPU process serving a local model with vLLM
data_dir = "/var/lib/shmbroker"

[[consumers]]
name = "gpu0"
max_batch_size = 256
max_batch_tokens = 16384
max_input_len = 8192
model = "llama"
engine = "vllm"
[consumers.engine_settings]
model = "/models/llama-3-8b"
'''
INTRO = ["# Configuration reference (`shmbroker.toml`)", "",
         f"<!-- Generated from the settings' fields (shmbroker/config/reference.py): {REGENERATE} -->", "",
         "One TOML file, read with the standard library's `tomllib` into frozen dataclasses and validated in one "
         "place. No file means the built-in default: two simulated consumers, `big` and `small`, as in `bench pack`. "
         "Unknown keys and impossible values are refused with a message that names the key "
         "(`shmbroker.toml: consumers[1].max_batch_size: must be a positive integer, got 0`). "
         "`shmbroker config [--config FILE]` checks a file and prints it resolved, defaults filled in (exit 2 and the "
         "message on a refusal); `shmbroker supervise` refuses to start on one the same way.", "",
         "Every key is optional unless its default says *required*. A key's default and meaning are declared once, "
         "on the dataclass field that holds it (`shmbroker/config/broker.py`, `shmbroker/engines/options.py`, "
         "`shmbroker/cluster/options.py`, `shmbroker/cluster/subjects.py`), and this page is generated from those "
         f"fields: `{REGENERATE}`.", "",
         "## A minimal file", "", "```toml", *EXAMPLE.splitlines(), "```", ""]
CONSUMERS_TEXT = ("One table per GPU process: its name, its contract (the batches its engine takes) and its engine. "
                  "Without any, the built-in `big` and `small` (simulated) stand.")
ENGINE_SETTINGS_TEXT = ("A consumer's (or a tier's) `engine_settings` table holds its engine's settings: "
                        "`[consumers.engine_settings]`, or inline, `engine_settings = { model = \"/models/llama\" }`. "
                        "A key of another engine is refused.")
TIERS_TEXT = ("A tier says what a card with at least so much memory runs. `shmbroker supervise --gpus auto` (and "
              "`shmbroker config --gpus auto`, which prints the result) reads the cards, gives each the tier with the "
              "largest `min_memory_gib` its total memory reaches, and makes one consumer per card, `card<index>`, in "
              "place of `[[consumers]]`. Without `--gpus auto` tiers are checked but `[[consumers]]` stands as "
              "written. A tier has a consumer's keys and `min_memory_gib`.")
GPUS_TEXT = ("Cards come from NVML when nvidia-ml-py is installed (`pip install 'shmbroker[gpu]'`) and a driver "
             "answers; otherwise the `[[gpus]]` tables are the cards. Only `--gpus auto` reads them.")
CLUSTER_TEXT = ("The broker is a node of a cluster on NATS JetStream (`pip install 'shmbroker[cluster]'`). The keys "
                "are written flat in the one table; each is a field of one of the dataclasses below, and "
                "`shmbroker config` shows them grouped so.")
HTTP_TEXT = ("It serves the OpenAI Files and Batches API for the official `openai` client ([jobs](jobs.md#the-openai-"
             "batch-api-over-http)); `pip install 'shmbroker[http]'`. A request without a key of `[http.keys]` is "
             "answered 401; each tenant sees only its own files and batches.")
