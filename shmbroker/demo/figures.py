"""The demo's figures: one consumer's from its GPU process's counters, their total, and FIFO feeding
of the same workload simulated offline (`workloads/packsim.py`) to compare with.
"""

from __future__ import annotations


def consumer_figures(c: dict[str, int], contract, mode: str) -> dict:
    """One consumer's figures (DESIGN.md "Words") from its GPU process's counters."""
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
    }


def total_figures(per: dict[str, dict]) -> dict:
    out = {k: sum(f[k] for f in per.values())
           for k in ("batches", "items", "ok", "tokens", "failed", "guard_violations", "padded_tokens", "rect_tokens",
                     "hit_blocks", "queried_blocks", "shape_switches", "excess_shape_switches", "families",
                     "batch_tokens_max_sum", "modeled_seconds", "engine_wall_seconds")}
    out["batch_fill"] = out["tokens"] / out["batch_tokens_max_sum"] if out["batch_tokens_max_sum"] else 0.0
    out["padding_waste"] = out["padded_tokens"] / out["rect_tokens"] if out["rect_tokens"] else 0.0
    out["cache_hit_rate"] = out["hit_blocks"] / out["queried_blocks"] if out["queried_blocks"] else 0.0
    out["makespan_seconds"] = max(f["modeled_seconds"] for f in per.values())  # the consumers run side by side
    out["modeled_tokens_per_s"] = out["tokens"] / out["makespan_seconds"] if out["makespan_seconds"] else 0.0
    out["packed"] = all(f["mode"] == "packed" for f in per.values())
    return out


def fifo_figures(wl, cfg) -> dict:
    """The same workload fed first-in-first-out to the same consumers, offline, in virtual time.

    The engines see the blocks the broker's simulated engines see (they hash each batch's tokens
    without the declared prefixes), so the cache hit rates compare like for like."""
    from ..pack.shapes import distinct_blocks, shape_items
    from ..workloads.feeders import FifoFeeder
    from ..workloads.packsim import SimConsumer, simulate

    consumers = [SimConsumer(c.name, c.contract, c.engine_settings.cache_tokens) for c in cfg.consumers]
    modes = {c.engine_settings.mode for c in cfg.consumers}
    costs = {c.engine_settings.cost for c in cfg.consumers}
    assert len(modes) == 1, "the simulation runs one engine mode for all consumers"
    assert len(costs) == 1, "the simulation runs one cost model for all consumers"
    mode, cost = modes.pop(), costs.pop()
    shapes = shape_items(wl.tokens, wl.offsets, block_tokens=cfg.block_tokens)
    feeder = FifoFeeder(consumers, mode, shapes, wl, tolerance=cfg.padding_tolerance)
    out = simulate(feeder, consumers, mode, shapes, wl, cost=cost)
    total_blocks, distinct, _ = distinct_blocks(shapes)
    out["cache_hit_rate_max"] = 1 - distinct / total_blocks if total_blocks else 0.0  # every block computed once
    return out
