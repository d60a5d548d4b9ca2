"""The scheduler's statistics words (`stats.SCHED`) and its gauges: the items and tokens pending,
in all and per model, counted in (+1) as items arrive and out (-1) as they are dispatched, failed
back or found done while they waited (`Pending.count`; items of a model no consumer serves never
count: the scheduler fails them back at once), and when each indexed item arrived, for the age of
the oldest (`Arrivals`).
"""

from __future__ import annotations

from collections import deque

import numpy as np

from ..control.stats import MAX_MODELS, slot_of

NO_ITEM_NS = np.iinfo(np.int64).max
ARRIVAL_PIECE = 4096  # items per piece of the arrival-order list the oldest-item age is read from

(S_INDEXED_ITEMS, S_INDEXED_TOKENS, S_BATCHES, S_ITEMS, S_EMPTY, S_NO_CONSUMER, S_TOO_LONG, S_PENDING_ITEMS,
 S_PENDING_TOKENS, S_OVERFLOW, S_FAMILIES, S_OLDEST, S_NUM_MODELS, S_RECOVERED_CORRUPT, S_RECOVERED_UNNAMED,
 S_HELD_BACK, S_WAITING) = (
    slot_of("sched", k) for k in ("indexed_items", "indexed_tokens", "batches", "items", "rejected_empty",
                                  "rejected_no_consumer", "rejected_too_long", "pending_items", "pending_tokens",
                                  "overflow_items", "families", "oldest_ns", "num_models", "recovered_corrupt",
                                  "recovered_unnamed_corrupt", "held_back", "waiting_items"))
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


class Arrivals:
    """When each index slot's item came in, and the oldest of them."""

    def __init__(self, capacity: int):
        self.arrival_ns = np.full(capacity, NO_ITEM_NS, np.int64)
        # (arrival_ns, slots) in arrival order, pieces of at most ARRIVAL_PIECE: the oldest waiting
        # item is the first piece with a slot still holding its arrival (dead pieces are dropped)
        self.pieces: deque = deque()

    def add(self, slots: np.ndarray, arrival_ns: int) -> None:
        self.arrival_ns[slots] = arrival_ns
        for at in range(0, slots.size, ARRIVAL_PIECE):
            self.pieces.append((arrival_ns, slots[at : at + ARRIVAL_PIECE]))

    def drop(self, slots: np.ndarray) -> None:
        """The items of `slots` left the index."""
        self.arrival_ns[slots] = NO_ITEM_NS

    def oldest_ns(self) -> int:
        """The oldest indexed item's arrival; NO_ITEM_NS when none is indexed."""
        pieces = self.pieces
        while pieces and not (self.arrival_ns[pieces[0][1]] == pieces[0][0]).any():
            pieces.popleft()
        return int(pieces[0][0]) if pieces else NO_ITEM_NS
