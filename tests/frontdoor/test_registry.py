"""The registry's Unix socket: permissions, peer credentials, bad requests, lifetime, ring-name secrecy.

Every test runs its own `Owner` + `Registry` (conftest's `broker`) on its own tmp data directory
with a random instance name, and checks that no shared memory of that
instance is left afterwards.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import secrets
import socket
import stat
import threading
import time
from pathlib import Path

import pytest
from support.harness import DEV_SHM, BrokerSide, shm_leftovers

from shmbroker.client.producer import Producer
from shmbroker.config.broker import BrokerConfig
from shmbroker.errors import NotRunning
from shmbroker.frontdoor.registry import REQUEST_TIMEOUT_SECONDS, Registry
from shmbroker.protocol import MAX_REQUEST_BYTES, PROTOCOL_VERSION, request
from shmbroker.ring.liveness import start_ticks
from shmbroker.ring.owner import Owner

pytestmark = pytest.mark.timeout(60)

REPLY_SECONDS = 5.0


def exchange(path: Path, payload: bytes, timeout_seconds: float = REPLY_SECONDS) -> dict:
    """Send raw bytes on the socket (then half-close), return the parsed one-line reply."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_seconds)
        sock.connect(str(path))
        if payload:
            sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.endswith(b"\n"), f"reply {data!r} is not one JSON line"
    assert data.count(b"\n") == 1
    return json.loads(data)


def connect_msg(name, **extra) -> dict:
    return {"op": "connect", "version": PROTOCOL_VERSION, "name": name, **extra}


def ring_names(reply: dict) -> set[str]:
    return {reply[ring][field] for ring in ("ingest", "results") for field in ("segment", "data_bell", "space_bell")}


def assert_serving(b: BrokerSide, name: str = "after") -> None:
    """A real producer can still connect and submit."""
    with Producer(name, data_dir=b.data_dir, connect_timeout_seconds=REPLY_SECONDS) as p:
        assert p.submit([1, 2, 3], max_new_tokens=1) == p.producer_id << 40
    assert b.reg._thread is not None and b.reg._thread.is_alive()


# -- permissions ------------------------------------------------------------------------


def mode_of(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_socket_is_0600_and_data_dir_0700_even_with_a_lax_umask(tmp_path, make_broker):
    data = tmp_path / "lax"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)
    old = os.umask(0)
    try:
        b = make_broker(data_dir=data)
    finally:
        os.umask(old)
    assert stat.S_ISSOCK(os.stat(b.reg.path).st_mode)
    assert b.reg.path == data / "broker.sock"
    assert mode_of(b.reg.path) == 0o600
    assert mode_of(data) == 0o700
    reply = request(b.data_dir, connect_msg("perm"), REPLY_SECONDS)
    assert reply["ok"] is True
    for ring in ("ingest", "results"):  # the rings a producer gets are private too
        names = reply[ring]
        assert mode_of(DEV_SHM / names["segment"][1:]) == 0o600
        for bell in ("data_bell", "space_bell"):
            assert mode_of(DEV_SHM / ("sem." + names[bell][1:])) == 0o600


def test_peer_pid_comes_from_so_peercred_not_from_the_request(broker):
    reply = request(broker.data_dir, connect_msg("claims", pid=1, uid=0), REPLY_SECONDS)
    assert reply["ok"] is True
    (entry,) = broker.reg.producers()
    assert entry.name == "claims"
    assert entry.pid == os.getpid()
    assert entry.pid_start == start_ticks(os.getpid())


def _child_connects(data_dir: str, conn) -> None:
    with Producer("child", data_dir=data_dir) as p:
        conn.send((os.getpid(), p.producer_id))
        conn.poll(REPLY_SECONDS)  # wait until the parent has looked


def test_peer_pid_of_a_child_process_is_recorded(broker):
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_child_connects, args=(broker.data_dir, child))
    proc.start()
    try:
        assert parent.poll(REPLY_SECONDS), "child did not connect"
        child_pid, producer_id = parent.recv()
        assert child_pid == proc.pid != os.getpid()
        (entry,) = broker.reg.producers()
        assert entry.producer_id == producer_id
        assert entry.pid == proc.pid
        assert entry.pid_start == start_ticks(proc.pid)
        parent.send("done")
        proc.join(REPLY_SECONDS)
        assert proc.exitcode == 0
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# -- bad requests -----------------------------------------------------------------------


