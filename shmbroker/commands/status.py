"""`shmbroker status`: one screen (or one JSON object) about a running broker.

`status` attaches read-only (`watch.BrokerView`: `broker.json`, the control segment, the rings'
headers; no RPC, no lock), takes two snapshots half a second apart and shows processes,
consumers, backlog and rates. `--json` prints the second snapshot with the rates between the two
(`rates`) as one object: the same numbers `shmbroker top` and the Prometheus exporter show.
"""

from __future__ import annotations

import json
import time

from .common import config_data_dir, print_error

RATE_SECONDS = 0.5  # `status` samples the counters twice, this far apart


def status(args) -> int:
    from ..observe.watch import BrokerView, NoBroker, rates

    data_dir = config_data_dir(args)
    if data_dir is None:
        return 2
    try:
        view = BrokerView.attach(data_dir)
    except NoBroker as exc:
        print_error(str(exc))
        return 1
    try:
        first = view.snapshot()
        time.sleep(RATE_SECONDS)
        report = view.snapshot()
    finally:
        view.close()
    report["rates"] = rates(first, report)
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


RATIOS = ("padding_waste", "hit_rate")


def _ratio(value) -> str:
    return "-" if value is None else f"{value:.4f}"


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ..observe.watch import format_bytes

    console = Console()
    up = report["uptime_seconds"]
    console.print(f"shmbroker on [bold]{escape(report['data_dir'])}[/bold]: supervisor pid {report['pid']}, "
                  f"up {_fmt(up)} s, {len(report['producers'])} producer(s) connected"
                  + (", [red]stopping[/red]" if report["stopping"] else ""), highlight=False)
    t = Table(title="processes", title_justify="left")
    for col in ("role", "pid", "restarts", "heartbeat age s", "alive", "hung kills", "last error"):
        t.add_column(col, justify="left" if col in ("role", "last error") else "right")
    for p in report["processes"]:
        age = p["heartbeat_age_seconds"]
        error = escape(p.get("last_error") or "-")
        if p.get("crash_loop"):
            error = f"[red]crash loop[/red]: {error}"
        t.add_row(p["role"], str(p["pid"] or "-"), str(p["restarts"]), "-" if age is None else f"{age:.2f}",
                  "[green]yes[/green]" if p["alive"] else "[red]no[/red]", str(p.get("watchdog_kills", 0)), error)
    console.print(t)
    t = Table(title="consumers", title_justify="left")
    t.add_column("")
    names = list(report["consumers"])
    for name in names:
        t.add_column(name, justify="right")
    rows = ("batches", "items", "tokens", "ok", "too_long", "invalid", "engine_errors", "corrupt", "guard_violations",
            "padding_waste", "hit_rate", "shape_switches", "excess_shape_switches")
    for key in rows:
        fmt = _ratio if key in RATIOS else _fmt
        t.add_row(key, *(fmt(report["consumers"][n].get(key)) for n in names))
    t.add_row("engine_deaths", *(_fmt(report["consumers"][n].get("engine_deaths")) for n in names))
    t.add_row("last restart s", *(_fmt(report["consumers"][n].get("engine_restart_ns", 0) / 1e9 or None) for n in names))
    for key in ("items_per_second", "tokens_per_second"):
        t.add_row(key.replace("_per_second", "/s"), *(_fmt(report["rates"]["consumers"][n][key]) for n in names))
    console.print(t)
    t = Table(title="broker", title_justify="left")
    for col in ("", "", "value"):
        t.add_column(col, justify="right" if col else "left")
    ing, sch, res, bl = report["ingest"], report["scheduler"], report["results"], report["backlog"]
    rate = report["rates"]["ingest"]
    rows = [("ingest", "items", _fmt(ing.get("items"))), ("", "tokens", _fmt(ing.get("tokens"))),
            ("", "bytes", format_bytes(ing.get("bytes", 0))), ("", "items/s", _fmt(rate["items_per_second"])),
            ("", "tokens/s", _fmt(rate["tokens_per_second"])),
            ("scheduler", "batches", _fmt(sch.get("batches"))), ("", "items packed", _fmt(sch.get("items"))),
            ("results", "results", _fmt(res.get("results"))), ("", "delivered", _fmt(res.get("delivered"))),
            ("", "acked", _fmt(res.get("acked"))), ("", "parked", _fmt(res.get("parked"))),
            ("", "names far behind", _fmt(res.get("names_behind"))),
            ("", "their results on disk", format_bytes(res.get("behind_bytes", 0))),
            ("backlog", "pending items", _fmt(bl["pending_items"])), ("", "pending tokens", _fmt(bl["pending_tokens"])),
            ("", "families", _fmt(bl["families"])), ("", "oldest age s", _fmt(bl["oldest_age_seconds"])),
            ("", "on disk", format_bytes(bl["disk_bytes"])), ("", "segment files", _fmt(bl["segments"]))]
    c = report.get("cluster")
    if c:
        crate = report["rates"].get("cluster", {})
        rows += [("cluster", "node", c["node"]), ("", "partitions held", _fmt(c.get("partitions"))),
                 ("", "draining", _fmt(c.get("draining"))), ("", "live nodes", _fmt(c.get("live_nodes"))),
                 ("", "pending in JetStream", _fmt(c.get("stream_items"))), ("", "staged here", _fmt(c.get("staged_items"))),
                 ("", "pulled/s", _fmt(crate.get("pulled_per_second"))), ("", "published/s", _fmt(crate.get("published_per_second"))),
                 ("", "leases taken / lost", f"{_fmt(c.get('leases_taken'))} / {_fmt(c.get('leases_lost'))}"),
                 ("", "refused messages", _fmt(c.get("refused"))), ("", "connected", "yes" if c.get("connected") else "NO")]
    jobs = report.get("jobs") or {"live": [], "by_status": {}}
    if any(jobs["by_status"].values()):
        rows.append(("jobs", "by status", ", ".join(f"{n} {s}" for s, n in jobs["by_status"].items() if n)))
        for j in jobs["live"]:
            done = j["completed"] + j["failed"] + j["cancelled"]
            rows.append(("", j["name"], f"{j['status']}: {done:,}/{j['total']:,} ({j['failed']:,} failed, "
                                        f"{j['cancelled']:,} cancelled)"))
    for row in rows:
        t.add_row(*row)
    console.print(t)
    for b in res.get("behind", []):
        console.print(f"results of {b['name']!r} wait on disk ({format_bytes(b['bytes'])}): its reader is more than "
                      "results_name_bytes behind")
