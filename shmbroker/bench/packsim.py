"""Virtual-time simulation of consumers fed by the packer or by a plain FIFO queue.

`simulate` drains a workload's items through `feeder` into one simulated
engine per consumer and returns the accounting (DESIGN.md "Words"). Offline:
every item is in the backlog at time 0. Streaming: items arrive at their
(scaled) arrival times; a consumer that finds nothing waits for the next
arrival. Virtual time: a consumer's clock advances by its engine's modeled
seconds per batch; the consumer with the earliest clock decides next.
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..gpu.engines.sim import SimCost, SimEngine
from ..pack.contract import Batch, Contract, Shape
from ..pack.guard import Guard
from ..pack.packer import ConsumerSpec, Packer


@dataclass(frozen=True)
class SimConsumer:
    name: str
    contract: Contract
    cache_tokens: int


@dataclass
class Tally:
    batches: int = 0
    items: int = 0
    input_tokens: int = 0
    computed_tokens: int = 0
    padded_tokens: int = 0
    rect_tokens: int = 0
    hit_blocks: int = 0
    queried_blocks: int = 0
    batch_tokens_max_sum: int = 0
    seconds: float = 0.0
    switches: int = 0
    families: set = field(default_factory=set)
    last_family: int | None = None
    failed_too_long: int = 0

    def add(self, cost, family: int, max_batch_tokens: int) -> None:
        self.batches += 1
        self.items += cost.items
        self.input_tokens += cost.input_tokens
        self.computed_tokens += cost.computed_tokens
        self.padded_tokens += cost.padded_tokens
        self.rect_tokens += cost.rect_tokens
        self.hit_blocks += cost.hit_blocks
        self.queried_blocks += cost.queried_blocks
        self.batch_tokens_max_sum += max_batch_tokens
        self.seconds += cost.seconds
        if self.last_family is not None and family != self.last_family:
            self.switches += 1
        self.last_family = family
        self.families.add(family)

    def figures(self) -> dict:
        excess = self.switches - max(0, len(self.families) - 1)
        return {
            "batches": self.batches, "items": self.items, "input_tokens": self.input_tokens,
            "computed_tokens": self.computed_tokens,
            "padding_waste": round(self.padded_tokens / self.rect_tokens, 6) if self.rect_tokens else 0.0,
            "batch_fill": round(self.input_tokens / self.batch_tokens_max_sum, 4) if self.batches else 0.0,
            "cache_hit_rate": round(self.hit_blocks / self.queried_blocks, 4) if self.queried_blocks else 0.0,
            "shape_switches": self.switches, "families_served": len(self.families),
            "excess_shape_switches": excess, "modeled_seconds": round(self.seconds, 3),
            "failed_too_long": self.failed_too_long,
        }


def merge(tallies: list[Tally]) -> dict:
    """The consumers' figures together (counts summed, ratios of the sums)."""
    total = Tally()
    for t in tallies:
        for f in dataclasses.fields(Tally):
            if f.type in ("int", "float"):
                setattr(total, f.name, getattr(total, f.name) + getattr(t, f.name))
    out = total.figures()
    out["excess_shape_switches"] = sum(t.figures()["excess_shape_switches"] for t in tallies)
    out["families_served"] = sum(len(t.families) for t in tallies)
    return out


class PackerFeeder:
    """Feeds consumers from shmbroker's packer."""

    name = "shmbroker"

    def __init__(self, consumers, mode, shapes, wl, *, max_wait_seconds=None, capacity=None, tolerance=1 / 16):
        specs = [ConsumerSpec(c.name, c.contract, mode) for c in consumers]
        cap = capacity or len(shapes)
        # sized as a scheduler would size it for this backlog: items, twice the distinct families
        families = max(16, 2 * int(np.unique(shapes.families).size))
        self.packer = Packer(specs, capacity=cap, families=families, max_wait_seconds=max_wait_seconds,
                             tolerance=tolerance)
        self.shapes = shapes
        self.wl = wl
        self.args = (consumers, mode, shapes, wl)
        self.kwargs = {"max_wait_seconds": max_wait_seconds, "capacity": capacity, "tolerance": tolerance}
        self.events: list[tuple] = []  # ("add", row, arrival) and ("decide", consumer, now), in call order

    def add(self, row: int, arrival: float) -> None:
        s = self.shapes
        self.events.append(("add", row, arrival))
        self.packer.add(row, arrival, int(s.lengths[row]), int(self.wl.max_new_tokens[row]), int(s.models[row]),
                        int(s.families[row]), s.blocks(row))

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
        from ..pack.select import oldest

        policy = self.packer.policies[c]
        if self.packer.max_wait_seconds is None:
            return False
        return oldest(self.packer.index.S, policy.cls_order, now - self.packer.max_wait_seconds) != -1

    @property
    def guard_refusals(self) -> int:
        return sum(g.num_refusals for g in self.packer.guards)


