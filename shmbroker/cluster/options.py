"""A node's cluster configuration: the `[cluster]` table, read into frozen dataclasses here.

    [cluster]
    servers = ["nats://10.0.0.5:4222", "nats://10.0.0.6:4222"]   # default: nats://127.0.0.1:4222
    node = "gpu-host-7"             # this node's name in leases (default: the host name and instance)
    user = "node"                   # credentials: user + password, or token, or nkeys_seed_file
    password = "..."
    tls_ca_file = "/etc/nats/ca.pem"  # TLS when a CA or a client certificate is given
    subject_prefix = "shmb"         # names (subjects.ClusterNames)
    prompts_stream = "SHMB_PROMPTS"
    results_stream = "SHMB_RESULTS"
    leases_bucket = "SHMB_LEASES"
    num_partitions = 128
    replicas = 3                    # stream limits and windows (subjects.StreamSettings)
    prompts_max_bytes = 8589934592
    results_max_bytes = 8589934592
    ack_wait_seconds = 30.0
    max_ack_pending = 4096
    lease_seconds = 10.0            # the node's own (NodeSettings)
    staging_items = 4096
    epsilon = 0.05

Every key is optional; its default is declared once, in the dataclass that holds it. nats-py is
not imported here: a configuration reads without the cluster extra, and a node started with one
fails at its start naming the extra (`nats_loop.require_nats`).
"""

from __future__ import annotations

import dataclasses
import re
import socket
from dataclasses import dataclass

from ..config.defaults import DEFAULT_CLUSTER_EPSILON
from ..config.validator import Validator
from ..errors import ConfigError
from .subjects import ClusterNames, StreamSettings

DEFAULT_SERVERS = ("nats://127.0.0.1:4222",)
NODE_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a key token of the leases bucket


@dataclass(frozen=True)
class NatsOptions:
    """How to reach and authenticate to the NATS servers (credentials optional; TLS when a CA or cert is given)."""

    servers: tuple[str, ...] = DEFAULT_SERVERS
    user: str | None = None
    password: str | None = None
    token: str | None = None
    nkeys_seed_file: str | None = None
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    name: str | None = None  # the connection's name in the servers' monitoring
    inbox_prefix: str | None = None  # replies come to <inbox_prefix>.*: a producer's own (permissions.py)
    connect_timeout_seconds: float = 5.0
    reconnect_wait_seconds: float = 0.5
    max_reconnect_attempts: int = 120  # with the wait above: about a minute without any server, then closed

    def __post_init__(self):
        if isinstance(self.servers, str):
            object.__setattr__(self, "servers", (self.servers,))
        if not self.servers or not all(isinstance(s, str) and s for s in self.servers):
            raise ConfigError(f"servers must be one or more nats:// URLs, got {self.servers!r}")
        if (self.user is None) != (self.password is None):
            raise ConfigError("user and password go together")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ConfigError("tls_key_file needs tls_cert_file")
        if self.max_reconnect_attempts < 0 or not self.connect_timeout_seconds > 0:
            raise ConfigError("max_reconnect_attempts must be >= 0 and connect_timeout_seconds positive")

    def tls_context(self):
        if self.tls_ca_file is None and self.tls_cert_file is None:
            return None
        import ssl

        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.tls_ca_file)
        if self.tls_cert_file is not None:
            ctx.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return ctx



@dataclass(frozen=True)
class NodeSettings:
    """How a node takes part: its name, its leases, its staging window, its placement."""

    node: str
    lease_seconds: float = 10.0  # a lease (and a node's heartbeat) not renewed this long is expired
    staging_items: int = 4096  # prompts pulled and not yet answered, at most (the node's staging window)
    epsilon: float = DEFAULT_CLUSTER_EPSILON  # no node above (1 + epsilon) x the mean of pending tokens

    def __post_init__(self):
        if NODE_NAME_RE.fullmatch(self.node) is None:
            raise ValueError(f"node must match [A-Za-z0-9_-]{{1,64}}, got {self.node!r}")
        if not 0.1 <= self.lease_seconds <= 3600:
            raise ValueError(f"lease_seconds must be in 0.1..3600, got {self.lease_seconds!r}")
        if self.staging_items < 1:
            raise ValueError(f"staging_items must be at least 1, got {self.staging_items!r}")
        if not 0 <= self.epsilon <= 10:
            raise ValueError(f"epsilon must be in 0..10, got {self.epsilon!r}")


@dataclass(frozen=True)
class ClusterConfig:
    """The `[cluster]` table: where the servers are, what things are called, the node's own settings."""

    nats: NatsOptions
    names: ClusterNames
    streams: StreamSettings
    node: NodeSettings


def default_node_name(instance: str) -> str:
    """The host's name (its first label) and the broker's instance, as a key token."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname().split(".")[0]) or "node"
    return f"{host}-{instance}"[:64]


_STRINGS = ("user", "password", "token", "nkeys_seed_file", "tls_ca_file", "tls_cert_file", "tls_key_file",
            "subject_prefix", "prompts_stream", "results_stream", "leases_bucket", "node")
_INTEGERS = {"num_partitions": (1, 1 << 20), "replicas": (1, 5), "prompts_max_bytes": (1 << 20, 1 << 50),
             "results_max_bytes": (1 << 20, 1 << 50), "max_ack_pending": (1, 1 << 24), "staging_items": (1, 1 << 24)}
_NUMBERS = {"ack_wait_seconds": (0.1, 86400.0), "duplicate_window_seconds": (1.0, 86400.0 * 7),
            "lease_seconds": (0.1, 3600.0), "epsilon": (0.0, 10.0)}
_HOLDERS = (NatsOptions, ClusterNames, StreamSettings, NodeSettings)


def parse_cluster(v: Validator, raw, instance: str) -> ClusterConfig:
    """The `[cluster]` table (`raw`, parsed TOML) checked; ConfigError naming `cluster.<key>`."""
    if not isinstance(raw, dict):
        v.fail("cluster", "must be a table ([cluster])", raw)
    known = set(_STRINGS) | set(_INTEGERS) | set(_NUMBERS) | {"servers"}
    v.no_unknown(raw, known, "cluster")
    values: dict = {}
    if "servers" in raw:
        servers = raw["servers"]
        servers = [servers] if isinstance(servers, str) else servers
        if not isinstance(servers, list) or not servers or not all(isinstance(s, str) and s.startswith(("nats://", "tls://"))
                                                                    for s in servers):
            v.fail("cluster.servers", "must be a nats:// (or tls://) URL or a list of them", raw["servers"])
        values["servers"] = tuple(servers)
    for key in _STRINGS:
        if key in raw:
            values[key] = v.string(raw, key, "cluster")
    for key, (lo, hi) in _INTEGERS.items():
        if key in raw:
            values[key] = v.integer(raw, key, lo, hi, at="cluster")
    for key, (lo, hi) in _NUMBERS.items():
        if key in raw:
            values[key] = v.number(raw, key, lo, hi, at="cluster")
    values.setdefault("node", default_node_name(instance))
    values.setdefault("name", f"shmb-node-{values['node']}")
    built = []
    for holder in _HOLDERS:
        mine = {f.name: values[f.name] for f in dataclasses.fields(holder) if f.name in values}
        try:
            built.append(holder(**mine))
        except (ValueError, ConfigError) as exc:
            why = str(exc).split(": ", 1)[-1] if isinstance(exc, ConfigError) else str(exc)
            raise ConfigError(f"{v.where}: cluster: {why}") from None
    return ClusterConfig(*built)
