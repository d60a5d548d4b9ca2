"""`shmbroker bench pack`: shape-pure packing against FIFO feeding and the engine alone, on the simulated engine.

Two consumers of one model (the built-in configuration's `big` and `small`), each with its own
simulated engine; the workload is the seeded generator's or a Mooncake-format
trace (`--trace`). For each engine mode (`padded`, `packed`) the broker's
figures sit at the top level; measured in the same run, FIFO feeding's under
"fifo" (arrival-order batches, one at a time) and the engine alone's under
"engine_alone" (no broker: packed, every item in arrival order through one
shared queue to whichever engine has room, each batching continuously;
padded, arrival-order rectangle batches; `workloads/feeders.py` says exactly). A packed
consumer fed by the broker keeps an in-flight window in its engine, topped up
from the packer's batch records in order (`workloads/packsim.py`). Offline: the whole
workload is the backlog. Streaming: items arrive by their timestamps,
rescaled so they arrive at twice the rate the consumers serve them (measured
by the offline run), so a backlog forms.

`lower_bound_seconds` is the modeled seconds (the consumers' engine seconds
summed, as `modeled_seconds`) of the ideal feeding at full concurrency. With P
the tokens of the workload's distinct blocks (every distinct prefill token
computed once), D = sum(max(max_new_tokens, 1) - 1) the tokens decoded after
each item's first (which comes out of its prefill), N consumers with
max_batch_size S_1..S_N, and T the largest max_batch_tokens:

    decode_steps = ceil(D / (S_1 + ... + S_N))   every output token decoded with all
                                                 the consumers' slots busy, each
                                                 consumer stepping decode_steps times
    prefill_only = max(0, ceil(P / T) - N x decode_steps)   full steps of prefill
                                                 the decode steps cannot carry
    lower_bound  = prefill_token_seconds x P + decode_token_seconds x D
                 + decode_step_seconds x N x decode_steps
                 + batch_overhead_seconds x prefill_only

(a step that decodes costs decode_step_seconds, any other batch_overhead_seconds,
plus its tokens: `engines/continuous.py`; a padded batch pays the same per
step). Prefill only (D = 0) it is ceil(P / T) full batches of prefill, a bound
on any feeding. With decode it bounds the feedings that keep every consumer
decoding, all slots busy, as long as the others (the split that finishes
first); one that leaves a small card's slots idler can spend fewer summed
seconds, never fewer than `lower_bound_strict_seconds`: the same with every
decode step on the consumer of the most slots (decode_steps = ceil(D /
max S), steps >= ceil((P + D) / T)).

Under "padded", `lower_bound_padded_seconds` bounds a feeding of a padded engine that knows each
item's max_new_tokens (as a policy does) and `modeled_vs_padded_bound` judges the policy against
it; `oracle_bound_padded_seconds` (`modeled_vs_oracle_bound`) bounds even one that knew where every
output stops (`pack_bound.py` gives both formulas).
With `--max-new-tokens 0` an item generates its own output length (a trace's `output_length`);
a workload whose items stop early (`Workload.real_new`) is charged their real lengths.

The decision latency is measured twice: with the whole workload as the
backlog and with 1 % of it, so the JSON shows a 100x larger backlog beside.
"""

from __future__ import annotations

import gc
import math

import numpy as np

from ..engines.cost import SimCost
from ..pack.contract import Contract, Mode
from ..pack.policy import DEFAULT_PADDING_TOLERANCE
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, distinct_blocks, shape_items
from ..workloads.feeders import EngineAloneFeeder, FifoFeeder, PackerFeeder
from ..workloads.packsim import SimConsumer, simulate
from .pack_bound import lower_bound_padded_seconds, oracle_bound_padded_seconds

CONSUMERS = (
    SimConsumer("big", Contract(256, 131072, 131072), cache_tokens=2 << 20),
    SimConsumer("small", Contract(64, 16384, 16384), cache_tokens=256 << 10),
)


def workload_for(trace: str | None, scale: float, seed: int, workload: str = "generator"):
    if workload != "generator":
        from ..workloads.families import generate_family

        return generate_family(workload, max(200, int(8000 * scale)), seed)
    if trace:
        from ..workloads.trace import load

        if scale >= 1:
            return load(trace)
        with open(trace) as fh:
            lines = sum(1 for line in fh if line.strip())
        return load(trace, limit=max(100, int(lines * scale)))
    from ..workloads.synthetic import generate

    return generate(max(200, int(20_000 * scale)), seed=seed)


