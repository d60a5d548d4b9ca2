"""The scheduler's statistics words (`stats.SCHED`, named here once) and its pending gauges: the
items and tokens pending, in all and per model, counted in (+1) as items arrive and out (-1) as they
are dispatched, failed back or found done while they waited (`Pending.count`; items of a model no
consumer serves never count: the scheduler fails them back at once).
"""

from __future__ import annotations

import numpy as np

from ..control.stats import MAX_MODELS, slot_of

(S_INDEXED_ITEMS, S_INDEXED_TOKENS, S_BATCHES, S_ITEMS, S_EMPTY, S_NO_CONSUMER, S_TOO_LONG, S_PENDING_ITEMS,
 S_PENDING_TOKENS, S_OVERFLOW, S_FAMILIES, S_OLDEST, S_NUM_MODELS, S_RECOVERED_CORRUPT, S_RECOVERED_UNNAMED,
 S_HELD_BACK, S_WAITING) = (
    slot_of("sched", k) for k in ("indexed_items", "indexed_tokens", "batches", "items", "rejected_empty",
                                  "rejected_no_consumer", "rejected_too_long", "pending_items", "pending_tokens",
                                  "overflow_items", "families", "oldest_ns", "num_models", "recovered_corrupt",
                                  "recovered_unnamed_corrupt", "held_back", "waiting_items"))
S_CANCELLED = slot_of("sched", "cancelled")
S_MODEL_ITEMS = slot_of("sched", "model0_items")
S_MODEL_TOKENS = slot_of("sched", "model0_tokens")
# the words a new scheduler incarnation starts from 0: it rebuilds the index from disk
GAUGES = ((S_PENDING_ITEMS, S_PENDING_TOKENS, S_OVERFLOW, S_WAITING, S_FAMILIES, S_OLDEST)
          + tuple(range(S_MODEL_ITEMS, S_MODEL_ITEMS + MAX_MODELS))
          + tuple(range(S_MODEL_TOKENS, S_MODEL_TOKENS + MAX_MODELS)))


def models_of(cfg) -> dict[int, int]:
    """Model id -> index of its per-model statistics, in the order consumers name them (at most MAX_MODELS)."""
    out: dict[int, int] = {}
    for c in cfg.consumers:
        out.setdefault(c.contract.model, len(out))
    assert len(out) <= MAX_MODELS, "settings.load refuses more models"
    return out


class Pending:
    """The pending gauges in the scheduler's statistics words `values`."""

    def __init__(self, cfg, values: np.ndarray):
        self.values = values
        self.models = models_of(cfg)  # model id -> its per-model pending counters' index
        values[S_NUM_MODELS] = len(self.models)

    def count_locs(self, locs, sign: int) -> None:
        """Count LOC rows in (+1) or out (-1)."""
        self.count(locs["model"], locs["num_tokens"], sign)

    def count(self, models: np.ndarray, lengths: np.ndarray, sign: int) -> None:
        v = self.values
        if models.size == 0:
            return
        first = int(models[0])
        if (models == first).all():  # one model (the usual case): no per-item work
            m = self.models.get(first)
            if m is None:
                return
            n, tokens = models.size, int(lengths.sum())
            v[S_MODEL_ITEMS + m] += sign * n
            v[S_MODEL_TOKENS + m] += sign * tokens
            v[S_PENDING_ITEMS] += sign * n
            v[S_PENDING_TOKENS] += sign * tokens
            return
        for model, m in self.models.items():
            mine = models == model
            n, tokens = int(mine.sum()), int(lengths[mine].sum())
            v[S_MODEL_ITEMS + m] += sign * n
            v[S_MODEL_TOKENS + m] += sign * tokens
            v[S_PENDING_ITEMS] += sign * n
            v[S_PENDING_TOKENS] += sign * tokens
