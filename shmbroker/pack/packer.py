"""The packer: one shape-pure batch for one consumer, to its contract.

    packer = Packer([ConsumerSpec("big", Contract(256, 131072, 131072), Mode.PADDED), ...])
    packer.add(handle, arrival, length, max_new, model, family, hashes)   # O(item's blocks)
    batch = packer.next_batch(consumer, now)                           # O(batch + trie depth)

A decision: the consumer's policy picks a family (and band or branch) and
selects items without removing them; the guard checks the batch; only then
are the items removed from the index. Items no consumer of their model can
take come back in `batch.failed` with reason "too_long" (a batch may hold
only failures), when a walk meets them. Only this standalone use (tests,
`bench pack`, `workloads.packsim`) gives the packer such items: the scheduler
fails them at admission against `model_max` (`sched/admission.py`), so in
the broker `batch.failed` is always empty. Nothing here knows about rings,
disks or engines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .contract import BATCH_ROW, DEFAULT_STEP_TOKENS, Batch, Contract, Mode, Shape, as_mode
from .guard import Guard, Verdict
from .index import PackIndex
from .policy import DEFAULT_PADDING_TOLERANCE, POLICIES

FAILED_MAX = 64  # failures collected per decision


@dataclass(frozen=True)
class ConsumerSpec:
    name: str
    contract: Contract
    mode: Mode = Mode.PADDED

    def __post_init__(self):
        object.__setattr__(self, "mode", as_mode(self.mode, f"consumer {self.name!r}: mode"))


class Packer:
    def __init__(self, consumers: list[ConsumerSpec], *, capacity: int, nodes: int | None = None,
                 families: int | None = None, max_wait_seconds: float | None = None,
                 tolerance: float = DEFAULT_PADDING_TOLERANCE, step_tokens: float = DEFAULT_STEP_TOKENS):
        if not consumers:
            raise ValueError("a packer needs at least one consumer")
        names = [c.name for c in consumers]
        if len(set(names)) != len(names):
            raise ValueError(f"consumer names must be unique: {names}")
        if max_wait_seconds is not None and max_wait_seconds <= 0:
            raise ValueError(f"max_wait_seconds must be positive, got {max_wait_seconds}")
        self.consumers = list(consumers)
        self.index = PackIndex([(c.contract.model, c.contract.max_input_len) for c in consumers],
                               items=capacity, nodes=nodes, families=families, num_consumers=len(consumers))
        # per model: the longest item some consumer of it takes (longer ones are failed back)
        self.model_max: dict[int, int] = {}
        for c in consumers:
            m = c.contract.model
            self.model_max[m] = max(self.model_max.get(m, 0), c.contract.max_input_len)
        self.policies = []
        self.guards = []
        for i, c in enumerate(consumers):
            kw = {"tol": tolerance, "step_tokens": step_tokens} if c.mode == Mode.PADDED else {}
            policy = POLICIES[c.mode](self.index, i, c.contract, self.model_max[c.contract.model],
                                      max_wait_seconds, **kw)
            self.policies.append(policy)
            self.guards.append(Guard(policy.tol, c.mode))
        size = max(c.contract.max_batch_size for c in consumers)
        self._out = np.empty(size, np.int32)
        self._failed = np.empty(FAILED_MAX, np.int32)
        self._rows = np.zeros(size, BATCH_ROW)
        self._failed_ids = np.zeros(FAILED_MAX, np.uint64)
        self._models = [c.contract.model for c in consumers]
        self.max_wait_seconds = max_wait_seconds

    def add(self, handle: int, arrival: float, length: int, max_new: int, model: int, family: int,
            hashes: np.ndarray, base: int = 0) -> int:
        """Index one item; base: the tokens under its family key (`shapes.family_bases`), which a
        padded policy weighs against decode padding (0: not known)."""
        return self.index.insert(handle, arrival, length, max_new, model, family, hashes, base)

    def add_many(self, handles, arrivals, shapes, max_new) -> int:
        """Add every item of `shapes` (pack.shapes.ItemShapes) in one compiled call: item ids, arrivals and
        max_new_tokens one per item. The number added; fewer means the index is full (the rest, whole
        items, stay out). A scheduler rebuilding its index from a recovered backlog uses this."""
        n = len(shapes)
        return self.index.insert_many(handles, np.broadcast_to(np.asarray(arrivals, np.float64), (n,)), shapes.lengths,
                                      np.broadcast_to(np.asarray(max_new, np.int64), (n,)), shapes.models,
                                      shapes.families, shapes.hash_offsets, shapes.hashes, shapes.bases)

    def __len__(self) -> int:
        return len(self.index)

    def next_batch(self, c: int, now: float = 0.0) -> Batch | None:
        """The next batch for consumer c, or None when there is nothing it can take."""
        d = self.policies[c].decide(float(now), self._out, self._failed, self._rows, self._failed_ids)
        if d.family == -1:
            return None
        n = d.num_items
        if d.code != Verdict.OK:
            self.guards[c].count(d.code)
            n = 0
        failed = [(i, "too_long") for i in self._failed_ids[:d.num_failed].tolist()] if d.num_failed else []
        return Batch(c, Shape(self._models[c], int(d.family_key), int(d.length_min), int(d.length_max)),
                     self._rows[:n].copy(), failed)
