"""RemoteProducer against a real nats-server: subjects and message ids, duplicates, bad input
refused as Producer refuses it, back-pressure from a full stream, results once each, restarts,
torn results; and the message formats' decoders."""

from __future__ import annotations

import itertools
import sys
import time

import numpy as np
import pytest
from support.natsproc import start_or_skip

from shmbroker.errors import BrokerError, ConfigError, Full

nats = pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.cluster import subjects  # noqa: E402
from shmbroker.cluster.nats_loop import NatsLoop, require_nats  # noqa: E402
from shmbroker.cluster.options import NatsOptions  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings, decode_prompt, decode_result, encode_result  # noqa: E402

_ids = itertools.count()


def first_token_partition(tokens, prefix_len, model_id, num_partitions) -> int:
    """A stand-in for cluster.partition.partition_of: simple and predictable."""
    return int(tokens[0]) % num_partitions


def fresh_names(num_partitions: int = 16) -> ClusterNames:
    n = next(_ids)
    return ClusterNames(subject_prefix=f"t{n}", prompts_stream=f"P{n}", results_stream=f"R{n}",
                        leases_bucket=f"L{n}", num_partitions=num_partitions)


@pytest.fixture(scope="module")
def servers():
    s = start_or_skip(1)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def admin(servers):
    """A connection of the test's own, standing in for a broker node."""
    loop = NatsLoop(NatsOptions(servers=tuple(servers.urls)))
    yield loop
    loop.close()


SMALL = StreamSettings(prompts_max_bytes=16 << 20, results_max_bytes=16 << 20)  # a stream reserves its max_bytes


def producer(servers, name="p", names=None, settings=SMALL, **kw):
    from shmbroker.cluster.remote import RemoteProducer

    return RemoteProducer(name, servers=servers.urls, names=names or fresh_names(), settings=settings,
                          partition_fn=first_token_partition, **kw)


def stored(admin, stream: str) -> list:
    """Every message of a stream (subject, headers, payload), in order."""

    async def read():
        info = await admin.js.stream_info(stream)
        out = []
        for seq in range(info.state.first_seq, info.state.last_seq + 1) if info.state.messages else ():
            try:
                m = await admin.js.get_msg(stream, seq)
            except nats.js.errors.NotFoundError:
                continue
            out.append((m.subject, dict(m.headers or {}), m.data))
        return out

    return admin.call(read, timeout_seconds=10)


def publish(admin, subject: str, payload: bytes, headers=None):
    return admin.call(admin.js.publish, subject, payload, None, None, headers, timeout_seconds=10)


# -- formats (no server) -----------------------------------------------------------------


def test_prompt_and_result_round_trip_and_torn_ones_are_refused():
    tokens = np.array([5, 6, 2**32 - 1], np.uint32)
    m = decode_prompt(subjects.encode_prompt(tokens, 2**40 + 3, 17, 2))
    assert (m.seq, m.max_new_tokens, m.prefix_len, m.tokens.tolist()) == (2**40 + 3, 17, 2, tokens.tolist())
    assert decode_prompt(subjects.encode_prompt(tokens, 1, 0, None)).prefix_len is None
    good = subjects.encode_prompt(tokens, 1, 1, None)
    for bad, what in [(good[:-1], "does not hold"), (good[:10], "shorter"), (b"XXXX" + good[4:], "magic"),
                      (subjects.encode_prompt(tokens, 1, 1, 4), "exceeds")]:
        with pytest.raises(ValueError, match=what):
            decode_prompt(bad)
    r = decode_result(encode_result(9, "engine_error", [1, 2], "boom \u00e9"))
    assert (r.seq, r.status, r.tokens.tolist(), r.error) == (9, "engine_error", [1, 2], "boom \u00e9")
    assert decode_result(encode_result(3, 0, [])).error is None
    good = encode_result(9, "ok", [1, 2], "e")
    for bad, what in [(good[:-1], "does not hold"), (good + b"x", "does not hold"), (b"SBP1" + good[4:], "magic"),
                      (good[:4] + (77).to_bytes(4, "little") + good[8:], "status"), (b"", "shorter")]:
        with pytest.raises(ValueError, match=what):
            decode_result(bad)


def test_names_and_message_ids_are_checked():
    names = ClusterNames()
    assert names.prompt_subject(127) == "shmb.prompts.127" and names.result_subject("a-b_1") == "shmb.results.a-b_1"
    assert names.partition_of_subject("shmb.prompts.5") == 5
    assert (names.partition_consumer(3), names.results_consumer("x"), names.seq_key("x")) == ("part-3", "res-x", "seq.x")
    assert subjects.parse_msg_id("a:b-c:12") if False else subjects.parse_msg_id("ab:12") == ("ab", 12)
    for bad in ["", "a b", "a.b", "a*", ">", "x" * 65, 5, None]:
        with pytest.raises(ValueError, match="producer name"):
            subjects.check_producer_name(bad)
    for bad in ["shmb.prompts.128", "shmb.prompts.x", "shmb.results.1", "shmb.prompts."]:
        with pytest.raises(ValueError):
            names.partition_of_subject(bad)
    with pytest.raises(ValueError):
        names.prompt_subject(128)
    with pytest.raises(ValueError):
        ClusterNames(prompts_stream="a.b")
    with pytest.raises(ValueError):
        ClusterNames(num_partitions=0)
    with pytest.raises(ValueError):
        StreamSettings(replicas=2)


