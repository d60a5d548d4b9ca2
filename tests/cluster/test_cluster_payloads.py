"""Constraints cross to cluster nodes (cluster/payloads.py), against a real nats-server and a real broker
node (`shmbroker supervise`, the simulated engine with a byte-level BPE tokenizer: it writes valid JSON for
a schema):

- a RemoteProducer's items sharing one schema, and one with another, come back `ok`, each output valid for
  its own schema; each payload is published to the bucket once, and stored once in the node's `payloads/`;
- a payload the bucket lacks, or one there that does not hash to its digest, fails its item `corrupt`; one
  over the node's max_payload_bytes fails its item `invalid` naming the limit; one over what a message of the
  servers can carry is refused at the producer, before anything is published.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from support.bpetok import bpe_tokenizer_dir
from support.natsproc import start_or_skip

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.bench.cluster_nodes import LocalNode, wait_partitions  # noqa: E402
from shmbroker.cluster.nats_loop import NatsLoop  # noqa: E402
from shmbroker.cluster.options import NatsOptions  # noqa: E402
from shmbroker.cluster.remote import RemoteProducer  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings  # noqa: E402
from shmbroker.disk.payloads import DIR_NAME  # noqa: E402
from shmbroker.errors import PayloadRefused  # noqa: E402
from shmbroker.request.options import RequestOptions, parse_options  # noqa: E402
from shmbroker.request.structured import Constraint, Structured, digest_of  # noqa: E402

pytestmark = pytest.mark.timeout(240)

NAMES = ClusterNames()  # the node's
NODE_MAX_PAYLOAD = 4096
SETTINGS = StreamSettings(prompts_max_bytes=64 << 20, results_max_bytes=64 << 20)
SCHEMAS = {
    "a": {"type": "object", "properties": {"name": {"type": "string", "minLength": 2},
                                           "age": {"type": "integer", "minimum": 3}}, "required": ["name", "age"]},
    "b": {"type": "object", "properties": {"color": {"enum": ["red", "green"]},
                                           "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2}}},
}
CONSUMER = """
[[consumers]]
name = "sim"
max_batch_size = 16
max_batch_tokens = 65536
max_input_len = 2048
engine_settings = {{ mode = "packed", cache_tokens = 262144, pace_seconds = 0.0, tokenizer = "{tok}" }}
"""


@dataclass
class StructuredNode(LocalNode):
    """A broker node whose one simulated consumer writes constrained outputs as text (its tokenizer)."""

    tokenizer: str = ""

    def config_text(self) -> str:
        cluster = super().config_text().split("\n[[consumers]]", 1)[0]
        return f"max_payload_bytes = {NODE_MAX_PAYLOAD}\n{cluster}\n{CONSUMER.format(tok=self.tokenizer)}"


def fmt(schema: dict) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}


def digest(schema: dict) -> bytes:
    return parse_options(fmt(schema)).structured.digest


def only_digest(payload: bytes) -> RequestOptions:
    """Options naming a payload by its digest alone: the producer publishes nothing for them."""
    return RequestOptions(structured=Structured(Constraint.JSON, digest_of(payload)))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    server = start_or_skip(1)
    base = tmp_path_factory.mktemp("payloads")
    tok = bpe_tokenizer_dir(base / "tok")
    node = StructuredNode("structured", str(base), server.urls, tokenizer=str(tok))
    admin = None
    node.start()
    try:
        wait_partitions([node], NAMES.num_partitions, 90)
        admin = NatsLoop(NatsOptions(servers=tuple(server.urls)))
        yield server, node, admin, tok
    finally:
        if admin is not None:
            admin.close()
        node.stop()
        server.stop()


def bucket_state(admin) -> tuple[int, int]:
    """(messages, last sequence) of the payloads bucket's stream."""

    async def info():
        s = (await admin.js.stream_info(f"KV_{NAMES.payloads_bucket}")).state
        return s.messages, s.last_seq

    return admin.call(info, timeout_seconds=10)


def results_of(p, want: int, node, timeout_seconds: float = 120.0) -> dict:
    got, end = {}, time.monotonic() + timeout_seconds
    while len(got) < want:
        assert time.monotonic() < end, (len(got), want, node.log_tail())
        for r in p.results(1.0):
            got[int(r.item_id)] = r
    return got


