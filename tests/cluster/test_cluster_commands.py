"""`shmbroker submit --cluster`, `results --cluster` and `shmbroker nats` against real nats-servers,
with a thread standing in for a broker node (it answers every prompt with a result)."""

from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import types

import pytest
from support.natsproc import start_or_skip

from shmbroker.cli import main

pytest.importorskip("nats", reason="nats-py is not installed (pip install 'shmbroker[cluster]')")

from shmbroker.cluster import streams, subjects  # noqa: E402
from shmbroker.cluster.nats_loop import NatsLoop  # noqa: E402
from shmbroker.cluster.options import NatsOptions  # noqa: E402
from shmbroker.cluster.subjects import ClusterNames, StreamSettings  # noqa: E402

SMALL = StreamSettings(prompts_max_bytes=16 << 20, results_max_bytes=16 << 20)


@pytest.fixture(scope="module")
def servers():
    s = start_or_skip(1)
    loop = NatsLoop(NatsOptions(servers=tuple(s.urls)))
    loop.call(streams.ensure_streams, loop.js, ClusterNames(), SMALL, timeout_seconds=10)  # the CLI's default names
    loop.close()
    yield s
    s.stop()


@pytest.fixture
def partitions(monkeypatch):
    """cluster.partition (h-place's) when present, else a stand-in: everything to partition 0."""
    try:
        importlib.import_module("shmbroker.cluster.partition")
    except ImportError:
        fake = types.ModuleType("shmbroker.cluster.partition")
        fake.partition_of = lambda tokens, prefix_len, model_id, num_partitions: 0
        monkeypatch.setitem(sys.modules, "shmbroker.cluster.partition", fake)


class Node(threading.Thread):
    """Answers each prompt of the prompts stream (all partitions) with status ok and its first two tokens."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url = url
        self.stop = threading.Event()
        self.answered = 0

    def run(self) -> None:
        names = ClusterNames()
        loop = NatsLoop(NatsOptions(servers=(self.url,)))

        async def serve():
            sub = await loop.js.pull_subscribe(names.prompts_subjects, durable="node", stream=names.prompts_stream)
            while not self.stop.is_set():
                try:
                    msgs = await sub.fetch(64, timeout=0.1)
                except TimeoutError:
                    continue
                for m in msgs:
                    p = subjects.decode_prompt(m.data)
                    producer = m.headers[subjects.HEADER_PRODUCER]
                    await loop.js.publish(names.result_subject(producer), subjects.encode_result(p.seq, "ok", p.tokens[:2]),
                                          headers={subjects.HEADER_MSG_ID: m.headers[subjects.HEADER_MSG_ID]})
                    await m.ack()
                    self.answered += 1
            await sub.unsubscribe()

        try:
            loop.call(serve, timeout_seconds=60)
        finally:
            loop.close()


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_submit_to_the_cluster_and_wait_for_the_results(servers, partitions, tmp_path, capsys):
    rows = [{"tokens": [i + 1, i + 2, i + 3], "max_new_tokens": 4, "id": f"q{i}"} for i in range(20)]
    src = _write(tmp_path / "p.jsonl", rows + ['{"tokens": []}'])
    node = Node(servers.urls[0])
    node.start()
    try:
        out = tmp_path / "out.jsonl"
        rc = main(["submit", src, "--cluster", servers.urls[0], "--name", "cli-a", "--data-dir", str(tmp_path / "d"),
                   "--wait", "--out", str(out)])
    finally:
        node.stop.set()
        node.join(10)
    err = capsys.readouterr().err
    assert rc == 1, err  # one line refused
    assert "submitted 20 items, refused 1 line" in err and "p.jsonl:21" in err
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["id"] for r in got) == sorted(r["id"] for r in rows)
    by_id = {r["id"]: r for r in got}
    assert all(by_id[f"q{i}"]["tokens"] == [i + 1, i + 2] and by_id[f"q{i}"]["status"] == "ok" for i in range(20))
    assert node.answered == 20


def test_results_of_the_cluster_later_and_bad_names(servers, partitions, tmp_path, capsys):
    src = _write(tmp_path / "p.jsonl", [{"tokens": [7, 8], "max_new_tokens": 1}] * 3)
    assert main(["submit", src, "--cluster", servers.urls[0], "--name", "cli-b", "--data-dir", str(tmp_path / "d")]) == 0
    node = Node(servers.urls[0])
    node.start()
    try:
        deadline = time.monotonic() + 10
        while node.answered < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        node.stop.set()
        node.join(10)
    out = tmp_path / "r.jsonl"
    assert main(["results", "--name", "cli-b", "--cluster", servers.urls[0], "--data-dir", str(tmp_path / "d"),
                 "--out", str(out), "--timeout", "0.5"]) == 0
    assert len(out.read_text().splitlines()) == 3
    capsys.readouterr()
    assert main(["submit", src, "--cluster", servers.urls[0], "--name", "no.dots", "--data-dir", str(tmp_path / "d")]) == 2
    assert "producer name" in capsys.readouterr().err


def test_nats_command_prints_urls_and_stops_on_sigterm(tmp_path):
    pytest.importorskip("nats")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in [os.getcwd(), os.environ.get("PYTHONPATH")] if p))
    proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "nats", "--servers", "3", "--dir", str(tmp_path / "n")],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        urls = [proc.stdout.readline().strip() for _ in range(3)]
        assert all(u.startswith("nats://127.0.0.1:") for u in urls), urls
        loop = NatsLoop(NatsOptions(servers=tuple(urls)))
        loop.close()
        pids = [int(p) for p in subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()]
        assert len(pids) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
        assert os.path.isdir(tmp_path / "n" / "n0" / "store")  # --dir: the stores stay
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
