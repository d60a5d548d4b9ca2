"""`shmbroker bench cluster`: one JSON object of the routing simulation (affinity) and the
producer's throughput against plain nats-py (cluster_throughput) and real broker nodes on this
machine (cluster_nodes: the fault run's `lost`/`duplicated`/`node_kills`, items/s through one and
two nodes), merged at top level."""

from __future__ import annotations

from . import affinity, cluster_nodes, cluster_throughput


def run(trace: str | None = None, scale: float = 1.0, seed: int = 0, num_partitions: int | None = None,
        key_blocks: int | None = None, epsilon: float | None = None, num_items: int = 20000,
        num_repeats: int = 3, nodes: bool = True, say=lambda line: None) -> dict:
    result = affinity.run(trace=trace, scale=scale, seed=seed, num_partitions=num_partitions,
                          key_blocks=key_blocks, epsilon=epsilon)
    result.update(cluster_throughput.run(num_items=num_items, seed=seed, num_repeats=num_repeats, trace=trace))
    if nodes:  # broker nodes on this machine: faults, then items/s through one node and two
        result.update(cluster_nodes.run(num_items=num_items, seed=seed, say=say))
        result["node_ceiling"] = {
            "cores": result["nodes_throughput"]["cores"],
            "raw_publish_items_per_s": result["raw_publish_items_per_s"],
            "limits": "every item crosses JetStream twice (prompt in, result out) plus an ack, through one "
                      "bridge process per node doing per-message Python work; the nodes, the NATS server and "
                      "the client share the machine's cores, so a second node on the same cores adds no CPU"}
    return result