def test_constraints_cross_to_a_node_each_payload_published_and_stored_once(cluster):
    import jsonschema
    from tokenizers import Tokenizer

    server, node, admin, tok = cluster
    seen = []  # every message published on the bucket's subjects, stored or not

    async def watch():
        async def count(msg):
            seen.append(msg.subject)

        await admin.nc.subscribe(f"$KV.{NAMES.payloads_bucket}.>", cb=count)
        await admin.nc.flush()

    admin.call(watch, timeout_seconds=10)
    before = bucket_state(admin)
    a, b = SCHEMAS["a"], SCHEMAS["b"]
    with RemoteProducer("structured", servers=server.urls, settings=SETTINGS) as p:
        prompts = np.concatenate([np.arange(1 + i, 41 + i, dtype=np.uint32) for i in range(24)])
        many = p.submit_many(prompts, np.arange(0, 24 * 40 + 1, 40), max_new_tokens=64, options=fmt(a))
        ones = [p.submit(np.arange(7, 30 + i, dtype=np.uint32), max_new_tokens=64, options=fmt(a)) for i in range(4)]
        other = p.submit(np.arange(3, 50, dtype=np.uint32), max_new_tokens=64, options=fmt(b))
        lacking = p.submit(np.arange(5, 60, dtype=np.uint32), max_new_tokens=64, options=only_digest(b'{"type":"null"}'))
        got = results_of(p, len(many) + len(ones) + 2, node)
    schema_of = {**{int(i): a for i in [*many, *ones]}, int(other): b}
    decode = Tokenizer.from_file(str(tok / "tokenizer.json")).decode
    for item, schema in schema_of.items():
        r = got[item]
        assert r.status == "ok", (item, r.status, r.error)
        jsonschema.validate(json.loads(decode(r.tokens.tolist())), schema)
    r = got[int(lacking)]
    assert r.status == "corrupt" and digest_of(b'{"type":"null"}').hex() in r.error, (r.status, r.error)
    # each payload published once (the subscription saw every publish), stored once, never replaced
    admin.call(admin.nc.flush, timeout_seconds=10)
    keys = {NAMES.payload_subject(digest(a)), NAMES.payload_subject(digest(b))}
    assert sorted(seen) == sorted(keys)
    after = bucket_state(admin)
    assert (after[0] - before[0], after[1] - before[1]) == (2, 2)
    stored = sorted(f.name for f in (Path(node.data_dir) / DIR_NAME).iterdir())
    assert stored == sorted(f"{digest(s).hex()}.bin" for s in (a, b))


def test_a_spoiled_or_oversized_payload_fails_its_item_and_never_runs_unconstrained(cluster):
    server, node, admin, _tok = cluster
    spoiled = b'{"type":"boolean"}'

    async def spoil():  # the key of `spoiled`'s digest holds other bytes
        kv = await admin.js.key_value(NAMES.payloads_bucket)
        await kv.put(digest_of(spoiled).hex(), b'{"type":"string"}')

    admin.call(spoil, timeout_seconds=10)
    over_node = {"type": "object", "description": "x" * (NODE_MAX_PAYLOAD + 100)}
    prompt = np.arange(9, 70, dtype=np.uint32)
    with RemoteProducer("structured-bad", servers=server.urls, settings=SETTINGS) as p:
        bad = p.submit(prompt, max_new_tokens=32, options=only_digest(spoiled))
        big = p.submit(prompt, max_new_tokens=32, options=fmt(over_node))
        before = bucket_state(admin)
        over_servers = {"type": "object", "description": "x" * (2 << 20)}
        with pytest.raises(PayloadRefused, match="max_payload"):
            p.submit(prompt, max_new_tokens=32, options=fmt(over_servers))
        assert bucket_state(admin) == before  # refused before anything was published
        got = results_of(p, 2, node)
    assert got[int(bad)].status == "corrupt" and digest_of(spoiled).hex() in got[int(bad)].error, got[int(bad)]
    r = got[int(big)]
    assert r.status == "invalid" and f"max_payload_bytes = {NODE_MAX_PAYLOAD}" in r.error, (r.status, r.error)
    names = {f.name for f in (Path(node.data_dir) / DIR_NAME).iterdir()}
    assert f"{digest_of(spoiled).hex()}.bin" not in names and f"{digest(over_node).hex()}.bin" not in names


class FlakyLocal:
    """Test double of a node's local Producer: `put_payload` fails as `errors` says, in turn, then stores."""

    def __init__(self, data_dir, errors):
        self.data_dir, self.errors, self.stored = data_dir, list(errors), []

    def put_payload(self, payload: bytes) -> bytes:
        if self.errors:
            raise self.errors.pop(0)
        self.stored.append(payload)
        return digest_of(payload)


def test_a_node_tries_a_payload_again_after_a_failure_that_may_pass_and_remembers_a_refusal(cluster, tmp_path):
    import asyncio

    import nats

    from shmbroker.cluster.payloads import RETRY_SECONDS, NodePayloads
    from shmbroker.errors import NotRunning

    server, _node, _admin, _tok = cluster
    kept, refused = b'{"type":"integer"}', b'{"type":"number"}'
    now = [0.0]

    async def scenario():
        nc = await nats.connect(servers=server.urls, max_reconnect_attempts=0)
        js = nc.jetstream()
        kv = await js.key_value(NAMES.payloads_bucket)
        for payload in (kept, refused):
            await kv.put(digest_of(payload).hex(), payload)
        try:
            local = FlakyLocal(str(tmp_path), [NotRunning("restarting")])
            node = NodePayloads(js, NAMES, local, clock=lambda: now[0])
            opts = only_digest(kept)
            assert await node.prepare(opts) is False  # the local broker is restarting: later
            assert await node.prepare(opts) is False and node.counts["errors"] == 1  # not before RETRY_SECONDS
            now[0] += RETRY_SECONDS
            assert await node.prepare(opts) is True and local.stored == [kept]
            assert await node.prepare(opts) is True and node.counts["fetched"] == 1  # remembered: read once
            node.check(opts)
            local.errors = [PayloadRefused("over max_payload_bytes = 1")]
            opts = only_digest(refused)
            assert await node.prepare(opts) is True  # submitted, and answered invalid by check
            with pytest.raises(PayloadRefused, match="max_payload_bytes"):
                node.check(opts)
            assert await node.prepare(opts) is True and node.counts["refused"] == 1  # not asked again
        finally:
            await nc.close()

    asyncio.run(scenario())