def test_missing_nats_names_the_extra(monkeypatch):
    from shmbroker.cluster.remote import RemoteProducer

    monkeypatch.setitem(sys.modules, "nats", None)
    with pytest.raises(ConfigError, match=r"pip install 'shmbroker\[cluster\]'"):
        require_nats()
    with pytest.raises(ConfigError, match=r"pip install 'shmbroker\[cluster\]'"):
        RemoteProducer("x", partition_fn=first_token_partition)


# -- publishing --------------------------------------------------------------------------


def test_items_go_to_their_partition_with_their_message_id(servers, admin):
    names = fresh_names()
    with producer(servers, "pub", names) as p:
        a = p.submit([21, 2, 3], max_new_tokens=4, prefix_len=1, model="llama")
        ids = p.submit_many(np.arange(30, 40, dtype=np.uint32), [0, 3, 10], max_new_tokens=[5, 6])
        assert ids.dtype == np.uint64 and ids.tolist() == [a + 1, a + 2]
    msgs = stored(admin, names.prompts_stream)
    assert len(msgs) == 3
    want = [(a, [21, 2, 3], 4, 1, "llama"), (a + 1, [30, 31, 32], 5, None, None), (a + 2, list(range(33, 40)), 6, None, None)]
    for (subject, headers, payload), (seq, tokens, max_new, prefix, model) in zip(msgs, want):
        assert subject == names.prompt_subject(tokens[0] % names.num_partitions)
        assert headers["Nats-Msg-Id"] == f"pub:{seq}" and headers["Shmb-Producer"] == "pub"
        assert headers.get("Shmb-Model") == model
        m = decode_prompt(payload)
        assert (m.seq, m.tokens.tolist(), m.max_new_tokens, m.prefix_len) == (seq, tokens, max_new, prefix)


def test_a_retried_publish_is_stored_once(servers, admin):
    names = fresh_names()
    with producer(servers, "retry", names) as p:
        seq = p.submit([7, 8], max_new_tokens=1)
    (subject, headers, payload), = stored(admin, names.prompts_stream)
    ack = publish(admin, subject, payload, {"Nats-Msg-Id": headers["Nats-Msg-Id"]})
    assert ack.duplicate and headers["Nats-Msg-Id"] == f"retry:{seq}"
    assert len(stored(admin, names.prompts_stream)) == 1


@pytest.fixture(scope="module")
def bad_target(servers, admin):
    names = fresh_names()
    p = producer(servers, "bad", names)
    yield p, names
    p.close()


def _bad_cases():
    sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/client")
    from test_client import BAD_SUBMIT_MANYS, BAD_SUBMITS

    return BAD_SUBMITS + BAD_SUBMIT_MANYS + [
        ("model-newline", lambda p: p.submit([1], max_new_tokens=1, model="a\r\nb"), ValueError, "model"),
    ]


@pytest.mark.parametrize("call, exc, match", [c[1:] for c in _bad_cases()], ids=[c[0] for c in _bad_cases()])
def test_bad_input_is_refused_as_producer_refuses_it_and_nothing_is_published(bad_target, admin, call, exc, match):
    p, names = bad_target
    before = len(stored(admin, names.prompts_stream))
    next_seq = p._seqs.next
    with pytest.raises(exc, match=match) as info:
        call(p)
    assert not isinstance(info.value, Full)
    assert len(stored(admin, names.prompts_stream)) == before, "a refused call published"
    assert p._seqs.next == next_seq


def test_a_closed_producer_refuses_and_bad_names_refuse_at_construction(servers):
    from shmbroker.cluster.remote import RemoteProducer

    p = RemoteProducer("closing", servers=servers.urls[0], names=fresh_names(), settings=SMALL,
                       partition_fn=first_token_partition)  # one URL as a str
    assert p.submit([1], max_new_tokens=1) == 0
    p.close()
    p.close()
    with pytest.raises(BrokerError, match="closed"):
        p.submit([1], max_new_tokens=1)
    for bad in ["a b", "x.y", "", "z" * 65]:
        with pytest.raises(ValueError, match="producer name"):
            producer(servers, bad)


