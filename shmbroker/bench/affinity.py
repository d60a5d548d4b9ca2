"""`shmbroker bench cluster`: prefix affinity and balance of a two-node cluster's routing, simulated.

The workload is the Mooncake conversation trace (the pack benchmark's, `--trace`,
`--scale`; the seeded generator when the trace is absent), prefill only. Its
items are routed to two nodes three ways, all in the same run:

- single: every item to one node;
- cluster: by partition (`cluster.partition`, `num_partitions`, `key_blocks`),
  then placement (`cluster.placement.assign`) with bounded loads over the
  tokens of each partition (`epsilon`);
- random: each item to a node drawn at random (seeded).

Each node runs the pack benchmark's two consumers (`big` and `small`, packed
engines with their prefix caches) fed by the packer, offline, in
`workloads/packsim.py`. `hit_rate_*` is the prefix-cache hit rate over all
nodes' blocks. `node_tokens` is the cluster's input tokens per node, and
`busiest_vs_other` is the busier node's tokens over the other's. `key_blocks_sweep`
repeats the cluster routing for other key depths. `join`/`leave` place the same
weights on three nodes starting from the two-node owners, then back to two:
the fraction of partitions (and of tokens) that moved, against 1/N and
against placing from scratch.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..pack.shapes import DEFAULT_BLOCK_TOKENS, shape_items
from ..workloads.feeders import PackerFeeder
from ..workloads.packsim import simulate
from ..workloads.synthetic import Workload
from .pack import CONSUMERS, workload_for

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
NODES = ("node-0", "node-1")
SWEEP_KEY_BLOCKS = (0, 1, 2, 3, 4, 8)


def _subset(wl: Workload, rows: np.ndarray) -> Workload:
    """The items `rows` of wl (in order), as a workload of their own."""
    lengths = wl.lengths[rows]
    offsets = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([wl.item(int(i)) for i in rows]) if rows.size else np.empty(0, np.uint32)
    return Workload(tokens, offsets, wl.arrivals[rows], wl.max_new_tokens[rows], wl.prefix_lens[rows],
                    wl.models[rows], wl.name)


def _node_figures(wl: Workload, rows: np.ndarray) -> dict:
    """One node's consumers fed by the packer, offline, on the items `rows`."""
    if rows.size == 0:
        return {"items": 0, "input_tokens": 0, "computed_tokens": 0, "queried_blocks": 0, "hit_rate": 0.0,
                "modeled_seconds": 0.0}
    sub = _subset(wl, rows)
    shapes = shape_items(sub.tokens, sub.offsets, sub.prefix_lens, sub.models, block_tokens=DEFAULT_BLOCK_TOKENS)
    res = simulate(PackerFeeder(CONSUMERS, "packed", shapes, sub), CONSUMERS, "packed", shapes, sub)
    # blocks looked up per item: its family root and its blocks (a pooled item: one)
    queried = int(np.where(shapes.pooled, 1, np.diff(shapes.hash_offsets) + 1).sum())
    return {"items": int(rows.size), "input_tokens": int(sub.lengths.sum()), "computed_tokens": res["computed_tokens"],
            "queried_blocks": queried, "hit_rate": res["cache_hit_rate"], "modeled_seconds": res["modeled_seconds"]}


def _route(wl: Workload, node_of: np.ndarray, num_nodes: int) -> dict:
    nodes = [_node_figures(wl, np.flatnonzero(node_of == n)) for n in range(num_nodes)]
    queried = sum(n["queried_blocks"] for n in nodes)
    hits = sum(n["hit_rate"] * n["queried_blocks"] for n in nodes)
    tokens = [n["input_tokens"] for n in nodes]
    return {"hit_rate": round(hits / queried, 4) if queried else 0.0, "node_tokens": tokens,
            "busiest_vs_other": _ratio(tokens), "nodes": nodes}


def _ratio(tokens: list[int]) -> float | None:
    """Busier node's tokens over the other's (None when the other has none)."""
    low, high = min(tokens), max(tokens)
    return round(high / low, 4) if low else None


def _placed(partitions: np.ndarray, lengths: np.ndarray, num_partitions: int, epsilon: float):
    from ..cluster.placement import assign

    weights = np.bincount(partitions, weights=lengths, minlength=num_partitions)
    owners = assign(weights, NODES, epsilon=epsilon)
    node_of = np.array([NODES.index(o) for o in owners], np.int64)[partitions]
    return weights, owners, node_of


