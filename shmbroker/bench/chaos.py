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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from .broker import BenchBroker

PRODUCERS = 2
VOCAB = 32_000
SHORT_NAME_SECONDS = 0.5
DRAIN_IDLE_SECONDS = 60.0
KEEP_ENV = "SHMBROKER_CHAOS_KEEP"  # set: the scratch directory is kept (`scratch_dir` in the figures)
DRAIN_READ_SECONDS = 0.1  # a drain read ends after this long without a result (it comes round again)
WARMUP_SHARE = 0.25  # memory is taken after this share of the run, and at its end
FILL_LEFT_BYTES = 256 << 10  # what the filler leaves free on a small filesystem
FILL_FILE = "filler.ballast"
# on a small filesystem: the silent producer's results leave the shared log early (behind.py)
SMALL_FS_CONFIG = "results_name_bytes = 1048576\n"

# poison_attempts: here every death is the killer's, not an engine's; a GPU process killed while it
# holds a batch counts as a delivery of it (gpu/deliveries.py), so the default 3 would fail items
# the killer happened to hit three times in a row
CONFIG = """
poison_attempts = 8
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536

[[consumers]]
name = "big"
max_batch_size = 32
max_batch_tokens = 16384
max_input_len = 4096
engine_settings = { mode = "packed", cache_tokens = 131072, pace_seconds = 0.0 }

[[consumers]]
name = "small"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 2048
engine_settings = { mode = "padded", cache_tokens = 65536, pace_seconds = 0.0 }
"""


def prompt(seed: int, producer: int, k: int) -> tuple[np.ndarray, int]:
    """(tokens, max_new_tokens) of item k of producer `producer`: a shared prefix for half of them."""
    rng = np.random.default_rng([seed, producer, k])
    length = int(rng.integers(1, 700))
    tokens = rng.integers(0, VOCAB, length, dtype=np.uint32)
    if k % 2 and length > 64:
        tokens[:64] = np.random.default_rng([seed, k % 7]).integers(0, VOCAB, 64, dtype=np.uint32)
    return tokens, 1 + k % 8


def _anon_bytes(pid: int) -> int:
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


def _rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


# -- the processes the bench drives ------------------------------------------------------------


def _produce(name: str, index: int, data_dir: str, seed: int, stop, accepted_path: str) -> None:
    """Submit prompts until `stop`; one line "<item id> <k>" per accepted item."""
    from ..client import Producer
    from ..errors import BrokerError, Full

    producer = None
    k = 0
    with open(accepted_path, "w") as out:
        while not stop.is_set():
            try:
                if producer is None:
                    producer = Producer(name, data_dir=data_dir, timeout_seconds=2.0, connect_timeout_seconds=30.0)
                tokens, max_new = prompt(seed, index, k)
                item = producer.submit(tokens, max_new_tokens=max_new)
                out.write(f"{item} {k}\n")
                k += 1
                if k % 16 == 0:
                    out.flush()
                    time.sleep(0.01)  # a steady stream, not a flood: the readers and the killer share the cores
            except Full:
                time.sleep(0.05)
            except (BrokerError, OSError, RuntimeError):  # RuntimeError: a ring side still claimed
                if producer is not None:
                    try:
                        producer.close()
                    except Exception:
                        pass
                producer = None
                time.sleep(0.1)
        if producer is not None:
            producer.close()


def _short_lived(data_dir: str, seed: int, stop, accepted_path: str) -> None:
    """A new name every SHORT_NAME_SECONDS, one item each: "<name> <item id> <k>" per line."""
    from ..client import Producer
    from ..errors import BrokerError

    k = 0
    with open(accepted_path, "w") as out:
        while not stop.is_set():
            name = f"short-{k}-{secrets.token_hex(3)}"
            tokens, max_new = prompt(seed, 1000, k)
            try:
                with Producer(name, data_dir=data_dir, timeout_seconds=2.0, connect_timeout_seconds=5.0) as p:
                    item = p.submit(tokens, max_new_tokens=max_new)
                out.write(f"{name} {item} {k}\n")
                out.flush()
            except (BrokerError, OSError):
                pass
            k += 1
            stop.wait(SHORT_NAME_SECONDS)


