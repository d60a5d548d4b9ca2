"""Watching a running broker without touching it: `shmbroker top`, `status` and the exporter read here.

The supervisor writes `<data_dir>/broker.json` (mode 0600) once it is up: its pid and start
ticks, the control segment's name, the roles in slot order, each consumer's contract, engine and
model, the model names, the inter-process rings and the exporter's address. A watcher reads that
file once, maps the control segment and the rings' header pages read-only (PROT_READ), and from
then on copies the processes' statistics with seqlock reads (`stats.read_role`): no RPC, no lock,
no write into the broker's memory, so it costs the broker nothing.

`BrokerView.attach(data_dir)` raises `NoBroker` (saying why) when no broker runs there;
`view.snapshot()` is one consistent-per-process copy of everything as a dict (the JSON of
`shmbroker status --json`); `rates(a, b)` turns two snapshots into per-second rates.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import posix_ipc

from ..control.deaths import death_report
from ..control.roles import Kind, gpu, kind_of
from ..control.segment import (
    C_METRICS_PORT,
    C_STARTED_NS,
    C_STOPPING,
    C_SUPERVISOR_PID,
    R_BEAT,
    R_COMPILES,
    R_PID,
    R_RESTARTS,
    R_STARTED,
    Control,
    still_starting,
)
from ..control.stats import MAX_MODELS, read_role
from ..errors import BrokerError
from ..jobs.store import JobsWatch
from ..pack.contract import Mode
from ..results.behind import names_behind
from ..results.delivery import Cursors
from ..results.log import RESULTS_DIR
from ..ring import layout as L
from ..ring.items import DEFAULT_MODEL
from ..ring.liveness import is_alive, start_ticks
from ..ring.shm import Segment

BROKER_FILE = "broker.json"
WATCHER_NICE = 10  # the exporter and `shmbroker top` yield the CPU to the broker's processes
RING_HEADER_BYTES = L.HEADER_BYTES


class NoBroker(BrokerError):
    """No broker is running on the data directory (the message says how that was found)."""


# -- the description file (written by the supervisor) ----------------------------------------------

def describe(cfg, control: Control, roles: list[str], rings: dict[str, str], modes: list[Mode],
             metrics_addr: str | None, http_addr: str | None = None) -> dict:
    return {
        "pid": os.getpid(),
        "pid_start": start_ticks(os.getpid()),
        "instance": cfg.instance,
        "data_dir": os.path.abspath(cfg.data_dir),
        "control": control.segment.name,
        "roles": list(roles),
        "models": cfg.served_models(),
        "consumers": [{"name": c.name, "model": c.model_name or DEFAULT_MODEL, "engine": c.engine, "mode": mode,
                       "max_batch_size": c.contract.max_batch_size,
                       "max_batch_tokens": c.contract.max_batch_tokens,
                       "max_input_len": c.contract.max_input_len} for c, mode in zip(cfg.consumers, modes)],
        "rings": rings,
        "metrics_addr": metrics_addr,
        "http_addr": http_addr,
        "tokenizers": dict(cfg.tokenizers),
        "cluster": None if cfg.cluster is None else {
            "node": cfg.cluster.node.node, "servers": list(cfg.cluster.nats.servers),
            "num_partitions": cfg.cluster.names.num_partitions, "prompts_stream": cfg.cluster.names.prompts_stream,
            "results_stream": cfg.cluster.names.results_stream, "lease_seconds": cfg.cluster.node.lease_seconds,
            "staging_items": cfg.cluster.node.staging_items},
    }


def write_description(data_dir: str | os.PathLike, desc: dict) -> None:
    """Atomically (a temporary file renamed over it), owner-only."""
    path = Path(data_dir) / BROKER_FILE
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(desc, fh)
    os.replace(tmp, path)


def remove_description(data_dir: str | os.PathLike) -> None:
    (Path(data_dir) / BROKER_FILE).unlink(missing_ok=True)


# -- the view ------------------------------------------------------------------------------------

class BrokerView:
    def __init__(self, data_dir: str, desc: dict, control: Control):
        self.data_dir = data_dir
        self.desc = desc
        self.control = control
        self.roles = desc["roles"]
        self._values = np.empty(64, np.int64)
        self._rings: dict[str, Segment] = {}
        self.last_values: dict[int, dict] = {}  # role -> last read (kept when a read finds it mid-publication)
        self.jobs = JobsWatch(data_dir)

    @classmethod
    def attach(cls, data_dir: str | os.PathLike) -> BrokerView:
        data_dir = os.fspath(data_dir)
        path = Path(data_dir) / BROKER_FILE
        try:
            desc = json.loads(path.read_text())
        except FileNotFoundError:
            raise NoBroker(f"no broker is running on data directory {data_dir!r} (no {BROKER_FILE})") from None
        except (OSError, ValueError) as exc:
            raise NoBroker(f"no broker is running on data directory {data_dir!r} ({path}: {exc})") from None
        try:
            pid, ticks = int(desc["pid"]), int(desc["pid_start"])
            missing = [k for k in ("control", "roles", "consumers", "models", "rings") if k not in desc]
            if missing:
                raise KeyError(", ".join(missing))
        except (KeyError, TypeError, ValueError) as exc:
            raise NoBroker(f"no broker is running on data directory {data_dir!r} ({path}: not a broker "
                           f"description: {exc!r})") from None
        if pid <= 0 or not is_alive(pid, ticks):
            raise NoBroker(f"no broker is running on data directory {data_dir!r} "
                           f"(supervisor pid {pid} of {BROKER_FILE} is gone)")
        try:
            control = Control.attach(desc["control"], desc["roles"], readonly=True)
        except (OSError, ValueError, posix_ipc.Error) as exc:
            raise NoBroker(f"no broker is running on data directory {data_dir!r} ({exc})") from None
        if int(control.words[C_SUPERVISOR_PID]) != pid:
            control.close()
            raise NoBroker(f"no broker is running on data directory {data_dir!r} (stale {BROKER_FILE})")
        return cls(data_dir, desc, control)

    def alive(self) -> bool:
        """The supervisor that wrote the description still runs (`stopping()`: whether it began to stop)."""
        return is_alive(int(self.desc["pid"]), int(self.desc["pid_start"]))

    def stopping(self) -> bool:
        return bool(self.control.words[C_STOPPING])

    def role_values(self, r: int) -> dict[str, int]:
        got = read_role(self.control, r, self._values)
        if got is None:  # a writer stalled mid-publication (or killed in it): its last good copy
            return self.last_values.get(r, {})
        self.last_values[r] = got
        return got

    def process(self, r: int, now_ns: int) -> dict:
        """Role r's process as its slot says: pid, restarts, alive, starting (alive and its loop not begun
        yet: an engine loading), heartbeat age, uptime, compilations, and its deaths (`death_report`)."""
        slot = self.control.role(r)
        role = self.roles[r]
        pid, beat, started = int(slot[R_PID]), int(slot[R_BEAT]), int(slot[R_STARTED])
        ticks = start_ticks(pid) if pid > 0 else None
        alive = ticks is not None and is_alive(pid, ticks)
        return {"role": role, "kind": str(kind_of(role)), "pid": pid, "restarts": int(slot[R_RESTARTS]),
                "alive": alive, "starting": alive and still_starting(slot),
                "heartbeat_age_seconds": max(0.0, (now_ns - beat) / 1e9) if beat else None,
                "uptime_seconds": max(0.0, (now_ns - started) / 1e9) if started else None,
                "compiles": int(slot[R_COMPILES]), **death_report(slot, now_ns)}

    def snapshot(self) -> dict:
        w = self.control.words
        now = time.monotonic_ns()
        values = {role: self.role_values(r) for r, role in enumerate(self.roles)}
        processes = [self.process(r, now) for r in range(len(self.roles))]
        consumers = {}
        for i, c in enumerate(self.desc["consumers"]):
            v = dict(values.get(gpu(i, c["name"]).name, {}))
            v.pop("last_family", None)
            consumers[c["name"]] = {**c, **v, **derived(v, c["max_batch_tokens"])}
        ingest_roles = [r for r in self.roles if kind_of(r) is Kind.INGEST]
        ingest = {k: sum(values[r].get(k, 0) for r in ingest_roles) for k in ("items", "tokens", "bytes", "batches",
                                                                                "disk_full")}
        ingest["processes"] = {r: values[r] for r in ingest_roles}
        sched = dict(values.get("sched", {}))
        backlog = self._backlog(sched, now)
        started_unix = int(w[C_STARTED_NS]) / 1e9
        port = int(w[C_METRICS_PORT])
        return {
            "data_dir": self.data_dir,
            "instance": self.desc.get("instance"),
            "pid": int(self.desc["pid"]),
            "alive": self.alive(),
            "stopping": bool(w[C_STOPPING]),
            "started_unix": started_unix,
            "uptime_seconds": max(0.0, time.time() - started_unix),
            "metrics_addr": self.desc.get("metrics_addr") if port else None,
            "t_monotonic_ns": now,
            "processes": processes,
            "producers": [{"name": p.name, "producer_id": p.producer_id} for p in self.control.producers()],
            "consumers": consumers,
            "ingest": ingest,
            "scheduler": {k: v for k, v in sched.items() if not k.startswith(("model", "reserved", "num_models",
                                                                               "oldest_ns"))},
            "backlog": backlog,
            "results": {**values.get("results", {}), "behind": self._behind()},
            "rings": self.rings(),
            "cluster": None if self.desc.get("cluster") is None else {**self.desc["cluster"], **values.get("bridge", {})},
            "jobs": self.jobs.summary(),
        }

    def _behind(self) -> list[dict]:
        """The producer names read far behind, as the last saved `cursor.json` says."""
        root = Path(self.data_dir) / RESULTS_DIR
        return names_behind(root, Cursors(root))

    def _backlog(self, sched: dict, now_ns: int) -> dict:
        oldest = sched.get("oldest_ns", 0)
        per_model = {}
        for m, name in enumerate(self.desc["models"][:MAX_MODELS]):
            per_model[name] = {"items": sched.get(f"model{m}_items", 0), "tokens": sched.get(f"model{m}_tokens", 0)}
        return {"pending_items": sched.get("pending_items", 0), "pending_tokens": sched.get("pending_tokens", 0),
                "families": sched.get("families", 0), "overflow_items": sched.get("overflow_items", 0),
                "waiting_items": sched.get("waiting_items", 0),
                "oldest_age_seconds": max(0.0, (now_ns - oldest) / 1e9) if oldest else 0.0,
                "models": per_model, **backlog_on_disk(self.data_dir)}

    # -- rings -----------------------------------------------------------------------------------

    def rings(self) -> list[dict]:
        """Every ring's fill and refusals: the broker's own rings, then each producer's two."""
        names = [(label, name, kind) for label, name in self.desc["rings"].items()
                 for kind in (label.split(":", 1)[0],)]
        for p in self.control.producers():
            names.append((f"ingest:{p.name}", p.ingest_names.segment, "ingest"))
            names.append((f"results:{p.name}", p.result_names.segment, "results"))
        out, live = [], set()
        for label, name, kind in names:
            h = self._ring_header(name)
            if h is None:
                continue
            live.add(name)
            capacity = int(h[L.H_CAPACITY]) * 4
            used = (int(h[L.H_HEAD]) - int(h[L.H_TAIL])) * 4
            out.append({"ring": label, "kind": kind, "capacity_bytes": capacity,
                        "used_bytes": min(max(used, 0), capacity),
                        "occupancy": min(max(used, 0), capacity) / capacity if capacity else 0.0,
                        "full_total": int(h[L.H_NUM_FULL]), "pushed_total": int(h[L.H_NUM_PUSHED])})
        for name in set(self._rings) - live:
            self._rings.pop(name).close()
        return out

    def _ring_header(self, name: str):
        seg = self._rings.get(name)
        if seg is None:
            try:
                seg = Segment.attach(name, readonly=True, length=RING_HEADER_BYTES)
            except (OSError, ValueError, posix_ipc.Error):  # gone (a producer's ring being replaced)
                return None
            self._rings[name] = seg
        return seg.buf[:RING_HEADER_BYTES].view(np.int64)

    def close(self) -> None:
        for seg in self._rings.values():
            seg.close()
        self._rings.clear()
        if self.control is not None:
            self.control.close()
            self.control = None


