"""The feeders `packsim.simulate` drains a workload through: how its consumers are fed.

Feeders: `PackerFeeder` (shmbroker: "window" for packed engines, "batch" for
padded ones), `FifoFeeder` (arrival-order batches, "batch"), and
`EngineAloneFeeder`, what a user without the broker runs: packed, every item
in arrival order through one shared queue to whichever consumer's engine has
room ("window", one item at a time), each engine batching continuously with
its own prefix cache; padded, a rectangle engine has no continuous batching,
so it is what a user would write around `generate`: arrival-order batches of
up to max_batch_size items fitting max_batch_tokens (count x longest), the
FIFO batches without the broker's guard.

A feeder has `feeding` ("window" or "batch"), `add(row, arrival)`, `next_batch(consumer, now)`,
`overdue(consumer, now)` and `guard_refusals`.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..pack.contract import DEFAULT_STEP_TOKENS, Batch, Mode, Shape
from ..pack.guard import Guard
from ..pack.packer import ConsumerSpec, Packer
from ..pack.policy import DEFAULT_PADDING_TOLERANCE


class PackerFeeder:
    """Feeds consumers from shmbroker's packer."""

    name = "shmbroker"

    def __init__(self, consumers, mode: Mode, shapes, wl, *, max_wait_seconds=None, capacity=None, tolerance=DEFAULT_PADDING_TOLERANCE,
                 step_tokens=DEFAULT_STEP_TOKENS):
        specs = [ConsumerSpec(c.name, c.contract, mode) for c in consumers]
        cap = capacity or len(shapes)
        # sized as a scheduler would size it for this backlog: items, twice the distinct families
        families = max(16, 2 * int(np.unique(shapes.families).size))
        self.packer = Packer(specs, capacity=cap, families=families, max_wait_seconds=max_wait_seconds,
                             tolerance=tolerance, step_tokens=step_tokens)
        self.shapes = shapes
        self.wl = wl
        self.feeding = "window" if mode == Mode.PACKED else "batch"
        self.args = (consumers, mode, shapes, wl)
        self.kwargs = {"max_wait_seconds": max_wait_seconds, "capacity": capacity, "tolerance": tolerance,
                       "step_tokens": step_tokens}
        self.events: list[tuple] = []  # ("add", row, arrival) and ("decide", consumer, now), in call order

    def add(self, row: int, arrival: float) -> None:
        s = self.shapes
        self.events.append(("add", row, arrival))
        self.packer.add(row, arrival, int(s.lengths[row]), int(self.wl.max_new_tokens[row]), int(s.models[row]),
                        int(s.families[row]), s.blocks(row), int(s.bases[row]))

    def next_batch(self, c: int, now: float) -> Batch | None:
        self.events.append(("decide", c, now))
        return self.packer.next_batch(c, now)

    def decision_timings(self, min_samples: int = 0) -> tuple[list[int], list[int]]:
        """Replay this run's calls on fresh packers; (ns of each decision, items it returned).

        In the broker the scheduler is its own process; replaying without the simulated engines'
        work in between measures the packer, not the simulation (same calls, same batches)."""
        out: list[int] = []
        sizes: list[int] = []
        while True:
            fresh = PackerFeeder(*self.args, **self.kwargs)
            packer = fresh.packer
            clock = time.perf_counter_ns
            for kind, a, b in self.events:
                if kind == "add":
                    fresh.add(a, b)
                else:
                    t0 = clock()
                    batch = packer.next_batch(a, b)
                    out.append(clock() - t0)
                    sizes.append(len(batch) + len(batch.failed) if batch is not None else 0)
            if len(out) >= min_samples:
                return out, sizes

    def overdue(self, c: int, now: float) -> bool:
        from ..pack.ages import oldest_entry

        policy = self.packer.policies[c]
        if self.packer.max_wait_seconds is None:
            return False
        return oldest_entry(self.packer.index.arrays, policy.cls_order, now - self.packer.max_wait_seconds) != -1

    @property
    def guard_refusals(self) -> int:
        return sum(g.num_refusals for g in self.packer.guards)


class FifoFeeder:
    """A plain queue: each consumer takes the next items (in arrival order) that fit it.

    A batch holds up to max_batch_size items (`group` fewer); for a padded engine also
    count x longest <= max_batch_tokens (a packed engine's contract is an admission limit)."""

    name = "fifo"
    feeding = "batch"

    def __init__(self, consumers, mode: Mode, shapes, wl, *, tolerance=DEFAULT_PADDING_TOLERANCE, group: int | None = None,
                 guarded: bool = True, **_):
        self.consumers = consumers
        self.shapes = shapes
        self.wl = wl
        self.rectangle = mode == Mode.PADDED
        self.group_max = group
        self.limits = sorted({c.contract.max_input_len for c in consumers})
        self.queues = [deque() for _ in self.limits]
        self.failed: list[int] = []
        self.guard = Guard(tolerance if self.rectangle else None) if guarded else None

    def add(self, row: int, arrival: float) -> None:
        n = int(self.shapes.lengths[row])
        for k, limit in enumerate(self.limits):
            if n <= limit:
                self.queues[k].append(row)
                return
        self.failed.append(row)

    def next_batch(self, c: int, now: float) -> Batch | None:
        k = self.consumers[c].contract
        count = min(k.max_batch_size, self.group_max or k.max_batch_size)
        rows: list[int] = []
        longest = 0
        queues = [q for limit, q in zip(self.limits, self.queues) if limit <= k.max_input_len]
        failed = [(r, "too_long") for r in self.failed]
        self.failed.clear()
        while len(rows) < count:
            heads = [q for q in queues if q]
            if not heads:
                break
            q = min(heads, key=lambda q: q[0])  # rows are in arrival order
            n = int(self.shapes.lengths[q[0]])
            if self.rectangle and (len(rows) + 1) * max(longest, n) > k.max_batch_tokens:
                break
            rows.append(q.popleft())
            longest = max(longest, n)
        if not rows and not failed:
            return None
        rows_a = np.array(rows, np.int64)
        lengths = self.shapes.lengths[rows_a] if rows else np.zeros(0, np.int64)
        fam = int(self.shapes.families[rows[0]]) if rows else 0
        shape = Shape(k.model, fam, int(lengths.min()) if rows else 0, int(lengths.max()) if rows else 0)
        if rows and self.guard is not None:
            self.guard.check(self.shapes.families[rows_a], self.shapes.models[rows_a], lengths,
                             Shape(k.model, fam, 1, k.max_input_len), k)
        return Batch.of(c, shape, rows_a.astype(np.uint64), lengths, self.wl.max_new_tokens[rows_a],
                        failed=failed)

    def overdue(self, c: int, now: float) -> bool:
        return False

    @property
    def guard_refusals(self) -> int:
        return self.guard.num_refusals if self.guard is not None else 0


class EngineAloneFeeder(FifoFeeder):
    """No broker: packed, one shared arrival-order queue from which whichever engine has room takes
    the next item; padded, arrival-order rectangle batches (the module docstring)."""

    name = "engine_alone"

    def __init__(self, consumers, mode: Mode, shapes, wl, **kw):
        packed = mode == Mode.PACKED
        super().__init__(consumers, mode, shapes, wl, group=1 if packed else None, guarded=False)
        self.feeding = "window" if packed else "batch"
