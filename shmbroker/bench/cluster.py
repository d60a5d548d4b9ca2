"""`shmbroker bench cluster`: one JSON object of the routing simulation (affinity) and the
producer's throughput against plain nats-py (cluster_throughput), merged at top level."""

from __future__ import annotations

from . import affinity, cluster_throughput


def run(trace: str | None = None, scale: float = 1.0, seed: int = 0, num_partitions: int | None = None,
        key_blocks: int | None = None, epsilon: float | None = None, num_items: int = 20000,
        num_repeats: int = 3) -> dict:
    result = affinity.run(trace=trace, scale=scale, seed=seed, num_partitions=num_partitions,
                          key_blocks=key_blocks, epsilon=epsilon)
    result.update(cluster_throughput.run(num_items=num_items, seed=seed, num_repeats=num_repeats, trace=trace))
    # one result.update(...) per further part (the nodes' run goes here)
    return result
