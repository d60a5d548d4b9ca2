"""The `[cluster]` table of the configuration (cluster/options.py): no server and no nats-py needed."""

from __future__ import annotations

import sys

import pytest

from shmbroker.config import settings
from shmbroker.errors import ConfigError


def test_cluster_table_reads_into_the_node_settings():
    cfg = settings.parse({"instance": "n1", "cluster": {
        "servers": ["nats://10.0.0.5:4222", "nats://10.0.0.6:4222"], "node": "gpu-7", "user": "node", "password": "s3cret",
        "num_partitions": 64, "replicas": 3, "ack_wait_seconds": 12.5, "max_ack_pending": 512, "lease_seconds": 4,
        "staging_items": 1000, "epsilon": 0.1, "tls_ca_file": "/etc/ca.pem", "prompts_stream": "P"}})
    c = cfg.cluster
    assert c.nats.servers == ("nats://10.0.0.5:4222", "nats://10.0.0.6:4222")
    assert (c.nats.user, c.nats.password, c.nats.tls_ca_file) == ("node", "s3cret", "/etc/ca.pem")
    assert (c.names.num_partitions, c.names.prompts_stream, c.names.results_stream) == (64, "P", "SHMB_RESULTS")
    assert (c.streams.replicas, c.streams.ack_wait_seconds, c.streams.max_ack_pending) == (3, 12.5, 512)
    assert (c.node.node, c.node.lease_seconds, c.node.staging_items, c.node.epsilon) == ("gpu-7", 4.0, 1000, 0.1)
    shown = settings.as_dict(cfg)["cluster"]["nats"]
    assert shown["password"] == "***" and shown["user"] == "node"  # `shmbroker config` shows no secret
    assert settings.parse({}).cluster is None
    default = settings.parse({"instance": "x1", "cluster": {}}).cluster
    assert default.nats.servers == ("nats://127.0.0.1:4222",) and default.node.node.endswith("-x1")


@pytest.mark.parametrize("table, needle", [
    ({"replicas": 2}, "replicas must be 1, 3 or 5"),
    ({"servers": "http://x"}, "cluster.servers"),
    ({"lease_seconds": 0}, "cluster.lease_seconds"),
    ({"node": "a.b"}, "node must match"),
    ({"user": "u"}, "user and password go together"),
    ({"bogus": 1}, "unknown key 'cluster.bogus'"),
    ({"num_partitions": 0}, "cluster.num_partitions"),
])
def test_cluster_table_errors_name_the_key(table, needle):
    with pytest.raises(ConfigError, match="x.toml") as exc:
        settings.parse({"cluster": table}, "x.toml")
    assert needle in str(exc.value)


def test_a_node_without_the_extra_names_it(monkeypatch, tmp_path):
    from shmbroker.supervisor.supervise import supervise

    monkeypatch.setitem(sys.modules, "nats", None)
    cfg = settings.parse({"cluster": {}}, data_dir=str(tmp_path / "d"))
    with pytest.raises(ConfigError, match=r"pip install 'shmbroker\[cluster\]'"):
        supervise(cfg)
    assert not (tmp_path / "d").exists()  # refused before anything started


