"""Virtual-time simulation of consumers fed by the packer, a plain FIFO queue, or nothing but their engines.

`simulate` drains a workload's items through `feeder` into one simulated
engine per consumer and returns the accounting (DESIGN.md "Words"). Offline:
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
from ..engines.sim import SimCost, SimEngine
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
    cost = cost or SimCost()
    window = feeder.feeding == "window"
    if window and mode != Mode.PACKED:
        raise ValueError("only a packed engine is fed an in-flight window")
    count = len(shapes)
    runners = [_Runner(c, mode, shapes, cost) for c in consumers]
    tallies = [Tally() for _ in consumers]
    clocks = [0.0] * len(consumers)
    order = np.arange(count) if arrivals is None else np.argsort(arrivals, kind="stable")
    times = np.zeros(count) if arrivals is None else np.asarray(arrivals, np.float64)
    nxt = 0
    done = 0
    waits_max = 0.0
    idle_overdue = 0
    finished = [False] * len(consumers)
    retry = [False] * len(consumers)  # found nothing while another consumer still works: ask again later
    lengths = shapes.lengths
    while done < count:
        c = min((i for i in range(len(consumers)) if not finished[i]), key=lambda i: (clocks[i], retry[i]),
                default=None)
        if c is None:
            raise RuntimeError(f"{count - done} items left that no consumer takes")
        now = clocks[c]
        while nxt < count and times[order[nxt]] <= now:
            feeder.add(int(order[nxt]), float(times[order[nxt]]))
            nxt += 1
        run = runners[c]
        if window:
            engine = run.engine
            while engine.running + engine.waiting < run.window:
                if not run.pending:
                    batch = feeder.next_batch(c, now)
                    if batch is None or (len(batch) == 0 and not batch.failed):
                        break
                    tallies[c].failed_too_long += len(batch.failed)
                    done += len(batch.failed)
                    if not len(batch):
                        continue
                    rows = batch.handles.astype(np.int64)
                    tallies[c].group(batch.shape.family, len(batch), int(lengths[rows].sum()))
                    waits_max = max(waits_max, float(now - times[rows].min()))
                    run.pending.extend(zip(rows.tolist(), batch.max_new_tokens.tolist()))
                run.put(*run.pending.popleft())
            if not engine.idle:
                retry[c] = False
                seconds, keys = engine.step()
                clocks[c] = now + seconds
                done += len(keys)
                continue
        else:
            batch = feeder.next_batch(c, now)
            if batch is not None and (len(batch) or batch.failed):
                retry[c] = False
                tallies[c].failed_too_long += len(batch.failed)
                done += len(batch.failed)
                if len(batch):
                    rows = batch.handles.astype(np.int64)
                    if mode == Mode.PACKED:
                        seconds = run.run_batch(rows, batch.max_new_tokens)
                        tallies[c].group(batch.shape.family, len(batch), int(lengths[rows].sum()))
                    else:
                        cost_ = run.engine.run(shapes, rows, batch.max_new_tokens)
                        tallies[c].add(cost_, batch.shape.family, consumers[c].contract)
                        seconds = cost_.seconds
                    waits_max = max(waits_max, float(now - times[rows].min()))
                    clocks[c] = now + seconds
                    done += len(batch)
                continue
        # nothing to run: wait for the next arrival, or for another consumer to act (it may leave
        # work this one can take: a branch, a family), or stop when every other one waits too
        if feeder.overdue(c, now):
            idle_overdue += 1
        working = [clocks[d] for d in range(len(consumers)) if d != c and not finished[d] and not retry[d]]
        if nxt < count:
            clocks[c] = max(now, float(times[order[nxt]]))
        elif working:
            retry[c] = True
            clocks[c] = max(now, min(working))
        else:
            finished[c] = True
    for run, tally in zip(runners, tallies):
        if mode == Mode.PACKED:
            tally.absorb(run.engine)
    figures = merge(tallies)
    figures["makespan_seconds"] = round(max(clocks), 3)
    figures["guard_refusals"] = feeder.guard_refusals
    figures["max_wait_seconds"] = round(waits_max, 3)
    figures["idle_with_overdue"] = idle_overdue
    figures["consumers"] = {c.name: t.figures() for c, t in zip(consumers, tallies)}
    return figures
