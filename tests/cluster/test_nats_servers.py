"""Local nats-server clusters (cluster/servers.py): a 3-server JetStream cluster starts, a
replicas-3 stream survives a SIGKILLed server with publishes going on, the server rejoins on
restart; stop leaves no process and no directory."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from support.natsproc import start_or_skip

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from nats.js.api import StreamConfig  # noqa: E402

from shmbroker.cluster.nats_loop import NatsLoop  # noqa: E402
from shmbroker.cluster.options import NatsOptions  # noqa: E402
from shmbroker.cluster.remote import RemoteProducer  # noqa: E402
from shmbroker.cluster.servers import NatsServers  # noqa: E402
from shmbroker.cluster.subjects import StreamSettings  # noqa: E402

PUBLISH_DEADLINE_SECONDS = 20.0


@pytest.fixture(scope="module")
def cluster():
    s = start_or_skip(3)
    yield s
    s.stop()


def publish_until_stored(loop: NatsLoop, subject: str, payload: bytes, msg_id: str):
    """Publish with retries (a stream leader may be being elected); the server drops the repeats."""
    deadline = time.monotonic() + PUBLISH_DEADLINE_SECONDS
    while True:
        try:
            return loop.call(loop.js.publish, subject, payload, 2.0, None, {"Nats-Msg-Id": msg_id}, timeout_seconds=3.0)
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_a_replicated_stream_survives_a_killed_server_which_rejoins(cluster):
    assert len(cluster.urls) == 3 and all(u.startswith("nats://127.0.0.1:") for u in cluster.urls)
    for i in range(3):
        d = os.path.join(cluster.base_dir, f"n{i}")
        assert os.stat(os.path.join(d, "store")).st_mode & 0o777 == 0o700
    loop = NatsLoop(NatsOptions(servers=tuple(cluster.urls), reconnect_wait_seconds=0.1))
    try:
        config = StreamConfig(name="R3", subjects=["r3.*"], num_replicas=3, duplicate_window=60)
        info = loop.call(loop.js.add_stream, config, timeout_seconds=20)
        assert info.config.num_replicas == 3
        for k in range(20):
            publish_until_stored(loop, "r3.a", b"before %d" % k, f"t:{k}")
        # a producer whose streams exist (an R3 stream cannot be placed while a server is down)
        p = RemoteProducer("r3", servers=cluster.urls, settings=StreamSettings(replicas=3, prompts_max_bytes=8 << 20,
                           results_max_bytes=8 << 20), partition_fn=lambda *_: 0, connect_timeout_seconds=10.0)
        cluster.kill(0)
        assert not cluster.alive(0)
        for k in range(20, 40):
            publish_until_stored(loop, "r3.a", b"during %d" % k, f"t:{k}")
        publish_until_stored(loop, "r3.a", b"during 39", "t:39")  # a retry: dropped as a duplicate
        ids = p.submit_many(np.arange(1, 101, dtype=np.uint32), np.arange(0, 101, 10), max_new_tokens=1)
        assert ids.size == 10
        p.close()
        prompts = loop.call(loop.js.stream_info, "SHMB_PROMPTS", timeout_seconds=10)
        assert prompts.state.messages == 10 and prompts.config.num_replicas == 3
        cluster.restart(0)
        assert cluster.alive(0)
        for k in range(40, 50):
            publish_until_stored(loop, "r3.a", b"after %d" % k, f"t:{k}")
        state = loop.call(loop.js.stream_info, "R3", timeout_seconds=10)
        assert state.state.messages == 50
        # the restarted server caught up: it serves the stream on its own
        alone = NatsLoop(NatsOptions(servers=(cluster.urls[0],)))
        try:
            deadline = time.monotonic() + PUBLISH_DEADLINE_SECONDS
            while True:
                si = alone.call(alone.js.stream_info, "R3", timeout_seconds=10)
                replicas = [si.cluster.leader] + [r.name for r in si.cluster.replicas if r.current]
                if si.state.messages == 50 and sorted(replicas) == ["n0", "n1", "n2"]:
                    break
                assert time.monotonic() < deadline, f"n0 did not rejoin: {si.cluster}"
                time.sleep(0.2)
        finally:
            alone.close()
    finally:
        loop.close()


def test_stop_kills_every_server_and_removes_its_directory():
    s = start_or_skip(1, user="u", password="p w")
    try:
        pids = [s.pid(0)]
        with pytest.raises(ConnectionError, match="Authorization"):
            NatsLoop(NatsOptions(servers=tuple(s.urls), connect_timeout_seconds=1.0, max_reconnect_attempts=0))
        ok = NatsLoop(NatsOptions(servers=tuple(s.urls), user="u", password="p w"))
        ok.close()
        ok.close()
        s.restart(0)
        pids.append(s.pid(0))
    finally:
        s.stop()
    s.stop()
    assert not os.path.exists(s.base_dir)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_bad_server_count_is_refused():
    with pytest.raises(ValueError, match="num_servers"):
        NatsServers.start(2)
