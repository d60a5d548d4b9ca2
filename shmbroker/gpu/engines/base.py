"""The engine interface: what a GPU process hands an engine and what it gets back.

An engine receives one shape-pure `EngineBatch` (each item's token ids, zero-copy
where the caller can, the batch's shared prefix length, max_new_tokens and item
ids) and returns an `EngineOutcome`: one `ItemResult` per item (token ids, a
status, error text) plus what it knows of its cache. Each engine declares its
`mode`, `padded` or `packed` (DESIGN.md "Words"), so the scheduler serves it
the order its physics rewards. Engines never see rings, segments or the index.

`load_engine(name, settings)` imports an engine lazily by name, so the broker
imports no torch, vllm or tensorrt_llm unless a consumer uses them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ...errors import BrokerError

OK = "ok"
TOO_LONG = "too_long"
INVALID = "invalid"
ENGINE_ERROR = "engine_error"
STATUSES = (OK, TOO_LONG, INVALID, ENGINE_ERROR)

# name -> (module, class, the extra that installs its packages)
ENGINES = {"sim": ("shmbroker.gpu.engines.sim", "Sim", None)}


@dataclass
class EngineBatch:
    item_ids: np.ndarray  # uint64, one per item
    tokens: list  # one uint32 array per item
    max_new_tokens: np.ndarray  # int64, one per item
    prefix_tokens: int = 0  # tokens every item of the batch shares at its start

    def __len__(self) -> int:
        return len(self.tokens)


@dataclass
class ItemResult:
    item_id: int
    status: str
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    error: str | None = None

    def __post_init__(self):
        assert self.status in STATUSES, self.status


@dataclass
class EngineOutcome:
    results: list  # [ItemResult], in the batch's order
    hit_blocks: int = 0  # what the engine knows of its prefix cache for this batch
    queried_blocks: int = 0
    engine_seconds: float = 0.0  # the engine's own (or modeled) time for the batch


class Engine(Protocol):
    mode: str

    def run(self, batch: EngineBatch) -> EngineOutcome: ...

    def close(self) -> None: ...


class EngineUnavailable(BrokerError):
    """The engine's packages are not installed (the message names the extra to install)."""


def load_engine(name: str, settings, **options) -> Engine:
    """An engine instance by name (settings: its engine_settings; options: broker-wide ones such as
    block_tokens); imported only now."""
    try:
        module, cls, extra = ENGINES[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r}; known: {', '.join(sorted(ENGINES))}") from None
    try:
        impl = getattr(importlib.import_module(module), cls)
    except ImportError as exc:
        hint = f": pip install 'shmbroker[{extra}]'" if extra else ""
        raise EngineUnavailable(f"engine {name!r} needs packages that are not installed ({exc}){hint}") from exc
    return impl(settings, **options)
