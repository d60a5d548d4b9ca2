"""Broker nodes on this machine for `bench cluster` and the cluster's fault test: each node is a
real `shmbroker supervise` process tree with its own data directory, instance and `[cluster]`
table, against real nats-servers (`cluster.servers.NatsServers`).

- `faults(...)`: three NATS servers (replicas 3) and two nodes; a remote producer submits while
  a node is SIGKILLed and started again, a third node starts mid-run, and one NATS server is
  killed (and started again). Every item must get exactly one result at the client: `lost`
  (no result), `duplicated` (a result handed out twice), the dead node's partitions' takeover
  time against the lease time.
- `throughput(...)`: items/s through one node and through two (a zero-cost simulated engine),
  measured from the first publish to the last result stored in the results stream.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

STATUS_POLL_SECONDS = 0.05
NODE_READY_SECONDS = 60.0

class SimConsumer(NamedTuple):
    """One of the nodes' simulated consumers."""

    name: str
    max_batch_size: int
    max_batch_tokens: int
    cache_tokens: int


SIM_CONSUMERS = (SimConsumer("big", 64, 65536, 262144), SimConsumer("small", 16, 16384, 65536))


def consumers_toml(extra: str) -> str:
    """The nodes' two simulated consumers as [[consumers]] tables (`extra`: more engine settings)."""
    return "".join(f'\n[[consumers]]\nname = "{c.name}"\nmax_batch_size = {c.max_batch_size}\n'
                   f'max_batch_tokens = {c.max_batch_tokens}\nmax_input_len = 16384\n'
                   f'engine_settings = {{ mode = "packed", cache_tokens = {c.cache_tokens}{extra} }}\n'
                   for c in SIM_CONSUMERS)