class _Reader(threading.Thread):
    """`shmbroker results --name N --out F` again and again; `kill()` SIGKILLs the current run."""

    def __init__(self, name: str, data_dir: str, out: str):
        super().__init__(daemon=True)
        self.cmd = [sys.executable, "-m", "shmbroker.cli", "results", "--name", name, "--data-dir", data_dir,
                    "--out", out, "--timeout", "0.5"]
        self.proc: subprocess.Popen | None = None
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            self.proc.wait()
            self.halt.wait(0.2)

    def kill(self) -> bool:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return False
        proc.kill()
        return True

    def stop(self) -> None:
        self.halt.set()
        self.join(30)


# -- the broker under fire ---------------------------------------------------------------------


class _Broker:
    def __init__(self, tmp: str, instance: str, extra: str = ""):
        self.tmp = tmp
        self.config = f'instance = "{instance}"\n' + extra + CONFIG
        self.b: BenchBroker | None = None
        self.starts = 0

    def start(self, wait: bool = True) -> None:
        self.b = BenchBroker(self.tmp, self.config)
        self.starts += 1
        if wait:
            self.info = self.b.wait_ready()
            self.wait_roles()

    def wait_roles(self, timeout_seconds: float = 120.0) -> dict[str, int]:
        deadline = time.monotonic() + timeout_seconds
        while True:
            pids = self.role_pids()
            if pids and all(pids.values()):
                return pids
            if time.monotonic() > deadline:
                raise RuntimeError("broker roles did not all start: "
                                   + Path(self.b.log_path).read_text(errors="replace")[-3000:])
            time.sleep(0.05)

    def role_pids(self) -> dict[str, int]:
        from ..control import Control

        try:
            info = self.b.wait_ready()
            ctl = Control.attach(info["control"], info["roles"])
        except (OSError, RuntimeError, ValueError):  # a broker between two lives
            return {}
        try:
            return {role: int(ctl.role(r)[0]) for r, role in enumerate(info["roles"])}
        finally:
            ctl.close()

    def kill_supervisor(self) -> None:
        self.b.proc.kill()
        self.b.proc.wait(30)
        self.b._log.close()

    def stop(self) -> int:
        return self.b.stop()


