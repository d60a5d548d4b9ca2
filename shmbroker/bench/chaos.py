"""`shmbroker bench chaos --seconds S --json`: the soak. A real broker runs while its processes and
its result readers are SIGKILLed at random, and every item accepted must come back exactly once.

For `seconds`, on a scratch data directory:

- PRODUCERS producer processes submit seeded prompts (the prompt of item k of producer p is a
  function of (seed, p, k), so the expected output is known) and record each item id that
  `submit` returned; they ride out every restart with the client's reconnect;
- one more producer never reads its results until the end (its results wait on disk);
- a short-lived-names process connects under a new name every SHORT_NAME_SECONDS, submits one
  item and leaves;
- a reader per producer runs `shmbroker results --name N --out F` again and again, all of them
  appending to one file per name;
- every 0.3-1.5 s the killer SIGKILLs a random broker process (ingest, sched, results, a GPU
  process), a reader, two of them at once, or the supervisor (then a new one starts, and is
  sometimes killed again during its recovery); at the end it SIGKILLs a child while the broker
  stops.

With `fs_mib` (`--fs-mib N`), the data directory is a tmpfs of N MiB (mounted for the run; it
needs the right to mount: without it the run goes on on the ordinary disk and says why in
`small_fs`), and a filler takes all but FILL_LEFT_BYTES of its free space every few seconds for
a second or two, as another tenant of a small disk would: ingest, the results log and every
bookkeeping file meet a full disk again and again.

Then a fresh broker drains: every name's results are read until each accepted item has one.
Figures: `items` accepted, `kills`, `lost` (accepted, no result), `duplicated` (result rows
beyond the first of an item, across every reader's output), `wrong` (an `ok` result whose tokens
are not the simulated engine's output for that item's prompt), `failed` (a result other than
`ok`), `memory_growth_ratio` (the largest resident size of the long-lived client, a GPU process,
the scheduler and the results process at the end over the same after warm-up), and what `results/` and the
instance's /dev/shm hold at the end.

This module runs that scenario and builds the figures; the load (producers, short-lived names,
readers, the prompts) is `chaos_procs.py`, the broker, the killer and the filler `chaos_fire.py`,
the counting (memory, backlog, the drain, the score) `chaos_score.py`.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from .chaos_fire import SMALL_FS_CONFIG, Broker, Filler, kill_during_stop, mount_small_fs, strike
from .chaos_procs import Reader, produce, short_lived
from .chaos_score import accepted_items, anon_bytes, backlog, drain, memory, score

PRODUCERS = 2
KEEP_ENV = "SHMBROKER_CHAOS_KEEP"  # set: the scratch directory is kept (`scratch_dir` in the figures)
WARMUP_SHARE = 0.25  # memory is taken after this share of the run, and at its end


def run(seconds: float = 30.0, seed: int = 0, fs_mib: int | None = None) -> dict:
    tmp = tempfile.mkdtemp(prefix="shmbroker-chaos-")
    instance = "chaos" + secrets.token_hex(3)
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    mounted, why = mount_small_fs(tmp, fs_mib) if fs_mib else (None, None)
    broker = Broker(tmp, instance, SMALL_FS_CONFIG if mounted else "")
    filler = Filler(mounted, seed) if mounted else None
    try:
        out = _run(tmp, instance, rng, ctx, broker, filler, seconds, seed)
    finally:
        if broker.b is not None and broker.b.proc.poll() is None:  # a run that failed: no broker left behind
            broker.b.proc.kill()
            broker.b.proc.wait(30)
        if filler is not None:
            filler.stop()
        if mounted:
            subprocess.run(["umount", "-l", mounted], capture_output=True, timeout=60)
    out["small_fs"] = None if not fs_mib else {
        "mib": fs_mib, "mounted": bool(mounted), "why_not": why,
        "fills": filler.fills if filler else 0, "min_free_bytes": filler.min_free_bytes if filler else None}
    if os.environ.get(KEEP_ENV):  # to look into a run afterwards: its data directory, logs and outputs
        out["scratch_dir"] = tmp
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _run(tmp: str, instance: str, rng, ctx, broker, filler, seconds: float, seed: int) -> dict:
    broker.start()
    if filler is not None:
        filler.start()
    data_dir = broker.b.data_dir
    stop = ctx.Event()
    names = [f"chaos-{i}" for i in range(PRODUCERS)] + ["chaos-silent"]
    outs = {n: os.path.join(tmp, f"{n}.results.jsonl") for n in names}
    procs = [ctx.Process(target=produce, args=(n, i, data_dir, seed, stop, os.path.join(tmp, f"{n}.accepted")))
             for i, n in enumerate(names)]
    procs.append(ctx.Process(target=short_lived, args=(data_dir, seed, stop, os.path.join(tmp, "short.accepted"))))
    for p in procs:
        p.start()
    readers = [Reader(n, data_dir, outs[n]) for n in names[:PRODUCERS]]  # chaos-silent: not until the end
    for r in readers:
        r.start()
    kills = 0
    memory_warm: dict[str, int] = {}
    anon_warm: dict[str, int] = {}
    backlog_warm: dict[str, int] = {}
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < seconds:
            time.sleep(rng.uniform(0.3, 1.5))
            if not memory_warm and time.monotonic() - t0 > WARMUP_SHARE * seconds:
                memory_warm = memory(broker, procs[0].pid)
                anon_warm = memory(broker, procs[0].pid, anon_bytes)
                backlog_warm = backlog(data_dir)
            kills += strike(broker, readers, rng)
        memory_end = memory(broker, procs[0].pid)
        anon_end = memory(broker, procs[0].pid, anon_bytes)
        backlog_end = backlog(data_dir)
        if filler is not None:
            filler.stop()  # the drain has the whole (small) filesystem
        stop.set()
        for p in procs:
            p.join(60)
        for r in readers:
            r.stop()
        kills += kill_during_stop(broker, rng)
        broker.start()  # the drain: a broker nobody shoots at
        accepted = accepted_items(tmp, names)
        drain(data_dir, accepted, outs)
        code = broker.stop()
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        for r in readers:
            r.halt.set()
            r.kill()
    figures = score(accepted, outs, seed)
    ratio = max((memory_end.get(k, 0) / v for k, v in memory_warm.items() if v), default=None)
    anon_ratio = max((anon_end.get(k, 0) / v for k, v in anon_warm.items() if v and anon_end.get(k)), default=None)
    results_dir = Path(data_dir) / "results"
    shm_left = sum(p.stat().st_size for p in Path("/dev/shm").glob(f"*shmb.{instance}.*"))
    out = {"seconds": round(time.monotonic() - t0, 1), "items": figures["items"], "kills": kills,
           "lost": figures["lost"], "duplicated": figures["duplicated"], "wrong": figures["wrong"],
           "failed": figures["failed"], "names": figures["names"], "lost_by_name": figures["lost_by_name"],
           "memory_growth_ratio": round(ratio, 3) if ratio is not None else None,
           "memory_warm_bytes": memory_warm, "memory_end_bytes": memory_end,
           "anon_growth_ratio": round(anon_ratio, 3) if anon_ratio is not None else None,
           "anon_warm_bytes": anon_warm, "anon_end_bytes": anon_end,
           "backlog_warm": backlog_warm, "backlog_end": backlog_end,
           "results_dir_bytes": sum(p.stat().st_size for p in results_dir.rglob("*") if p.is_file()),
           "shm_left_bytes": shm_left, "broker_starts": broker.starts, "final_stop_code": code}
    return out
