"""Which node owns which partition: rendezvous hashing with bounded loads, and hysteresis.

Each (node, partition) pair has a score, a 64-bit blake2b hash of the two.
A partition's **home** is the live node with the highest score. Its ranking
is the live nodes by descending score (highest random weight hashing). A
partition's weight is its pending tokens. No node may hold more than the bound
(1 + ε) × the mean load (total weight / live nodes). `assign` places
partitions heaviest first (ties by partition number), in three passes:

1. a partition whose home owns nothing in `current` (a node that just
   joined, or every node when `current` is None) goes home if it fits;
2. a partition keeps its current owner while that node is live and the
   partition fits under the owner's bound;
3. the rest take the first node in their ranking with room, else the least
   loaded node (ties by ranking).

Pass 2 is the hysteresis. Weights change all the time and a partition does
not follow them: it moves only when its owner dies or can no longer hold it.
Pass 1 gives a joining node the partitions whose home it is, so a join moves
about 1/N of the partitions. A leave from owners within the bound moves
exactly the dead node's partitions, because every other owner's bound only
grows. When `current` is
None the result is plain rendezvous hashing with bounded loads.

Guarantees:
- Every partition gets a live owner.
- No node exceeds max(bound, mean + heaviest weight). When every weight is
  ≤ ε × mean, no node exceeds the bound. The proof: when a partition of
  weight w is placed, the others placed so far weigh ≤ total − w, so some
  node holds < mean and has room for w ≤ ε × mean.
- The result is a fixed point. When it keeps every node within the bound,
  passing it back as `current` returns it unchanged.
- Deterministic: the same weights, node names (in any order), ε and current
  give the same owners on every node. Token counts are integers, so every
  sum is exact in float64 whatever the machine.

ε trades balance for stability. With two nodes the busier node's tokens over
the other's reach (1 + ε) / (1 − ε). Pending tokens drift, and with no slack
(ε = 0) partitions follow them. `bench cluster`'s drift figures on the trace
(each twelfth of it the weights in turn) show the trade. Per recomputation:

| ε | partitions moved | balance |
|---|---|---|
| 0 | 27 % | 1.001 |
| 0.05 | 6.3 % | 1.105 |
| 0.08 | 0.6 % | 1.174 |
| 0.1 | 0.4 % | 1.22 |

Default 0.05: the balance mark (≤ 1.2) with room for drift between
recomputations. That model of drift is harsh, since real pending counts
change slowly. The guarantee wants partitions of at most ε/N of the load, so
num_partitions should be well above N/ε (40 for two nodes at 0.05).

Scores are cached per (node, number of partitions). After the first call for a
set of nodes, 128 partitions over a few nodes take about 0.1 ms (`bench cluster`
measures it).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from functools import lru_cache

import numpy as np

from .options import NodeSettings

_TOLERANCE = 1e-9  # relative slack of the bound against float rounding


@lru_cache(maxsize=1024)
def _scores(node: str, num_partitions: int) -> np.ndarray:
    """The node's rendezvous score of every partition."""
    name = node.encode()
    return np.array([int.from_bytes(hashlib.blake2b(p.to_bytes(4, "little") + name, digest_size=8).digest(), "little")
                     for p in range(num_partitions)], np.uint64)


def _owners_of(current, num_partitions: int, index: dict[str, int]) -> list[int]:
    """Current owners as live-node indices (-1: none, or not live)."""
    out = [-1] * num_partitions
    if current is None:
        return out
    pairs = current.items() if isinstance(current, Mapping) else enumerate(current)
    for p, node in pairs:
        if not 0 <= p < num_partitions:
            raise ValueError(f"current names partition {p}, not in 0..{num_partitions - 1}")
        out[p] = index.get(node, -1) if node is not None else -1
    return out


def assign(weights, nodes: Iterable[str], *, epsilon: float = NodeSettings.epsilon,
           current: Mapping[int, str | None] | Sequence[str | None] | None = None) -> list[str]:
    """Owner of every partition (the module docstring's rule): weights[p] = partition p's pending tokens."""
    w = np.asarray(weights, np.float64)
    if w.ndim != 1 or w.size < 1:
        raise ValueError("weights must be a non-empty 1-D sequence, one per partition")
    if not np.isfinite(w).all() or (w < 0).any():
        raise ValueError("weights must be finite and >= 0")
    if not (math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon must be finite and >= 0, got {epsilon}")
    live = sorted(set(nodes))
    if not live:
        raise ValueError("no live node")
    for name in live:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a node name must be a non-empty str, got {name!r}")
    num_partitions, num_nodes = w.size, len(live)
    index = {name: i for i, name in enumerate(live)}
    cur = _owners_of(current, num_partitions, index)
    scores = np.stack([_scores(name, num_partitions) for name in live], axis=1)
    rank = np.argsort(scores, axis=1, kind="stable")[:, ::-1].tolist()
    bound = (1 + epsilon) * float(w.sum()) / num_nodes * (1 + _TOLERANCE)
    weight = w.tolist()
    order = sorted(range(num_partitions), key=lambda p: (-weight[p], p))
    load = [0.0] * num_nodes
    owner = [-1] * num_partitions

    def place(p: int, n: int) -> None:
        owner[p] = n
        load[n] += weight[p]

    owning = set(cur)
    for p in order:  # 1: a joining node takes its home partitions
        home = rank[p][0]
        if home not in owning and load[home] + weight[p] <= bound:
            place(p, home)
    for p in order:  # 2: the others stay where they are while they fit
        n = cur[p]
        if owner[p] < 0 and n >= 0 and load[n] + weight[p] <= bound:
            place(p, n)
    for p in order:  # 3: the rest by ranking, bounded
        if owner[p] < 0:
            n = next((n for n in rank[p] if load[n] + weight[p] <= bound), None)
            place(p, min(rank[p], key=load.__getitem__) if n is None else n)
    return [live[n] for n in owner]


def moved(before: Sequence[str], after: Sequence[str]) -> list[int]:
    """Partitions whose owner differs between two assignments of the same partitions."""
    if len(before) != len(after):
        raise ValueError(f"assignments of {len(before)} and {len(after)} partitions")
    return [p for p, (a, b) in enumerate(zip(before, after)) if a != b]