def _line(obj) -> bytes:
    return json.dumps(obj).encode() + b"\n"


BAD_REQUESTS = [
    ("not-json", b"not json\n", "malformed"),
    ("truncated-json", b'{"op": "connect", "version": 1\n', "malformed"),
    ("empty-line", b"\n", "malformed"),
    ("nothing-sent", b"", "malformed"),
    ("binary", b"\xff\xfe\x00\x01garbage\n", ""),
    ("json-array", _line([1, 2, 3]), "JSON object"),
    ("json-string", _line("connect"), "JSON object"),
    ("json-null", _line(None), "JSON object"),
    ("unknown-op", _line({"op": "disconnect", "version": 1, "name": "a"}), "unknown op"),
    ("missing-op", _line({"version": 1, "name": "a"}), "unknown op"),
    ("op-not-str", _line({"op": ["connect"], "version": 1, "name": "a"}), "unknown op"),
    ("version-2", _line({"op": "connect", "version": 2, "name": "a"}), "version"),
    ("version-0", _line({"op": "connect", "version": 0, "name": "a"}), "version"),
    ("version-str", _line({"op": "connect", "version": "1", "name": "a"}), "version"),
    ("version-missing", _line({"op": "connect", "name": "a"}), "version"),
    ("name-missing", _line({"op": "connect", "version": 1}), "name"),
    ("name-null", _line(connect_msg(None)), "name"),
    ("name-int", _line(connect_msg(7)), "name"),
    ("name-list", _line(connect_msg(["a"])), "name"),
    ("name-empty", _line(connect_msg("")), "name"),
    ("name-space", _line(connect_msg("a b")), "name"),
    ("name-slash", _line(connect_msg("a/b")), "name"),
    ("name-dotdot-slash", _line(connect_msg("../../etc/passwd")), "name"),
    ("name-65-chars", _line(connect_msg("x" * 65)), "name"),
    ("name-unicode", _line(connect_msg("prodücer")), "name"),
    ("name-nul", _line(connect_msg("a\x00b")), "name"),
    ("too-long", b'{"op": "connect", "pad": "' + b"x" * (MAX_REQUEST_BYTES + 100) + b'"}\n', "too long"),
]


