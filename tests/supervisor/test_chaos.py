"""Chaos: SIGKILL a broker process at a random moment while producers submit; nothing accepted is lost.

For each victim kind (`ingest-0`, `sched`, `results`, `gpu-big`, `gpu-small`, and the supervisor
itself) one real broker (`brokerproc.BrokerProc`, its own data directory and shm instance) runs
a number of iterations. One iteration:

1. two producer processes (fork) connect under their names (the same names every iteration, so
   a later iteration's process reconnects to its rings) and, on a common start signal, submit
   seeded items (lengths 1..3000, some with prefixes shared between items and between the two
   producers, single `submit` and `submit_many` calls) continuously, draining their results as
   they go;
2. at a random moment the test SIGKILLs the victim: a child is restarted by the supervisor (the
   test waits for its new pid), the supervisor is replaced by a new one on the same data
   directory (`kill()`, an optional short outage, `start()`); the producers must ride this out
   with the client's reconnect;
3. the producers stop submitting a moment later and collect results until every item they were
   told was accepted has one (a generous deadline);
4. checks: per producer, the ids that submit/submit_many returned == the ids with a result; the
   client never yielded an id twice; every status ok; tokens == `Sim.generated(id, max_new, prompt)`;
   the supervisor log shows the victim's death and restart, and no other process died.

At the end the broker stops gracefully (exit 0) and none of its instance's shm is left.

`SHMBROKER_SOAK_ITERATIONS=N` runs N iterations per victim (default 1); `SHMBROKER_CHAOS_SEED`
sets the base seed (iteration i uses seed + i, so a failing iteration's seed, printed in the
failure, reproduces its workload and kill timing as iteration 0; the race itself is not deterministic).
"""

from __future__ import annotations

import faulthandler
import multiprocessing as mp
import os
import random
import secrets
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import BrokerProc
from support.harness import Workload, shm_leftovers

ITERATIONS = max(1, int(os.environ.get("SHMBROKER_SOAK_ITERATIONS", "1")))
BASE_SEED = int(os.environ.get("SHMBROKER_CHAOS_SEED", "20261130"))
VICTIMS = ["ingest-0", "sched", "results", "gpu-big", "gpu-small", "supervisor"]
PRODUCERS = 2
MAX_NEW = 48
MAX_ITEMS = 1500  # per producer and iteration: bounds the drain
RESULTS_SECONDS = 60.0  # a producer's deadline for all its results once it stopped submitting
RESTART_SECONDS = 30.0  # a killed child must be back by then
READY_SECONDS = 60.0
JOIN_SLACK_SECONDS = 30.0
ITERATION_SECONDS = 150.0  # for the pytest timeout: well above what one iteration can take

pytestmark = pytest.mark.timeout(120 + ITERATION_SECONDS * ITERATIONS)

# -- a producer process ------------------------------------------------------------------------