def format_bytes(n: float) -> str:
    """1536 -> "1.5 KiB" (what `top` and `status` show)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def lower_priority() -> None:
    """Run as SCHED_IDLE where Linux has it, else at nice WATCHER_NICE (best effort; never raises the
    priority): a watcher takes a core only when the broker's processes leave one, and its wake-ups
    never preempt them (a nice value alone still lets a waking watcher preempt a broker process)."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return
    except (AttributeError, OSError):
        pass
    try:
        now = os.nice(0)
        if now < WATCHER_NICE:
            os.nice(WATCHER_NICE - now)
    except OSError:
        pass


def derived(v: dict, max_batch_tokens: int) -> dict:
    """A consumer's ratios over the broker's life (docs/design.md "Words"); None before its first batch."""
    rect, queried, batches = v.get("rect_tokens", 0), v.get("queried_blocks", 0), v.get("batches", 0)
    return {"padding_waste": v.get("padded_tokens", 0) / rect if rect else None,
            "hit_rate": v.get("hit_blocks", 0) / queried if queried else None,
            "batch_fill": v.get("tokens", 0) / (batches * max_batch_tokens) if batches else None}


def backlog_on_disk(data_dir: str) -> dict:
    """Segment files and bytes of the backlog on disk (a directory listing: the broker is not asked)."""
    from ..spill.store import BACKLOG_DIR

    size = segments = 0
    for root, _dirs, files in os.walk(Path(data_dir) / BACKLOG_DIR):
        for f in files:
            try:
                size += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # acked and deleted meanwhile
                continue
            segments += f.endswith(".seg")
    return {"disk_bytes": size, "segments": segments}


