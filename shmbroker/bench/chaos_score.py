"""What `bench chaos` counts: resident memory and backlog figures during the run, which items were
accepted, the final drain of every name's results, and the score (lost, duplicated, wrong, failed).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from pathlib import Path

from ..control import roles
from .chaos_fire import Broker
from .chaos_procs import prompt

DRAIN_IDLE_SECONDS = 60.0
DRAIN_READ_SECONDS = 0.1  # a drain read ends after this long without a result (it comes round again)


def anon_bytes(pid: int) -> int:
    """Resident anonymous memory (RssAnon): the heap and private pages, not mapped files (a GPU
    process maps up to 64 backlog segments, whose touched pages count in its resident size)."""
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory(broker: Broker, client_pid: int, measure=rss_bytes) -> dict[str, int]:
    pids = broker.role_pids()
    out = {"client": measure(client_pid), "sched": measure(pids.get("sched", 0)),
           "results": measure(pids.get("results", 0))}
    for role, pid in pids.items():
        if roles.kind_of(role) is roles.Kind.GPU:
            out[role] = measure(pid)
    return out


def backlog(data_dir: str) -> dict[str, int]:
    """Items waiting for a batch (in the scheduler's memory, and on disk only) and results waiting
    for readers far behind, as the broker's shared counters say now; {} if it cannot be read."""
    from ..errors import BrokerError
    from ..observe.watch import BrokerView

    try:  # a role being restarted: its segment may be gone for a moment
        view = BrokerView.attach(data_dir)
    except (BrokerError, OSError, ValueError):
        return {}
    try:
        report = view.snapshot()
    except (BrokerError, OSError, ValueError):
        return {}
    finally:
        view.close()
    b, r = report["backlog"], report["results"]
    return {"pending_items": int(b["pending_items"]), "waiting_items": int(b["waiting_items"]),
            "overflow_items": int(b["overflow_items"]), "behind_bytes": int(r.get("behind_bytes", 0))}


def accepted_items(tmp: str, names: list[str]) -> dict[str, dict[int, tuple[int, int]]]:
    """name -> {item id: (producer index, k)}."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for i, name in enumerate(names):
        rows = out.setdefault(name, {})
        for line in Path(tmp, f"{name}.accepted").read_text().splitlines():
            parts = line.split()
            if len(parts) == 2:
                rows[int(parts[0])] = (i, int(parts[1]))
    for line in Path(tmp, "short.accepted").read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out.setdefault(parts[0], {})[int(parts[1])] = (1000, int(parts[2]))
    return out


def drain(data_dir: str, accepted: dict, outs: dict[str, str]) -> None:
    """Read every name's results until each accepted item has one, or none came for
    DRAIN_IDLE_SECONDS."""
    from ..commands import results

    for name in accepted:
        outs.setdefault(name, os.path.join(os.path.dirname(data_dir), f"{name}.results.jsonl"))
    missing = dict(accepted)
    last = time.monotonic()
    while missing and time.monotonic() - last < DRAIN_IDLE_SECONDS:
        for name in list(missing):
            before = len(_ids_in(outs[name]))
            # in this process (no interpreter start per name: a long run leaves a thousand names)
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
                results(argparse.Namespace(name=name, data_dir=data_dir, config=None, out=outs[name],
                                           timeout=DRAIN_READ_SECONDS))
            have = _ids_in(outs[name])
            if len(have) > before:
                last = time.monotonic()
            if set(accepted[name]) <= have:
                del missing[name]


def _rows(path: str) -> list[dict]:
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass
    return rows


def _ids_in(path: str) -> set[int]:
    return {r["item_id"] for r in _rows(path)}


def score(accepted: dict, outs: dict[str, str], seed: int) -> dict:
    from ..engines.sim import Sim

    items = lost = duplicated = wrong = failed = 0
    lost_by_name: dict[str, int] = {}
    for name, want in accepted.items():
        rows = _rows(outs[name]) if name in outs else []
        seen: set[int] = set()
        for r in rows:
            item = r["item_id"]
            if item in seen:
                duplicated += 1
                continue
            seen.add(item)
            if item not in want:
                continue  # not accepted by this run (cannot happen on a fresh data directory)
            if r["status"] != "ok":
                failed += 1
                continue
            producer, k = want[item]
            tokens, max_new = prompt(seed, producer, k)
            if r["tokens"] != Sim.generated(item, max_new, tokens).tolist():
                wrong += 1
        items += len(want)
        lost += len(set(want) - seen)
        if set(want) - seen:
            lost_by_name[name] = len(set(want) - seen)
    return {"items": items, "lost": lost, "duplicated": duplicated, "wrong": wrong, "failed": failed,
            "names": len(accepted), "lost_by_name": lost_by_name}
