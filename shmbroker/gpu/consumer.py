"""The GPU process's core: one batch in, exactly one result per item out.

`ConsumerCore.process(batch, tokens)` is what a GPU process does with each
batch it takes from its batch ring (the process loop around it, reading the
tokens zero-copy from the backlog's segments and writing results, comes with
the supervisor):

1. the shape guard again: a batch that is not shape-pure or breaks the
   contract is counted (`guard_violations`) and still served, since its results
   are right either way;
2. items the contract cannot take are failed back here, never searched for by
   the scheduler: `too_long` (with the lengths in the error) and `invalid`
   (no tokens);
3. the engine runs the rest as one batch; if it raises, each item runs alone so
   that an engine error fails only the items that cause it (`engine_error` with
   the message), never the batch or the process; an engine that returns a
   result for the wrong item, or none, fails that item the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..pack.contract import Batch, Contract
from ..pack.guard import Guard
from .engines.base import ENGINE_ERROR, INVALID, OK, TOO_LONG, EngineBatch, EngineOutcome, ItemResult


@dataclass
class ConsumerStats:
    batches: int = 0
    items: int = 0
    ok: int = 0
    too_long: int = 0
    invalid: int = 0
    engine_errors: int = 0
    guard_violations: int = 0
    hit_blocks: int = 0
    queried_blocks: int = 0
    engine_seconds: float = 0.0


class ConsumerCore:
    def __init__(self, contract: Contract, engine, *, tolerance: float | None = None):
        self.contract = contract
        self.engine = engine
        self.guard = Guard(tolerance if engine.mode == "padded" else None)
        self.stats = ConsumerStats()

    def process(self, batch: Batch, tokens: list) -> list[ItemResult]:
        """Results in the batch's order, one per item. tokens[i] holds item i's token ids."""
        assert len(tokens) == len(batch), "one token array per item"
        stats = self.stats
        stats.batches += 1
        stats.items += len(batch)
        if len(batch) and self.guard.check_batch(batch, self.contract) is not None:
            stats.guard_violations += 1
        ids = [int(k) for k in batch.keys]
        results: list[ItemResult | None] = [None] * len(batch)
        runnable = []
        limit = self.contract.max_input_len
        for i, t in enumerate(tokens):
            if t.size == 0:
                results[i] = ItemResult(ids[i], INVALID, error="no tokens")
            elif t.size > limit:
                results[i] = ItemResult(ids[i], TOO_LONG, error=f"{t.size} tokens > max_input_len {limit}")
            else:
                runnable.append(i)
        if runnable:
            for i, result in zip(runnable, self._run(runnable, ids, tokens, batch.max_new_tokens)):
                results[i] = result
        for r in results:
            stats.ok += r.status == OK
            stats.too_long += r.status == TOO_LONG
            stats.invalid += r.status == INVALID
            stats.engine_errors += r.status == ENGINE_ERROR
        return results

    def _run(self, rows: list, ids: list, tokens: list, max_new) -> list[ItemResult]:
        sub = EngineBatch(np.array([ids[i] for i in rows], np.uint64), [tokens[i] for i in rows],
                          np.array([int(max_new[i]) for i in rows], np.int64), _common_prefix([tokens[i] for i in rows]))
        try:
            return self._checked(sub, self.engine.run(sub))
        except Exception as exc:  # noqa: BLE001 - isolate the item(s) that fail, below
            if len(rows) == 1:
                return [_engine_error(sub.item_ids[0], exc)]
        out = []
        for k in range(len(rows)):
            one = EngineBatch(sub.item_ids[k : k + 1], sub.tokens[k : k + 1], sub.max_new_tokens[k : k + 1],
                              int(sub.tokens[k].size))
            try:
                out.extend(self._checked(one, self.engine.run(one)))
            except Exception as exc:  # noqa: BLE001 - an engine error fails its item, not the process
                out.append(_engine_error(sub.item_ids[k], exc))
        return out

    def _checked(self, sub: EngineBatch, outcome: EngineOutcome) -> list[ItemResult]:
        self.stats.hit_blocks += outcome.hit_blocks
        self.stats.queried_blocks += outcome.queried_blocks
        self.stats.engine_seconds += outcome.engine_seconds
        by_id = {r.item_id: r for r in outcome.results}
        return [by_id.get(int(i)) or ItemResult(int(i), ENGINE_ERROR, error="the engine returned no result for it")
                for i in sub.item_ids]


def _engine_error(item_id, exc: Exception) -> ItemResult:
    return ItemResult(int(item_id), ENGINE_ERROR, error=f"{type(exc).__name__}: {exc}")


def _common_prefix(tokens: list) -> int:
    """Tokens every array shares at its start."""
    if not tokens:
        return 0
    n = min(t.size for t in tokens)
    first = tokens[0][:n]
    for t in tokens[1:]:
        diff = np.flatnonzero(t[:n] != first)
        if diff.size:
            n = int(diff[0])
            first = first[:n]
    return n
