"""Broker nodes of a cluster: leases by compare-and-set, the bridge's fence, and the
fault run (three NATS servers with replicas 3, broker nodes killed, started, and a NATS server killed).

Everything runs against real nats-servers from the cluster extra's wheel (tests/support/natsproc.py skips cleanly
without it). The fence test drives two `Bridge`s on one event loop with a stand-in for each node's local
broker (`FakeLocal`, a test double: the bridge's side of NATS is what is under test); the fault test runs
real `shmbroker supervise` nodes.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from support.natsproc import start_or_skip

# -- with a server ------------------------------------------------------------------------

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.client.reader import Result  # noqa: E402
from shmbroker.cluster import subjects  # noqa: E402
from shmbroker.cluster.bridge import Bridge  # noqa: E402
from shmbroker.cluster.leases import Leases  # noqa: E402
from shmbroker.cluster.options import NodeSettings  # noqa: E402
from shmbroker.cluster.streams import ensure_streams  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings  # noqa: E402


@pytest.fixture(scope="module")
def server():
    s = start_or_skip(1)
    yield s
    s.stop()


async def _connect(url):
    import nats

    return await nats.connect(servers=[url], max_reconnect_attempts=0)


async def _until(cond, timeout_seconds: float = 5.0):
    end = time.monotonic() + timeout_seconds
    while not cond():
        assert time.monotonic() < end, "condition not reached in time"
        await asyncio.sleep(0.01)


def test_leases_are_taken_by_compare_and_set_and_lost_when_expired(server):
    names = ClusterNames(leases_bucket="L1", prompts_stream="P1", results_stream="R1", subject_prefix="l1")
    now = [100.0]

    async def scenario():
        nc = await _connect(server.urls[0])
        js = nc.jetstream()
        await ensure_streams(js, names, StreamSettings(prompts_max_bytes=1 << 20, results_max_bytes=1 << 20))
        kv = await js.key_value(names.leases_bucket)
        a = Leases(kv, "a", 4, 1.0, clock=lambda: now[0])
        b = Leases(kv, "b", 4, 1.0, clock=lambda: now[0])
        await a.start()
        await b.start()
        try:
            assert await a.take(0)
            await _until(lambda: "part.0" in b.seen and b.seen["part.0"].revision == a.held[0])
            assert not await b.take(0)  # held, not expired: refused
            assert b.owners() == {0: "a"}
            await a.beat({0: 5.0})
            await _until(lambda: "node.a" in b.seen)
            assert b.live_nodes() == ["a", "b"] and b.loads() == {0: 5.0}
            assert await a.renew() == [] and a.fresh(0)
            await _until(lambda: b.seen["part.0"].revision == a.held[0])
            now[0] += 1.5  # a says nothing for longer than the lease: b sees it expired
            assert b.live_nodes() == ["b"] and b.owners() == {}
            assert not a.fresh(0)  # a may not act on p 0 until it renews
            assert await b.take(0)
            assert await a.renew() == [0]  # a's write at its old revision fails: it lost p 0
            assert 0 not in a.held and not a.fresh(0) and b.fresh(0)
            assert (a.num_taken, a.num_lost, b.num_taken) == (1, 1, 1)
            await b.release(0)
            await _until(lambda: "part.0" not in a.seen)
            assert await a.take(0)  # free again: taken by create
        finally:
            await a.close()
            await b.close()
            await nc.close()

    asyncio.run(scenario())


class FakeLocal:
    """Test double of a node's local broker (a `Producer` of it): items are kept, and their results
    come out only when the test calls `finish()`."""

    def __init__(self):
        self.items: dict[int, int] = {}  # local id -> max_new_tokens
        self.ready: list[Result] = []
        self.next_id = 1

    def submit(self, tokens, *, max_new_tokens, prefix_len=None, model=None, block=True):
        self.items[self.next_id] = max_new_tokens
        self.next_id += 1
        return self.next_id - 1

    def submit_many(self, flat, offsets, *, max_new_tokens, prefix_len=None, model=None, block=True, options=None):
        return np.array([self.submit(flat[a:b], max_new_tokens=int(m), model=model)
                         for a, b, m in zip(offsets[:-1], offsets[1:], max_new_tokens)], np.uint64)

    def finish(self) -> int:
        self.ready += [Result(i, "ok", np.arange(n, dtype=np.uint32)) for i, n in self.items.items()]
        n = len(self.items)
        self.items.clear()
        return n

    def pop_results(self, max_results=256):
        out, self.ready = self.ready[:max_results], self.ready[max_results:]
        return out

    def ack(self):
        pass


def test_a_paused_node_that_wakes_after_its_lease_moved_delivers_nothing(server):
    """Node a stages prompts, then stops (as if SIGSTOPped) past its lease; node b takes the partitions,
    runs the redelivered prompts and answers. When a wakes with its results, it must not publish
    them: it finds its leases gone and forgets (fences) what it staged."""
    names = ClusterNames(leases_bucket="L2", prompts_stream="P2", results_stream="R2", subject_prefix="l2",
                         num_partitions=2)
    streams = StreamSettings(prompts_max_bytes=1 << 20, results_max_bytes=1 << 20, ack_wait_seconds=1.0)
    num_items = 10

    async def scenario():
        nca, ncb = await _connect(server.urls[0]), await _connect(server.urls[0])
        jsa, jsb = nca.jetstream(), ncb.jetstream()
        await ensure_streams(jsa, names, streams)
        la = Leases(await jsa.key_value(names.leases_bucket), "a", 2, 1.0)
        lb = Leases(await jsb.key_value(names.leases_bucket), "b", 2, 1.0)
        local_a, local_b = FakeLocal(), FakeLocal()
        a = Bridge(jsa, nca, la, names, streams, NodeSettings("a", lease_seconds=1.0), local_a)
        b = Bridge(jsb, ncb, lb, names, streams, NodeSettings("b", lease_seconds=1.0), local_b)
        await la.start()
        try:
            await a.round()
            assert sorted(la.held) == [0, 1]
            for seq in range(num_items):
                payload = subjects.encode_prompt(np.arange(1, 9, dtype=np.uint32) + seq, seq, 3, None)
                await jsa.publish(names.prompt_subject(seq % 2), payload, headers=subjects.prompt_headers("prod", seq, None))
            end = time.monotonic() + 10
            while len(a.staged) < num_items:
                assert time.monotonic() < end
                await a.round()
                await asyncio.sleep(0.01)
            for task in a.pullers.values():  # a freezes: nothing of it runs from here
                task.cancel()
            await lb.start()
            end = time.monotonic() + 15
            while b.counts["acked"] < num_items:  # b: a's leases expire, b takes them, a's prompts come again
                assert time.monotonic() < end, (b.counts, lb.held)
                await b.round()
                local_b.finish()
                await asyncio.sleep(0.01)
            assert sorted(lb.held) == [0, 1]
            assert local_a.finish() == num_items  # a's engine finished too, while it was frozen
            await a.round()  # a wakes: its renewal fails first
            for _ in range(5):
                await a.round()
            assert a.counts["fenced"] == num_items and a.counts["published"] == 0 and a.counts["acked"] == 0
            assert a.counts["unknown_results"] == num_items and la.num_lost == 2 and not la.held
            info = await jsa.stream_info(names.results_stream)
            assert info.state.messages == num_items  # one result per item, b's
            assert b.counts["published"] == num_items
            prompts = await jsa.stream_info(names.prompts_stream)
            assert prompts.state.messages == 0  # every prompt acked (by b)
        finally:
            for br in (a, b):
                for task in br.pullers.values():
                    task.cancel()
            await la.close()
            await lb.close()
            await nca.close()
            await ncb.close()

    asyncio.run(scenario())


def test_a_malformed_prompt_fails_alone(server):
    """A torn prompt that names its item is answered `invalid`; one that names nothing is terminated; the
    good prompts around them go through."""
    names = ClusterNames(leases_bucket="L3", prompts_stream="P3", results_stream="R3", subject_prefix="l3",
                         num_partitions=1)
    streams = StreamSettings(prompts_max_bytes=1 << 20, results_max_bytes=1 << 20, ack_wait_seconds=1.0)

    async def scenario():
        nc = await _connect(server.urls[0])
        js = nc.jetstream()
        await ensure_streams(js, names, streams)
        leases = Leases(await js.key_value(names.leases_bucket), "a", 1, 1.0)
        local = FakeLocal()
        br = Bridge(js, nc, leases, names, streams, NodeSettings("a", lease_seconds=1.0), local)
        await leases.start()
        try:
            def good(seq):
                return subjects.encode_prompt(np.arange(1, 5, dtype=np.uint32), seq, 2, None)

            await js.publish(names.prompt_subject(0), good(0), headers=subjects.prompt_headers("prod", 0, None))
            await js.publish(names.prompt_subject(0), good(1)[:30], headers=subjects.prompt_headers("prod", 1, None))
            await js.publish(names.prompt_subject(0), b"garbage")
            await js.publish(names.prompt_subject(0), good(2), headers=subjects.prompt_headers("prod", 2, None))
            await js.publish(names.prompt_subject(0), good(0), headers=subjects.prompt_headers("prod", 3, None))
            end = time.monotonic() + 10
            while br.counts["acked"] < 4:
                assert time.monotonic() < end, br.counts
                await br.round()
                local.finish()
                await asyncio.sleep(0.01)
            assert br.counts["refused"] == 3 and br.counts["submitted"] == 2
            sub = await js.pull_subscribe(names.result_subject("prod"), durable="chk", stream=names.results_stream)
            got = {}
            while len(got) < 4:
                for m in await sub.fetch(3, timeout=2):
                    r = subjects.decode_result(m.data)
                    got[r.seq] = (r.status, r.error)
            assert got[0][0] == "ok" and got[2][0] == "ok"
            assert got[1][0] == "invalid" and "does not hold its" in got[1][1]
            assert got[3][0] == "invalid" and "is not its producer's and payload's" in got[3][1]  # a forged id
            info = await js.stream_info(names.prompts_stream)
            assert info.state.messages == 0  # the garbage one too: terminated, not redelivered forever
        finally:
            for task in br.pullers.values():
                task.cancel()
            await leases.close()
            await nc.close()

    asyncio.run(scenario())


@pytest.mark.timeout(300)
def test_every_item_gets_exactly_one_result_through_node_and_server_faults(tmp_path):
    """Three NATS servers (replicas 3), two broker nodes; a remote producer submits while node-a is
    SIGKILLed and started again, node-c starts mid-run and one NATS server is killed and restarted."""
    pytest.importorskip("nats")
    start_or_skip(1).stop()  # skips without the server binary
    from shmbroker.bench.cluster_nodes import faults

    lease = 2.0
    r = faults(num_items=1200, seconds=16.0, lease_seconds=lease, base_dir=str(tmp_path))
    diag = {k: v for k, v in r.items() if k != "bridges"}
    assert r["submitted"] == r["items"] == 1200, diag
    assert r["lost"] == 0 and r["duplicated"] == 0 and r["unknown"] == 0, diag
    assert r["results"] == r["items"] and r["not_ok"] == 0, diag
    assert r["node_kills"] == 1
    # the dead node's partitions moved within its lease (plus one renewal round, and slack for 2 cores)
    assert r["takeover_seconds"] <= lease + lease / 3 + 1.5, diag
    c = r["bridges"]["node-c"]
    assert c is not None and c["leases_taken"] > 0, r["bridges"]  # the late node got partitions


@pytest.mark.timeout(300)
def test_throughput_through_one_and_two_nodes_answers_every_item(tmp_path):
    """`bench cluster`'s node throughput, small: every item answered, by the nodes that hold its partition."""
    start_or_skip(1).stop()
    from shmbroker.bench.cluster_nodes import throughput

    r = throughput(num_items=300, base_dir=str(tmp_path))
    assert r["one_node_items_per_s"] > 0 and r["two_node_items_per_s"] > 0
    assert sum(r["one_node_node_items"].values()) == 300
    assert sum(r["two_node_node_items"].values()) == 300 and len(r["two_node_node_items"]) == 2


