"""The `[cluster]` table read into the cluster's dataclasses (cluster/options.py, cluster/subjects.py).

Its keys are written flat in `[cluster]`; each is a field of one of `HOLDERS` (the connection, the
names, the streams, the node's own settings), which declares its default. Every key is optional.
`CLUSTER_CHECKS` holds each key's check, in the order they are read; `servers` is read on its own.
"""

from __future__ import annotations

import dataclasses

from ..cluster.options import ClusterConfig, NatsOptions, NodeSettings, default_node_name
from ..cluster.subjects import ClusterNames, StreamSettings
from ..errors import ConfigError
from .validator import Integer, Number, Text, Validator

HOLDERS = (NatsOptions, ClusterNames, StreamSettings, NodeSettings)  # ClusterConfig's parts, in its order
SERVER_SCHEMES = ("nats://", "tls://")
CLUSTER_CHECKS = {
    **{key: Text() for key in ("user", "password", "token", "nkeys_seed_file", "tls_ca_file", "tls_cert_file",
                               "tls_key_file", "subject_prefix", "prompts_stream", "results_stream", "leases_bucket",
                               "node")},
    "num_partitions": Integer(1, 1 << 20),
    "replicas": Integer(1, 5),
    "prompts_max_bytes": Integer(1 << 20, 1 << 50),
    "results_max_bytes": Integer(1 << 20, 1 << 50),
    "max_ack_pending": Integer(1, 1 << 24),
    "staging_items": Integer(1, 1 << 24),
    "ack_wait_seconds": Number(0.1, 86400.0),
    "duplicate_window_seconds": Number(1.0, 86400.0 * 7),
    "lease_seconds": Number(0.1, 3600.0),
    "epsilon": Number(0.0, 10.0),
}
CLUSTER_KEYS = ("servers", *CLUSTER_CHECKS)


def parse_cluster(v: Validator, raw, instance: str) -> ClusterConfig:
    """The `[cluster]` table (`raw`, parsed TOML) checked; ConfigError naming `cluster.<key>`."""
    if not isinstance(raw, dict):
        v.fail("cluster", "must be a table ([cluster])", raw)
    v.no_unknown(raw, set(CLUSTER_KEYS), "cluster")
    values: dict = {}
    if "servers" in raw:
        values["servers"] = servers(v, raw["servers"])
    for key, check in CLUSTER_CHECKS.items():
        if key in raw:
            values[key] = check.read(v, raw, key, "cluster")
    values.setdefault("node", default_node_name(instance))
    values.setdefault("name", f"shmb-node-{values['node']}")
    built = []
    for holder in HOLDERS:
        mine = {f.name: values[f.name] for f in dataclasses.fields(holder) if f.name in values}
        try:
            built.append(holder(**mine))
        except (ValueError, ConfigError) as exc:
            why = str(exc).split(": ", 1)[-1] if isinstance(exc, ConfigError) else str(exc)
            raise ConfigError(f"{v.where}: cluster: {why}") from None
    return ClusterConfig(*built)


def servers(v: Validator, value) -> tuple[str, ...]:
    """`servers`: one nats:// (or tls://) URL or a list of them."""
    urls = [value] if isinstance(value, str) else value
    if not isinstance(urls, list) or not urls or not all(isinstance(s, str) and s.startswith(SERVER_SCHEMES)
                                                         for s in urls):
        v.fail("cluster.servers", "must be a nats:// (or tls://) URL or a list of them", value)
    return tuple(urls)