def rates(a: dict, b: dict) -> dict:
    """Per-second rates between two snapshots of one broker: ingest, and per consumer (with busy %)."""
    seconds = (b["t_monotonic_ns"] - a["t_monotonic_ns"]) / 1e9
    if seconds <= 0:
        return {"interval_seconds": 0.0, "ingest": {}, "consumers": {}}

    def per_s(x: dict, y: dict, key: str) -> float:
        return max(0.0, (y.get(key, 0) - x.get(key, 0)) / seconds)

    out = {"interval_seconds": seconds,
           "ingest": {f"{k}_per_second": per_s(a["ingest"], b["ingest"], k) for k in ("items", "tokens", "bytes")},
           "consumers": {}}
    for name, y in b["consumers"].items():
        x = a["consumers"].get(name, {})
        busy = per_s(x, y, "busy_ns")
        out["consumers"][name] = {"items_per_second": per_s(x, y, "items"),
                                  "tokens_per_second": per_s(x, y, "tokens"),
                                  "batches_per_second": per_s(x, y, "batches"),
                                  "busy_fraction": min(1.0, busy / 1e9)}
    if b.get("cluster") and a.get("cluster"):  # a node's bridge
        out["cluster"] = {f"{k}_per_second": per_s(a["cluster"], b["cluster"], k) for k in BRIDGE_RATES}
    return out


BRIDGE_RATES = ("pulled", "published", "acked")