@pytest.mark.timeout(120)
def test_a_nodes_status_top_and_exporter_show_its_bridge(server, tmp_path):
    """A real node on one server: its snapshot's "cluster", `top`'s cluster panel and the exporter's
    shmbroker_bridge_* metrics carry its partitions, leases and what it moved."""
    import io

    from prometheus_client import CollectorRegistry, generate_latest
    from rich.console import Console

    from shmbroker.bench.cluster_nodes import Client, LocalNode, wait_partitions
    from shmbroker.observe import top
    from shmbroker.observe.exporter import BrokerCollector
    from shmbroker.observe.watch import BrokerView

    node = LocalNode("solo", str(tmp_path), server.urls, lease_seconds=2.0, zero_cost=True)
    node.start()
    client = None
    try:
        wait_partitions([node], ClusterNames().num_partitions, 60)
        client = Client("ops", server.urls, StreamSettings(prompts_max_bytes=64 << 20, results_max_bytes=64 << 20))
        flat = np.arange(1, 201, dtype=np.uint32)
        client.submit(flat, np.array([0, 50, 120, 200]), np.array([2, 2, 2], np.uint32), 0, 3)
        end = time.monotonic() + 30
        while len(client.results) < 3:
            assert time.monotonic() < end, node.log_tail()
            client.read(0.5)
        end = time.monotonic() + 10
        while (node.bridge() or {}).get("acked", 0) < 3:  # published with the next statistics round
            assert time.monotonic() < end
            time.sleep(0.05)
        view = BrokerView.attach(node.data_dir)
        try:
            snap = view.snapshot()
            c = snap["cluster"]
            assert (c["node"], c["partitions"], c["live_nodes"], c["connected"]) == ("solo", 128, 1, 1)
            assert c["pulled"] == c["submitted"] == c["published"] == c["acked"] == 3 and c["leases_taken"] == 128
            console = Console(file=io.StringIO(), width=200, height=80, color_system=None)
            console.print(top.render(snap, {}))
            text = console.file.getvalue()
            assert "cluster" in text and "128 of 128" in text and "solo" in text
            registry = CollectorRegistry()
            registry.register(BrokerCollector(view))
            metrics = generate_latest(registry).decode()
            assert "shmbroker_bridge_partitions 128.0" in metrics
            assert "shmbroker_bridge_acked_items_total 3.0" in metrics
        finally:
            view.close()
    finally:
        if client is not None:
            client.close()
        node.stop()