class _Filler(threading.Thread):
    """Every 2-5 s, take all but FILL_LEFT_BYTES of a filesystem's free space for 0.5-2 s."""

    def __init__(self, directory: str, seed: int):
        super().__init__(daemon=True)
        self.path = os.path.join(directory, FILL_FILE)
        self.directory = directory
        self.rng = random.Random(seed)
        self.halt = threading.Event()
        self.fills = 0
        self.min_free_bytes: int | None = None

    def _free(self) -> int:
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        self.min_free_bytes = free if self.min_free_bytes is None else min(self.min_free_bytes, free)
        return free

    def run(self) -> None:
        while not self.halt.wait(self.rng.uniform(2.0, 5.0)):
            take = self._free() - FILL_LEFT_BYTES
            if take <= 0:
                continue
            fd = os.open(self.path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
            try:
                os.posix_fallocate(fd, 0, take)
                self.fills += 1
            except OSError:
                pass
            finally:
                os.close(fd)
            end = time.monotonic() + self.rng.uniform(0.5, 2.0)
            while time.monotonic() < end and not self.halt.is_set():
                self._free()
                time.sleep(0.1)
            os.unlink(self.path)

    def stop(self) -> None:
        self.halt.set()
        self.join(30)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _mount_small_fs(tmp: str, mib: int) -> tuple[str | None, str | None]:
    """(the mounted data directory, None) or (None, why it could not be mounted)."""
    path = os.path.join(tmp, "data")
    os.makedirs(path, mode=0o700, exist_ok=True)
    try:
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={int(mib)}m,mode=0700", "tmpfs", path],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if r.returncode != 0:
        return None, (r.stderr or r.stdout).strip() or f"mount exited {r.returncode}"
    return path, None


def run(seconds: float = 30.0, seed: int = 0, fs_mib: int | None = None) -> dict:
    tmp = tempfile.mkdtemp(prefix="shmbroker-chaos-")
    instance = "chaos" + secrets.token_hex(3)
    rng = random.Random(seed)
    ctx = mp.get_context("spawn")
    mounted, why = _mount_small_fs(tmp, fs_mib) if fs_mib else (None, None)
    broker = _Broker(tmp, instance, SMALL_FS_CONFIG if mounted else "")
    filler = _Filler(mounted, seed) if mounted else None
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
    procs = [ctx.Process(target=_produce, args=(n, i, data_dir, seed, stop, os.path.join(tmp, f"{n}.accepted")))
             for i, n in enumerate(names)]
    procs.append(ctx.Process(target=_short_lived, args=(data_dir, seed, stop, os.path.join(tmp, "short.accepted"))))
    for p in procs:
        p.start()
    readers = [_Reader(n, data_dir, outs[n]) for n in names[:PRODUCERS]]  # chaos-silent: not until the end
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
                memory_warm = _memory(broker, procs[0].pid)
                anon_warm = _memory(broker, procs[0].pid, _anon_bytes)
                backlog_warm = _backlog(data_dir)
            kills += _strike(broker, readers, rng)
        memory_end = _memory(broker, procs[0].pid)
        anon_end = _memory(broker, procs[0].pid, _anon_bytes)
        backlog_end = _backlog(data_dir)
        if filler is not None:
            filler.stop()  # the drain has the whole (small) filesystem
        stop.set()
        for p in procs:
            p.join(60)
        for r in readers:
            r.stop()
        kills += _kill_during_stop(broker, rng)
        broker.start()  # the drain: a broker nobody shoots at
        accepted = _accepted(tmp, names)
        _drain(data_dir, accepted, outs)
        code = broker.stop()
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
        for r in readers:
            r.halt.set()
            r.kill()
    figures = _score(accepted, outs, seed)
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


def _strike(broker: _Broker, readers: list[_Reader], rng: random.Random) -> int:
    """One random blow; returns the processes killed."""
    roll = rng.random()
    if roll < 0.12:  # the supervisor; sometimes its successor too, during its recovery
        broker.kill_supervisor()
        broker.start(wait=False)
        if rng.random() < 0.4:
            time.sleep(rng.uniform(0.05, 0.6))
            if broker.b.proc.poll() is None:
                broker.kill_supervisor()
                broker.start(wait=False)
                broker.b.wait_ready()
                broker.wait_roles()
                return 2
        broker.b.wait_ready()
        broker.wait_roles()
        return 1
    if roll < 0.3:
        return int(rng.choice(readers).kill())
    pids = broker.role_pids()
    victims = [r for r in pids if r != "metrics" and pids[r]]
    count = 2 if roll > 0.85 else 1
    killed = 0
    for role in rng.sample(victims, min(count, len(victims))):
        try:
            os.kill(pids[role], signal.SIGKILL)
            killed += 1
        except ProcessLookupError:
            pass
    return killed


def _kill_during_stop(broker: _Broker, rng: random.Random) -> int:
    pids = broker.role_pids()
    broker.b.proc.send_signal(signal.SIGTERM)
    time.sleep(rng.uniform(0.0, 0.3))
    killed = 0
    role = rng.choice([r for r in pids if pids[r]]) if pids else None
    if role is not None:
        try:
            os.kill(pids[role], signal.SIGKILL)
            killed = 1
        except ProcessLookupError:
            pass
    try:
        broker.b.proc.wait(60)
    except subprocess.TimeoutExpired:
        broker.b.proc.kill()
        broker.b.proc.wait()
    broker.b._log.close()
    return killed


def _memory(broker: _Broker, client_pid: int, measure=_rss_bytes) -> dict[str, int]:
    pids = broker.role_pids()
    out = {"client": measure(client_pid), "sched": measure(pids.get("sched", 0)),
           "results": measure(pids.get("results", 0))}
    for role, pid in pids.items():
        if role.startswith("gpu-"):
            out[role] = measure(pid)
    return out


def _backlog(data_dir: str) -> dict[str, int]:
    """Items waiting for a batch (in the scheduler's memory, and on disk only) and results waiting
    for readers far behind, as the broker's shared counters say now; {} if it cannot be read."""
    from ..errors import BrokerError
    from ..watch import BrokerView

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


def _accepted(tmp: str, names: list[str]) -> dict[str, dict[int, tuple[int, int]]]:
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


def _drain(data_dir: str, accepted: dict, outs: dict[str, str]) -> None:
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


def _score(accepted: dict, outs: dict[str, str], seed: int) -> dict:
    from ..gpu.engines.sim import Sim

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
