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
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from . import config

SEED = 7
ITEMS = 60_000  # about 12 s on 2 cores, broker start and FIFO simulation included
MAX_NEW_TOKENS: int | None = 1
CHUNK = 256  # items per submit_many call of the `batch` producer
DRAIN_EVERY = 64  # `chat` reads its results every this many submits
READY_SECONDS = 120.0
RESULTS_SECONDS = 600.0
STOP_SECONDS = 120.0
COUNTERS_SECONDS = 10.0
SHM_DIR = "/dev/shm"


# -- the workload ------------------------------------------------------------------------


def workload(items: int, seed: int, max_new_tokens: int | None = None):
    """The generator's workload, default model only: a consumer without a model name serves model id 0.
    `max_new_tokens`: every item's (None: the generator's, per item)."""
    from .workloads.synthetic import Workload, generate

    wl = generate(items, seed=seed)
    if max_new_tokens is not None:
        wl.max_new_tokens = np.full(len(wl), max_new_tokens, np.int64)
    keep = np.flatnonzero(wl.models == 0)
    if keep.size == len(wl):
        return wl
    lengths = wl.lengths[keep]
    offsets = np.zeros(keep.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([wl.item(int(i)) for i in keep])
    return Workload(tokens, offsets, wl.arrivals[keep], wl.max_new_tokens[keep], wl.prefix_lens[keep],
                    wl.models[keep], f"{wl.name}, default model")


# -- the producers (forked) ---------------------------------------------------------------


def _producer(name: str, data_dir: str, wl, rows: np.ndarray, bulk: bool, conn) -> None:
    from .client import Producer

    max_new = wl.max_new_tokens[rows]
    prefixes = wl.prefix_lens[rows]
    got_ids: list[int] = []
    got_tokens: list[np.ndarray] = []
    not_ok = 0

    seen: set[int] = set()

    def drain(timeout_seconds: float) -> None:
        nonlocal not_ok
        for r in p.results(timeout_seconds):
            seen.add(r.item_id)
            got_ids.append(r.item_id)
            got_tokens.append(r.tokens)
            not_ok += r.status != "ok"

    n = rows.size
    ids = np.empty(n, np.uint64)
    with Producer(name, data_dir=data_dir) as p:
        conn.send("ready")
        conn.recv()
        t0 = time.monotonic()
        if bulk:
            for lo in range(0, n, CHUNK):
                hi = min(lo + CHUNK, n)
                part = [wl.item(int(i)) for i in rows[lo:hi]]
                offsets = np.zeros(hi - lo + 1, np.int64)
                np.cumsum([t.size for t in part], out=offsets[1:])
                ids[lo:hi] = p.submit_many(np.concatenate(part), offsets, max_new_tokens=max_new[lo:hi],
                                           prefix_len=prefixes[lo:hi])
                drain(0.0)
        else:
            for k, i in enumerate(rows.tolist()):
                ids[k] = p.submit(wl.item(i), max_new_tokens=int(max_new[k]), prefix_len=int(prefixes[k]) or None)
                if k % DRAIN_EVERY == DRAIN_EVERY - 1:
                    drain(0.0)
        submitted = time.monotonic()
        deadline = submitted + RESULTS_SECONDS
        while len(seen) < n and time.monotonic() < deadline:
            drain(0.2)
        t1 = time.monotonic()
    from .gpu.engines.sim import Sim

    digests = np.array([Sim.digest(wl.item(int(i))) for i in rows.tolist()], np.uint32)  # after the clock stops
    conn.send({"start": t0, "submitted": submitted, "end": t1,
               **_check(ids, max_new, digests, np.array(got_ids, np.uint64), got_tokens, not_ok),
               "tokens": int(wl.lengths[rows].sum())})


def _check(ids: np.ndarray, max_new: np.ndarray, digests: np.ndarray, got: np.ndarray, tokens: list[np.ndarray],
           not_ok: int) -> dict:
    """Every submitted id exactly once, ok, with the simulated engine's tokens for it (`digests`: each submitted
    prompt's `Sim.digest`)."""
    from .gpu.engines.sim import Sim

    order = np.argsort(ids)
    sorted_ids = ids[order]
    pos = np.minimum(np.searchsorted(sorted_ids, got), max(0, ids.size - 1))
    mine = sorted_ids[pos] == got if ids.size else np.zeros(got.size, bool)
    unique, counts = np.unique(got[mine], return_counts=True)
    expected = Sim.generated_many(got[mine], max_new[order][pos[mine]], digests[order][pos[mine]])
    mismatched = 0
    k = 0
    for j in np.flatnonzero(mine).tolist():
        want = expected.flat[expected.offsets[k] : expected.offsets[k + 1]]
        mismatched += not np.array_equal(tokens[j], want)
        k += 1
    out = {
        "items": int(ids.size), "results": int(got.size), "missing": int(ids.size - unique.size),
        "duplicates": int((counts - 1).sum()), "foreign": int((~mine).sum()), "not_ok": int(not_ok),
        "token_mismatches": int(mismatched),
    }
    out["verified"] = out["missing"] == out["duplicates"] == out["foreign"] == out["not_ok"] == mismatched == 0
    return out


# -- the broker ---------------------------------------------------------------------------


def _wait_ready(sup: subprocess.Popen, data: str, log_path: Path) -> dict:
    """The registry's info once it answers for this supervisor and every broker process runs its loop."""
    from .control import R_BEAT, R_PID, R_STARTED, Control
    from .registry import request

    deadline = time.monotonic() + READY_SECONDS
    while True:
        if sup.poll() is not None:
            raise RuntimeError(f"the broker exited with {sup.returncode}:\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the broker was not ready in {READY_SECONDS:.0f} s:\n{_tail(log_path)}")
        try:
            info = request(data, {"op": "info"}, 1.0)
        except (OSError, ValueError):
            info = {}
        if info.get("ok") and info.get("pid") == sup.pid:
            ctl = Control.attach(info["control"], info["roles"], readonly=True)
            try:
                # every process forked and in its loop: a heartbeat after its start (the scheduler's
                # first comes after its start scan of the backlog)
                slots = [ctl.role(r) for r in range(len(info["roles"]))]
                if all(int(s[R_PID]) and int(s[R_BEAT]) >= int(s[R_STARTED]) for s in slots):
                    return info
            finally:
                ctl.close()
        time.sleep(0.05)


def _counters(info: dict, items: int) -> dict[str, dict[str, int]]:
    """Every role's counters, once the GPU processes have counted all `items` (they count a batch
    just after writing its results, so the last results can reach a producer first)."""
    from .control import Control
    from .stats import read_role

    ctl = Control.attach(info["control"], info["roles"], readonly=True)
    try:
        deadline = time.monotonic() + COUNTERS_SECONDS
        while True:
            out = {role: read_role(ctl, r) for r, role in enumerate(info["roles"])}
            if any(v is None for v in out.values()):  # a process restarting mid-publication: read again
                if time.monotonic() > deadline:
                    raise TimeoutError("a broker process's statistics stayed unreadable")
                time.sleep(0.02)
                continue
            done = sum(c["items"] for role, c in out.items() if role.startswith("gpu-"))
            if done >= items or time.monotonic() > deadline:
                return out
            time.sleep(0.02)
    finally:
        ctl.close()


def _stop(sup: subprocess.Popen) -> int:
    if sup.poll() is None:
        sup.send_signal(signal.SIGTERM)
        try:
            return sup.wait(STOP_SECONDS)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.wait()
            return -signal.SIGKILL
    return sup.returncode


def shm_left(instance: str, data: str) -> list[str]:
    """Shared memory of this instance still there: names in /dev/shm, or still in the data directory's manifest."""
    from .ring.owner import Manifest

    tag = f"shmb.{instance}."
    found = sorted(n for n in os.listdir(SHM_DIR) if n.startswith(tag) or n.startswith("sem." + tag)) \
        if os.path.isdir(SHM_DIR) else []
    listed = Manifest(data).names()
    return found + [n for kind in ("segments", "doorbells") for n in listed[kind]]


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except FileNotFoundError:
        return ""


# -- the figures --------------------------------------------------------------------------


def consumer_figures(c: dict[str, int], contract, mode: str) -> dict:
    """One consumer's figures (DESIGN.md "Words") from its GPU process's counters."""
    modeled = c["engine_own_ns"] / 1e9
    return {
        "mode": mode, "batches": c["batches"], "items": c["items"], "ok": c["ok"], "tokens": c["tokens"],
        "failed": c["too_long"] + c["invalid"] + c["engine_errors"] + c["corrupt"],
        "guard_violations": c["guard_violations"],
        "padded_tokens": c["padded_tokens"], "rect_tokens": c["rect_tokens"],
        "padding_waste": c["padded_tokens"] / c["rect_tokens"] if c["rect_tokens"] else 0.0,
        "batch_tokens_max_sum": c["batches"] * contract.max_batch_tokens,
        "batch_fill": c["tokens"] / (c["batches"] * contract.max_batch_tokens) if c["batches"] else 0.0,
        "hit_blocks": c["hit_blocks"], "queried_blocks": c["queried_blocks"],
        "cache_hit_rate": c["hit_blocks"] / c["queried_blocks"] if c["queried_blocks"] else 0.0,
        "shape_switches": c["shape_switches"], "excess_shape_switches": c["excess_shape_switches"],
        "families": c["families"], "modeled_seconds": modeled,
        "modeled_tokens_per_s": c["tokens"] / modeled if modeled else 0.0,
        "engine_wall_seconds": c["busy_ns"] / 1e9,
    }


def total_figures(per: dict[str, dict]) -> dict:
    out = {k: sum(f[k] for f in per.values())
           for k in ("batches", "items", "ok", "tokens", "failed", "guard_violations", "padded_tokens", "rect_tokens",
                     "hit_blocks", "queried_blocks", "shape_switches", "excess_shape_switches", "families",
                     "batch_tokens_max_sum", "modeled_seconds", "engine_wall_seconds")}
    out["batch_fill"] = out["tokens"] / out["batch_tokens_max_sum"] if out["batch_tokens_max_sum"] else 0.0
    out["padding_waste"] = out["padded_tokens"] / out["rect_tokens"] if out["rect_tokens"] else 0.0
    out["cache_hit_rate"] = out["hit_blocks"] / out["queried_blocks"] if out["queried_blocks"] else 0.0
    out["makespan_seconds"] = max(f["modeled_seconds"] for f in per.values())  # the consumers run side by side
    out["modeled_tokens_per_s"] = out["tokens"] / out["makespan_seconds"] if out["makespan_seconds"] else 0.0
    out["packed"] = all(f["mode"] == "packed" for f in per.values())
    return out


def fifo_figures(wl, cfg) -> dict:
    """The same workload fed first-in-first-out to the same consumers, offline, in virtual time.

    The engines see the blocks the broker's simulated engines see (they hash each batch's tokens
    without the declared prefixes), so the cache hit rates compare like for like."""
    from .pack.shapes import distinct_blocks, shape_items
    from .workloads.packsim import FifoFeeder, SimConsumer, simulate

    consumers = [SimConsumer(c.name, c.contract, c.engine_settings.cache_tokens) for c in cfg.consumers]
    modes = {c.engine_settings.mode for c in cfg.consumers}
    costs = {c.engine_settings.cost for c in cfg.consumers}
    assert len(modes) == 1, "the simulation runs one engine mode for all consumers"
    assert len(costs) == 1, "the simulation runs one cost model for all consumers"
    mode, cost = modes.pop(), costs.pop()
    shapes = shape_items(wl.tokens, wl.offsets, block_tokens=cfg.block_tokens)
    feeder = FifoFeeder(consumers, mode, shapes, wl, tolerance=cfg.padding_tolerance)
    out = simulate(feeder, consumers, mode, shapes, wl, cost=cost)
    total_blocks, distinct, _ = distinct_blocks(shapes)
    out["cache_hit_rate_max"] = 1 - distinct / total_blocks if total_blocks else 0.0  # every block computed once
    return out


# -- the run ------------------------------------------------------------------------------


def run(data_dir: str | None = None, items: int = ITEMS, seed: int = SEED, *,
        max_new_tokens: int | None = MAX_NEW_TOKENS) -> dict:
    from . import settings

    t_start = time.monotonic()
    root = Path(config.data_dir(data_dir))
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
        info = _wait_ready(sup, data, log_path)
        t_ready = time.monotonic()
        conns = {}
        # the two producers take alternate items, so both feed every family and conversation
        for name, rows, bulk in (("chat", np.arange(0, n, 2), False), ("batch", np.arange(1, n, 2), True)):
            parent, child = ctx.Pipe()
            procs[name] = ctx.Process(target=_producer, args=(name, data, wl, rows, bulk, child), name=f"demo-{name}",
                                      daemon=True)
            procs[name].start()
            conns[name] = parent
        for name, conn in conns.items():
            _recv(conn, procs[name], 60.0)
        for conn in conns.values():
            conn.send("go")
        producers = {name: _recv(conn, procs[name], RESULTS_SECONDS + 60.0) for name, conn in conns.items()}
        for proc in procs.values():
            proc.join(10)
        counters = _counters(info, n)
        t_stop = time.monotonic()
        code = _stop(sup)
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
            "broker": {"ingest_items": sum(c["items"] for r, c in counters.items() if r.startswith("ingest-")),
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
            _stop(sup)
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)


def _recv(conn, proc, timeout_seconds: float):
    deadline = time.monotonic() + timeout_seconds
    while not conn.poll(0.2):
        if proc.exitcode is not None:
            raise RuntimeError(f"producer {proc.name} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"producer {proc.name}: nothing for {timeout_seconds:.0f} s")
    return conn.recv()


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
