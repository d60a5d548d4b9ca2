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
`workloads/packsim.py`. The hit rates are the prefix-cache hit rate over all
nodes' blocks (`single_node_hit_rate`, `two_node_hit_rate`,
`random_routing_hit_rate`). `node_tokens` is the cluster's input tokens per node, and
`node_load_ratio` is the busier node's tokens over the other's.

Beside them, measured in the same run:

- `streaming`: each routing again, with items arriving by their timestamps at
  twice the rate its own nodes served the backlog offline, as
  `bench pack --mode streaming` does for one node;
- `key_blocks_sweep`: the cluster routing at other key depths;
- `join` and `leave`: the same weights placed on three nodes, starting from
  the two-node owners, then back to two. Each reports the fraction of
  partitions (and of tokens) that moved, against 1/N and against placing
  from scratch;
- `epsilon_sweep`, `placement_by_nodes`: placement alone (tokens, no
  simulation) at other ε and over 2–16 nodes;
- `drift`: the trace cut into twelve windows of arrival, each window's tokens
  in turn the partitions' weights, owners recomputed from the last window's:
  partitions moved per recomputation, per ε.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from ..pack.contract import Mode
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, shape_items
from ..workloads.feeders import PackerFeeder
from ..workloads.packsim import simulate
from ..workloads.synthetic import Workload
from .pack import CONSUMERS, workload_for

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
NODES = ("node-0", "node-1")
SWEEP_KEY_BLOCKS = (0, 1, 2, 3, 4, 8)
SWEEP_EPSILONS = (0.0, 0.02, 0.05, 0.08, 0.1, 0.25)
SPREAD_NODES = (2, 3, 4, 8, 16)
DRIFT_WINDOWS = 12
HIT_RATE_NAMES = {"single": "single_node_hit_rate", "cluster": "two_node_hit_rate", "random": "random_routing_hit_rate"}