@pytest.mark.timeout(180)
def test_request_options_cross_hosts_and_samples_come_back(server, tmp_path):
    """A RemoteProducer's request options ride each prompt message's headers to a real node, which
    submits them with its items; the samples, finish reasons and cached tokens come back in the
    result messages' headers. An options header that does not decode fails its item alone."""
    from shmbroker.bench.cluster_nodes import LocalNode, wait_partitions
    from shmbroker.cluster.remote import RemoteProducer
    from shmbroker.engines.sim import Sim
    from shmbroker.engines.sim_requests import sample_key, sampled_result
    from shmbroker.request.extras import decode_extras
    from shmbroker.request.options import parse_options

    node = LocalNode("opts", str(tmp_path), server.urls, lease_seconds=2.0)
    node.start()
    try:
        wait_partitions([node], ClusterNames().num_partitions, 60)
        prompt = np.arange(1, 301, dtype=np.uint32)
        body = {"n": 3, "temperature": 1.0, "seed": 9}
        with RemoteProducer("remote-opts", servers=server.urls,
                            settings=StreamSettings(prompts_max_bytes=64 << 20, results_max_bytes=64 << 20)) as p:
            sampled = p.submit(prompt, max_new_tokens=12, options=body)
            many = p.submit_many(np.tile(prompt, 2), np.array([0, 300, 600]), max_new_tokens=12,
                                 options={"temperature": 0.0})
            plain = p.submit(prompt, max_new_tokens=12)
            bad = int(plain) + 1000  # a prompt published by hand under a seq the producer has not used

            async def publish_bad():  # its options header is not base64
                nc = await _connect(server.urls[0])
                await nc.jetstream().publish(p.names.prompt_subject(0), subjects.encode_prompt(prompt, bad, 4, None),
                                             headers=subjects.prompt_headers(p.name, bad, None, "#not-base64#"))
                await nc.close()

            asyncio.run(publish_bad())
            got = {}
            end = time.monotonic() + 60
            while len(got) < 5:
                assert time.monotonic() < end, (sorted(got), node.log_tail())
                for r in p.results(1.0):
                    got[int(r.item_id)] = r
        r = got[int(sampled)]
        assert r.status == "ok" and len(r.samples) == 3, (r.status, r.error)
        # the simulated engine's three samples under these options: seeded, a function of the prompt and
        # the seed alone, whatever the item's id on the node (engines/sim_requests.py)
        opts = parse_options(body)
        key = sample_key(0, Sim.digest(prompt), opts)
        tokens, extras = sampled_result(0, key, 12, opts, lambda keys, counts: Sim.generated_many(
            np.zeros(keys.size, np.uint64), counts, keys=keys).flat)
        want = decode_extras(extras, tokens.size)
        assert r.tokens.tolist() == tokens.tolist() and r.finish_reasons == want.finish_reasons
        assert len({tuple(s.tolist()) for s in r.samples}) == 3
        greedy = [got[int(i)] for i in many]
        assert all(g.status == "ok" for g in greedy) and greedy[0].tokens.tolist() == greedy[1].tokens.tolist()
        assert got[int(plain)].status == "ok" and got[int(plain)].finish_reasons == ("length",)
        assert got[int(plain)].cached_tokens is not None  # the node's packed engine said it, across hosts
        assert got[bad].status == "invalid" and "options header is not base64" in got[bad].error
    finally:
        node.stop()