@pytest.mark.parametrize("payload, match", [c[1:] for c in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_an_error_reply_and_the_registry_keeps_serving(broker, payload, match):
    version = broker.reg.version
    reply = exchange(broker.reg.path, payload)
    assert set(reply) == {"ok", "error"}
    assert reply["ok"] is False
    assert isinstance(reply["error"], str) and reply["error"]
    assert re.search(match, reply["error"], re.I), reply["error"]
    assert broker.reg.producers() == []
    assert broker.reg.version == version
    assert_serving(broker)


def test_name_with_a_trailing_newline_is_refused(broker):
    """BUG: NAME_RE.match with `$` lets "name\\n" through (`$` matches before a final newline)."""
    reply = request(broker.data_dir, connect_msg("abc\n"), REPLY_SECONDS)
    assert reply["ok"] is False, reply
    assert broker.reg.producers() == []


def test_deeply_nested_json_does_not_kill_the_registry(broker):
    """BUG: json.loads raises RecursionError (not a ValueError) on deep nesting; it kills the accept thread."""
    depth = (MAX_REQUEST_BYTES - 10) // 2
    payload = b"[" * depth + b"]" * depth + b"\n"
    try:
        reply = exchange(broker.reg.path, payload)
    except (AssertionError, OSError) as exc:
        reply = {"no reply": repr(exc)}
    time.sleep(0.05)
    assert broker.reg._thread is not None and broker.reg._thread.is_alive(), "the registry's accept thread died"
    assert reply.get("ok") is False, reply
    assert_serving(broker)


def test_name_limits_and_characters_accepted(broker):
    for name in ("a", "x" * 64, "Ab9_.-z", "ingest-7"):
        reply = request(broker.data_dir, connect_msg(name), REPLY_SECONDS)
        assert reply["ok"] is True, (name, reply)
    assert sorted(e.name for e in broker.reg.producers()) == sorted(("a", "x" * 64, "Ab9_.-z", "ingest-7"))
    assert sorted(e.producer_id for e in broker.reg.producers()) == [1, 2, 3, 4]


def test_silent_client_is_dropped_after_the_request_timeout(broker):
    """A client that connects and says nothing holds the registry at most REQUEST_TIMEOUT_SECONDS."""
    idle = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        idle.settimeout(REQUEST_TIMEOUT_SECONDS + REPLY_SECONDS)
        idle.connect(str(broker.reg.path))
        time.sleep(0.05)
        t0 = time.monotonic()
        reply = request(broker.data_dir, connect_msg("patient"), REQUEST_TIMEOUT_SECONDS + REPLY_SECONDS)
        assert reply["ok"] is True
        assert time.monotonic() - t0 < REQUEST_TIMEOUT_SECONDS + 1.0
        answer = idle.recv(4096)  # the idle client got an error reply or a closed socket
        assert answer == b"" or json.loads(answer)["ok"] is False
    finally:
        idle.close()
    assert_serving(broker)


def test_version_changes_only_when_the_producer_table_does(broker):
    v0 = broker.reg.version
    assert request(broker.data_dir, connect_msg("v"), REPLY_SECONDS)["ok"]
    v1 = broker.reg.version
    assert v1 > v0
    assert not exchange(broker.reg.path, b"junk\n")["ok"]
    assert broker.reg.version == v1
    assert request(broker.data_dir, connect_msg("v"), REPLY_SECONDS)["ok"]  # reconnect: its pid is rewritten
    assert broker.reg.version > v1
    assert len(broker.reg.producers()) == 1


# -- lifetime ---------------------------------------------------------------------------


def test_close_removes_the_socket_and_is_idempotent(broker):
    path = broker.reg.path
    assert path.exists()
    t0 = time.monotonic()
    broker.reg.close()
    assert time.monotonic() - t0 < 2.0
    assert not path.exists()
    assert broker.reg._thread is None
    broker.reg.close()
    assert not path.exists()
    with pytest.raises(NotRunning):
        Producer("late", data_dir=broker.data_dir, connect_timeout_seconds=1.0)


def test_start_replaces_a_stale_socket_and_works_as_a_context_manager(tmp_path):
    instance = "t" + secrets.token_hex(3)
    data = tmp_path / "stale"
    owner = Owner(data, instance)
    try:
        stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stale.bind(str(data / "broker.sock"))
        stale.close()  # a crashed broker's socket file: connect is refused
        with pytest.raises(NotRunning):
            Producer("x", data_dir=data, connect_timeout_seconds=1.0)
        with Registry(owner, data, ingest_ring_bytes=1 << 12, result_ring_bytes=1 << 12,
                      retire_seconds=BrokerConfig.producer_retire_seconds) as reg:
            assert mode_of(reg.path) == 0o600
            with Producer("x", data_dir=data) as p:
                assert p.producer_id == 1
        assert not (data / "broker.sock").exists()
    finally:
        owner.close()
    assert shm_leftovers(instance) == []


# -- secrecy of ring names ----------------------------------------------------------------

NAME_RE_FOR = "^/shmb\\.{instance}\\.([0-9a-f]{{12}})\\.[A-Za-z0-9_-]+$"


def test_a_reply_holds_only_that_producers_rings(broker):
    a = request(broker.data_dir, connect_msg("alice"), REPLY_SECONDS)
    b = request(broker.data_dir, connect_msg("bob"), REPLY_SECONDS)
    for reply in (a, b):
        assert reply["ok"] is True
        assert set(reply) == {"ok", "broker_pid", "producer_id", "ingest", "results", "max_payload_bytes"}
        assert set(reply["ingest"]) == set(reply["results"]) == {"segment", "data_bell", "space_bell"}
    assert a["producer_id"] != b["producer_id"]
    by_name = {e.name: e for e in broker.reg.producers()}
    for name, reply in (("alice", a), ("bob", b)):
        entry = by_name[name]
        assert reply["producer_id"] == entry.producer_id
        assert reply["ingest"] == entry.ingest.names.to_dict()
        assert reply["results"] == entry.results.names.to_dict()
    # The only name two producers share is the broker's one ingest doorbell (ringing it wakes the drainer).
    assert ring_names(a) & ring_names(b) == {broker.reg.ingest_bell.name}
    assert a["ingest"]["data_bell"] == b["ingest"]["data_bell"] == broker.reg.ingest_bell.name
    assert len(ring_names(a)) == len(ring_names(b)) == 6
    # Reconnecting gives the same rings back, not anyone else's.
    assert request(broker.data_dir, connect_msg("alice"), REPLY_SECONDS) == a


def test_ring_names_carry_the_instance_and_a_fresh_random_token(make_broker):
    shared_instance = "t" + secrets.token_hex(3)
    brokers = [make_broker(), make_broker(), make_broker(shared_instance), make_broker(shared_instance)]
    all_names: list[str] = []
    tokens: list[str] = []
    for b in brokers:
        reply = request(b.data_dir, connect_msg("same-name"), REPLY_SECONDS)
        assert reply["ok"] is True and reply["producer_id"] == 1
        pattern = re.compile(NAME_RE_FOR.format(instance=re.escape(b.instance)))
        for name in ring_names(reply):
            m = pattern.match(name)
            assert m, name
            assert "same-name" not in name
            tokens.append(m.group(1))
        all_names.extend(ring_names(reply))
    assert len(set(all_names)) == len(all_names) == 6 * len(brokers)
    assert len(set(tokens)) == len(tokens)


def test_concurrent_connects_get_distinct_producers(broker):
    """Connections from many threads at once: each name gets one id, and every reply is its own."""
    names = [f"c{i}" for i in range(16)]
    replies: dict[str, dict] = {}

    def go(name):
        replies[name] = request(broker.data_dir, connect_msg(name), REPLY_SECONDS * 2)

    threads = [threading.Thread(target=go, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REPLY_SECONDS * 3)
    assert sorted(replies) == sorted(names)
    assert all(r["ok"] for r in replies.values())
    ids = [r["producer_id"] for r in replies.values()]
    assert sorted(ids) == list(range(1, 17))
    by_name = {e.name: e for e in broker.reg.producers()}
    for name, reply in replies.items():
        assert reply["ingest"] == by_name[name].ingest.names.to_dict()


# -- serving under trouble ---------------------------------------------


def test_slow_clients_delay_nobody(broker):
    """Before: one accept thread answered one connection at a time, so each silent client held
    every other one for up to REQUEST_TIMEOUT_SECONDS. Now each is answered on its own thread."""
    idle = []
    try:
        for _ in range(4):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(broker.reg.path))
            idle.append(s)
        time.sleep(0.05)
        t0 = time.monotonic()
        assert request(broker.data_dir, connect_msg("quick"), REPLY_SECONDS)["ok"] is True
        assert time.monotonic() - t0 < 0.5 * REQUEST_TIMEOUT_SECONDS
    finally:
        for s in idle:
            s.close()
    assert_serving(broker)


def test_accept_failing_for_lack_of_descriptors_does_not_stop_the_registry(broker):
    """Before: an OSError from accept() (EMFILE) ended the accept thread, and no producer could
    connect for the rest of the broker's life. Now it is counted and retried."""
    import resource

    client = mp.get_context("spawn").Process(target=_connect_later, args=(broker.data_dir, 0.5))
    client.start()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    fillers = []
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
        try:
            while True:
                fillers.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass  # every descriptor is taken: the registry's accept() fails with EMFILE
        deadline = time.monotonic() + 5
        while broker.reg.accept_errors == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    client.join(20)
    assert broker.reg.accept_errors > 0 and "Too many open files" in broker.reg.last_accept_error
    assert client.exitcode == 0  # its connect was answered once descriptors were free again
    assert_serving(broker)


def _connect_later(data_dir: str, delay_seconds: float) -> None:
    time.sleep(delay_seconds)
    reply = request(data_dir, connect_msg("late"), 10.0)
    raise SystemExit(0 if reply.get("ok") else 1)