@dataclass
class LocalNode:
    """One broker node: `shmbroker supervise` with a `[cluster]` table, in its own session."""

    name: str
    base_dir: str
    servers: list[str]
    lease_seconds: float = 2.0
    ack_wait_seconds: float = 4.0
    replicas: int = 1
    zero_cost: bool = False
    stream_max_bytes: int = 256 << 20
    proc: subprocess.Popen | None = None
    starts: int = 0
    log_path: str = field(init=False)

    def __post_init__(self):
        os.makedirs(self.base_dir, mode=0o700, exist_ok=True)
        self.log_path = os.path.join(self.base_dir, f"{self.name}.log")

    @property
    def data_dir(self) -> str:
        return os.path.join(self.base_dir, f"{self.name}-data")

    def config_text(self) -> str:
        extra = ", zero_cost = true, pace_seconds = 0.0" if self.zero_cost else ""
        servers = ", ".join(f'"{u}"' for u in self.servers)
        return (f'metrics_addr = ""\ninstance = "{self.name}"\n'
                f"[cluster]\nservers = [{servers}]\nnode = \"{self.name}\"\nlease_seconds = {self.lease_seconds}\n"
                f"ack_wait_seconds = {self.ack_wait_seconds}\nreplicas = {self.replicas}\n"
                f"prompts_max_bytes = {self.stream_max_bytes}\nresults_max_bytes = {self.stream_max_bytes}\n"
                + consumers_toml(extra))

    def start(self) -> None:
        assert self.proc is None or self.proc.poll() is not None
        path = os.path.join(self.base_dir, f"{self.name}.toml")
        Path(path).write_text(self.config_text())
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", path,
                                      "--data-dir", self.data_dir], stdout=log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        log.close()
        self.starts += 1

    def kill(self) -> None:
        """SIGKILL the supervisor (its children die with it: PR_SET_PDEATHSIG)."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_seconds: float = 40.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_seconds)
        except subprocess.TimeoutExpired:
            self.kill()

    def pause(self, paused: bool) -> None:
        """SIGSTOP / SIGCONT the node's whole process group."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP if paused else signal.SIGCONT)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def bridge(self) -> dict | None:
        """The node's bridge statistics (status's "cluster"), None while it is not up."""
        from ..observe.watch import BrokerView

        try:
            view = BrokerView.attach(self.data_dir)
        except Exception:  # not up (yet), or stopping
            return None
        try:
            return view.snapshot().get("cluster")
        finally:
            view.close()

    def log_tail(self, num_bytes: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(max(0, os.path.getsize(self.log_path) - num_bytes))
                return fh.read().decode(errors="replace")
        except OSError:
            return ""


def wait_partitions(nodes: list[LocalNode], num_partitions: int, timeout_seconds: float) -> float:
    """Seconds until the live nodes' bridges hold every partition between them, each once
    (TimeoutError past the deadline)."""
    t0 = time.monotonic()
    while True:
        held = [b.get("partitions", 0) for b in (n.bridge() for n in nodes if n.alive) if b]
        if sum(held) == num_partitions and len(held) == sum(n.alive for n in nodes):
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout_seconds:
            raise TimeoutError(f"the nodes hold {held} of {num_partitions} partitions after {timeout_seconds:g} s")
        time.sleep(STATUS_POLL_SECONDS)


def _items(num_items: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Conversation-like items: 400 families of 1-3 shared blocks, then a suffix; (flat, offsets, max_new)."""
    rng = np.random.default_rng(seed)
    roots = [rng.integers(1, 50_000, 512 * rng.integers(1, 4)).astype(np.uint32) for _ in range(400)]
    parts, max_new = [], rng.integers(1, 16, num_items).astype(np.uint32)
    for i in range(num_items):
        parts.append(np.concatenate([roots[i % len(roots)], rng.integers(1, 50_000, rng.integers(16, 400)).astype(np.uint32)]))
    offsets = np.zeros(num_items + 1, np.int64)
    offsets[1:] = np.cumsum([p.size for p in parts])
    return np.concatenate(parts), offsets, max_new


class Client:
    """A remote producer submitting in chunks and reading its results, counting what it sees."""

    def __init__(self, name: str, servers: list[str], settings, chunk: int = 50):
        from ..cluster.remote import RemoteProducer

        self.p = RemoteProducer(name, servers=servers, settings=settings, timeout_seconds=60.0)
        self.chunk = chunk
        self.ids: list[int] = []
        self.results: dict[int, str] = {}
        self.duplicated = 0
        self.not_ok = 0

    def submit(self, flat, offsets, max_new, lo: int, hi: int) -> None:
        sub = offsets[lo : hi + 1]
        ids = self.p.submit_many(flat[sub[0] : sub[-1]], sub - sub[0], max_new_tokens=max_new[lo:hi])
        self.ids.extend(int(i) for i in ids)

    def read(self, timeout_seconds: float) -> int:
        n = 0
        for r in self.p.results(timeout_seconds):
            if r.item_id in self.results:
                self.duplicated += 1
            self.results[r.item_id] = r.status
            self.not_ok += r.status != "ok"
            n += 1
            if n >= 2000:
                break
        return n

    def close(self) -> None:
        self.p.close()


def faults(num_items: int = 3000, seconds: float = 24.0, lease_seconds: float = 2.0, seed: int = 0,
           base_dir: str | None = None, say=lambda line: None) -> dict:
    """The fault run of the module docstring; its figures (`lost`, `duplicated`, `node_kills`, ...)."""
    from ..cluster.servers import NatsServers
    from ..cluster.subjects import ClusterNames, StreamSettings

    own = base_dir is None
    base = tempfile.mkdtemp(prefix="shmb-faults-") if own else base_dir
    settings = StreamSettings(replicas=3, prompts_max_bytes=256 << 20, results_max_bytes=256 << 20,
                              ack_wait_seconds=2 * lease_seconds)
    num_partitions = ClusterNames().num_partitions
    servers = NatsServers.start(3, base_dir=os.path.join(base, "nats"))
    nodes = [LocalNode(f"node-{c}", base, servers.urls, lease_seconds, settings.ack_wait_seconds, replicas=3)
             for c in "abc"]
    events: list[dict] = []
    client = None
    try:
        for n in nodes[:2]:
            n.start()
        wait_partitions(nodes[:2], num_partitions, NODE_READY_SECONDS)
        client = Client("faults", servers.urls, settings)
        flat, offsets, max_new = _items(num_items, seed)
        plan = [(0.25, "kill node-a"), (0.4, "start node-a"), (0.55, "start node-c"), (0.7, "kill nats-1"),
                (0.85, "start nats-1")]
        t0, done = time.monotonic(), 0
        while done < num_items or plan:
            frac = (time.monotonic() - t0) / seconds
            while plan and plan[0][0] <= frac:
                _, what = plan.pop(0)
                events.append(_event(what, nodes, servers, num_partitions, lease_seconds, t0))
                say(f"{time.monotonic() - t0:6.1f} s: {what} ({events[-1]})")
            upto = min(num_items, max(done, int(num_items * min(1.0, frac / 0.95))))
            if upto > done:
                step = min(upto, done + client.chunk)
                client.submit(flat, offsets, max_new, done, step)
                done = step
            client.read(0.05)
        deadline = time.monotonic() + 30 * lease_seconds + 60
        while len(client.results) < num_items and time.monotonic() < deadline:
            client.read(0.5)
        client.read(2 * lease_seconds)  # anything late (a duplicate) would come now
        wanted = set(client.ids)
        out = {"items": num_items, "submitted": len(client.ids), "results": len(client.results),
               "lost": len(wanted - set(client.results)), "duplicated": client.duplicated,
               "unknown": len(set(client.results) - wanted), "not_ok": client.not_ok,
               "duplicates_dropped_by_client": client.p.num_duplicate_results,
               "node_kills": sum(e["what"] == "kill node-a" for e in events), "nats_server_kills": 1,
               "lease_seconds": lease_seconds, "events": events, "seconds": round(time.monotonic() - t0, 2),
               "bridges": {n.name: n.bridge() for n in nodes}}
        if out["lost"]:
            out["left_in_streams"] = _left(servers.urls, settings)
        takeover = [e["takeover_seconds"] for e in events if "takeover_seconds" in e]
        out["takeover_seconds"] = max(takeover) if takeover else None
        return out
    finally:
        _stop_all(client, nodes, servers)
        if own:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def _stop_all(client, nodes: list[LocalNode], servers) -> None:
    if client is not None:
        client.close()
    for n in nodes:
        n.stop()
    servers.stop()


def _left(urls, settings) -> dict:
    """What the streams still hold (for a run that lost items: stuck in the prompts stream, or gone)."""
    from ..cluster.nats_loop import NatsLoop
    from ..cluster.options import NatsOptions
    from ..cluster.subjects import ClusterNames

    names = ClusterNames()

    async def look(js):
        p = await js.stream_info(names.prompts_stream, subjects_filter=names.prompts_subjects)
        r = await js.stream_info(names.results_stream)
        return {"prompts": p.state.messages, "prompts_by_subject": p.state.subjects, "results": r.state.messages}

    loop = NatsLoop(NatsOptions(servers=tuple(urls)))
    try:
        return loop.call(look, loop.js, timeout_seconds=10)
    finally:
        loop.close()


def _event(what: str, nodes: list[LocalNode], servers, num_partitions: int, lease_seconds: float, t0: float) -> dict:
    ev = {"what": what, "at_seconds": round(time.monotonic() - t0, 2)}
    verb, target = what.split(" ")
    if target.startswith("nats-"):
        i = int(target.split("-")[1])
        servers.kill(i) if verb == "kill" else servers.restart(i)
        return ev
    node = next(n for n in nodes if n.name == target)
    if verb == "kill":
        node.kill()
        # the dead node's partitions move to the others within the lease time (plus a renewal round)
        live = [n for n in nodes if n.alive]
        ev["takeover_seconds"] = round(wait_partitions(live, num_partitions, 10 * lease_seconds + 30), 3)
    else:
        node.start()
    return ev


def throughput(num_items: int = 20000, seed: int = 0, base_dir: str | None = None) -> dict:
    """Items/s through one node and through two (zero-cost engine), same items, same run."""
    from ..cluster.servers import NatsServers
    from ..cluster.subjects import ClusterNames, StreamSettings

    own = base_dir is None
    base = tempfile.mkdtemp(prefix="shmb-tput-") if own else base_dir
    settings = StreamSettings(prompts_max_bytes=1 << 30, results_max_bytes=1 << 30, ack_wait_seconds=60.0)
    flat, offsets, max_new = _items(num_items, seed)
    out = {"items": num_items, "tokens_per_item": round(float(flat.size) / num_items, 1)}
    try:
        for count in (1, 2):
            servers = NatsServers.start(1, base_dir=os.path.join(base, f"nats{count}"))
            nodes = [LocalNode(f"t{count}-{c}", base, servers.urls, 30.0, 60.0, zero_cost=True, stream_max_bytes=1 << 30)
                     for c in "ab"[:count]]
            client = None
            try:
                for n in nodes:
                    n.start()
                wait_partitions(nodes, ClusterNames().num_partitions, NODE_READY_SECONDS)
                client = Client(f"tput{count}", servers.urls, settings, chunk=1000)
                t0 = time.monotonic()
                for lo in range(0, num_items, client.chunk):
                    client.submit(flat, offsets, max_new, lo, min(num_items, lo + client.chunk))
                submit_seconds = time.monotonic() - t0
                _read_all(client, num_items)
                seconds = time.monotonic() - t0
                assert len(client.results) == num_items, f"{len(client.results)} of {num_items} results"
                key = "one_node" if count == 1 else "two_node"
                out[f"{key}_items_per_s"] = round(num_items / seconds, 1)
                out[f"{key}_submit_seconds"] = round(submit_seconds, 3)
                out[f"{key}_node_items"] = {n.name: (n.bridge() or {}).get("acked") for n in nodes}
            finally:
                _stop_all(client, nodes, servers)
        out["two_vs_one"] = round(out["two_node_items_per_s"] / out["one_node_items_per_s"], 3)
        out["cores"] = os.cpu_count()
        return out
    finally:
        if own:
            import shutil

            shutil.rmtree(base, ignore_errors=True)


def _read_all(client: Client, num_items: int) -> None:
    deadline = time.monotonic() + 600
    while len(client.results) < num_items and time.monotonic() < deadline:
        client.read(0.5)


def run(num_items: int = 20000, fault_items: int = 3000, fault_seconds: float = 24.0, seed: int = 0,
        say=lambda line: None) -> dict:
    """`bench cluster`'s nodes part: the fault run and the throughput through one and two nodes."""
    f = faults(num_items=fault_items, seconds=fault_seconds, seed=seed, say=say)
    bridges = f.pop("bridges")
    t = throughput(num_items=num_items, seed=seed)
    return {"lost": f["lost"], "duplicated": f["duplicated"], "node_kills": f["node_kills"],
            "takeover_seconds": f["takeover_seconds"], "one_node_items_per_s": t["one_node_items_per_s"],
            "two_node_items_per_s": t["two_node_items_per_s"], "two_vs_one_node": t["two_vs_one"],
            "faults": {**f, "bridges_acked": {n: (b or {}).get("acked") for n, b in bridges.items()}},
            "nodes_throughput": t}
