"""How long `submit --wait` waits: as long as the broker works on the items still without a result.

Silence alone says little: a result may take minutes to come (a 70 B model loading, an engine
restarted after it died, a long generation). So after each second without a result the wait looks
at the broker the way `status` does, read-only (`observe/watch.py`: each role slot's pid, start,
heartbeat, pending restart and crash-loop words, and broker.json's consumers with their models). A
model's items are worked on while a consumer of that model runs, starts (its engine loading) or is
due to be restarted, and is not in a crash loop; the items of a model no consumer serves come back
`invalid` on any consumer's batch, so any consumer counts for them. The wait gives up when no model
it still waits for is worked on, seen so for GIVE_UP_SECONDS (a process between its death and its
restart is not taken for a dead one), when no broker runs or it is stopping, or when its ingest,
scheduler or results process is in a crash loop; with `--idle-timeout S`, also after S seconds
without a result. It then says what the broker was doing: each consumer of those models and its
state. A cluster's nodes cannot be watched from here: with --cluster the wait gives up after
CLUSTER_IDLE_SECONDS without a result, unless --idle-timeout says otherwise.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from ..control.roles import Kind, gpu, kind_of
from ..ring.items import DEFAULT_MODEL

GIVE_UP_SECONDS = 3.0  # how long nothing must be seen working on the items before the wait gives up
CLUSTER_IDLE_SECONDS = 60.0  # with --cluster (nothing to watch): the wait's bound without a result
LOOK_SECONDS = 1.0  # the longest read of results between two looks at the broker
PIPELINE = (Kind.INGEST, Kind.SCHED, Kind.RESULTS)  # every item's result passes through these


class ItemModels:
    """The model of each item a run waits for, kept as runs of consecutive item ids (a file's lines of
    one model get consecutive ids), so millions of items cost a few entries."""

    def __init__(self):
        self.starts: list[int] = []
        self.ends: list[int] = []  # one past each run's last id
        self.names: list[str] = []
        self._known: tuple[int, set[str]] = (-1, set())  # (how many items were asked about, their models)

    def add(self, item: int, model: str | None) -> None:
        name = model or DEFAULT_MODEL
        if self.names and self.names[-1] == name and self.ends[-1] == item:
            self.ends[-1] = item + 1
        else:
            self.starts.append(item)
            self.ends.append(item + 1)
            self.names.append(name)

    def of(self, items: set[int]) -> set[str]:
        """The models of `items` (all added). Asked again about as many items (the set only shrinks as
        results come), the answer is the last one."""
        if len(set(self.names)) <= 1:
            return set(self.names)
        if self._known[0] != len(items):
            starts = np.array(self.starts, np.uint64)
            order = np.argsort(starts, kind="stable")
            ids = np.fromiter(items, np.uint64, len(items))
            runs = np.searchsorted(starts[order], ids, side="right") - 1  # the runs are disjoint
            self._known = (len(items), {self.names[int(order[k])] for k in np.unique(runs[runs >= 0]).tolist()})
        return self._known[1]


def consumer_state(process: dict, engine_down: bool = False) -> tuple[bool, str]:
    """(whether a consumer works on items, its state in words), from its process as
    `BrokerView.process` reads it."""
    error = f"; last error: {process['last_error']}" if process.get("last_error") else ""
    if process["alive"] and not process["starting"]:
        return True, "running, its engine down (retrying)" if engine_down else "running"
    if process["crash_loop"]:
        return False, f"in a crash loop ({process['restarts']} restarts{error})"
    if process["alive"]:
        return True, f"starting for {process['uptime_seconds'] or 0.0:.0f} s (its engine loading)"
    if process["restart_in_seconds"] is not None:
        return True, f"restarting in {process['restart_in_seconds']:.1f} s{error}"
    return False, f"not running{error}"


class Consumer(NamedTuple):
    """One consumer of the broker as the wait sees it: its name, its model, and `consumer_state`'s
    two answers."""

    name: str
    model: str
    working: bool
    state: str


def verdict(models: set[str], consumers: list[Consumer]) -> tuple[bool, str]:
    """Whether the items of any of `models` are worked on, and what each model's consumers do, in
    words."""
    if not consumers:
        return False, "the broker has no consumer"
    working, parts = False, []
    for model in sorted(models):
        mine = [c for c in consumers if c.model == model]
        said = ", ".join(f"consumer {c.name} {c.state}" for c in mine or consumers)
        working |= any(c.working for c in mine or consumers)
        parts.append(f"model {model!r}: {said}" if mine else
                     f"model {model!r}: no consumer serves it (its items come back invalid on any consumer's "
                     f"batch): {said}")
    return working, "; ".join(parts)


class BrokerWatch:
    """The broker on a data directory, looked at read-only (a `BrokerView`, attached again when the
    broker it saw stopped): what it does about the items of some models."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.view = None

    def look(self, models: set[str]) -> tuple[bool, str]:
        """(whether the broker works on items of `models`, what it does with them in words)."""
        from ..observe.watch import NoBroker

        try:
            view = self._view()
        except NoBroker as exc:
            return False, str(exc)
        if view.stopping():
            return False, "the broker is stopping"
        now = time.monotonic_ns()
        for r, role in enumerate(view.roles):
            if kind_of(role) in PIPELINE and (p := view.process(r, now))["crash_loop"]:
                return False, f"the broker's {role} process is {consumer_state(p)[1]}"
        consumers = []
        for i, c in enumerate(view.desc["consumers"]):
            r = view.roles.index(gpu(i, c["name"]).name)
            state = consumer_state(view.process(r, now), bool(view.role_values(r).get("engine_down")))
            consumers.append(Consumer(c["name"], c["model"], *state))
        return verdict(models, consumers)

    def _view(self):
        from ..observe.watch import BrokerView

        if self.view is not None and not self.view.alive():
            self.close()  # it stopped; another broker may run on the directory by now
        if self.view is None:
            self.view = BrokerView.attach(self.data_dir)
        return self.view

    def close(self) -> None:
        if self.view is not None:
            self.view.close()
            self.view = None