def test_a_full_stream_is_back_pressure_then_full(servers, admin):
    names = fresh_names()
    settings = StreamSettings(prompts_max_bytes=24_000, results_max_bytes=1 << 20)
    item = np.arange(1, 513, dtype=np.uint32)  # 2 KiB and headers a message
    with producer(servers, "bp", names, settings=settings) as p:
        flat = np.tile(item, 30)
        t0 = time.monotonic()
        with pytest.raises(Full, match="stayed full") as info:
            p.submit_many(flat, np.arange(0, flat.size + 1, item.size), max_new_tokens=1, timeout_seconds=0.5)
        assert time.monotonic() - t0 >= 0.5
        exc = info.value
        assert 1 <= exc.submitted < 30 and len(exc.ids) == exc.submitted
        msgs = stored(admin, names.prompts_stream)
        assert [h["Nats-Msg-Id"] for _, h, _ in msgs] == [f"bp:{i}" for i in exc.ids.tolist()]
        t0 = time.monotonic()
        with pytest.raises(Full):
            p.submit(item, max_new_tokens=1, block=False)
        assert time.monotonic() - t0 < 1.0
        # a node takes some: the producer goes on
        admin.call(admin.js.purge_stream, names.prompts_stream, timeout_seconds=10)
        seq = p.submit(item, max_new_tokens=1, timeout_seconds=2.0)
        assert seq > int(exc.ids[-1])
    assert len(stored(admin, names.prompts_stream)) == 1


# -- results -----------------------------------------------------------------------------


def publish_results(admin, names, producer_name, rows, msg_ids=True):
    for seq, status, tokens, error in rows:
        headers = {"Nats-Msg-Id": f"{producer_name}:{seq}"} if msg_ids else None
        publish(admin, names.result_subject(producer_name), encode_result(seq, status, tokens, error), headers)


def test_results_come_back_once_each_and_are_acked(servers, admin):
    names = fresh_names()
    with producer(servers, "res", names) as p:
        seqs = p.submit_many(np.arange(1, 7, dtype=np.uint32), [0, 2, 4, 6], max_new_tokens=3).tolist()
        rows = [(seqs[0], "ok", [9, 9], None), (seqs[1], "too_long", [], "too long for every consumer"),
                (seqs[2], "ok", [1], None)]
        publish_results(admin, names, "res", rows)
        publish_results(admin, names, "res", rows[:1], msg_ids=False)  # a node that died after publishing: again
        got = list(p.results(timeout_seconds=0.5))
        assert sorted((r.item_id, r.status, r.tokens.tolist(), r.error) for r in got) == sorted(rows)
        assert p.num_duplicate_results == 1
        assert list(p.results(timeout_seconds=0.1)) == []
    assert stored(admin, names.results_stream) == [], "results handed out were not acked"


def test_take_results_gives_columns(servers, admin):
    names = fresh_names()
    with producer(servers, "cols", names) as p:
        publish_results(admin, names, "cols", [(5, "ok", [1, 2, 3], None), (6, "invalid", [], "bad")])
        batch = p.take_results(timeout_seconds=1.0)
        assert sorted(batch.item_ids.tolist()) == [5, 6] and sorted(batch.num_tokens.tolist()) == [0, 3]
        assert len(p.take_results(timeout_seconds=0.1)) == 0
    assert stored(admin, names.results_stream) == []


def test_a_restarted_producer_gets_fresh_seqs_and_the_unacked_results(servers, admin):
    names = fresh_names()
    with producer(servers, "again", names) as p:
        first = p.submit_many(np.arange(1, 5, dtype=np.uint32), [0, 2, 4], max_new_tokens=1).tolist()
        publish_results(admin, names, "again", [(s, "ok", [s], None) for s in first])
        assert sorted(r.item_id for r in p.results(timeout_seconds=0.5, auto_ack=False)) == first
        # closed without ack(): the results go back to JetStream
    with producer(servers, "again", names) as p:
        seq = p.submit([3], max_new_tokens=1)
        assert seq > max(first)
        assert sorted(r.item_id for r in p.results(timeout_seconds=1.0)) == first
    assert stored(admin, names.results_stream) == []
    assert [h["Nats-Msg-Id"] for _, h, _ in stored(admin, names.prompts_stream)] == [f"again:{s}" for s in first + [seq]]


def test_torn_and_foreign_results_are_counted_and_skipped(servers, admin):
    names = fresh_names()
    with producer(servers, "torn", names) as p:
        subject = names.result_subject("torn")
        good = encode_result(4, "ok", [1, 2])
        publish(admin, subject, good[:-2])
        publish(admin, subject, b"hello, not a result")
        publish(admin, subject, good[:4] + (99).to_bytes(4, "little") + good[8:])
        publish(admin, subject, good, {"Nats-Msg-Id": "someone-else:4"})
        publish(admin, subject, good, {"Nats-Msg-Id": "torn:4"})
        got = list(p.results(timeout_seconds=0.5))
        assert [(r.item_id, r.tokens.tolist()) for r in got] == [(4, [1, 2])]
        assert p.num_malformed_results == 4 and p.last_malformed
    assert stored(admin, names.results_stream) == []
