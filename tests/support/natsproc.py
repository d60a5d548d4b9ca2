"""Test helper: local nats-servers from the cluster extra, or a clean skip when it is missing."""

from __future__ import annotations

import pytest


def start_or_skip(num_servers: int = 1, **kw):
    """NatsServers.start(num_servers), or pytest.skip naming what is missing (nats-py, the binary)."""
    pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")
    from shmbroker.cluster.servers import NatsServers, server_binary
    from shmbroker.errors import ConfigError

    try:
        server_binary()
    except ConfigError as exc:
        pytest.skip(str(exc))
    return NatsServers.start(num_servers, **kw)
