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
ENGINES = {
    "sim": ("shmbroker.gpu.engines.sim", "Sim", None),
    "hf": ("shmbroker.gpu.engines.hf", "HF", "hf"),
    "vllm": ("shmbroker.gpu.engines.vllm", "VLLM", "vllm"),
    "trtllm": ("shmbroker.gpu.engines.trtllm", "TRTLLM", "trtllm"),
    "openai": ("shmbroker.gpu.engines.openai", "OpenAICompatible", "openai"),
}


class EngineBatch:
    """item_ids (uint64), tokens (a sequence of uint32 arrays, one per item, zero-copy views where
    the caller can; read lazily), max_new_tokens (int64); `prefix_tokens`, the tokens every item
    shares at its start, is computed on first use (an engine that ignores it reads no tokens)."""

    __slots__ = ("item_ids", "tokens", "max_new_tokens", "_prefix")

    def __init__(self, item_ids, tokens, max_new_tokens, prefix_tokens: int | None = None):
        self.item_ids = item_ids
        self.tokens = tokens
        self.max_new_tokens = max_new_tokens
        self._prefix = prefix_tokens

    @property
    def prefix_tokens(self) -> int:
        if self._prefix is None:
            self._prefix = common_prefix(self.tokens)
        return self._prefix

    def __len__(self) -> int:
        return len(self.item_ids)


def common_prefix(tokens) -> int:
    """Tokens every array shares at its start."""
    if not len(tokens):
        return 0
    n = min(t.size for t in tokens)
    first = tokens[0][:n]
    for t in tokens[1:]:
        diff = np.flatnonzero(t[:n] != first)
        if diff.size:
            n = int(diff[0])
            first = first[:n]
    return n


@dataclass
class ItemResult:
    item_id: int
    status: str
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    error: str | None = None

    def __post_init__(self):
        assert self.status in STATUSES, self.status


STATUS_CODES = {OK: 0, TOO_LONG: 1, INVALID: 2, ENGINE_ERROR: 3}  # = ring.items.STATUS_CODES
STATUS_OF = {code: name for name, code in STATUS_CODES.items()}


@dataclass
class BatchResults:
    """One result per item, in columns: what a GPU process writes (no Python object per item)."""

    item_ids: np.ndarray  # uint64
    status: np.ndarray  # uint32 codes (STATUS_CODES)
    flat: np.ndarray  # uint32 generated tokens of every item, concatenated
    offsets: np.ndarray  # int64, n + 1: item i's tokens are flat[offsets[i]:offsets[i+1]]
    errors: dict = field(default_factory=dict)  # row -> error text

    def __len__(self) -> int:
        return int(self.item_ids.size)

    @classmethod
    def of(cls, results: list) -> BatchResults:
        n = len(results)
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum([r.tokens.size for r in results], out=offsets[1:])
        flat = np.concatenate([r.tokens for r in results]).astype(np.uint32) if n else np.zeros(0, np.uint32)
        return cls(np.array([r.item_id for r in results], np.uint64),
                   np.array([STATUS_CODES[r.status] for r in results], np.uint32), flat, offsets,
                   {i: r.error for i, r in enumerate(results) if r.error is not None})

    def items(self) -> list[ItemResult]:
        return [ItemResult(int(self.item_ids[i]), STATUS_OF[int(self.status[i])],
                           self.flat[self.offsets[i] : self.offsets[i + 1]], self.errors.get(i))
                for i in range(len(self))]


@dataclass
class EngineOutcome:
    results: list  # [ItemResult], in the batch's order, or one BatchResults
    hit_blocks: int = 0  # what the engine knows of its prefix cache for this batch
    queried_blocks: int = 0
    engine_seconds: float = 0.0  # the engine's own (or modeled) time for the batch
    padded_tokens: int = 0  # a padded engine's rectangle cells that computed nothing
    rect_tokens: int = 0  # a padded engine's rectangle (count x longest suffix)
    reused_tokens: int = 0  # prefix tokens served from a cache instead of computed (hf: the shared prefix)


class Engine(Protocol):
    mode: str

    def run(self, batch: EngineBatch) -> EngineOutcome: ...

    def close(self) -> None: ...


class EngineUnavailable(BrokerError):
    """The engine's packages are not installed (the message names the extra to install)."""


def load_engine(name: str, settings, **options) -> Engine:
    """An engine instance by name (settings: its engine_settings; options: broker-wide ones such as
    block_tokens, and the consumer's contract); imported only now."""
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
