"""What the broker's processes share and what each one runs: the rings and doorbells between them
(`Wiring`, made by the supervisor at start) and a forked child's side of the fork (`run_child`).

| ring        | one per          | producer side | consumer side | bytes                  |
|-------------|------------------|---------------|---------------|------------------------|
| `ann<K>`    | ingest process K | ingest-K      | sched         | APPENDED_RING_BYTES    |
| `batch<c>`  | consumer c       | sched         | gpu-<c>       | BATCH_RING_BYTES       |
| `res<c>`    | consumer c       | gpu-<c>       | results       | RESULTS_RING_BYTES     |

A child dies with the supervisor (PR_SET_PDEATHSIG), takes SIGTERM as "stop" (a second as "stop
now": `stopping()`), counts every numba compile in its role slot (it should stay 0: the supervisor
loaded every kernel before it forked), then runs its kind's main (`MAINS`).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
from dataclasses import dataclass

import numpy as np

from ..config.settings import BrokerConfig
from ..control.roles import Kind, Role
from ..control.segment import R_COMPILES, Control
from ..pack.contract import Mode
from ..ring.owned import OwnedRing, create_ring
from ..ring.owner import Owner
from ..ring.ring import CONSUMER, PRODUCER
from ..ring.shm import Doorbell

BATCH_RING_BYTES = 4 << 20
APPENDED_RING_BYTES = 16 << 20
RESULTS_RING_BYTES = 16 << 20

_stopping = 0  # in a child: 0 run, 1 stop gracefully, 2 stop now


def stopping() -> int:
    return _stopping


@dataclass
class Wiring:
    """The shared memory a broker's processes talk through, and what their mains are given."""

    cfg: BrokerConfig
    modes: list[Mode]  # each consumer's engine mode, in cfg.consumers' order
    control: Control
    sched_bell: Doorbell
    results_bell: Doorbell
    ingest_bells: list[Doorbell]
    appended: list[OwnedRing]  # ann<K>: ingest K -> sched
    batch_rings: list[OwnedRing]  # batch<c>: sched -> gpu c
    results_rings: list[OwnedRing]  # res<c>: gpu c -> results
    # a dead broker's ingest rings the start had no room for, (producer id, segment name): ingest-0 drains them
    left_rings: list[tuple[int, str]]
    desc: dict | None = None  # broker.json (the exporter attaches with it)
    metrics_sock: socket.socket | None = None  # the exporter's bound socket
    http_sock: socket.socket | None = None  # the HTTP API's bound socket

    @classmethod
    def create(cls, owner: Owner, cfg: BrokerConfig, modes: list[Mode], control: Control,
               left_rings: list[tuple[int, str]]) -> Wiring:
        sched_bell = owner.doorbell("sched-d")
        results_bell = owner.doorbell("results-d")
        n = len(cfg.consumers)
        return cls(cfg, modes, control, sched_bell, results_bell,
                   [owner.doorbell(f"ingest{k}-d") for k in range(cfg.ingest_processes)],
                   [create_ring(owner, f"ann{k}", APPENDED_RING_BYTES, data_bell=sched_bell)
                    for k in range(cfg.ingest_processes)],
                   [create_ring(owner, f"batch{c}", BATCH_RING_BYTES, space_bell=sched_bell) for c in range(n)],
                   [create_ring(owner, f"res{c}", RESULTS_RING_BYTES, data_bell=results_bell) for c in range(n)],
                   left_rings)

    def ring_names(self) -> dict[str, str]:
        """broker.json's "rings": each ring's segment by what it carries."""
        consumers = self.cfg.consumers
        rings = {f"announce:{k}": r.names.segment for k, r in enumerate(self.appended)}
        rings.update({f"batch:{c.name}": r.names.segment for c, r in zip(consumers, self.batch_rings)})
        rings.update({f"done:{c.name}": r.names.segment for c, r in zip(consumers, self.results_rings)})
        return rings

    def sides(self, role: Role) -> list[tuple[np.ndarray, str]]:
        """The ring sides a role's process holds, [(segment buffer, side)]: their beats count as its
        own (`watchdog.Watchdog`)."""
        if role.kind is Kind.INGEST:
            return [(self.appended[role.index].segment.buf, PRODUCER)]
        if role.kind is Kind.SCHED:
            return ([(r.segment.buf, CONSUMER) for r in self.appended]
                    + [(r.segment.buf, PRODUCER) for r in self.batch_rings])
        if role.kind is Kind.RESULTS:
            return [(r.segment.buf, CONSUMER) for r in self.results_rings]
        if role.kind is Kind.GPU:
            return [(self.batch_rings[role.index].segment.buf, CONSUMER),
                    (self.results_rings[role.index].segment.buf, PRODUCER)]
        return []


def _run_ingest(w: Wiring, role: Role, slot) -> None:
    from ..ingest.loop import ingest_main

    k = role.index
    ingest_main(k, w.cfg, w.control, w.appended[k], w.ingest_bells[k], stopping, w.left_rings if k == 0 else ())


def _run_sched(w: Wiring, role: Role, slot) -> None:
    from ..sched.scheduler import sched_main

    sched_main(w.cfg, w.modes, w.control, w.appended, w.batch_rings, w.sched_bell, stopping)


def _run_results(w: Wiring, role: Role, slot) -> None:
    from ..results.router import results_main

    results_main(w.cfg, w.control, w.results_rings, w.results_bell, stopping)


def _run_gpu(w: Wiring, role: Role, slot) -> None:
    from ..gpu.consumer import gpu_main

    c = role.index
    gpu_main(c, w.cfg, w.control, w.batch_rings[c], w.results_rings[c], stopping)


def _run_metrics(w: Wiring, role: Role, slot) -> None:
    from ..observe.exporter import metrics_main
    from ..observe.watch import BrokerView

    metrics_main(BrokerView(w.cfg.data_dir, w.desc, w.control), w.metrics_sock, slot, stopping)


def _run_bridge(w: Wiring, role: Role, slot) -> None:
    from ..cluster.node import bridge_main

    bridge_main(w.cfg, w.control, stopping)


def _run_http(w: Wiring, role: Role, slot) -> None:
    from ..httpapi.server import http_main

    http_main(w.cfg, w.http_sock, slot, stopping)


MAINS = {Kind.HTTP: _run_http, Kind.INGEST: _run_ingest, Kind.SCHED: _run_sched, Kind.RESULTS: _run_results, Kind.GPU: _run_gpu,
         Kind.METRICS: _run_metrics, Kind.BRIDGE: _run_bridge}


def run_child(w: Wiring, role: Role, slot) -> None:
    """In a forked child: set it up (module docstring) and run its role's main until it stops. The
    exporter's socket stays open only in the exporter."""
    _child_setup(slot)
    if role.kind is not Kind.METRICS and w.metrics_sock is not None:
        w.metrics_sock.close()
    if role.kind is not Kind.HTTP and w.http_sock is not None:
        w.http_sock.close()
    MAINS[role.kind](w, role, slot)


def _child_setup(slot) -> None:
    from numba.core import event

    global _stopping
    _stopping = 0

    class CompileCounter(event.Listener):
        def on_start(self, ev):
            slot[R_COMPILES] += 1

        def on_end(self, ev):
            pass

    event.install_listener("numba:compiler_lock", CompileCounter())
    libc = ctypes.CDLL(None, use_errno=True)
    PR_SET_PDEATHSIG = 1
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() == 1:
        os._exit(1)  # the supervisor died while we forked

    def on_term(signum, _frame):
        global _stopping
        _stopping = min(2, _stopping + 1)

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
