"""The engine interface: a stream of items in, each item's result out when it finishes.

A GPU process keeps an in-flight window in its engine (docs/design.md "Feeding an engine"):

    engine.add(batch)              # non-blocking: these items start now, or queue inside the engine
    outcome = engine.poll(0.05)    # results of items finished since the last poll, in any order

`add` takes an `EngineBatch` (item ids, token ids as zero-copy views where the caller can,
max_new_tokens; the items of one add are one shape-pure group, in the scheduler's order) and
returns at once; an item the engine refuses at admission may raise (the caller then adds the
group's items one by one, so only that item fails). `poll(timeout_seconds)` waits at most that
long for at least one item to finish and returns an `EngineOutcome`: one `ItemResult` per
finished item (token ids, a status, error text) plus what the engine knows of its cache and its
own busy seconds since the last poll. An item is in flight from its `add` until a poll returns
its result; `pending()` is how many are.

Two kinds of engine sit behind it:
- streaming engines (`packed` ones: vLLM, TensorRT-LLM, an OpenAI-compatible server, the
  simulated engine) batch continuously: they keep up to `max_batch_size` sequences running and
  admit the next the moment one finishes. `StreamingRun` gives them `run(batch)` (add, then
  poll until every item is back) for callers that want one batch at a time;
- batch engines (`padded` ones: transformers) compute a whole rectangle per call: they define
  `run(batch)`, and `BatchStream` (`batch_stream.py`) runs those calls on a worker thread in order, so the GPU
  process takes and prepares its next batch while one runs (and a batch that raises is run
  item by item, judged by `engines/deaths.py`: a bad item fails alone, a dead engine fails none).

Engines never see rings, segments or the index. The catalogue (`catalogue.py`) declares each
engine once: name, module, class, extra, settings class and mode.

Failures. An item the engine refuses (its add raises, or its result says engine_error) fails
alone. The engine being down is not the items' fault, and nothing is failed for it:
- an engine that cannot run what it holds now (its server unreachable, overloaded, timing out)
  hands those items back: `EngineOutcome.down`, an `EngineDown` naming them (or `add` raising
  `EngineDown`: the group is not taken). The GPU process adds them again after a back-off
  (`engine_retry_min_seconds`, doubling to `engine_retry_max_seconds` while it stays down;
  `gpu/window.py`), counted (`engine_retries`, the `engine_down` gauge);
- a poll that raises anything else means the engine broke while running what it held: the items
  are handed back as above; after ENGINE_FAILURES_MAX such polls in a row, with no result between,
  the engine is dead;
- an engine is dead (`EngineDead`) when an adapter says so: its library's death error, an error
  every later call repeats, a streak of failures (`deaths.py`, which also decides when a lone item's
  failure is the item's). The GPU process then exits with its window handed back unfailed and a
  fresh one with a fresh engine takes the batches again (`gpu/engine_watch.py`; whether that counts
  as a delivery for the poison rule: `gpu/deliveries.py`).
`call_seconds_max` (optional): how long the engine itself may take to answer or give up on an
item (the `openai` engine's timeouts and retries); a batch's deadline is never shorter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..errors import BrokerError
from ..pack.contract import Mode
from ..request.extras import vector_extras, vector_words
from ..ring.items import STATUS_CODES, STATUS_NAMES, Status

# an engine reports each item's status by its label (ItemResult.status; ring.items.Status is the table)
OK = Status.OK.label
TOO_LONG = Status.TOO_LONG.label
INVALID = Status.INVALID.label
ENGINE_ERROR = Status.ENGINE_ERROR.label
CORRUPT = Status.CORRUPT.label
STATUSES = tuple(STATUS_CODES)



class EngineBatch:
    """item_ids (uint64), tokens (a sequence of uint32 arrays, one per item, zero-copy views where
    the caller can; read lazily), max_new_tokens (int64); `options`: None when no item has request
    options, else one `RequestOptions` or None per item (only options the engine honours reach it:
    its registry entry's `honours`); `prefix_tokens`, the tokens every item shares at its start, is
    computed on first use (an engine that ignores it reads no tokens)."""

    __slots__ = ("item_ids", "tokens", "max_new_tokens", "options", "_prefix")

    def __init__(self, item_ids, tokens, max_new_tokens, prefix_tokens: int | None = None, options=None):
        self.item_ids = item_ids
        self.tokens = tokens
        self.max_new_tokens = max_new_tokens
        self.options = options
        self._prefix = prefix_tokens

    def options_of(self, k: int):
        """Item k's RequestOptions, or None (no options: the engine's defaults)."""
        return None if self.options is None else self.options[k]

    def rows(self, rows) -> EngineBatch:
        """The items at positions `rows` (a list or array of ints), as a batch of their own."""
        rows = [int(k) for k in rows]
        return EngineBatch(np.asarray(self.item_ids)[rows], [self.tokens[k] for k in rows],
                           np.asarray(self.max_new_tokens)[rows],
                           options=None if self.options is None else [self.options[k] for k in rows])

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
    """One item's result. `tokens`: every sample's tokens, one after another; `extras`: the words
    that say how they split into samples, how each finished and how many prompt tokens the engine
    served from its cache (`request/extras.py` `encode_extras`), or None when the engine says none
    of it (one sample)."""

    item_id: int
    status: str
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint32))
    error: str | None = None
    extras: np.ndarray | None = None

    def __post_init__(self):
        assert self.status in STATUSES, self.status


@dataclass
class BatchResults:
    """One result per item, in columns: what a GPU process writes (no Python object per item)."""

    item_ids: np.ndarray  # uint64
    status: np.ndarray  # uint32 codes (STATUS_CODES)
    flat: np.ndarray  # uint32 generated tokens of every item, concatenated
    offsets: np.ndarray  # int64, n + 1: item i's tokens are flat[offsets[i]:offsets[i+1]]
    errors: dict = field(default_factory=dict)  # row -> error text
    extras: dict = field(default_factory=dict)  # row -> its extras words (request/extras.py)

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
                   {i: r.error for i, r in enumerate(results) if r.error is not None},
                   {i: r.extras for i, r in enumerate(results) if r.extras is not None})

    def items(self) -> list[ItemResult]:
        return [ItemResult(int(self.item_ids[i]), STATUS_NAMES[int(self.status[i])],
                           self.flat[self.offsets[i] : self.offsets[i + 1]], self.errors.get(i), self.extras.get(i))
                for i in range(len(self))]


class EngineDown(Exception):
    """The engine cannot run these items now (its server is unreachable, overloaded or timing out);
    they are not at fault: the consumer adds them again after a back-off. `item_ids`: the items
    handed back (an `add` that raises it hands back the whole group, whatever it names)."""

    def __init__(self, reason: str, item_ids=()):
        super().__init__(reason)
        self.item_ids = np.asarray(item_ids, np.uint64)


class EngineDead(Exception):
    """The engine in this process is broken for good: the GPU process exits and is started afresh
    (what it held is redelivered to its successor)."""


ENGINE_FAILURES_MAX = 3  # polls in a row that raise (no result between) before the engine is dead


@dataclass
class EngineOutcome:
    results: list  # [ItemResult], in the batch's order, or one BatchResults
    hit_blocks: int = 0  # what the engine knows of its prefix cache for this batch
    queried_blocks: int = 0
    engine_seconds: float = 0.0  # the engine's own (or modeled) time for the batch
    padded_tokens: int = 0  # a padded engine's rectangle cells that computed nothing
    rect_tokens: int = 0  # a padded engine's rectangle (count x longest suffix)
    reused_tokens: int = 0  # prefix tokens served from a cache instead of computed (hf: the shared prefix)
    down: EngineDown | None = None  # items handed back unrun: the engine is down (module docstring)


class Engine(Protocol):
    mode: Mode  # from the registry entry (catalogue.py)

    def add(self, batch: EngineBatch) -> None: ...

    def poll(self, timeout_seconds: float) -> EngineOutcome: ...

    def pending(self) -> int: ...

    def close(self) -> None: ...


def merge_outcomes(outcomes: list[EngineOutcome]) -> EngineOutcome:
    """Several outcomes as one: results concatenated, figures summed."""
    if len(outcomes) == 1:
        return outcomes[0]
    results: list = []
    for o in outcomes:
        results.extend(o.results.items() if isinstance(o.results, BatchResults) else o.results)
    downs = [o.down for o in outcomes if o.down is not None]
    down = None if not downs else downs[0] if len(downs) == 1 else EngineDown(
        str(downs[-1]), np.concatenate([d.item_ids for d in downs]))
    return EngineOutcome(results, sum(o.hit_blocks for o in outcomes), sum(o.queried_blocks for o in outcomes),
                         sum(o.engine_seconds for o in outcomes), sum(o.padded_tokens for o in outcomes),
                         sum(o.rect_tokens for o in outcomes), sum(o.reused_tokens for o in outcomes), down)


RUN_DEADLINE_SECONDS = 24 * 3600.0  # run(): the longest one batch may take before it is given up


class StreamingRun:
    """`run(batch)` for a streaming engine: add the batch, poll until every item has a result; the
    results in the batch's order (an item the engine never answered: engine_error). One call, no
    retry policy: an item the engine hands back as down comes back engine_error with the reason (the
    GPU process's window retries those instead, `gpu/window.py`)."""

    def _configure(self, name: str, settings, block_tokens: int, contract, needs: str | None) -> None:
        """The settings every streaming engine keeps, checked: `needs` says what the engine derives
        from the consumer's contract (None: it runs without one)."""
        if needs is not None and contract is None:
            raise ValueError(f"engine '{name}' needs the consumer's contract ({needs} is derived from it)")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.settings = settings
        self.contract = contract
        self.block_tokens = block_tokens

    def run(self, batch: EngineBatch) -> EngineOutcome:
        self.add(batch)
        want = {int(i) for i in batch.item_ids}
        got: dict[int, ItemResult] = {}
        parts: list[EngineOutcome] = []
        deadline = time.monotonic() + RUN_DEADLINE_SECONDS
        while len(got) < len(want) and time.monotonic() < deadline:
            out = self.poll(0.05)
            parts.append(out)
            rs = out.results.items() if isinstance(out.results, BatchResults) else out.results
            got.update((r.item_id, r) for r in rs if r.item_id in want)
            if out.down is not None:
                got.update((int(i), ItemResult(int(i), ENGINE_ERROR, error=str(out.down)))
                           for i in out.down.item_ids.tolist() if int(i) in want and int(i) not in got)
        total = merge_outcomes(parts) if parts else EngineOutcome([])
        total.results = [got.get(int(i)) or ItemResult(int(i), ENGINE_ERROR, error="the engine returned no result")
                         for i in batch.item_ids]
        total.down = None
        return total


def vector_result(item_id, vector, cached_tokens: int | None = None) -> ItemResult:
    """An embedding item's result: its vector's float32 values as the result's words (no copy of a
    contiguous float32 vector), marked as a vector by its extras (request/extras.py)."""
    return ItemResult(int(item_id), OK, vector_words(vector), extras=vector_extras(cached_tokens))


def truncated(vector: np.ndarray, dimensions: int | None) -> np.ndarray:
    """The first `dimensions` values renormalised (a Matryoshka model's cut, as sentence-transformers'
    `truncate_dim` and vLLM's `dimensions` make it); the vector itself when None."""
    if dimensions is None or dimensions >= vector.size:
        return vector
    head = vector[:dimensions].astype(np.float64)
    return (head / np.linalg.norm(head)).astype(np.float32)


def engine_error(item_id, exc: Exception) -> ItemResult:
    return ItemResult(int(item_id), ENGINE_ERROR, error=f"{type(exc).__name__}: {exc}")


class EngineUnavailable(BrokerError):
    """The engine's packages are not installed (the message names the extra to install)."""
