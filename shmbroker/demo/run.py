"""`shmbroker demo`: the race that matters, the broker against the engine alone, on generation.

1. The workload: the generator's (`workloads/synthetic.py`: Zipf prefix families, multi-turn
   chains, log-normal lengths; the default model only) with each item's own output length
   (`max_new_tokens` as the generator drew it, as `bench pack --max-new-tokens 0` runs it).
2. The broker, live: `shmbroker supervise` starts as a user would start it (a subprocess, the
   built-in consumers `big` and `small` on the simulated engine: continuous batching, an LRU
   prefix cache each, the modeled cost, paced), on a fresh data directory under the given one
   and a unique instance name. Two forked producers split the workload (alternate items): `chat`
   submits one item at a time, `batch` in chunks with `submit_many`; each reads its results while
   it submits and checks that every item id came back exactly once, ok, with the tokens the
   simulated engine generates for it (`Sim.generated`). The broker's accounting is read from its
   counters (the control segment) before the stop; then SIGTERM: it must exit 0 and leave none of
   its shared memory behind.
3. The engine alone, in the same run (`figures.baselines`): the same items, in arrival order,
   through one shared queue to whichever of the same consumers' engines has room, each batching
   continuously with its own LRU prefix cache: bench pack's `engine_alone`
   (`workloads/feeders.py`), simulated in virtual time. FIFO batch-at-a-time (arrival-order
   batches, each run to its last item) comes second.

The figure compared is the modeled makespan, the slower consumer's modeled engine seconds (the
consumers run side by side), both sides including prefill and decode:
- the broker's: each consumer's `engine_own_ns` counter, which its GPU process adds up from its
  simulated engine: the cost model's seconds of every step the engine ran (`engines/continuous.py`:
  a step's overhead or decode-step cost, one decode token per running sequence, the prefill tokens
  it computed past its cache hits). A step costs the same modeled seconds however fast the CPU
  runs it. Time an engine sat with nothing to run is not in it (no step ran): each consumer's
  `idle_wall_seconds` (its GPU process's `idle_ns`, wall seconds) is reported beside it.
- the engine alone's: `packsim.simulate` with `EngineAloneFeeder` on `ContinuousSim` engines built
  from the broker's own configuration (each consumer's contract, cache_tokens and SimCost), the
  prompts hashed into the blocks the live engines hash (`block_tokens`, no declared prefixes), the
  same in-flight window (max_batch_size and an eighth) and the same output lengths. Offline: every
  item waits at time 0, the best case for arrival-order feeding, so an engine never waits for
  work and its clock at its last step is its summed step seconds, the same sum as the broker's.

The engines run at the built-in configuration's pace (PACE_SECONDS wall seconds per modeled second),
so the work splits between the consumers by their modeled speed, as between two cards. The
workload: ITEMS items of seed SEED, about 20 s of engines and half a minute in all on 2 cores; a
run that long stays inside the broker's aging bound (`max_wait_seconds`, 30 wall seconds), past
which the oldest waiting item, not the cache, picks a consumer's next family. Decode, the larger part of the modeled time, costs both sides alike: the
broker gains by its prefix-cache hits (a family kept on one card, a conversation's turns one
after another) and by keeping every slot busy to the end (the longest generations first). The
packer simulated with an unbounded queue behind each window (`PackerFeeder`) takes 0.83 of the
engine alone's makespan on 20,000 items and 0.89 on 60,000 (its even finish matters less as the
workload grows).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from .. import protocol
from ..control import roles
from ..engines.options import SimSettings
from .broker import read_counters, shm_left, stop, wait_ready
from .figures import Baselines, baselines, consumer_figures, total_figures
from .producers import RESULTS_SECONDS, producer, recv, workload
from .summary import headline, print_summary

SEED = 7
ITEMS = 20_000  # about 20 s of paced engines, half a minute in all on 2 cores (the module docstring)
MAX_NEW_TOKENS: int | None = None  # None: every item's own output length, as the generator drew it
MAKESPAN_RATIO_MAX = 0.9  # the broker's modeled makespan against the engine alone's, at most
PACE_SECONDS = SimSettings.pace_seconds  # the simulated engines' pace: the built-in configuration's

__all__ = ["ITEMS", "MAKESPAN_RATIO_MAX", "SEED", "main", "print_summary", "run"]


@dataclass(frozen=True)
class DemoDirs:
    """A run's own directory under the data directory: the broker's data, configuration and log."""

    root: Path
    data: str
    instance: str
    config_path: Path
    log_path: Path

    @classmethod
    def make(cls, data_dir: str | None, pace_seconds: float) -> DemoDirs:
        top = Path(protocol.data_dir(data_dir))
        top.mkdir(mode=0o700, parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="demo-", dir=top))  # 0700
        instance = f"demo{os.getpid()}"
        config_path = root / "shmbroker.toml"
        config_path.write_text(config_text(instance, pace_seconds))
        return cls(root, str(root / "data"), instance, config_path, root / "supervisor.log")


def config_text(instance: str, pace_seconds: float) -> str:
    """The demo broker's configuration: its instance, the exporter on a free port (the default one
    may be taken; `shmbroker top` needs no port), and the built-in consumers (`default_consumers`:
    their contracts, caches and cost model) at the demo's pace."""
    from ..config.settings import default_consumers

    lines = [f'instance = "{instance}"', 'metrics_addr = "127.0.0.1:0"']
    for c in default_consumers():
        k, sim = c.contract, c.engine_settings
        assert c.model_name is None and c.engine == "sim", "the built-in consumers serve the default model, simulated"
        lines += ["", "[[consumers]]", f'name = "{c.name}"', f"max_batch_size = {k.max_batch_size}",
                  f"max_batch_tokens = {k.max_batch_tokens}", f"max_input_len = {k.max_input_len}", 'engine = "sim"',
                  "[consumers.engine_settings]", f'mode = "{sim.mode}"', f"cache_tokens = {sim.cache_tokens}",
                  f"pace_seconds = {pace_seconds!r}"]
        lines += [f"{key} = {str(value).lower() if isinstance(value, bool) else repr(value)}"
                  for key, value in dataclasses.asdict(sim.cost).items()]
    return "\n".join(lines) + "\n"