class FifoFeeder:
    """A plain queue: each consumer takes the next items (in arrival order) that fit it."""

    name = "fifo"

    def __init__(self, consumers, mode, shapes, wl, *, tolerance=1 / 16, **_):
        self.consumers = consumers
        self.shapes = shapes
        self.wl = wl
        self.limits = sorted({c.contract.max_input_len for c in consumers})
        self.queues = [deque() for _ in self.limits]
        self.failed: list[int] = []
        self.guard = Guard(tolerance if mode == "padded" else None)

    def add(self, row: int, arrival: float) -> None:
        n = int(self.shapes.lengths[row])
        for k, limit in enumerate(self.limits):
            if n <= limit:
                self.queues[k].append(row)
                return
        self.failed.append(row)

    def next_batch(self, c: int, now: float) -> Batch | None:
        k = self.consumers[c].contract
        rows: list[int] = []
        longest = 0
        queues = [q for limit, q in zip(self.limits, self.queues) if limit <= k.max_input_len]
        failed = [(r, "too_long") for r in self.failed]
        self.failed.clear()
        while len(rows) < k.max_batch_size:
            heads = [q for q in queues if q]
            if not heads:
                break
            q = min(heads, key=lambda q: q[0])  # rows are in arrival order
            n = int(self.shapes.lengths[q[0]])
            if (len(rows) + 1) * max(longest, n) > k.max_batch_tokens:
                break
            rows.append(q.popleft())
            longest = max(longest, n)
        if not rows and not failed:
            return None
        rows_a = np.array(rows, np.int64)
        lengths = self.shapes.lengths[rows_a] if rows else np.zeros(0, np.int64)
        fam = int(self.shapes.families[rows[0]]) if rows else 0
        shape = Shape(k.model, fam, int(lengths.min()) if rows else 0, int(lengths.max()) if rows else 0)
        if rows:
            self.guard.check(self.shapes.families[rows_a], self.shapes.models[rows_a], lengths,
                             Shape(k.model, fam, 1, k.max_input_len), k)
        return Batch.of(c, shape, rows_a.astype(np.uint64), lengths, self.wl.max_new_tokens[rows_a],
                        failed=failed)

    def overdue(self, c: int, now: float) -> bool:
        return False

    @property
    def guard_refusals(self) -> int:
        return self.guard.num_refusals


def simulate(feeder, consumers, mode, shapes, wl, *, arrivals=None, cost: SimCost | None = None) -> dict:
    """Drain every item; arrivals=None is offline (all at 0)."""
    cost = cost or SimCost()
    count = len(shapes)
    engines = [SimEngine(mode, cache_tokens=c.cache_tokens, block_tokens=shapes.block_tokens, cost=cost)
               for c in consumers]
    tallies = [Tally() for _ in consumers]
    clocks = [0.0] * len(consumers)
    order = np.arange(count) if arrivals is None else np.argsort(arrivals, kind="stable")
    times = np.zeros(count) if arrivals is None else np.asarray(arrivals, np.float64)
    nxt = 0
    done = 0
    waits_max = 0.0
    idle_overdue = 0
    finished = [False] * len(consumers)
    while done < count:
        c = min((i for i in range(len(consumers)) if not finished[i]), key=lambda i: clocks[i], default=None)
        if c is None:
            raise RuntimeError(f"{count - done} items left that no consumer takes")
        now = clocks[c]
        while nxt < count and times[order[nxt]] <= now:
            feeder.add(int(order[nxt]), float(times[order[nxt]]))
            nxt += 1
        batch = feeder.next_batch(c, now)
        if batch is None or (len(batch) == 0 and not batch.failed):
            if feeder.overdue(c, now):
                idle_overdue += 1
            if nxt < count:
                clocks[c] = max(now, float(times[order[nxt]]))
            else:
                finished[c] = True
            continue
        tallies[c].failed_too_long += len(batch.failed)
        done += len(batch.failed)
        if len(batch):
            rows = batch.keys.astype(np.int64)
            cost_ = engines[c].run(shapes, rows, batch.max_new_tokens)
            tallies[c].add(cost_, batch.shape.family, consumers[c].contract.max_batch_tokens)
            waits_max = max(waits_max, float(now - times[rows].min()))
            clocks[c] = now + cost_.seconds
            done += len(batch)
    figures = merge(tallies)
    figures["makespan_seconds"] = round(max(clocks), 3)
    figures["guard_refusals"] = feeder.guard_refusals
    figures["max_wait_seconds"] = round(waits_max, 3)
    figures["idle_with_overdue"] = idle_overdue
    figures["consumers"] = {c.name: t.figures() for c, t in zip(consumers, tallies)}
    return figures
