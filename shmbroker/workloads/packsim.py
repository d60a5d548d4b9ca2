"""Virtual-time simulation of consumers fed by the packer, a plain FIFO queue, or nothing but their engines.

`simulate` drains a workload's items through `feeder` into one simulated
engine per consumer and returns the accounting (docs/design.md "Words"). Offline:
every item is in the backlog at time 0. Streaming: items arrive at their
(scaled) arrival times; a consumer that finds nothing waits for the next
arrival. Virtual time: each consumer has a clock; the consumer with the
earliest clock acts next. A feeder says how its consumers are fed
(`feeding`):

- "batch": one batch at a time. A padded engine runs the batch's rectangle
  (`SimEngine.run`); a packed one is the continuous model
  (`engines/continuous.py`) given the batch and stepped until the batch's
  last item finishes, so the engine idles through every batch's tail. The
  clock advances by the batch's modeled seconds.
- "window": the GPU process keeps an in-flight window in a packed engine
  (`window_items`: max_batch_size sequences plus WINDOW_HEADROOM of them, so
  the engine never waits for its next item) and tops it up, before every
  engine step, from the feeder's batch records in their order. The clock
  advances by each step's modeled seconds.

Feeders (`PackerFeeder`, `FifoFeeder`, `EngineAloneFeeder`) are in `feeders.py`.

Figures per consumer and summed (`Tally.figures`). For a continuous engine
`batch_fill` is the token budget's fill, scheduled tokens (prefill chunks and
decodes) / (steps x max_batch_tokens); for a batch engine it stays input
tokens / the batches' max_batch_tokens. `slot_fill` is running sequences /
max_batch_size, over steps (continuous) or batches (padded).
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ..engines.continuous import ContinuousSim
from ..engines.cost import SimCost
from ..engines.sim import SimEngine
from ..pack.contract import Contract, Mode

WINDOW_HEADROOM = 1 / 8  # in-flight items past max_batch_size, as a share of it


def window_items(contract: Contract) -> int:
    """Items a GPU process keeps in a packed engine: max_batch_size and a little headroom."""
    return contract.max_batch_size + max(1, math.ceil(contract.max_batch_size * WINDOW_HEADROOM))


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
    fill_tokens: int = 0
    fill_capacity: int = 0
    slot_steps: int = 0
    slot_capacity: int = 0
    engine_steps: int = 0
    decode_tokens: int = 0
    seconds: float = 0.0
    switches: int = 0
    families: set = field(default_factory=set)
    last_family: int | None = None
    failed_too_long: int = 0

    def group(self, family: int, items: int, input_tokens: int) -> None:
        """A batch record received (its engine work is counted by `add` or `absorb`)."""
        self.batches += 1
        self.items += items
        self.input_tokens += input_tokens
        if self.last_family is not None and family != self.last_family:
            self.switches += 1
        self.last_family = family
        self.families.add(family)

    def add(self, cost, family: int, contract: Contract) -> None:
        """A batch run by a rectangle engine (a `BatchCost`)."""
        self.group(family, cost.items, cost.input_tokens)
        self.computed_tokens += cost.computed_tokens
        self.padded_tokens += cost.padded_tokens
        self.rect_tokens += cost.rect_tokens
        self.hit_blocks += cost.hit_blocks
        self.queried_blocks += cost.queried_blocks
        self.fill_tokens += cost.input_tokens
        self.fill_capacity += contract.max_batch_tokens
        self.slot_steps += cost.items
        self.slot_capacity += contract.max_batch_size
        self.seconds += cost.seconds

    def absorb(self, engine: ContinuousSim) -> None:
        """A continuous engine's counters, once it has run everything."""
        self.computed_tokens += engine.computed_tokens
        self.hit_blocks += engine.hit_blocks
        self.queried_blocks += engine.queried_blocks
        self.fill_tokens += engine.scheduled_tokens
        self.fill_capacity += engine.steps * engine.max_batch_tokens
        self.slot_steps += engine.running_steps
        self.slot_capacity += engine.steps * engine.max_batch_size
        self.engine_steps += engine.steps
        self.decode_tokens += engine.decode_tokens
        self.seconds += engine.seconds

    def figures(self) -> dict:
        excess = self.switches - max(0, len(self.families) - 1)
        return {
            "batches": self.batches, "items": self.items, "input_tokens": self.input_tokens,
            "computed_tokens": self.computed_tokens,
            "padding_waste": round(self.padded_tokens / self.rect_tokens, 6) if self.rect_tokens else 0.0,
            "batch_fill": round(self.fill_tokens / self.fill_capacity, 4) if self.fill_capacity else 0.0,
            "slot_fill": round(self.slot_steps / self.slot_capacity, 4) if self.slot_capacity else 0.0,
            "cache_hit_rate": round(self.hit_blocks / self.queried_blocks, 4) if self.queried_blocks else 0.0,
            "shape_switches": self.switches, "families_served": len(self.families),
            "excess_shape_switches": excess, "modeled_seconds": round(self.seconds, 3),
            "engine_steps": self.engine_steps, "decode_tokens": self.decode_tokens,
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


class _Runner:
    """One consumer's engine and the items it has received but not yet put into it."""

    def __init__(self, consumer: SimConsumer, mode: Mode, shapes, cost: SimCost):
        k = consumer.contract
        self.contract = k
        self.shapes = shapes
        if mode == Mode.PACKED:
            self.engine = ContinuousSim(k.max_batch_size, k.max_batch_tokens, consumer.cache_tokens, cost)
        else:
            self.engine = SimEngine(mode, cache_tokens=consumer.cache_tokens, block_tokens=shapes.block_tokens,
                                    cost=cost)
        self.window = window_items(k)
        self.pending: deque = deque()  # (row, max_new) received, not yet in the engine

    def put(self, row: int, max_new: int) -> None:
        self.engine.add(row, self.shapes.sized_blocks(row), int(self.shapes.lengths[row]), max_new)

    def run_batch(self, rows, max_new) -> float:
        """A packed engine given one batch and stepped until its last item finishes: its seconds."""
        for r, m in zip(rows.tolist(), max_new.tolist()):
            self.put(r, m)
        seconds = 0.0
        while not self.engine.idle:
            seconds += self.engine.step()[0]
        return seconds


def simulate(feeder, consumers, mode: Mode, shapes, wl, *, arrivals=None, cost: SimCost | None = None) -> dict:
    """Drain every item; arrivals=None is offline (all at 0)."""
    window = feeder.feeding == "window"
    if window and mode != Mode.PACKED:
        raise ValueError("only a packed engine is fed an in-flight window")
    sim = _Simulation(feeder, consumers, mode, shapes, arrivals, cost or SimCost(), wl.outputs)
    while sim.done < sim.count:
        c = sim.next_consumer()
        now = sim.clocks[c]
        sim.arrive(now)
        if not (sim.fill_window(c, now) if window else sim.run_batch(c, now)):
            sim.wait(c, now)
    return sim.figures()


class _Simulation:
    """One `simulate` run: each consumer's modeled clock, engine and tally, the items not yet done.
    The consumer whose clock is earliest acts next: it runs what the feeder gives it, or waits."""

    def __init__(self, feeder, consumers, mode: Mode, shapes, arrivals, cost: SimCost, real: np.ndarray):
        n = len(consumers)
        # each item's real output length (`Workload.outputs`: at most its max_new_tokens): the engine stops it there
        self.real = np.asarray(real, np.int64)
        self.feeder = feeder
        self.consumers = consumers
        self.mode = mode
        self.shapes = shapes
        self.count = len(shapes)
        self.runners = [_Runner(c, mode, shapes, cost) for c in consumers]
        self.tallies = [Tally() for _ in consumers]
        self.clocks = [0.0] * n
        self.order = np.arange(self.count) if arrivals is None else np.argsort(arrivals, kind="stable")
        self.times = np.zeros(self.count) if arrivals is None else np.asarray(arrivals, np.float64)
        self.nxt = 0  # the next arrival, in self.order
        self.done = 0
        self.waits_max = 0.0
        self.idle_overdue = 0
        self.finished = [False] * n
        self.retry = [False] * n  # found nothing while another consumer still works: ask again later

    def next_consumer(self) -> int:
        n = len(self.consumers)
        c = min((i for i in range(n) if not self.finished[i]), key=lambda i: (self.clocks[i], self.retry[i]),
                default=None)
        if c is None:
            raise RuntimeError(f"{self.count - self.done} items left that no consumer takes")
        return c

    def arrive(self, now: float) -> None:
        """Give the feeder every item that has arrived by `now`."""
        order, times = self.order, self.times
        while self.nxt < self.count and times[order[self.nxt]] <= now:
            self.feeder.add(int(order[self.nxt]), float(times[order[self.nxt]]))
            self.nxt += 1

    def _taken(self, c: int, batch, now: float) -> np.ndarray:
        """Count a batch's failures as done, note how long its items waited; its rows."""
        self.tallies[c].failed_too_long += len(batch.failed)
        self.done += len(batch.failed)
        rows = batch.handles.astype(np.int64)
        if len(batch):
            self.waits_max = max(self.waits_max, float(now - self.times[rows].min()))
        return rows

    def fill_window(self, c: int, now: float) -> bool:
        """A packed engine's in-flight window refilled from the feeder, then one engine step; False
        when the engine has nothing to run."""
        run = self.runners[c]
        engine = run.engine
        while engine.running + engine.waiting < run.window:
            if not run.pending:
                batch = self.feeder.next_batch(c, now)
                if batch is None or (len(batch) == 0 and not batch.failed):
                    break
                rows = self._taken(c, batch, now)
                if not len(batch):
                    continue
                self.tallies[c].group(batch.shape.family, len(batch), int(self.shapes.lengths[rows].sum()))
                run.pending.extend(zip(rows.tolist(), self.real[rows].tolist()))
            run.put(*run.pending.popleft())
        if engine.idle:
            return False
        self.retry[c] = False
        seconds, keys = engine.step()
        self.clocks[c] = now + seconds
        self.done += len(keys)
        return True

    def run_batch(self, c: int, now: float) -> bool:
        """The feeder's next batch for consumer c run to its end; False when it gave none."""
        batch = self.feeder.next_batch(c, now)
        if batch is None or not (len(batch) or batch.failed):
            return False
        self.retry[c] = False
        rows = self._taken(c, batch, now)
        if len(batch):
            run, tally = self.runners[c], self.tallies[c]
            if self.mode == Mode.PACKED:
                seconds = run.run_batch(rows, self.real[rows])
                tally.group(batch.shape.family, len(batch), int(self.shapes.lengths[rows].sum()))
            else:
                cost = run.engine.run(self.shapes, rows, batch.max_new_tokens, self.real[rows])
                tally.add(cost, batch.shape.family, self.consumers[c].contract)
                seconds = cost.seconds
            self.clocks[c] = now + seconds
            self.done += len(batch)
        return True

    def wait(self, c: int, now: float) -> None:
        """Nothing to run: wait for the next arrival, or for another consumer to act (it may leave
        work this one can take: a branch, a family), or stop when every other one waits too."""
        if self.feeder.overdue(c, now):
            self.idle_overdue += 1
        working = [self.clocks[d] for d in range(len(self.consumers))
                   if d != c and not self.finished[d] and not self.retry[d]]
        if self.nxt < self.count:
            self.clocks[c] = max(now, float(self.times[self.order[self.nxt]]))
        elif working:
            self.retry[c] = True
            self.clocks[c] = max(now, min(working))
        else:
            self.finished[c] = True

    def figures(self) -> dict:
        if self.mode == Mode.PACKED:
            for run, tally in zip(self.runners, self.tallies):
                tally.absorb(run.engine)
        figures = merge(self.tallies)
        figures["makespan_seconds"] = round(max(self.clocks), 3)
        figures["guard_refusals"] = self.feeder.guard_refusals
        figures["max_wait_seconds"] = round(self.waits_max, 3)
        figures["idle_with_overdue"] = self.idle_overdue
        figures["consumers"] = {c.name: t.figures() for c, t in zip(self.consumers, self.tallies)}
        return figures