def paced(consumers, pace_seconds: float) -> tuple:
    """`consumers` with their simulated engines at `pace_seconds`."""
    return tuple(dataclasses.replace(c, engine_settings=dataclasses.replace(c.engine_settings, pace_seconds=pace_seconds))
                 for c in consumers)


class Stopped(NamedTuple):
    """How the broker stopped: its exit status, the seconds it took, its shared memory left."""

    exit_code: int
    seconds: float
    shm_left: list


class Clock(NamedTuple):
    """Wall-clock marks of a run (time.monotonic)."""

    start: float
    broker: float  # the workload generated, the broker starting
    ready: float  # every broker process in its loop


def run(data_dir: str | None = None, items: int = ITEMS, seed: int = SEED, *,
        max_new_tokens: int | None = MAX_NEW_TOKENS, pace_seconds: float = PACE_SECONDS) -> dict:
    from ..config import settings

    t_start = time.monotonic()
    dirs = DemoDirs.make(data_dir, pace_seconds)
    cfg = settings.load(dirs.config_path, data_dir=dirs.data)  # what the broker reads
    assert cfg.consumers == paced(settings.default_consumers(), pace_seconds), "the built-in consumers, paced"
    wl = workload(items, seed, max_new_tokens)
    t_broker = time.monotonic()
    with open(dirs.log_path, "wb") as log:
        sup = subprocess.Popen([sys.executable, "-m", "shmbroker.cli", "supervise", "--config", str(dirs.config_path),
                                "--data-dir", dirs.data], stdout=log, stderr=subprocess.STDOUT)
    procs: dict[str, mp.Process] = {}
    ok = False
    try:
        info = wait_ready(sup, dirs.data, dirs.log_path)
        clock = Clock(t_start, t_broker, time.monotonic())
        producers = feed(dirs.data, wl, procs)
        counters = read_counters(info, len(wl))
        t_stop = time.monotonic()
        code = stop(sup)
        stopped = Stopped(code, time.monotonic() - t_stop, shm_left(dirs.instance, dirs.data))
        base = baselines(wl, cfg)
        report = build_report(wl, cfg, producers, counters, base, clock, stopped)
        report.update(seed=seed, max_new_tokens=max_new_tokens, instance=dirs.instance, pace_seconds=pace_seconds)
        report["headline"] = headline(report)
        ok = report["verified"] and report["stopped_cleanly"]
        report["data_dir"] = None if ok else str(dirs.root)
        return report
    except BaseException as exc:
        exc.add_note(f"shmbroker demo: the broker's data directory and log are kept in {dirs.root}")
        raise
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        if sup.poll() is None:
            stop(sup)
        if ok:
            shutil.rmtree(dirs.root, ignore_errors=True)