def _producer_main(conn, name: str, data_dir: str, seed: int, k: int, ready, go, stop) -> None:
    """Submit until `stop`, then collect every result; send a report (a dict) on `conn`."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks for a stack when we hang
    from shmbroker.client.producer import Producer
    from shmbroker.engines.sim import Sim
    from shmbroker.errors import Full

    report = {"name": name, "ids": [], "max_new": [], "t": [], "yielded": [], "bad": [], "error": None,
              "producer_ids": [], "reconnects": 0, "results_seconds": None}
    max_new_of: dict[int, tuple[int, int]] = {}  # item id -> (max_new_tokens, its prompt's Sim.digest)
    got: set[int] = set()
    yielded = report["yielded"]
    bad = report["bad"]

    def handle(r) -> None:
        yielded.append(r.item_id)
        if r.item_id in got:
            return  # the test counts what the client yielded twice
        entry = max_new_of.get(r.item_id)
        if entry is None:
            return  # not ours this iteration (an earlier process of this name): the test sorts it out
        got.add(r.item_id)
        if r.status != "ok":
            bad.append((r.item_id, f"status {r.status}: {r.error}"))
        elif r.error is not None:
            bad.append((r.item_id, f"ok with error {r.error!r}"))
        else:
            m, digest = entry
            want = Sim.generated_many(np.array([r.item_id], np.uint64), np.array([m]), np.array([digest])).flat
            if r.tokens.size != want.size or not np.array_equal(r.tokens, want):
                bad.append((r.item_id, f"tokens differ: {r.tokens.size} vs {want.size} expected"))

    def accepted(ids, max_new, t, digests) -> None:
        for i, m, d in zip((int(x) for x in ids), max_new, digests):
            report["ids"].append(i)
            report["max_new"].append(int(m))
            report["t"].append(t)
            max_new_of[i] = (int(m), int(d))

    p = None
    try:
        p = Producer(name, data_dir=data_dir, connect_timeout_seconds=RESTART_SECONDS)
        report["producer_ids"].append(p.producer_id)
        ready.set()
        go.wait(READY_SECONDS)
        work = Workload(seed, name)
        rng = random.Random(f"{seed}/{name}/ops")
        try:
            while not stop.is_set() and len(max_new_of) < MAX_ITEMS:
                if rng.random() < 0.4:
                    tokens, plen = work.item()
                    m = rng.randint(1, MAX_NEW)
                    t = time.monotonic()
                    if plen and rng.random() < 0.5:
                        i = p.submit(tokens, max_new_tokens=m, prefix_len=plen)
                    else:
                        i = p.submit(tokens, max_new_tokens=m)
                    accepted([i], [m], t, [Sim.digest(tokens)])
                else:
                    n = rng.randint(2, 16)
                    made = [work.item() for _ in range(n)]
                    offsets = np.zeros(n + 1, np.int64)
                    np.cumsum([x[0].size for x in made], out=offsets[1:])
                    flat = np.concatenate([x[0] for x in made])
                    one = rng.random() < 0.3
                    m = rng.randint(1, MAX_NEW) if one else np.array([rng.randint(1, MAX_NEW) for _ in range(n)])
                    ms = [m] * n if one else m.tolist()
                    prefix_len = np.array([x[1] for x in made], np.int64) if rng.random() < 0.5 else None
                    digests = [Sim.digest(x[0]) for x in made]
                    t = time.monotonic()
                    try:
                        ids = p.submit_many(flat, offsets, max_new_tokens=m, prefix_len=prefix_len)
                    except Full as exc:
                        accepted(exc.ids, ms[: len(exc.ids)], t, digests)
                        raise
                    accepted(ids, ms, t, digests)
                if p.producer_id not in report["producer_ids"]:
                    report["producer_ids"].append(p.producer_id)
                for r in p.results(0.0):
                    handle(r)
                time.sleep(rng.uniform(0.0, 0.02))
        finally:
            report["submitted_until"] = time.monotonic()
        t0 = time.monotonic()
        deadline = t0 + RESULTS_SECONDS
        while len(got) < len(max_new_of) and time.monotonic() < deadline:
            for r in p.results(0.5):
                handle(r)
                if len(got) == len(max_new_of):
                    break
        report["results_seconds"] = time.monotonic() - t0
        for r in p.results(0.2):  # anything more would be a duplicate the client let through
            handle(r)
    except BaseException:  # noqa: BLE001 - reported to the test
        report["error"] = traceback.format_exc()
    finally:
        ready.set()
        if p is not None:
            if p.producer_id not in report["producer_ids"]:
                report["producer_ids"].append(p.producer_id)
            report["reconnects"] = p.reconnects
            p.close()
        conn.send(report)
        conn.close()


# -- the test ----------------------------------------------------------------------------------


class Chaos:
    def __init__(self, tmp_path: Path, victim: str):
        self.victim = victim
        self.instance = "c" + secrets.token_hex(4)
        self.broker = BrokerProc(tmp_path, instance=self.instance)
        self.names = [f"chaos-{victim}-{k}" for k in range(PRODUCERS)]
        self.earlier: dict[str, set[int]] = {n: set() for n in self.names}  # ids of earlier iterations
        self.ctx = mp.get_context("fork")
        self.timings: list[dict] = []

    def log_from(self, offset: int) -> str:
        try:
            with open(self.broker.log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def log_size(self) -> int:
        try:
            return self.broker.log_path.stat().st_size
        except FileNotFoundError:
            return 0

    def iteration(self, it: int) -> None:
        seed = BASE_SEED + it
        rng = random.Random(f"{seed}/{self.victim}")
        where = f"victim {self.victim}, iteration {it}, SHMBROKER_CHAOS_SEED={seed}"
        broker = self.broker
        log_at = self.log_size()
        before = broker.role_pids()
        ready = [self.ctx.Event() for _ in range(PRODUCERS)]
        go, stop = self.ctx.Event(), self.ctx.Event()
        pipes, procs = [], []
        for k, name in enumerate(self.names):
            recv, send = self.ctx.Pipe(duplex=False)
            proc = self.ctx.Process(target=_producer_main, args=(send, name, broker.data_dir, seed, k, ready[k], go, stop),
                                    name=name, daemon=True)
            proc.start()
            send.close()
            pipes.append(recv)
            procs.append(proc)
        reports: list[dict | None] = [None] * PRODUCERS
        event: dict = {"victim": self.victim, "iteration": it, "seed": seed}
        try:
            for e in ready:
                assert e.wait(READY_SECONDS), f"{where}: a producer did not connect"
            submit_seconds = rng.uniform(1.2, 2.2)
            kill_after = rng.uniform(0.02, 0.8) * submit_seconds
            outage = rng.choice([0.0, 0.0, rng.uniform(0.05, 0.6)])
            t_go = time.monotonic()
            go.set()
            time.sleep(kill_after)
            event["kill_at"] = time.monotonic()
            if self.victim == "supervisor":
                event["pid"] = broker.proc.pid
                broker.kill()
                time.sleep(outage)
                t = time.monotonic()
                broker.start(READY_SECONDS)
                event["back_after"] = time.monotonic() - event["kill_at"]
                event["start_seconds"] = time.monotonic() - t
            else:
                old = broker.kill_role(self.victim)
                event["pid"] = old
                back = None
                deadline = time.monotonic() + RESTART_SECONDS
                while time.monotonic() < deadline:
                    pid = broker.role_pids().get(self.victim, 0)
                    if pid and pid != old:
                        back = pid
                        break
                    time.sleep(0.02)
                assert back is not None, (f"{where}: {self.victim} (pid {old}) not restarted in {RESTART_SECONDS} s\n"
                                          f"{self.log_from(log_at)}")
                event["back_after"] = time.monotonic() - event["kill_at"]
            # keep submitting a while against the restarted process
            time.sleep(max(0.3, submit_seconds - (time.monotonic() - t_go)))
            stop.set()
            event["stop_at"] = time.monotonic()
            deadline = time.monotonic() + RESULTS_SECONDS + JOIN_SLACK_SECONDS
            for k, (recv, proc) in enumerate(zip(pipes, procs)):
                if recv.poll(max(0.0, deadline - time.monotonic())):
                    reports[k] = recv.recv()
                else:  # hung: ask for its stack (faulthandler, on stderr) before the test fails
                    os.kill(proc.pid, signal.SIGUSR1)
                    time.sleep(0.5)
            event["collected_after"] = time.monotonic() - event["stop_at"]
        finally:
            stop.set()
            go.set()
            for proc in procs:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(5)
        log = self.log_from(log_at)
        self.check(where, reports, event, before, log)
        self.timings.append(event)

    def check(self, where: str, reports: list, event: dict, before: dict, log: str) -> None:
        """Every problem of the iteration in one failure message."""
        from shmbroker.ring.items import SEQ_BITS

        seq_mask = (1 << SEQ_BITS) - 1
        kill_at = event.get("kill_at", 0.0)
        problems: list[str] = []
        for k, rep in enumerate(reports):
            name = self.names[k]
            if rep is None:
                problems.append(f"producer {name} hung (no report in time; its stack is on stderr)")
                continue
            if rep["error"] is not None:
                problems.append(f"producer {name} failed:\n{rep['error']}")
            ids = rep["ids"]
            t_of = dict(zip(ids, rep["t"]))

            def describe(i: int, t_of=t_of) -> str:
                t = t_of.get(i)
                when = "" if t is None else f", submitted {t - kill_at:+.3f} s from the kill"
                return f"{i:#x} (producer {i >> SEQ_BITS} seq {i & seq_mask}{when})"

            submitted = set(ids)
            if len(submitted) != len(ids):
                problems.append(f"producer {name}: submit returned an id twice")
            seen: set[int] = set()
            twice = sorted({i for i in rep["yielded"] if i in seen or seen.add(i)})
            if twice:
                problems.append(f"producer {name}: the client yielded {len(twice)} ids twice: "
                                + ", ".join(describe(i) for i in twice[:20]))
            extra = seen - submitted
            stale = extra & self.earlier[name]
            unexpected = sorted(extra - stale)
            missing = sorted(submitted - seen)
            if missing:
                by_producer: dict[int, int] = {}
                for i in missing:
                    by_producer[i >> SEQ_BITS] = by_producer.get(i >> SEQ_BITS, 0) + 1
                problems.append(f"producer {name}: {len(missing)} of {len(ids)} accepted items got no result in "
                                f"{RESULTS_SECONDS} s (missing per producer id: {by_producer}; this process's producer "
                                f"ids {rep['producer_ids']}, reconnects {rep['reconnects']}):\n    "
                                + "\n    ".join(describe(i) for i in missing[:30]))
            if unexpected:
                problems.append(f"producer {name}: results for {len(unexpected)} ids never submitted: "
                                + ", ".join(describe(i) for i in unexpected[:20]))
            if rep["bad"]:
                problems.append(f"producer {name}: wrong results: "
                                + "; ".join(f"{describe(i)}: {why}" for i, why in rep["bad"][:20]))
            event[f"{name}.items"] = len(ids)
            event[f"{name}.after_kill"] = sum(1 for t in rep["t"] if t > kill_at)
            event[f"{name}.stale"] = len(stale)
            event[f"{name}.reconnects"] = rep["reconnects"]
            event[f"{name}.results_seconds"] = rep["results_seconds"]
            self.earlier[name] |= submitted
        # the log: the victim died and came back; nothing else died or failed
        if " failed:\n" in log or "Traceback" in log:
            problems.append("a broker process failed (traceback in the log)")
        died = [line for line in log.splitlines() if " died: " in line]
        if self.victim == "supervisor":
            if died:
                problems.append(f"a child died after the supervisor restart: {died}")
            if log.count(f"broker {self.instance!r} up") != 1:
                problems.append("the log does not show the new supervisor up")
        else:
            want = f"{self.victim} (pid {event['pid']}) died: killed by SIGKILL"
            if not any(want in line for line in died):
                problems.append(f"the supervisor log does not show {want!r}")
            others = [line for line in died if want not in line]
            if others:
                problems.append(f"other processes died too: {others}")
        after = self.broker.role_pids()
        changed = {r for r in after if after[r] != before.get(r)}
        expected = set(after) if self.victim == "supervisor" else {self.victim}
        if changed != expected:
            problems.append(f"role pids changed: {before} -> {after}")
        if problems:
            pytest.fail(f"{where}; {event}\n" + "\n".join(problems)
                        + f"\nsupervisor log of the iteration:\n{log[-6000:]}", pytrace=False)


@pytest.mark.parametrize("victim", VICTIMS)
def test_chaos_kill(tmp_path, victim):
    chaos = Chaos(tmp_path, victim)
    broker = chaos.broker
    t0 = time.monotonic()
    try:
        broker.start(READY_SECONDS)
        for it in range(ITERATIONS):
            chaos.iteration(it)
        code = broker.stop()
        assert code == 0, f"supervisor exited with {code}:\n{broker.log()}"
        left = shm_leftovers(chaos.instance)
        assert left == [], f"shm of instance {chaos.instance} left after a clean stop: {left}"
    finally:
        if broker.proc is not None and broker.proc.poll() is None:
            try:
                broker.stop(30)
            except Exception:  # noqa: BLE001 - a failed test still cleans up
                broker.kill()
        for path in shm_leftovers(chaos.instance):
            path.unlink(missing_ok=True)
    items = sum(v for e in chaos.timings for key, v in e.items() if key.endswith(".items"))
    back = [e["back_after"] for e in chaos.timings]
    print(f"\nchaos {victim}: {ITERATIONS} iterations, {items} items in {time.monotonic() - t0:.1f} s; "
          f"victim back after {min(back):.2f}..{max(back):.2f} s")
    for e in chaos.timings:
        per = " ".join(f"{n[-1]}:{e[n + '.items']}/{e[n + '.after_kill']}/{e[n + '.reconnects']}" for n in chaos.names)
        print(f"  it {e['iteration']} seed {e['seed']}: back {e['back_after']:.2f} s, results {e['collected_after']:.2f} s "
              f"after the stop; items/after kill/reconnects {per}")
