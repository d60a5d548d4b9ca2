"""The NATS permissions of cluster/permissions.py on a real server: a producer submits and reads its
own results (and publishes payloads to the payloads bucket), and cannot read another producer's (by its
consumer, its subject, or its inbox)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from support.natsproc import start_or_skip

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.cluster import subjects  # noqa: E402
from shmbroker.cluster.nats_loop import NatsLoop  # noqa: E402
from shmbroker.cluster.options import NatsOptions  # noqa: E402
from shmbroker.cluster.permissions import authorization_block  # noqa: E402
from shmbroker.cluster.remote import RemoteProducer  # noqa: E402
from shmbroker.cluster.streams import ensure_results_consumer, ensure_streams  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings  # noqa: E402
from shmbroker.request.structured import digest_of  # noqa: E402

SMALL = StreamSettings(prompts_max_bytes=4 << 20, results_max_bytes=4 << 20)
NAMES = ClusterNames()


@pytest.fixture(scope="module")
def server():
    block = authorization_block(NAMES, producers={"alice": "pa", "bob": "pb"}, trusted={"node": "pn"})
    s = start_or_skip(1, authorization=block)
    admin = NatsLoop(NatsOptions(servers=tuple(s.urls), user="node", password="pn"))

    async def setup(js):
        await ensure_streams(js, NAMES, SMALL)
        for p in ("alice", "bob"):
            await ensure_results_consumer(js, NAMES, SMALL, p)

    admin.call(setup, admin.js, timeout_seconds=10)
    yield s, admin
    admin.close()
    s.stop()


def _answer(admin, producer: str, seq: int) -> None:
    async def publish(js):
        await js.publish(NAMES.result_subject(producer), subjects.encode_result(seq, "ok", [7, 8]),
                         headers={subjects.HEADER_MSG_ID: subjects.msg_id(producer, seq)})

    admin.call(publish, admin.js, timeout_seconds=5)


def test_a_producer_submits_and_reads_only_its_own_results(server):
    s, admin = server
    opts = NatsOptions(servers=tuple(s.urls), user="alice", password="pa", inbox_prefix="_INBOX_alice")
    with RemoteProducer("alice", options=opts, create_streams=False, settings=SMALL) as alice:
        seq = alice.submit(np.arange(1, 40, dtype=np.uint32), max_new_tokens=2)
        schema = b'{"type":"object"}'  # a constraint's payload: to the payloads bucket
        assert alice.put_payload(schema) == digest_of(schema) and alice.put_payload(schema) == digest_of(schema)
        _answer(admin, "alice", seq)
        _answer(admin, "bob", 12345)
        got = [r for r in alice.results(3.0)]
        assert [(r.item_id, r.status) for r in got] == [(seq, "ok")]
    # bob's result is still there for bob alone
    bob_opts = NatsOptions(servers=tuple(s.urls), user="bob", password="pb", inbox_prefix="_INBOX_bob")
    with RemoteProducer("bob", options=bob_opts, create_streams=False, settings=SMALL) as bob:
        assert [r.item_id for r in bob.results(3.0)] == [12345]


def test_a_producer_cannot_read_another_producers_results(server):
    s, admin = server
    _answer(admin, "bob", 777)
    import nats
    import nats.errors
    import nats.js.errors

    async def as_alice():
        errors, seen = [], []

        async def on_error(exc):
            errors.append(exc)

        async def on_msg(msg):
            seen.append(msg)

        nc = await nats.connect(servers=s.urls, user="alice", password="pa", inbox_prefix="_INBOX_alice",
                                error_cb=on_error, max_reconnect_attempts=0)
        js = nc.jetstream(timeout=1.0)
        outcomes = {}
        try:  # bob's durable consumer
            sub = await js.pull_subscribe_bind("res-bob", NAMES.results_stream)
            await sub.fetch(1, timeout=1.0)
            outcomes["consumer"] = "read"
        except (nats.errors.TimeoutError, nats.js.errors.APIError, nats.errors.Error) as exc:
            outcomes["consumer"] = type(exc).__name__
        await nc.subscribe(NAMES.result_subject("bob"), cb=on_msg)  # bob's subject
        await nc.subscribe("_INBOX_bob.>", cb=on_msg)  # bob's replies
        await nc.subscribe("_INBOX.>", cb=on_msg)  # anyone's default replies
        await asyncio.sleep(0.5)
        await nc.close()
        return outcomes, seen, errors

    outcomes, seen, errors = asyncio.run(as_alice())
    assert outcomes["consumer"] != "read"
    assert seen == []
    text = " ".join(str(e) for e in errors).lower()
    assert "permissions violation" in text and "_inbox_bob" in text and "shmb.results.bob" in text
    # and bob still gets it
    bob_opts = NatsOptions(servers=tuple(s.urls), user="bob", password="pb", inbox_prefix="_INBOX_bob")
    with RemoteProducer("bob", options=bob_opts, create_streams=False, settings=SMALL) as bob:
        assert 777 in [r.item_id for r in bob.results(3.0)]

