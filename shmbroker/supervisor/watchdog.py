"""The supervisor's watch over its children: bounded restarts, crash loops, hung processes. The
supervisor (`supervise.py`) forks and reaps; what to make of a death and whether a live child is
hung is decided here (a death's words in the role slot: `control/deaths.py`).

Restarts (`RestartPolicy`, per role). A child that dies is restarted after a back-off: 0.1 s,
doubling after each death that came within HEALTHY_SECONDS of its start, up to
`restart_backoff_max_seconds`. A role whose last `crash_loop_restarts` deaths each came within
`crash_loop_window_seconds` of its start is in a crash loop: the supervisor sets its slot's
`crash_loop` word, which `shmbroker status`, `top` and the metrics show with its last error
(its exit status or signal, the watchdog's reason, the last line of the exception it died of).
It is still restarted, at the back-off's pace; it leaves the crash loop once an incarnation has
run a whole window. A GPU process that dies on a poison item is bounded besides by its deliveries
(`gpu/deliveries.py`): after poison_attempts deaths on the item alone, the item fails.

Hangs (`Watchdog.check`, every round of the supervisor's loop). Each process beats its role slot
(`R_BEAT`) from its loop; a wait on a ring beats that ring's side instead (a GPU process held up
by a full results ring, an ingest process by a restarting scheduler: they wait, they are not
hung). Until its first beat after its start a process is starting (an engine loading: vLLM takes
about a minute on a small machine; `startup_timeout_seconds` bounds that). Then:
- no beat from its loop or its rings for `heartbeat_timeout_seconds`: hung (an engine call that
  never returns blocks the loop);
- a GPU process publishes its batch deadline (`R_DEADLINE`, `gpu/window.py`): derived from the
  oldest batch's tokens and moved on by every result, so a long batch that keeps finishing items,
  or a long rectangle within its tokens' time, runs on; missed: hung (an item that never
  finishes, an engine thread that hangs while the loop beats).
A hung process is killed (SIGKILL), counted (`watchdog_kills`), restarted like any dead one, and
its batches redelivered; the kill counts as a delivery for the poison logic.
"""

from __future__ import annotations

import logging
import os
import signal
from collections import deque
from dataclasses import dataclass

import numpy as np

from ..control.segment import (
    R_BEAT,
    R_CRASH_LOOP,
    R_DEADLINE,
    R_EXCEPTION,
    R_LAST_ERROR,
    R_LAST_EXIT_NS,
    R_LAST_STATUS,
    R_RESTART_AT,
    R_STARTED,
    R_WATCHDOG_KILLS,
    Control,
    get_text,
    put_text,
)
from ..ring import layout as L
from ..ring.ring import CONSUMER, PRODUCER

log = logging.getLogger("shmbroker.supervisor.supervise")

BACKOFF_MIN_SECONDS = 0.1
HEALTHY_SECONDS = 10.0  # a death after running this long restarts the back-off

_SIDE_WORDS = {PRODUCER: (L.H_PRODUCER_PID, L.H_PRODUCER_BEAT), CONSUMER: (L.H_CONSUMER_PID, L.H_CONSUMER_BEAT)}


@dataclass(frozen=True)
class Limits:
    """The watchdog's and the restart policy's settings, taken from the broker's configuration
    (`Limits.of(cfg)`; config/broker.py has each one's default and what it means)."""

    heartbeat_timeout_seconds: float
    startup_timeout_seconds: float
    restart_backoff_max_seconds: float
    crash_loop_restarts: int
    crash_loop_window_seconds: float

    @classmethod
    def of(cls, cfg) -> Limits:
        return cls(cfg.heartbeat_timeout_seconds, cfg.startup_timeout_seconds, cfg.restart_backoff_max_seconds,
                   cfg.crash_loop_restarts, cfg.crash_loop_window_seconds)


class RestartPolicy:
    """When to restart a dead role, and whether it crash-loops (module docstring)."""

    def __init__(self, limits: Limits):
        self.limits = limits
        self.backoff: dict[str, float] = {}
        self.short_deaths: dict[str, deque] = {}  # role -> its recent deaths that came soon after a start

    def died(self, role: str, ran_seconds: float) -> float:
        """The role died after running `ran_seconds`: the seconds to wait before its restart."""
        lim = self.limits
        if ran_seconds > HEALTHY_SECONDS:
            delay = BACKOFF_MIN_SECONDS
        else:
            delay = min(lim.restart_backoff_max_seconds, 2 * self.backoff.get(role, BACKOFF_MIN_SECONDS / 2))
        self.backoff[role] = delay
        deaths = self.short_deaths.setdefault(role, deque(maxlen=lim.crash_loop_restarts))
        if ran_seconds > lim.crash_loop_window_seconds:
            deaths.clear()
        deaths.append(ran_seconds)
        return delay

    def crash_loop(self, role: str, running_seconds: float | None) -> bool:
        """Whether the role is in a crash loop; `running_seconds`: how long its current incarnation
        has run (None: none runs)."""
        deaths = self.short_deaths.get(role)
        if not deaths:
            return False
        if running_seconds is not None and running_seconds > self.limits.crash_loop_window_seconds:
            deaths.clear()  # it ran a whole window: out of the loop
            return False
        return len(deaths) >= self.limits.crash_loop_restarts


