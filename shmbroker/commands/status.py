"""`shmbroker status`: one screen about a running broker.

`status` reads the control segment twice, half a second apart, and shows
processes, consumers, backlog and rates.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path

from .common import _data_dir, _err

RATE_SECONDS = 0.5  # `status` samples the counters twice, this far apart


def _sample(ctl) -> dict:
    from ..control import R_BEAT, R_PID, R_RESTARTS, R_STARTED

    roles = []
    for r, role in enumerate(ctl.roles):
        slot = ctl.role(r)
        roles.append({"role": role, "pid": int(slot[R_PID]), "restarts": int(slot[R_RESTARTS]),
                      "beat_ns": int(slot[R_BEAT]), "started_ns": int(slot[R_STARTED]),
                      "counters": ctl.counter_dict(r)})
    return {"t_ns": time.monotonic_ns(), "roles": {x["role"]: x for x in roles}}


def _alive(pid: int) -> bool:
    from ..ring.liveness import is_alive, start_ticks

    ticks = start_ticks(pid) if pid > 0 else None
    return ticks is not None and is_alive(pid, ticks)


def _backlog_on_disk(data_dir: str) -> dict:
    from ..spill.store import BACKLOG_DIR

    size = segments = 0
    for root, _dirs, files in os.walk(Path(data_dir) / BACKLOG_DIR):
        for f in files:
            try:
                size += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # acked and deleted meanwhile
                continue
            segments += f.endswith(".seg")
    return {"bytes": size, "segments": segments}


def _rate(a: dict, b: dict, key: str, seconds: float) -> float:
    return max(0.0, (b["counters"][key] - a["counters"][key]) / seconds) if seconds > 0 else 0.0


def _report(data_dir: str, info: dict, header: dict, producers: list, first: dict, second: dict) -> dict:
    now = second["t_ns"]
    seconds = (second["t_ns"] - first["t_ns"]) / 1e9
    roles = second["roles"]
    processes = [{"role": x["role"], "pid": x["pid"], "restarts": x["restarts"],
                  "heartbeat_age_seconds": (now - x["beat_ns"]) / 1e9 if x["beat_ns"] else None,
                  "uptime_seconds": (now - x["started_ns"]) / 1e9 if x["started_ns"] else None,
                  "alive": _alive(x["pid"])} for x in roles.values()]
    ingest_roles = [r for r in roles if r.startswith("ingest-")]
    ingest: Counter[str] = Counter()
    for r in ingest_roles:
        ingest.update(roles[r]["counters"])
    consumers, consumer_rates = {}, {}
    for name in info.get("consumers", []):
        role = f"gpu-{name}"
        if role not in roles:
            continue
        c = dict(roles[role]["counters"])
        c["hit_rate"] = c["hit_blocks"] / c["queried_blocks"] if c.get("queried_blocks") else None
        consumers[name] = c
        consumer_rates[name] = {"items_per_second": _rate(first["roles"][role], roles[role], "items", seconds),
                                "tokens_per_second": _rate(first["roles"][role], roles[role], "tokens", seconds)}
    rates = {"interval_seconds": seconds,
             "ingest": {k + "_per_second": sum(_rate(first["roles"][r], roles[r], k, seconds) for r in ingest_roles)
                        for k in ("items", "tokens")},
             "consumers": consumer_rates}
    return {
        "data_dir": data_dir,
        "pid": info.get("pid"),
        "uptime_seconds": max(0.0, (time.time_ns() - header["started_ns"]) / 1e9) if header["started_ns"] else None,
        "stopping": header["stopping"],
        "processes": processes,
        "producers": producers,
        "consumers": consumers,
        "ingest": dict(ingest),
        "scheduler": dict(roles["sched"]["counters"]) if "sched" in roles else {},
        "results": dict(roles["results"]["counters"]) if "results" in roles else {},
        "backlog": _backlog_on_disk(data_dir),
        "rates": rates,
    }


def status(args) -> int:
    from ..control import C_STARTED_NS, C_STOPPING, Control
    from ..registry import request

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    try:
        info = request(data_dir, {"op": "info"}, 1.0)
    except (OSError, ValueError):
        info = {}
    if not info.get("ok") or not info.get("control"):
        _err(f"no broker is running on data directory {data_dir!r}")
        return 1
    try:
        ctl = Control.attach(info["control"], info["roles"])
    except (OSError, ValueError) as exc:
        _err(f"no broker is running on data directory {data_dir!r} ({exc})")
        return 1
    try:
        first = _sample(ctl)
        time.sleep(RATE_SECONDS)
        second = _sample(ctl)
        header = {"started_ns": int(ctl.words[C_STARTED_NS]), "stopping": bool(ctl.words[C_STOPPING])}
        producers = [{"name": p.name, "producer_id": p.producer_id} for p in ctl.producers()]
    finally:
        ctl.close()
    report = _report(data_dir, info, header, producers, first, second)
    if args.json:
        print(json.dumps(report))
    else:
        _render(report)
    return 0


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    up = report["uptime_seconds"]
    console.print(f"shmbroker on [bold]{escape(report['data_dir'])}[/bold]: supervisor pid {report['pid']}, "
                  f"up {_fmt(up)} s, {len(report['producers'])} producer(s) connected"
                  + (", [red]stopping[/red]" if report["stopping"] else ""), highlight=False)
    t = Table(title="processes", title_justify="left")
    for col in ("role", "pid", "restarts", "heartbeat age s", "alive"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for p in report["processes"]:
        age = p["heartbeat_age_seconds"]
        t.add_row(p["role"], str(p["pid"] or "-"), str(p["restarts"]), "-" if age is None else f"{age:.2f}",
                  "[green]yes[/green]" if p["alive"] else "[red]no[/red]")
    console.print(t)
    t = Table(title="consumers", title_justify="left")
    t.add_column("")
    names = list(report["consumers"])
    for name in names:
        t.add_column(name, justify="right")
    rows = ("batches", "items", "tokens", "ok", "too_long", "invalid", "engine_errors", "guard_violations", "hit_rate")
    for key in rows:
        t.add_row(key, *(_fmt(report["consumers"][n].get(key)) for n in names))
    for key in ("items_per_second", "tokens_per_second"):
        t.add_row(key.replace("_per_second", "/s"), *(_fmt(report["rates"]["consumers"][n][key]) for n in names))
    console.print(t)
    t = Table(title="broker", title_justify="left")
    for col in ("", "", "value"):
        t.add_column(col, justify="right" if col else "left")
    ing, sch, res, bl = report["ingest"], report["scheduler"], report["results"], report["backlog"]
    rate = report["rates"]["ingest"]
    rows = [("ingest", "items", _fmt(ing.get("items"))), ("", "tokens", _fmt(ing.get("tokens"))),
            ("", "bytes", _bytes(ing.get("bytes", 0))), ("", "items/s", _fmt(rate["items_per_second"])),
            ("", "tokens/s", _fmt(rate["tokens_per_second"])),
            ("scheduler", "pending items", _fmt(sch.get("pending_items"))), ("", "batches", _fmt(sch.get("batches"))),
            ("results", "results", _fmt(res.get("results"))), ("", "delivered", _fmt(res.get("delivered"))),
            ("", "acked", _fmt(res.get("acked"))), ("", "parked", _fmt(res.get("parked"))),
            ("backlog", "on disk", _bytes(bl["bytes"])), ("", "segment files", _fmt(bl["segments"]))]
    for row in rows:
        t.add_row(*row)
    console.print(t)
