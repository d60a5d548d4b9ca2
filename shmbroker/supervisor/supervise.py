"""`shmbroker supervise`: create the broker's shared memory, fork its processes, watch and restart them.

Start:

1. take the data directory's lock (`supervisor.lock`; a second supervisor is refused, a dead
   one's lock is taken over);
2. salvage: the ingest rings a dead broker left in shared memory (listed in the shm manifest)
   may still hold items their producers were told were accepted; each ring is closed (its
   producer now sees it full, and its consumer dead, so it reconnects) and what it holds is
   appended to the backlog;
3. recover the backlog (torn tails cut, segments of done records reclaimed);
4. sweep the dead broker's shared memory, load every numba kernel (children never compile), create
   the control segment, the rings between processes (`wiring.py`) and the registry socket;
5. bind the exporter's socket on `metrics_addr` (a taken address fails the start here, clearly);
6. fork one process per role (`control/roles.py`): `ingest-K` (one per `ingest_processes`), `sched`,
   `results`, `gpu-<consumer>` (one per consumer) and `metrics` (the Prometheus exporter, unless
   `metrics_addr` is "") and, with a `[cluster]` table, `bridge` (cluster/node.py: this broker is
   a node of a cluster); what a child runs is `wiring.run_child`'s. A child that
   dies is restarted after a back-off, a child that is hung is killed first, and a role that
   crash-loops is reported (`watchdog.py`); why it died is logged and kept in its role slot (a
   child that fails writes the last line of its exception there on its way out). Children die
   with the supervisor (PR_SET_PDEATHSIG);
7. write `broker.json` (`observe/watch.py`): what `shmbroker top`, `status` and the exporter need to
   attach read-only. It is removed at stop.

Stop (SIGTERM or SIGINT): close the registry socket; stop the ingest processes (each drains its
producers' rings until they stay empty, closes them and takes what landed meanwhile); stop the
scheduler (no new batches); the GPU processes finish the batches already in their rings; the
results process logs and delivers what is left and checkpoints (acks, the delivery cursor); the
exporter stops last; then `broker.json` is removed, the shared memory unlinked and the lock released. Each step has a deadline (`STOP_SECONDS`),
after which the step is hurried (a second SIGTERM) and then killed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
import traceback
from pathlib import Path

from ..config.settings import BrokerConfig
from ..control.deaths import describe_status, note_exception
from ..control.roles import STOP_ORDER, broker_roles
from ..control.segment import C_METRICS_PORT, C_STOPPING, C_SUPERVISOR_PID, R_PID, R_RESTARTS, Control, mark_started
from ..disk.lockfile import AlreadyRunning, InstanceLock
from ..disk.payloads import PayloadStore
from ..observe.watch import describe, remove_description, write_description
from ..pack.contract import Mode
from ..ring.owner import Owner
from .salvage import salvage_at_start, salvage_at_stop
from .watchdog import Limits, Supervision
from .wiring import Wiring, run_child

log = logging.getLogger("shmbroker.supervisor.supervise")

STOP_SECONDS = 10.0
LOCK_WAIT_SECONDS = 5.0
WATCH_SECONDS = 0.05


class Supervisor:
    def __init__(self, cfg: BrokerConfig, modes: list[Mode]):
        self.cfg = cfg
        self.modes = modes
        self.data_dir = Path(cfg.data_dir)
        # the roles' names key the control segment's slots, broker.json and the logs (control/roles.py)
        self.role_of = {r.name: r for r in broker_roles(cfg.ingest_processes, [c.name for c in cfg.consumers],
                                                        bool(cfg.metrics_addr), cfg.cluster is not None,
                                                        cfg.http is not None)}
        self.roles = list(self.role_of)
        self.wiring: Wiring | None = None
        self.metrics_sock = None
        self.metrics_addr: str | None = None
        self.http_sock = None
        self.http_addr: str | None = None
        self.desc: dict | None = None
        self.pids: dict[int, str] = {}
        self.role_pid: dict[str, int] = {}
        self.restart_at: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.supervision: Supervision | None = None
        self.stop_requested = False
        self.lock = None
        self.owner = None
        self.keep_shm = False  # set when a stop could not salvage the ingest rings
        self.left_rings: list[tuple[int, str]] = []  # a dead broker's ingest rings the start had no room for
        self.registry = None
        self.report: dict = {}

    # -- start ---------------------------------------------------------------------------

    def start(self) -> None:
        t0 = time.monotonic()
        self.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.data_dir, 0o700)
        self.lock = _acquire_lock(self.data_dir)
        try:
            self._start(t0)
        except BaseException:
            self.close()
            raise

    def _start(self, t0: float) -> None:
        from ..frontdoor.registry import Registry
        from ..spill.store import Backlog
        from . import warmup

        from ..config.settings import parse_addr
        from ..observe.exporter import addr_text, bind

        cfg = self.cfg
        # first, the listening addresses: a taken one fails the start before any recovery work
        if cfg.metrics_addr:
            self.metrics_sock = bind(parse_addr(cfg.metrics_addr))
            self.metrics_addr = addr_text(self.metrics_sock)
            log.info("metrics exporter on http://%s/metrics", self.metrics_addr)
        if cfg.http is not None:
            self.http_sock = bind(parse_addr(cfg.http.addr), "http.addr", 1024)
            self.http_addr = addr_text(self.http_sock)
            log.info("OpenAI Files and Batches API on http://%s/v1", self.http_addr)
        backlog, report = Backlog.open(cfg.data_dir, segment_bytes=cfg.segment_bytes)
        try:
            salvaged, self.left_rings = salvage_at_start(backlog, cfg)
        finally:
            backlog.close()
        self.report = {"recovery": report.as_dict(), "salvaged_items": salvaged,
                       "rings_left_unsalvaged": len(self.left_rings)}
        if report.torn_bytes or report.quarantined:
            log.warning("backlog recovery: cut %d torn bytes, quarantined %d records (%d answered corrupt, %d lost "
                        "with no item named)", report.torn_bytes, len(report.quarantined), report.corrupt_records,
                        report.unnamed_corrupt)
        for damaged in report.damaged_files:
            log.warning("backlog recovery: %s: %s; %s", damaged["file"], damaged["reason"], damaged["action"])
        log.info("backlog: %d records pending (%d tokens), recovered in %.3f s; %d items salvaged from rings",
                 report.pending_records, report.pending_tokens, report.seconds, salvaged)
        self.owner = Owner(cfg.data_dir, cfg.instance, keep={name for _, name in self.left_rings})
        warmup.warm_all()
        owner = self.owner
        self.control = Control.create(owner, self.roles)
        self.control.words[C_SUPERVISOR_PID] = os.getpid()
        if self.metrics_sock is not None:
            self.control.words[C_METRICS_PORT] = self.metrics_sock.getsockname()[1]
        self.wiring = w = Wiring.create(owner, cfg, self.modes, self.control, self.left_rings)
        self.registry = Registry(owner, cfg.data_dir, ingest_ring_bytes=cfg.ingest_ring_bytes,
                                 result_ring_bytes=cfg.result_ring_bytes, control=self.control,
                                 retire_seconds=cfg.producer_retire_seconds,
                                 ingest_bells=w.ingest_bells,
                                 payloads=PayloadStore(cfg.data_dir, cfg.max_payload_bytes),
                                 info={"control": self.control.segment.name, "pid": os.getpid(),
                                       "roles": self.roles, "consumers": [c.name for c in cfg.consumers]})
        self.desc = w.desc = describe(cfg, self.control, self.roles, w.ring_names(), self.modes, self.metrics_addr,
                                      self.http_addr)
        w.metrics_sock = self.metrics_sock
        w.http_sock = self.http_sock
        self.supervision = Supervision(self.control, self.roles, Limits.of(cfg),
                                       {name: w.sides(role) for name, role in self.role_of.items()})
        for role in self.roles:
            self._spawn(role)
        write_description(cfg.data_dir, self.desc)  # before the registry answers: "ready" means watchable
        self.registry.start()
        log.info("broker %r up in %.2f s: %s", cfg.instance, time.monotonic() - t0, ", ".join(self.roles))

    # -- children ------------------------------------------------------------------------

    def _spawn(self, role: str) -> None:
        r = self.roles.index(role)
        slot = self.control.role(r)
        self.supervision.spawning(role)
        mark_started(slot)  # before the fork: its first beat comes after
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                if self.registry is not None:
                    self.registry.close_in_child()
                run_child(self.wiring, self.role_of[role], slot)
            except BaseException as exc:  # noqa: BLE001 - a child reports and exits, never returns
                code = 1
                note_exception(slot, exc)
                sys.stderr.write(f"shmbroker {role} (pid {os.getpid()}) failed:\n{traceback.format_exc()}")
                sys.stderr.flush()
            finally:
                os._exit(code)
        self.pids[pid] = role
        self.role_pid[role] = pid
        self.started[role] = time.monotonic()
        slot[R_PID] = pid

    def reap(self) -> None:
        """Collect dead children; schedule their restart (unless stopping)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            role = self.pids.pop(pid, None)
            if role is None:
                continue
            self.role_pid.pop(role, None)
            self.control.role(self.roles.index(role))[R_PID] = 0
            why = describe_status(status)
            if self.stop_requested:
                log.info("%s (pid %d) stopped: %s", role, pid, why)
                continue
            ran = time.monotonic() - self.started.get(role, 0.0)
            delay, error = self.supervision.died(role, pid, status, why, ran)
            self.restart_at[role] = time.monotonic() + delay
            log.warning("%s (pid %d) died: %s; restarting in %.1f s", role, pid, error, delay)

    def restart_due(self) -> None:
        now = time.monotonic()
        for role, at in list(self.restart_at.items()):
            if at <= now:
                del self.restart_at[role]
                self.control.role(self.roles.index(role))[R_RESTARTS] += 1
                self._spawn(role)

    def catch_stop(self) -> None:
        """SIGTERM/SIGINT ask for a graceful stop from now on (installed before `start`, so a signal
        that comes while the children start is not the default action's: a supervisor killed with
        its broker half up)."""
        def on_signal(signum, _frame):
            self.stop_requested = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def run(self) -> int:
        """Watch until SIGTERM/SIGINT, then stop gracefully; the exit status."""
        self.catch_stop()
        try:
            while not self.stop_requested:
                self.reap()
                if not self.stop_requested:  # hung children killed, crash loops ended (watchdog.py)
                    now = time.monotonic()
                    self.supervision.watch(self.role_pid, {r: now - self.started[r] for r in self.role_pid})
                self.restart_due()
                time.sleep(WATCH_SECONDS)
        except BaseException:
            log.exception("the supervisor failed; stopping the broker")
            self.stop()
            raise
        self.stop()
        return 0

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        self.stop_requested = True
        self.control.words[C_STOPPING] = 1
        if self.registry is not None:
            self.registry.close()
        for kind in STOP_ORDER:
            self._stop_group([name for name, role in self.role_of.items() if role.kind is kind])
        self.keep_shm = not salvage_at_stop(self.cfg)
        if not self.keep_shm and self.owner is not None:  # the rings a dead broker left are salvaged now
            self.owner.manifest.sweep(self.owner.names())
        self.close()

    def _stop_group(self, roles: list[str]) -> None:
        live = [r for r in roles if r in self.role_pid]
        for r in live:
            _signal(self.role_pid[r], signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        hurried = False
        while any(r in self.role_pid for r in live):
            self.reap()
            if time.monotonic() > deadline:
                if hurried:
                    for r in live:
                        if r in self.role_pid:
                            log.warning("%s did not stop in time: killed", r)
                            _signal(self.role_pid[r], signal.SIGKILL)
                    deadline = time.monotonic() + STOP_SECONDS
                else:
                    for r in live:
                        if r in self.role_pid:
                            _signal(self.role_pid[r], signal.SIGTERM)  # the second: stop now
                    hurried = True
                    deadline = time.monotonic() + STOP_SECONDS / 2
            time.sleep(0.01)

    def close(self) -> None:
        for pid in list(self.pids):
            _signal(pid, signal.SIGKILL)
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
        self.pids.clear()
        if self.registry is not None:
            self.registry.close()
        if self.metrics_sock is not None:
            self.metrics_sock.close()
            self.metrics_sock = None
        if self.http_sock is not None:
            self.http_sock.close()
            self.http_sock = None
        if self.desc is not None:
            remove_description(self.cfg.data_dir)
            self.desc = None
        if self.owner is not None:
            if not self.keep_shm:
                self.owner.close()
            self.owner = None
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _acquire_lock(data_dir: Path) -> InstanceLock:
    """The lock; while a dead supervisor's children are still going away (they hold it a moment
    longer), wait for them."""
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            return InstanceLock.acquire(data_dir)
        except AlreadyRunning as exc:
            holder = re.match(r"pid ([0-9]+) start ([0-9]+)", exc.holder)
            from ..ring.liveness import is_alive

            if holder is None or is_alive(int(holder.group(1)), int(holder.group(2))) \
                    or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def engine_modes(cfg: BrokerConfig) -> list[Mode]:
    """Each consumer's engine mode, from the engine registry (the sim's from its settings)."""
    from ..engines.catalogue import engine_mode

    return [engine_mode(c.engine, c.engine_settings) for c in cfg.consumers]


def supervise(cfg) -> int:
    if cfg.cluster is not None:  # a node: the missing extra is named before anything starts
        from ..cluster.nats_loop import require_nats

        require_nats()
    sup = Supervisor(cfg, engine_modes(cfg))
    sup.catch_stop()
    sup.start()
    return sup.run()