class Patience:
    """When `submit --wait` gives up (module docstring): `result_came()` after results came,
    `gives_up(models)` after a read that brought none (`models`: those of the items still waited
    for); `why` then says why, in words. `data_dir` None: nothing to watch (a cluster)."""

    def __init__(self, data_dir: str | None, idle_timeout: float | None):
        self.watch = BrokerWatch(data_dir) if data_dir is not None else None
        self.idle_timeout, self.bound = idle_timeout, f"--idle-timeout {idle_timeout or 0:g}"
        if idle_timeout is None and data_dir is None:
            self.idle_timeout, self.bound = CLUSTER_IDLE_SECONDS, "--idle-timeout S waits longer"
        self.last_result = time.monotonic()
        self.stuck_since: float | None = None
        self.why = ""

    def read_seconds(self) -> float:
        """How long the next read of results may wait for one."""
        if self.idle_timeout is None:
            return LOOK_SECONDS
        return min(LOOK_SECONDS, max(0.01, self.last_result + self.idle_timeout - time.monotonic()))

    def result_came(self) -> None:
        self.last_result = time.monotonic()
        self.stuck_since = None

    def gives_up(self, models: Callable[[], set[str]]) -> bool:
        """After a read that brought no result: look at the broker; whether the wait ends here."""
        now = time.monotonic()
        idle = now - self.last_result
        working, doing = True, "the cluster's nodes cannot be watched from here"
        if self.watch is not None:
            working, doing = self.watch.look(models())
        if working:
            self.stuck_since = None
        elif self.stuck_since is None:
            self.stuck_since = now
        if self.idle_timeout is not None and idle >= self.idle_timeout:
            self.why = f"no result came for {idle:.0f} s ({self.bound}); {doing}"
        elif self.stuck_since is not None and now - self.stuck_since >= GIVE_UP_SECONDS:
            self.why = f"nothing works on the items: {doing}"
        return bool(self.why)

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
