"""`shmbroker demo`: the running broker on its default configuration, fed a seeded workload by two producers.

1. `shmbroker supervise` starts as a user would start it (a subprocess, the built-in consumers
   `big` and `small` on the simulated engine, packed mode, modeled cost), on a fresh data
   directory under the given one and a unique instance name; the demo waits until every broker
   process runs.
2. The generator's workload (`workloads/synthetic.py`: Zipf prefix families, multi-turn chains,
   log-normal lengths; the default model only) is split between two forked producers: `chat`
   submits its half one item at a time, `batch` in chunks with `submit_many`. Each reads its
   results while it submits and checks that every item id came back exactly once, ok, with the
   tokens the simulated engine generates for it (`Sim.generated`).
3. The summary comes from the broker's own accounting (the control segment's counters, read
   before the stop): per consumer batches, items, tokens, batch fill, cache hit rate, shape
   switches, families, modeled engine seconds and modeled throughput; wall-clock items/s are
   the producers' (first submit to last result).
4. FIFO feeding of the same workload to the same two consumers, in virtual time with the packing
   benchmark's simulation (`workloads/packsim.py`), beside it.
5. The broker is stopped (SIGTERM), must exit 0 and leave none of its shared memory behind.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .. import protocol
from ..control import roles
from .broker import read_counters, shm_left, stop, wait_ready
from .figures import consumer_figures, fifo_figures, total_figures
from .producers import CHUNK, RESULTS_SECONDS, producer, recv, workload

SEED = 7
ITEMS = 60_000  # about 12 s on 2 cores, broker start and FIFO simulation included
MAX_NEW_TOKENS: int | None = 1


def run(data_dir: str | None = None, items: int = ITEMS, seed: int = SEED, *,
        max_new_tokens: int | None = MAX_NEW_TOKENS) -> dict:
    from ..config import settings

    t_start = time.monotonic()
    root = Path(protocol.data_dir(data_dir))
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=root))
    data = str(tmp / "data")
    instance = f"demo{os.getpid()}"
    cfg_path = tmp / "shmbroker.toml"
    # the exporter on a free port (the default one may be taken); `shmbroker top` needs no port
    cfg_path.write_text(f'instance = "{instance}"\nmetrics_addr = "127.0.0.1:0"\n')
    cfg = settings.load(cfg_path, data_dir=data)  # what the broker reads: this instance, default consumers
    log_path = tmp / "supervisor.log"
    wl = workload(items, seed, max_new_tokens)
    n = len(wl)
    t_broker = time.monotonic()
    with open(log_path, "wb") as log:
        sup = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", str(cfg_path),
                                "--data-dir", data], stdout=log, stderr=subprocess.STDOUT)
    ctx = mp.get_context("fork")
    procs: dict[str, mp.Process] = {}
    ok = False
    try:
        info = wait_ready(sup, data, log_path)
        t_ready = time.monotonic()
        conns = {}
        # the two producers take alternate items, so both feed every family and conversation
        for name, rows, bulk in (("chat", np.arange(0, n, 2), False), ("batch", np.arange(1, n, 2), True)):
            parent, child = ctx.Pipe()
            procs[name] = ctx.Process(target=producer, args=(name, data, wl, rows, bulk, child), name=f"demo-{name}",
                                      daemon=True)
            procs[name].start()
            conns[name] = parent
        for name, conn in conns.items():
            recv(conn, procs[name], 60.0)
        for conn in conns.values():
            conn.send("go")
        producers = {name: recv(conn, procs[name], RESULTS_SECONDS + 60.0) for name, conn in conns.items()}
        for proc in procs.values():
            proc.join(10)
        counters = read_counters(info, n)
        t_stop = time.monotonic()
        code = stop(sup)
        stop_seconds = time.monotonic() - t_stop
        left = shm_left(instance, data)
        t0 = min(p["start"] for p in producers.values())
        t1 = max(p["end"] for p in producers.values())
        for p in producers.values():
            p["seconds"] = p["end"] - p["start"]
            p["items_per_s"] = p["items"] / p["seconds"]
        per = {c.name: consumer_figures(counters[f"gpu-{c.name}"], c.contract, c.engine_settings.mode)
               for c in cfg.consumers}
        total = total_figures(per)
        t_fifo = time.monotonic()
        fifo = fifo_figures(wl, cfg)
        fifo_seconds = time.monotonic() - t_fifo
        seconds = t1 - t0
        report = {
            "workload": wl.name, "max_new_tokens": max_new_tokens, "items": n, "input_tokens": int(wl.lengths.sum()), "instance": instance,
            "producers": producers,
            "wall": {"seconds": seconds, "items_per_s": n / seconds, "tokens_per_s": int(wl.lengths.sum()) / seconds,
                     "workload_seconds": t_broker - t_start, "broker_start_seconds": t_ready - t_broker,
                     "stop_seconds": stop_seconds,
                     "fifo_simulation_seconds": fifo_seconds},
            "broker": {"ingest_items": sum(c["items"] for r, c in counters.items() if roles.kind_of(r) is roles.Kind.INGEST),
                       "sched_items": counters["sched"]["items"], "sched_failed": sum(counters["sched"][k] for k in (
                           "rejected_empty", "rejected_no_consumer", "rejected_too_long")),
                       "results": counters["results"]["results"]},
            "counters": counters,
            "consumers": per,
            "total": total,
            "fifo": fifo,
            "vs_fifo": {
                "makespan_speedup": fifo["makespan_seconds"] / total["makespan_seconds"]
                if total["makespan_seconds"] else 0.0,
                "modeled_seconds_speedup": fifo["modeled_seconds"] / total["modeled_seconds"]
                if total["modeled_seconds"] else 0.0,
            },
            "verified": all(p["verified"] for p in producers.values()) and sum(p["items"] for p in producers.values()) == n,
            "exit_code": code,
            "shm_left": left,
            "stopped_cleanly": code == 0 and not left,
        }
        ok = report["verified"] and report["stopped_cleanly"]
        report["data_dir"] = None if ok else str(tmp)
        return report
    except BaseException as exc:
        exc.add_note(f"shmbroker demo: the broker's data directory and log are kept in {tmp}")
        raise
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if sup.poll() is None:
            stop(sup)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)


# -- the summary --------------------------------------------------------------------------


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _waste(f: dict) -> str:
    return "n/a (packed)" if f.get("packed", f.get("mode") == "packed") else _pct(f["padding_waste"])


def _fill(f: dict) -> str:
    """Batch fill is a rectangle's (count x longest within max_batch_tokens): a packed consumer's batch
    records are ordered groups fed into a continuous engine, so it has none."""
    return "n/a (packed)" if f.get("packed", f.get("mode") == "packed") else _pct(f["batch_fill"])


def print_summary(report: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    mnt = report["max_new_tokens"]
    console.print(f"[bold]shmbroker demo[/]: `shmbroker supervise`, default configuration (instance "
                  f"{report['instance']}); {report['workload']}: {report['items']:,} items, "
                  f"{report['input_tokens']:,} input tokens, max_new_tokens "
                  + ("per item (the generator's)" if mnt is None else f"{mnt} (prefill only, as `bench pack`)"))

    t = Table(title="producers: wall clock, first submit to last result", title_justify="left")
    for col in ("producer", "submits", "items", "input tokens", "seconds", "items/s", "verified"):
        t.add_column(col, justify="left" if col in ("producer", "submits") else "right")
    for name, p in report["producers"].items():
        how = "one by one" if name == "chat" else f"{CHUNK} a call"
        t.add_row(name, how, f"{p['items']:,}", f"{p['tokens']:,}", f"{p['seconds']:.2f}", f"{p['items_per_s']:,.0f}",
                  "yes" if p["verified"] else "NO")
    w = report["wall"]
    t.add_row("both", "", f"{report['items']:,}", f"{report['input_tokens']:,}", f"{w['seconds']:.2f}",
              f"{w['items_per_s']:,.0f}", "yes" if report["verified"] else "NO")
    console.print(t)
    for name, p in report["producers"].items():
        if not p["verified"]:
            console.print(f"[red]{name}: missing {p['missing']}, duplicates {p['duplicates']}, foreign "
                          f"{p['foreign']}, not ok {p['not_ok']}, token mismatches {p['token_mismatches']}[/]")
    if report["verified"]:
        console.print("  verified: every item id came back exactly once, ok, with the simulated engine's tokens")

    names = list(report["consumers"])
    t = Table(title="consumers: the broker's own counters (engine seconds are MODELED)", title_justify="left")
    t.add_column("")
    for name in names:
        t.add_column(f"gpu-{name}", justify="right")
    t.add_column("total", justify="right")
    rows = [
        ("batches", lambda f: f"{f['batches']:,}"),
        ("items", lambda f: f"{f['items']:,}"),
        ("input tokens", lambda f: f"{f['tokens']:,}"),
        ("batch fill", _fill),
        ("padding waste", _waste),
        ("cache hit rate", lambda f: _pct(f["cache_hit_rate"])),
        ("shape switches (excess)", lambda f: f"{f['shape_switches']:,} ({f['excess_shape_switches']:,})"),
        ("families served", lambda f: f"{f['families']:,}"),
        ("modeled engine seconds", lambda f: f"{f['modeled_seconds']:,.1f}"),
        ("modeled input tokens/s", lambda f: f"{f['modeled_tokens_per_s']:,.0f}"),
        ("failed, guard violations", lambda f: f"{f['failed']}, {f['guard_violations']}"),
    ]
    for label, fmt in rows:
        t.add_row(label, *[fmt(report["consumers"][n]) for n in names], fmt(report["total"]))
    console.print(t)
    console.print("  total tokens/s: over the modeled makespan (the slowest consumer's seconds). Each simulated "
                  "engine paces itself (pace_seconds wall seconds per modeled second), so the work splits between "
                  "the consumers by their modeled speed, as between two real cards, where the CPU keeps up.")

    b, f, tot = report["vs_fifo"], report["fifo"], report["total"]
    t = Table(title="broker vs FIFO: same workload and consumers, FIFO simulated in virtual time",
              title_justify="left")
    for col in ("", "broker", "FIFO", "FIFO / broker"):
        t.add_column(col, justify="right" if col else "left")
    t.add_row("padding waste", _waste(tot), _waste({"packed": tot["packed"], **f}), "")
    t.add_row("cache hit rate", _pct(tot["cache_hit_rate"]), _pct(f["cache_hit_rate"]), "")
    t.add_row("  possible (each block once)", _pct(f["cache_hit_rate_max"]), _pct(f["cache_hit_rate_max"]), "")
    t.add_row("batches", f"{tot['batches']:,}", f"{f['batches']:,}", "")
    t.add_row("batch fill", _fill(tot), _fill({"packed": tot["packed"], **f}), "")
    t.add_row("modeled seconds (sum)", f"{tot['modeled_seconds']:,.1f}", f"{f['modeled_seconds']:,.1f}",
              f"{b['modeled_seconds_speedup']:.2f}x")
    t.add_row("modeled makespan (max)", f"{tot['makespan_seconds']:,.1f}", f"{f['makespan_seconds']:,.1f}",
              f"{b['makespan_speedup']:.2f}x")
    console.print(t)
    left = report["shm_left"]
    console.print(f"broker stopped: exit {report['exit_code']} in {w['stop_seconds']:.1f} s, "
                  + ("no shared memory of its instance left" if not left else f"[red]LEFT: {', '.join(left)}[/]")
                  + f"; started in {w['broker_start_seconds']:.1f} s; FIFO simulated in "
                  f"{w['fifo_simulation_seconds']:.1f} s")
    if report.get("data_dir"):
        console.print(f"[red]the broker's data directory and log are kept in {report['data_dir']}[/]")


def main(data_dir: str | None = None) -> None:
    t0 = time.monotonic()
    report = run(data_dir)
    print_summary(report)
    print(f"total wall time {time.monotonic() - t0:.1f} s")
    if not (report["verified"] and report["stopped_cleanly"]):
        raise SystemExit(1)