def feed(data: str, wl, procs: dict[str, mp.Process]) -> dict[str, dict]:
    """Fork the two producers (into `procs`, which the caller cleans up), start them together and
    return what each reports once it has every result."""
    ctx = mp.get_context("fork")
    n = len(wl)
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
    for p in producers.values():
        p["seconds"] = p["end"] - p["start"]
        p["items_per_s"] = p["items"] / p["seconds"]
    return producers


def build_report(wl, cfg, producers: dict, counters: dict, base: Baselines, clock: Clock, stopped: Stopped) -> dict:
    """The run's figures (the module docstring says what each side's makespan is)."""
    n = len(wl)
    input_tokens = int(wl.lengths.sum())
    per = {c.name: consumer_figures(counters[f"gpu-{c.name}"], c.contract, c.engine_settings.mode)
           for c in cfg.consumers}
    total = total_figures(per, sum(p["output_tokens"] for p in producers.values()))
    alone, fifo = base.engine_alone, base.fifo
    seconds = max(p["end"] for p in producers.values()) - min(p["start"] for p in producers.values())
    ratio = total["makespan_seconds"] / alone["makespan_seconds"] if alone["makespan_seconds"] else float("inf")
    return {
        "workload": wl.name, "items": n, "input_tokens": input_tokens,
        "output_tokens": int(np.maximum(wl.max_new_tokens, 1).sum()),
        "producers": producers,
        "wall": {"seconds": seconds, "items_per_s": n / seconds, "tokens_per_s": input_tokens / seconds,
                 "workload_seconds": clock.broker - clock.start, "broker_start_seconds": clock.ready - clock.broker,
                 "stop_seconds": stopped.seconds, "engine_alone_simulation_seconds": base.engine_alone_seconds,
                 "fifo_simulation_seconds": base.fifo_seconds},
        "broker": {"ingest_items": sum(c["items"] for r, c in counters.items() if roles.kind_of(r) is roles.Kind.INGEST),
                   "sched_items": counters["sched"]["items"], "sched_failed": sum(counters["sched"][k] for k in (
                       "rejected_empty", "rejected_no_consumer", "rejected_too_long")),
                   "results": counters["results"]["results"]},
        "counters": counters,
        "consumers": per,
        "total": total,
        "engine_alone": alone,
        "fifo": fifo,
        "vs_engine_alone": {"makespan_ratio": ratio, "makespan_ratio_max": MAKESPAN_RATIO_MAX,
                            "met": ratio <= MAKESPAN_RATIO_MAX,
                            "modeled_seconds_ratio": total["modeled_seconds"] / alone["modeled_seconds"]},
        "vs_fifo": {
            "makespan_speedup": fifo["makespan_seconds"] / total["makespan_seconds"]
            if total["makespan_seconds"] else 0.0,
            "modeled_seconds_speedup": fifo["modeled_seconds"] / total["modeled_seconds"]
            if total["modeled_seconds"] else 0.0,
        },
        "verified": all(p["verified"] for p in producers.values()) and sum(p["items"] for p in producers.values()) == n,
        "exit_code": stopped.exit_code,
        "shm_left": stopped.shm_left,
        "stopped_cleanly": stopped.exit_code == 0 and not stopped.shm_left,
    }


def main(data_dir: str | None = None) -> None:
    t0 = time.monotonic()
    report = run(data_dir)
    print_summary(report)
    print(f"total wall time {time.monotonic() - t0:.1f} s")
    if not (report["verified"] and report["stopped_cleanly"]):
        raise SystemExit(1)