def _membership(weights: np.ndarray, owners: list[str], epsilon: float) -> dict:
    """Fractions moved when a third node joins (hysteresis and from scratch), then leaves again."""
    from ..cluster.placement import assign, moved

    three = (*NODES, "node-2")
    total = float(weights.sum()) or 1.0

    def fractions(before, after) -> dict:
        ps = moved(before, after)
        return {"partitions": round(len(ps) / len(before), 4), "tokens": round(float(weights[ps].sum()) / total, 4)}

    joined = assign(weights, three, epsilon=epsilon, current=owners)
    left = assign(weights, NODES, epsilon=epsilon, current=joined)
    t0 = time.perf_counter()
    for _ in range(200):
        assign(weights, three, epsilon=epsilon, current=joined)
    assign_us = (time.perf_counter() - t0) / 200 * 1e6
    return {"join": {**fractions(owners, joined), "ideal": round(1 / 3, 4),
                     "from_scratch": fractions(owners, assign(weights, three, epsilon=epsilon)),
                     "node_tokens": [int(weights[[o == n for o in joined]].sum()) for n in three]},
            "leave": {**fractions(joined, left), "ideal": round(1 / 3, 4),
                      "from_scratch": fractions(joined, assign(weights, NODES, epsilon=epsilon))},
            "assign_us_128_partitions_3_nodes": round(assign_us, 1)}


def _partition_of_us(wl: Workload, num_partitions: int, key_blocks: int) -> float:
    """Mean time of the producer's per-item call over the workload's first items."""
    from ..cluster.partition import partition_of

    count = min(len(wl), 2000)
    items = [wl.item(i) for i in range(count)]
    partition_of(items[0], None, 0, num_partitions, key_blocks=key_blocks)  # compile outside the timing
    t0 = time.perf_counter()
    for tokens, prefix, model in zip(items, wl.prefix_lens[:count].tolist(), wl.models[:count].tolist()):
        partition_of(tokens, prefix, model, num_partitions, key_blocks=key_blocks)
    return round((time.perf_counter() - t0) / count * 1e6, 2)


def run(trace: str | None = None, scale: float = 1.0, seed: int = 0, num_partitions: int | None = None,
        key_blocks: int | None = None, epsilon: float | None = None) -> dict:
    from ..cluster.partition import DEFAULT_KEY_BLOCKS, DEFAULT_NUM_PARTITIONS, partitions_of
    from ..cluster.placement import DEFAULT_EPSILON

    num_partitions = DEFAULT_NUM_PARTITIONS if num_partitions is None else num_partitions
    key_blocks = DEFAULT_KEY_BLOCKS if key_blocks is None else key_blocks
    epsilon = DEFAULT_EPSILON if epsilon is None else epsilon
    if trace is None and TRACE.exists():
        trace = str(TRACE)
    wl = workload_for(trace, scale, seed)
    wl.max_new_tokens = np.ones(len(wl), np.int64)  # prefill only, as the pack benchmark
    lengths = wl.lengths

    def partitions(k: int) -> np.ndarray:
        return partitions_of(wl.tokens, wl.offsets, wl.prefix_lens, wl.models, num_partitions, key_blocks=k)

    parts = partitions(key_blocks)
    weights, owners, node_of = _placed(parts, lengths, num_partitions, epsilon)
    single = _route(wl, np.zeros(len(wl), np.int64), 1)
    cluster = _route(wl, node_of, len(NODES))
    rand = _route(wl, np.random.default_rng(seed).integers(0, len(NODES), len(wl)), len(NODES))
    sweep = []
    for k in SWEEP_KEY_BLOCKS:
        p = parts if k == key_blocks else partitions(k)
        w, _, n_of = _placed(p, lengths, num_partitions, epsilon)
        routed = cluster if k == key_blocks else _route(wl, n_of, len(NODES))
        sweep.append({"key_blocks": k, "hit_rate_cluster": routed["hit_rate"],
                      "cluster_vs_single": round(routed["hit_rate"] / single["hit_rate"], 4),
                      "node_tokens": routed["node_tokens"], "busiest_vs_other": routed["busiest_vs_other"],
                      "max_partition_share": round(float(w.max() / w.sum()), 4)})
    base = single["hit_rate"]
    return {
        "workload": wl.name, "items": len(wl), "input_tokens": int(lengths.sum()), "nodes": len(NODES),
        "consumers_per_node": [c.name for c in CONSUMERS], "engine_mode": "packed",
        "num_partitions": num_partitions, "key_blocks": key_blocks, "epsilon": epsilon,
        "hit_rate_single": base, "hit_rate_cluster": cluster["hit_rate"], "hit_rate_random": rand["hit_rate"],
        "cluster_vs_single": round(cluster["hit_rate"] / base, 4) if base else 0.0,
        "random_vs_single": round(rand["hit_rate"] / base, 4) if base else 0.0,
        "node_tokens": cluster["node_tokens"], "busiest_vs_other": cluster["busiest_vs_other"],
        "random_node_tokens": rand["node_tokens"], "random_busiest_vs_other": rand["busiest_vs_other"],
        "max_partition_share": round(float(weights.max() / weights.sum()), 4),
        "partition_of_us": _partition_of_us(wl, num_partitions, key_blocks),
        **_membership(weights, owners, epsilon),
        "key_blocks_sweep": sweep,
        "single": single, "cluster": cluster, "random": rand,
    }