class Watchdog:
    """Finds hung children (module docstring). `rings`: role -> [(ring segment buffer, side)] of the
    rings whose side it holds (their beats count as its own)."""

    def __init__(self, control: Control, roles: list[str], limits: Limits, rings: dict | None = None):
        self.control = control
        self.roles = roles
        self.limits = limits
        self.rings = {role: [(buf[: L.HEADER_BYTES].view(np.int64), _SIDE_WORDS[side]) for buf, side in sides]
                      for role, sides in (rings or {}).items()}

    def check(self, role_pid: dict[str, int], now_ns: int | None = None) -> list[tuple[str, str]]:
        """[(role, why it is hung)] among the running roles `role_pid` (role -> pid)."""
        import time

        now = time.monotonic_ns() if now_ns is None else now_ns
        lim = self.limits
        hung = []
        for role, pid in role_pid.items():
            slot = self.control.role(self.roles.index(role))
            started, beat = int(slot[R_STARTED]), int(slot[R_BEAT])
            if beat <= started:  # still starting (its loop has not beaten yet)
                age = (now - started) / 1e9
                if started and age > lim.startup_timeout_seconds:
                    hung.append((role, f"no heartbeat {age:.1f} s after its start "
                                       f"(startup_timeout_seconds {lim.startup_timeout_seconds:g})"))
                continue
            for header, (pid_at, beat_at) in self.rings.get(role, ()):
                if int(header[pid_at]) == pid:
                    beat = max(beat, int(header[beat_at]))
            age = (now - beat) / 1e9
            if age > lim.heartbeat_timeout_seconds:
                hung.append((role, f"heartbeat stale for {age:.1f} s (heartbeat_timeout_seconds "
                                   f"{lim.heartbeat_timeout_seconds:g})"))
                continue
            deadline = int(slot[R_DEADLINE])
            if deadline and now > deadline:
                hung.append((role, f"missed its batch deadline by {(now - deadline) / 1e9:.1f} s (no result since "
                                   f"its work was due)"))
        return hung


class Supervision:
    """What the supervisor does about its children's deaths and hangs, in their role slots: the
    restart policy and the watchdog together (module docstring)."""

    def __init__(self, control: Control, roles: list[str], limits: Limits, rings: dict | None = None):
        self.control = control
        self.roles = roles
        self.limits = limits
        self.policy = RestartPolicy(limits)
        self.watchdog = Watchdog(control, roles, limits, rings)
        self.hung: dict[int, str] = {}  # pid the watchdog killed -> why

    def _slot(self, role: str) -> np.ndarray:
        return self.control.role(self.roles.index(role))

    def spawning(self, role: str) -> None:
        """Before a fork: clear what the role's previous incarnation left for this one."""
        slot = self._slot(role)
        slot[R_DEADLINE] = 0
        put_text(slot, R_EXCEPTION, "")
        slot[R_RESTART_AT] = 0

    def died(self, role: str, pid: int, status: int, why: str, ran_seconds: float) -> tuple[float, str]:
        """The role's process died (`why`: its wait status in words): (seconds until its restart,
        its death in words), both kept in its slot."""
        import time

        slot = self._slot(role)
        slot[R_DEADLINE] = 0
        hung = self.hung.pop(pid, None)
        exception = get_text(slot, R_EXCEPTION)
        error = f"killed by the watchdog: {hung}" if hung else f"{why}: {exception}" if exception else why
        slot[R_LAST_STATUS] = status
        slot[R_LAST_EXIT_NS] = time.time_ns()
        put_text(slot, R_LAST_ERROR, error)
        delay = self.policy.died(role, ran_seconds)
        slot[R_RESTART_AT] = time.monotonic_ns() + int(delay * 1e9)
        looping = self.policy.crash_loop(role, None)
        if looping and not slot[R_CRASH_LOOP]:
            log.error("%s is in a crash loop: %d deaths in a row, each within %g s of its start; the last: %s", role,
                      self.limits.crash_loop_restarts, self.limits.crash_loop_window_seconds, error)
        slot[R_CRASH_LOOP] = int(looping)
        return delay, error

    def watch(self, role_pid: dict[str, int], running_seconds: dict[str, float]) -> None:
        """One round over the running roles: a crash loop ends once a role has run a whole window; a
        hung child is killed (SIGKILL; the supervisor reaps and restarts it)."""
        for role in role_pid:
            slot = self._slot(role)
            if slot[R_CRASH_LOOP] and not self.policy.crash_loop(role, running_seconds.get(role, 0.0)):
                slot[R_CRASH_LOOP] = 0
                log.info("%s ran %g s: no longer in a crash loop", role, self.limits.crash_loop_window_seconds)
        for role, why in self.watchdog.check({r: p for r, p in role_pid.items() if p not in self.hung}):
            pid = role_pid[role]
            log.error("%s (pid %d) is hung: %s; killing it", role, pid, why)
            self.hung[pid] = why
            self._slot(role)[R_WATCHDOG_KILLS] += 1
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

