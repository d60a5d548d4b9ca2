"""The bridge process of a broker node (`supervise` with a `[cluster]` table forks it): connect to
NATS, set the streams up, join the leases, and run the bridge (bridge.py) until told to stop.

It is the local broker's producer `cluster-bridge` (`LOCAL_PRODUCER`): its prompts enter through an
ingest ring like any producer's, and its results come back on that name's result ring. It beats
its role slot every round and publishes its counters (stats.BRIDGE) after each. A connection that
closes for good (no server for `max_reconnect_attempts`) ends the process; the supervisor starts
it again after its back-off.
"""

from __future__ import annotations

import asyncio
import logging

from ..control.roles import Kind
from ..control.segment import beat

log = logging.getLogger("shmbroker.bridge")

LOCAL_PRODUCER = "cluster-bridge"
LOCAL_CONNECT_SECONDS = 60.0  # the local broker's registry answers once every process is forked
IDLE_SECONDS = 0.005  # a round that moved nothing sleeps this long
STOP_DELIVER_SECONDS = 5.0  # a graceful stop delivers what comes this long, then hands the rest back
STATS_SECONDS = 0.1


def bridge_main(cfg, control, stopping) -> None:
    from ..client.producer import Producer
    from ..control.stats import StatsWriter
    from .nats_loop import require_nats

    nats = require_nats()
    role = control.roles.index(str(Kind.BRIDGE))
    slot = control.role(role)
    stats = StatsWriter(control, role)
    beat(slot)
    local = Producer(LOCAL_PRODUCER, data_dir=cfg.data_dir, connect_timeout_seconds=LOCAL_CONNECT_SECONDS)
    try:
        asyncio.run(_run(nats, cfg.cluster, local, slot, stats, stopping))
    finally:
        local.close()


async def _run(nats, cc, local, slot, stats, stopping) -> None:
    from .bridge import Bridge
    from .leases import Leases
    from .nats_loop import connect
    from .streams import ensure_streams

    state = {"reconnects": 0, "connected": 1}

    async def on_disconnect():
        state["connected"] = 0

    async def on_reconnect():
        state["reconnects"] += 1
        state["connected"] = 1

    async def on_error(exc):
        log.debug("nats: %s: %s", type(exc).__name__, exc)

    nc = await connect(nats, cc.nats, error_cb=on_error, disconnected_cb=on_disconnect, reconnected_cb=on_reconnect)
    js = nc.jetstream()
    try:
        await ensure_streams(js, cc.names, cc.streams, update=False)
        kv = await js.key_value(cc.names.leases_bucket)
        leases = Leases(kv, cc.node.node, cc.names.num_partitions, cc.node.lease_seconds)
        await leases.start()
        bridge = Bridge(js, nc, leases, cc.names, cc.streams, cc.node, local)
        log.info("node %s: bridge up on %s", cc.node.node, ", ".join(cc.nats.servers))
        v, idx = stats.values, stats.index
        base = v.copy()  # counters go on from the last bridge's (control/stats.py)
        next_stats = 0.0
        try:
            while not stopping():
                beat(slot)
                if nc.is_closed:
                    raise ConnectionError(f"the connection to NATS at {', '.join(cc.nats.servers)} closed")
                moved = await bridge.round()
                now = bridge.clock()
                if now >= next_stats:
                    next_stats = now + STATS_SECONDS
                    _publish(v, base, idx, bridge, leases, state)
                    stats.publish()
                if not moved:
                    await asyncio.sleep(IDLE_SECONDS)
            if stopping() == 1:
                await bridge.stop(STOP_DELIVER_SECONDS)
            _publish(v, base, idx, bridge, leases, state)
            stats.publish()
        finally:
            await leases.close()
    finally:
        try:
            await asyncio.wait_for(nc.close(), 2.0)
        except Exception:  # already gone
            pass


def _publish(v, base, idx, bridge, leases, state) -> None:
    """The bridge's counters and gauges into the statistics words (stats.BRIDGE)."""
    for key, n in bridge.counts.items():
        v[idx[key]] = n
    v[idx["leases_taken"]] = leases.num_taken
    v[idx["leases_lost"]] = leases.num_lost
    v[idx["leases_released"]] = leases.num_released
    v[idx["nats_reconnects"]] = state["reconnects"]
    v[idx["connected"]] = state["connected"]
    v[idx["partitions"]] = len(leases.held)
    v[idx["draining"]] = bridge.num_draining
    v[idx["live_nodes"]] = len(leases.live_nodes())
    v[idx["staged_items"]] = len(bridge.staged) + len(bridge.waiting)
    v[idx["stream_items"]] = sum(bridge.stream_items.get(p, 0) for p in leases.held)