def lower_bound_seconds(distinct_tokens: int, max_new: np.ndarray, cost: SimCost) -> float:
    """The module docstring's bound: every distinct token prefilled once, decode with every slot busy."""
    slots = sum(c.contract.max_batch_size for c in CONSUMERS)
    bt = max(c.contract.max_batch_tokens for c in CONSUMERS)
    decoded = int(np.sum(np.maximum(max_new, 1) - 1))
    decode_steps = len(CONSUMERS) * math.ceil(decoded / slots)
    prefill_only = max(0, math.ceil(distinct_tokens / bt) - decode_steps)
    return (cost.prefill_token_seconds * distinct_tokens + cost.decode_token_seconds * decoded
            + cost.decode_step_seconds * decode_steps + cost.batch_overhead_seconds * prefill_only)


def lower_bound_strict_seconds(distinct_tokens: int, max_new: np.ndarray, cost: SimCost) -> float:
    """A bound on any feeding's modeled seconds: every decode step on the card of the most slots."""
    slots = max(c.contract.max_batch_size for c in CONSUMERS)
    bt = max(c.contract.max_batch_tokens for c in CONSUMERS)
    decoded = int(np.sum(np.maximum(max_new, 1) - 1))
    decode_steps = math.ceil(decoded / slots)
    steps = max(decode_steps, math.ceil((distinct_tokens + decoded) / bt))
    return (cost.prefill_token_seconds * distinct_tokens + cost.decode_token_seconds * decoded
            + cost.decode_step_seconds * decode_steps + cost.batch_overhead_seconds * (steps - decode_steps))


def _percentiles(ns: list[int]) -> tuple[float, float]:
    if not ns:
        return 0.0, 0.0
    a = np.array(ns[1:] or ns, np.float64) / 1000.0  # the first decision pays numba dispatch set-up
    return round(float(np.percentile(a, 50)), 2), round(float(np.percentile(a, 99)), 2)


def per_item(ns: list[int], sizes: list[int]) -> float:
    """Mean decision time per item returned, over decisions that returned items."""
    taken = [(t, n) for t, n in zip(ns, sizes) if n]
    return round(sum(t for t, _ in taken) / max(1, sum(n for _, n in taken)) / 1000.0, 3)


def run(trace: str | None = None, mode: str = "offline", scale: float = 1.0, seed: int = 0,
        max_new_tokens: int = 1, max_wait_seconds: float | None = None, tolerance: float | None = None,
        workload: str = "generator") -> dict:
    if mode not in ("offline", "streaming"):
        raise ValueError(f"mode must be offline or streaming, got {mode!r}")
    tol = DEFAULT_PADDING_TOLERANCE if tolerance is None else tolerance
    wl = workload_for(trace, scale, seed, workload)
    if max_new_tokens > 0:
        wl.max_new_tokens = np.full(len(wl), max_new_tokens, np.int64)
    shapes = shape_items(wl.tokens, wl.offsets, wl.prefix_lens, wl.models, block_tokens=DEFAULT_BLOCK_TOKENS)
    cost = SimCost()
    total_blocks, distinct, distinct_tokens = distinct_blocks(shapes)
    lb = lower_bound_seconds(distinct_tokens, wl.outputs, cost)
    strict = lower_bound_strict_seconds(distinct_tokens, wl.outputs, cost)
    s_max = max(c.contract.max_batch_size for c in CONSUMERS)
    t_max = max(c.contract.max_batch_tokens for c in CONSUMERS)
    padded_lb = lower_bound_padded_seconds(distinct_tokens, wl.max_new_tokens, wl.outputs, wl.lengths, s_max, t_max, cost)
    oracle_lb = oracle_bound_padded_seconds(distinct_tokens, wl.outputs, wl.lengths, s_max, t_max, cost)
    out: dict = {"workload": wl.name, "mode": mode, "items": len(wl), "input_tokens": int(wl.lengths.sum()),
                 "block_tokens": DEFAULT_BLOCK_TOKENS, "max_new_tokens": max_new_tokens or "workload",
                 "consumers": {c.name: {"max_batch_size": c.contract.max_batch_size,
                                        "max_batch_tokens": c.contract.max_batch_tokens,
                                        "max_input_len": c.contract.max_input_len,
                                        "cache_tokens": c.cache_tokens} for c in CONSUMERS},
                 "sim_cost": cost.__dict__, "padding_tolerance": tol}
    hit_max = round(1 - distinct / total_blocks, 4)
    gc.collect()
    gc.freeze()  # the workload's objects are permanent: keep the collector's pauses out of the timings
    try:
        _modes(out, wl, shapes, mode, cost, (lb, strict), hit_max, tol, max_wait_seconds)
        padded = out[Mode.PADDED]
        padded["lower_bound_padded_seconds"] = round(padded_lb, 3)
        padded["modeled_vs_padded_bound"] = round(padded["modeled_seconds"] / padded_lb, 4)
        padded["oracle_bound_padded_seconds"] = round(oracle_lb, 3)
        padded["modeled_vs_oracle_bound"] = round(padded["modeled_seconds"] / oracle_lb, 4)
    finally:
        gc.unfreeze()
    return out


