"""The demo's figures: one consumer's from its GPU process's counters, their total, and the same
workload run without the broker on the same consumers, simulated (`workloads/packsim.py`): the
engine alone (bench pack's `engine_alone`) first, FIFO batch-at-a-time second.

Both simulations are set up from the broker's own configuration (`SimSetup.of`): each consumer's
contract, cache size and cost model, and the blocks its simulated engine hashes (the prompt's
tokens in `block_tokens` blocks, without the declared prefixes: `engines/sim.py`'s `Sim.add`), so
the cache hit rates and the modeled seconds compare like for like.
"""

from __future__ import annotations

import time
from typing import NamedTuple


def consumer_figures(c: dict[str, int], contract, mode: str) -> dict:
    """One consumer's figures (docs/design.md "Words") from its GPU process's counters."""
    modeled = c["engine_own_ns"] / 1e9
    return {
        "mode": mode, "batches": c["batches"], "items": c["items"], "ok": c["ok"], "tokens": c["tokens"],
        "failed": c["too_long"] + c["invalid"] + c["engine_errors"] + c["corrupt"],
        "guard_violations": c["guard_violations"],
        "padded_tokens": c["padded_tokens"], "rect_tokens": c["rect_tokens"],
        "padding_waste": c["padded_tokens"] / c["rect_tokens"] if c["rect_tokens"] else 0.0,
        "batch_tokens_max_sum": c["batches"] * contract.max_batch_tokens,
        "batch_fill": c["tokens"] / (c["batches"] * contract.max_batch_tokens) if c["batches"] else 0.0,
        "hit_blocks": c["hit_blocks"], "queried_blocks": c["queried_blocks"],
        "cache_hit_rate": c["hit_blocks"] / c["queried_blocks"] if c["queried_blocks"] else 0.0,
        "shape_switches": c["shape_switches"], "excess_shape_switches": c["excess_shape_switches"],
        "families": c["families"], "modeled_seconds": modeled,
        "modeled_tokens_per_s": c["tokens"] / modeled if modeled else 0.0,
        "engine_wall_seconds": c["busy_ns"] / 1e9,
        "idle_wall_seconds": c["idle_ns"] / 1e9,  # nothing in the GPU process's window: no modeled seconds
    }


def total_figures(per: dict[str, dict], output_tokens: int) -> dict:
    """The consumers' figures together; `output_tokens`: the tokens the producers got back (the GPU
    processes do not count generated tokens)."""
    out = {k: sum(f[k] for f in per.values())
           for k in ("batches", "items", "ok", "tokens", "failed", "guard_violations", "padded_tokens", "rect_tokens",
                     "hit_blocks", "queried_blocks", "shape_switches", "excess_shape_switches", "families",
                     "batch_tokens_max_sum", "modeled_seconds", "engine_wall_seconds", "idle_wall_seconds")}
    out["output_tokens"] = output_tokens
    out["batch_fill"] = out["tokens"] / out["batch_tokens_max_sum"] if out["batch_tokens_max_sum"] else 0.0
    out["padding_waste"] = out["padded_tokens"] / out["rect_tokens"] if out["rect_tokens"] else 0.0
    out["cache_hit_rate"] = out["hit_blocks"] / out["queried_blocks"] if out["queried_blocks"] else 0.0
    out["makespan_seconds"] = max(f["modeled_seconds"] for f in per.values())  # the consumers run side by side
    out["modeled_tokens_per_s"] = out["tokens"] / out["makespan_seconds"] if out["makespan_seconds"] else 0.0
    out["packed"] = all(f["mode"] == "packed" for f in per.values())
    return out


class SimSetup(NamedTuple):
    """What the simulations share with the running broker: its consumers, their engine mode and
    cost model, and the workload hashed into blocks as their simulated engines hash it."""

    consumers: list
    mode: str
    cost: object  # engines.sim.SimCost
    shapes: object  # pack.shapes.ItemShapes
    cache_hit_rate_max: float  # every distinct block computed once

    @classmethod
    def of(cls, wl, cfg) -> SimSetup:
        from ..pack.shapes import distinct_blocks, shape_items
        from ..workloads.packsim import SimConsumer

        consumers = [SimConsumer(c.name, c.contract, c.engine_settings.cache_tokens) for c in cfg.consumers]
        modes = {c.engine_settings.mode for c in cfg.consumers}
        costs = {c.engine_settings.cost for c in cfg.consumers}
        assert len(modes) == 1, "the simulation runs one engine mode for all consumers"
        assert len(costs) == 1, "the simulation runs one cost model for all consumers"
        shapes = shape_items(wl.tokens, wl.offsets, block_tokens=cfg.block_tokens)
        total_blocks, distinct, _ = distinct_blocks(shapes)
        return cls(consumers, modes.pop(), costs.pop(), shapes, 1 - distinct / total_blocks if total_blocks else 0.0)


class Baselines(NamedTuple):
    """The workload run without the broker, in virtual time, and the CPU seconds each took."""

    engine_alone: dict
    fifo: dict
    engine_alone_seconds: float
    fifo_seconds: float


def baselines(wl, cfg) -> Baselines:
    """The engine alone and FIFO feeding, each on the broker's consumers (`SimSetup`), offline (the
    whole workload waiting at time 0, the best case for arrival-order feeding).

    Engine alone (`EngineAloneFeeder`): every item, in arrival order, through one shared queue to
    whichever consumer's continuous engine has room in its in-flight window. FIFO (`FifoFeeder`):
    arrival-order batches of up to max_batch_size items, each run to its last item before the next."""
    from ..workloads.feeders import EngineAloneFeeder, FifoFeeder

    setup = SimSetup.of(wl, cfg)
    t0 = time.monotonic()
    alone = _simulate(setup, wl, EngineAloneFeeder(setup.consumers, setup.mode, setup.shapes, wl))
    t1 = time.monotonic()
    fifo = _simulate(setup, wl, FifoFeeder(setup.consumers, setup.mode, setup.shapes, wl,
                                           tolerance=cfg.padding_tolerance))
    return Baselines(alone, fifo, t1 - t0, time.monotonic() - t1)


def _simulate(setup: SimSetup, wl, feeder) -> dict:
    from ..workloads.packsim import simulate

    out = simulate(feeder, setup.consumers, setup.mode, setup.shapes, wl, cost=setup.cost)
    out["cache_hit_rate_max"] = setup.cache_hit_rate_max
    # every item's output: its first token out of its prefill, the rest decoded
    out["output_tokens"] = out["items"] + out["decode_tokens"]
    for f in out["consumers"].values():
        f["output_tokens"] = f["items"] + f["decode_tokens"]
    return out