def _subset(wl: Workload, rows: np.ndarray) -> Workload:
    """The items `rows` of wl (in order), as a workload of their own."""
    lengths = wl.lengths[rows]
    offsets = np.zeros(rows.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([wl.item(int(i)) for i in rows]) if rows.size else np.empty(0, np.uint32)
    return Workload(tokens, offsets, wl.arrivals[rows], wl.max_new_tokens[rows], wl.prefix_lens[rows],
                    wl.models[rows], wl.name)


def _node_figures(wl: Workload, rows: np.ndarray, arrivals: np.ndarray | None, max_wait_seconds: float | None) -> dict:
    """One node's consumers fed by the packer on the items `rows`: offline (arrivals None) or streaming."""
    if rows.size == 0:
        return {"items": 0, "input_tokens": 0, "computed_tokens": 0, "queried_blocks": 0, "hit_rate": 0.0,
                "modeled_seconds": 0.0, "makespan_seconds": 0.0}
    sub = _subset(wl, rows)
    shapes = shape_items(sub.tokens, sub.offsets, sub.prefix_lens, sub.models, block_tokens=DEFAULT_BLOCK_TOKENS)
    feeder = PackerFeeder(CONSUMERS, Mode.PACKED, shapes, sub, max_wait_seconds=max_wait_seconds)
    res = simulate(feeder, CONSUMERS, Mode.PACKED, shapes, sub, arrivals=None if arrivals is None else arrivals[rows])
    # blocks looked up per item: its family root and its blocks (a pooled item: one)
    queried = int(np.where(shapes.pooled, 1, np.diff(shapes.hash_offsets) + 1).sum())
    return {"items": int(rows.size), "input_tokens": int(sub.lengths.sum()), "computed_tokens": res["computed_tokens"],
            "queried_blocks": queried, "hit_rate": res["cache_hit_rate"], "modeled_seconds": res["modeled_seconds"],
            "makespan_seconds": res["makespan_seconds"]}


def _route(wl: Workload, node_of: np.ndarray, num_nodes: int, arrivals=None, max_wait_seconds=None) -> dict:
    nodes = [_node_figures(wl, np.flatnonzero(node_of == n), arrivals, max_wait_seconds) for n in range(num_nodes)]
    queried = sum(n["queried_blocks"] for n in nodes)
    hits = sum(n["hit_rate"] * n["queried_blocks"] for n in nodes)
    tokens = [n["input_tokens"] for n in nodes]
    return {"hit_rate": round(hits / queried, 4) if queried else 0.0, "node_tokens": tokens,
            "node_load_ratio": _ratio(tokens), "nodes": nodes}


def _ratio(tokens: list[int]) -> float | None:
    """Busier node's tokens over the other's (None when the other has none)."""
    low, high = min(tokens), max(tokens)
    return round(high / low, 4) if low else None


def _placed(partitions: np.ndarray, lengths: np.ndarray, num_partitions: int, epsilon: float, nodes=NODES):
    """(token weight of each partition, owner of each partition, node index of each item)."""
    from ..cluster.placement import assign

    weights = np.bincount(partitions, weights=lengths, minlength=num_partitions)
    owners = assign(weights, nodes, epsilon=epsilon)
    node_of = np.array([nodes.index(o) for o in owners], np.int64)[partitions]
    return weights, owners, node_of


def _loads(weights: np.ndarray, owners: list[str], nodes) -> list[int]:
    return [int(weights[[o == n for o in owners]].sum()) for n in nodes]


def _by_nodes(weights: np.ndarray, epsilon: float) -> list[dict]:
    """Placement alone (tokens, no simulation) over more nodes: the busiest and idlest node against the mean."""
    from ..cluster.placement import assign

    out = []
    for num_nodes in SPREAD_NODES:
        names = tuple(f"node-{i}" for i in range(num_nodes))
        loads = np.array(_loads(weights, assign(weights, names, epsilon=epsilon), names), np.float64)
        mean = loads.mean()
        out.append({"nodes": num_nodes, "max_vs_mean": round(float(loads.max() / mean), 4),
                    "min_vs_mean": round(float(loads.min() / mean), 4)})
    return out


def _by_epsilon(weights: np.ndarray) -> list[dict]:
    """Placement alone over two nodes, then a third joining, for other epsilons."""
    from ..cluster.placement import assign, moved

    out = []
    for epsilon in SWEEP_EPSILONS:
        owners = assign(weights, NODES, epsilon=epsilon)
        joined = assign(weights, (*NODES, "node-2"), epsilon=epsilon, current=owners)
        loads = _loads(weights, joined, (*NODES, "node-2"))
        out.append({"epsilon": epsilon, "node_load_ratio": _ratio(_loads(weights, owners, NODES)),
                    "join_moved_partitions": round(len(moved(owners, joined)) / len(owners), 4),
                    "join_max_vs_min": round(max(loads) / min(loads), 4) if min(loads) else None})
    return out


def _streaming(wl: Workload, routings: dict, offline: dict) -> dict:
    """Each routing again with items arriving by their timestamps, at twice the rate its nodes served the
    backlog offline (so each node's backlog grows as in `bench pack --mode streaming`)."""
    out: dict = {}
    span = max(float(wl.arrivals[-1] - wl.arrivals[0]), 1e-9)
    for name, node_of in routings.items():
        target = max(n["makespan_seconds"] for n in offline[name]["nodes"]) / 2
        arrivals = (wl.arrivals - wl.arrivals[0]) * (target / span)
        out[HIT_RATE_NAMES[name]] = _route(wl, node_of, int(node_of.max()) + 1, arrivals, target / 4)["hit_rate"]
    for name in ("cluster", "random"):
        out[f"{name}_vs_single"] = round(out[HIT_RATE_NAMES[name]] / out[HIT_RATE_NAMES["single"]], 4)
    return out


def _drift(parts: np.ndarray, wl: Workload, num_partitions: int) -> list[dict]:
    """Placement as pending tokens drift: the trace cut into DRIFT_WINDOWS windows of arrival, each window's
    tokens a partition's weights, owners recomputed from the last window's. Per epsilon: partitions moved per
    recomputation (mean), and the busier node's tokens over the other's (worst window)."""
    from ..cluster.placement import assign, moved

    window_of = np.minimum((np.arange(len(wl)) * DRIFT_WINDOWS) // max(len(wl), 1), DRIFT_WINDOWS - 1)
    out = []
    for epsilon in SWEEP_EPSILONS:
        owners, moves, worst = None, [], 1.0
        for t in range(DRIFT_WINDOWS):
            rows = window_of == t
            weights = np.bincount(parts[rows], weights=wl.lengths[rows], minlength=num_partitions)
            new = assign(weights, NODES, epsilon=epsilon, current=owners)
            if owners is not None:
                moves.append(len(moved(owners, new)) / num_partitions)
            worst = max(worst, _ratio(_loads(weights, new, NODES)) or float("inf"))
            owners = new
        out.append({"epsilon": epsilon, "moved_per_window": round(float(np.mean(moves)), 4),
                    "worst_node_load_ratio": round(worst, 4)})
    return out


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
                     "node_tokens": _loads(weights, joined, three)},
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
    from ..cluster.options import NodeSettings
    from ..cluster.partition import DEFAULT_KEY_BLOCKS, partitions_of
    from ..cluster.subjects import ClusterNames

    num_partitions = ClusterNames.num_partitions if num_partitions is None else num_partitions
    key_blocks = DEFAULT_KEY_BLOCKS if key_blocks is None else key_blocks
    epsilon = NodeSettings.epsilon if epsilon is None else epsilon
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
    random_of = np.random.default_rng(seed).integers(0, len(NODES), len(wl))
    rand = _route(wl, random_of, len(NODES))
    sweep = []
    for k in SWEEP_KEY_BLOCKS:
        p = parts if k == key_blocks else partitions(k)
        w, _, n_of = _placed(p, lengths, num_partitions, epsilon)
        routed = cluster if k == key_blocks else _route(wl, n_of, len(NODES))
        sweep.append({"key_blocks": k, "two_node_hit_rate": routed["hit_rate"],
                      "cluster_vs_single": round(routed["hit_rate"] / single["hit_rate"], 4),
                      "node_tokens": routed["node_tokens"], "node_load_ratio": routed["node_load_ratio"],
                      "max_partition_share": round(float(w.max() / w.sum()), 4)})
    base = single["hit_rate"]
    streaming = _streaming(wl, {"single": np.zeros(len(wl), np.int64), "cluster": node_of, "random": random_of},
                           {"single": single, "cluster": cluster, "random": rand})
    return {
        "workload": wl.name, "items": len(wl), "input_tokens": int(lengths.sum()), "nodes": len(NODES),
        "consumers_per_node": [c.name for c in CONSUMERS], "engine_mode": Mode.PACKED,
        "num_partitions": num_partitions, "key_blocks": key_blocks, "epsilon": epsilon,
        "single_node_hit_rate": base, "two_node_hit_rate": cluster["hit_rate"],
        "random_routing_hit_rate": rand["hit_rate"],
        "cluster_vs_single": round(cluster["hit_rate"] / base, 4) if base else 0.0,
        "random_vs_single": round(rand["hit_rate"] / base, 4) if base else 0.0,
        "node_tokens": cluster["node_tokens"], "node_load_ratio": cluster["node_load_ratio"],
        "random_node_tokens": rand["node_tokens"], "random_node_load_ratio": rand["node_load_ratio"],
        "max_partition_share": round(float(weights.max() / weights.sum()), 4),
        "partition_of_us": _partition_of_us(wl, num_partitions, key_blocks),
        **_membership(weights, owners, epsilon),
        "key_blocks_sweep": sweep, "epsilon_sweep": _by_epsilon(weights), "placement_by_nodes": _by_nodes(weights, epsilon),
        "drift": _drift(parts, wl, num_partitions),
        "streaming": streaming,
        "single": single, "cluster": cluster, "random": rand,
    }