def _modes(out, wl, shapes, mode, cost, bounds, hit_max, tol, max_wait_seconds) -> None:
    lb, strict = bounds
    for engine_mode in Mode:
        offline_packer = PackerFeeder(CONSUMERS, engine_mode, shapes, wl, tolerance=tol, step_tokens=cost.step_tokens)
        res = simulate(offline_packer, CONSUMERS, engine_mode, shapes, wl, cost=cost)
        arrivals = None
        if mode == "streaming":
            # arrive at twice the rate the consumers served the offline backlog
            span = max(float(wl.arrivals[-1] - wl.arrivals[0]), 1e-9)
            target = res["makespan_seconds"] / 2
            arrivals = (wl.arrivals - wl.arrivals[0]) * (target / span)
            wait = max_wait_seconds if max_wait_seconds is not None else target / 4
            feeder = PackerFeeder(CONSUMERS, engine_mode, shapes, wl, max_wait_seconds=wait, tolerance=tol,
                                  step_tokens=cost.step_tokens)
            res = simulate(feeder, CONSUMERS, engine_mode, shapes, wl, arrivals=arrivals, cost=cost)
            res["max_wait_configured_seconds"] = round(wait, 3)
            decisions, sizes = feeder.decision_timings()
        else:
            decisions, sizes = offline_packer.decision_timings()
        fifo = simulate(FifoFeeder(CONSUMERS, engine_mode, shapes, wl, tolerance=tol), CONSUMERS, engine_mode, shapes, wl,
                        arrivals=arrivals, cost=cost)
        alone = simulate(EngineAloneFeeder(CONSUMERS, engine_mode, shapes, wl), CONSUMERS, engine_mode, shapes, wl,
                         arrivals=arrivals, cost=cost)
        small = wl.head(max(1, len(wl) // 100))
        small_shapes = shape_items(small.tokens, small.offsets, small.prefix_lens, small.models,
                                   block_tokens=DEFAULT_BLOCK_TOKENS)
        small_feeder = PackerFeeder(CONSUMERS, engine_mode, small_shapes, small, tolerance=tol, step_tokens=cost.step_tokens)
        simulate(small_feeder, CONSUMERS, engine_mode, small_shapes, small, cost=cost)
        p50, p99 = _percentiles(decisions)
        small_decisions, small_sizes = small_feeder.decision_timings(min_samples=len(decisions))
        s50, s99 = _percentiles(small_decisions)
        for figures in (res, fifo, alone):
            figures["cache_hit_rate_max"] = hit_max
            figures["lower_bound_seconds"] = round(lb, 3)
            figures["lower_bound_strict_seconds"] = round(strict, 3)
        res.update({
            "decision_us_p50": p50, "decision_us_p99": p99, "decision_backlog_items": len(wl),
            "decision_us_p50_backlog_1pct": s50, "decision_us_p99_backlog_1pct": s99,
            "decision_backlog_items_1pct": len(small),
            # a decision costs O(batch): its items per decision and time per item, at both sizes
            "decision_items_mean": round(float(np.mean(sizes)), 2),
            "decision_items_mean_backlog_1pct": round(float(np.mean(small_sizes)), 2),
            "decision_us_per_item": per_item(decisions, sizes),
            "decision_us_per_item_backlog_1pct": per_item(small_decisions, small_sizes),
            "index_bytes_per_item": round(offline_packer.packer.index.nbytes() / len(wl), 1),
            "modeled_vs_fifo": round(res["modeled_seconds"] / fifo["modeled_seconds"], 4),
            "modeled_vs_lower_bound": round(res["modeled_seconds"] / lb, 4),
            "hit_rate_vs_max": round(res["cache_hit_rate"] / hit_max, 4) if hit_max else 0.0,
            "makespan_vs_engine_alone": round(res["makespan_seconds"] / alone["makespan_seconds"], 4),
            "fifo": fifo,
            "engine_alone": alone,
        })
        out[engine_mode] = res
