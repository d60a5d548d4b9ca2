"""Small runs of `shmbroker bench cluster` (bench/affinity.py), so that the benchmark cannot rot.

No marks asserted (a small slice of a workload has too few conversations for them): the JSON
interface, and invariants that hold on any workload: every item routed to one node, the hit rates
in range, the bound of bounded loads where the greedy's condition holds, key_blocks 0 sending the
trace (every item shares its first block) to one node.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from shmbroker.bench import affinity, cluster_throughput
from shmbroker.cli import main

pytestmark = pytest.mark.timeout(120)

TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
INTERFACE = ("single_node_hit_rate", "two_node_hit_rate", "random_routing_hit_rate", "cluster_vs_single", "random_vs_single",
             "node_tokens", "node_load_ratio", "num_partitions", "key_blocks", "epsilon")


def check(result: dict) -> None:
    for key in INTERFACE:
        assert key in result, key
    json.dumps(result, allow_nan=False)  # plain JSON, no Infinity
    total = result["input_tokens"]
    assert sum(result["node_tokens"]) == total
    assert sum(result["random_node_tokens"]) == total
    for routing in ("single", "cluster", "random"):
        assert sum(n["items"] for n in result[routing]["nodes"]) == result["items"]
    for key in ("single_node_hit_rate", "two_node_hit_rate", "random_routing_hit_rate"):
        assert 0 <= result[key] < 1
        assert 0 <= result["streaming"][key] < 1
    mean = total / len(result["node_tokens"])
    if result["max_partition_share"] * total <= result["epsilon"] * mean:  # the greedy's condition
        assert max(result["node_tokens"]) <= (1 + result["epsilon"]) * mean * (1 + 1e-9)
    for change in ("join", "leave"):
        assert 0 <= result[change]["partitions"] <= 1
    assert sum(result["join"]["node_tokens"]) == total
    assert [row["key_blocks"] for row in result["key_blocks_sweep"]] == list(affinity.SWEEP_KEY_BLOCKS)
    assert [row["nodes"] for row in result["placement_by_nodes"]] == list(affinity.SPREAD_NODES)
    for row in result["placement_by_nodes"]:
        assert row["min_vs_mean"] <= 1 <= row["max_vs_mean"]
    assert [row["epsilon"] for row in result["drift"]] == list(affinity.SWEEP_EPSILONS)


THROUGHPUT = ("raw_publish_items_per_s", "remote_submit_items_per_s", "remote_submit_one_items_per_s")


def nats_or_skip() -> None:
    """The throughput run starts its own nats-server: skip cleanly without nats-py or the binary."""
    pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")
    from shmbroker.cluster.servers import server_binary
    from shmbroker.errors import ConfigError

    try:
        server_binary()
    except ConfigError as exc:
        pytest.skip(str(exc))


def check_throughput(result: dict, num_items: int) -> None:
    json.dumps(result, allow_nan=False)
    for key in (*THROUGHPUT, "client_vs_raw"):
        assert result[key] > 0, key
    assert result["throughput"]["items"] == num_items
    for repeat in result["throughput"]["repeats"]:
        for key in THROUGHPUT:
            assert repeat[key] > 0
        # the stream held exactly the published items after each side (counted before the purge)
        assert repeat["stored"] == {"raw": num_items, "submit_many": num_items, "submit": num_items}


def test_throughput_of_a_few_hundred_items():
    nats_or_skip()
    result = cluster_throughput.run(num_items=300, num_repeats=1)
    check_throughput(result, 300)
    assert len(result["throughput"]["repeats"]) == 1


def test_the_generator_through_the_cli(monkeypatch, capsys):
    nats_or_skip()
    monkeypatch.setattr(affinity, "TRACE", Path("/nonexistent/trace.jsonl"))  # the seeded generator
    assert main(["bench", "cluster", "--json", "--scale", "0.02", "--items", "200", "--repeats", "1", "--no-nodes"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1
    result = json.loads(lines[0])
    check(result)
    check_throughput(result, 200)
    assert result["items"] == 400
    assert (result["key_blocks"], result["num_partitions"]) == (1, 128)


@pytest.mark.skipif(not TRACE.exists(),
                    reason=f"Mooncake trace not found at {TRACE} (the shared traces folder is optional)")
def test_a_slice_of_the_trace():
    result = affinity.run(trace=str(TRACE), scale=0.05)
    check(result)
    family_only = result["key_blocks_sweep"][0]
    assert family_only["key_blocks"] == 0
    assert family_only["max_partition_share"] == 1.0  # every item shares its first block
    assert family_only["node_load_ratio"] is None and min(family_only["node_tokens"]) == 0
    assert not math.isclose(result["two_node_hit_rate"], 0.0)
