"""The broker's processes, declared once: each role's kind, its place among its kind, and its name.

The supervisor forks one process per `Role` (`broker_roles`, in start order) and stops them kind by
kind (`STOP_ORDER`); the watchdog, the control segment's readers (`stats`, `watch`, `top`, the
exporter) and broker.json name them by `Role.name`:

| kind    | roles                          | name             |
|---------|--------------------------------|------------------|
| ingest  | one per `ingest_processes`     | ingest-K         |
| sched   | one                            | sched            |
| results | one                            | results          |
| gpu     | one per consumer               | gpu-<consumer>   |
| metrics | one, unless `metrics_addr` "" | metrics          |
| bridge  | one, with a `[cluster]` table  | bridge           |
| http    | one, with an `[http]` table    | http             |

Every role restarts the same way (`watchdog.RestartPolicy`). A name is built (`Role.name`) and read
back (`parse`) only here.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    INGEST = "ingest"
    SCHED = "sched"
    RESULTS = "results"
    GPU = "gpu"
    METRICS = "metrics"
    BRIDGE = "bridge"
    HTTP = "http"


# The order a graceful stop takes (supervisor/supervise.py's docstring says why): the HTTP API and the
# cluster's bridge (producers of this broker) first, producers' rings drained next, the exporter last.
STOP_ORDER = (Kind.HTTP, Kind.BRIDGE, Kind.INGEST, Kind.SCHED, Kind.GPU, Kind.RESULTS, Kind.METRICS)
_NUMBERED = (Kind.INGEST, Kind.GPU)  # the kinds with one role per ingest process or consumer


@dataclass(frozen=True)
class Role:
    """One broker process. index: its place among its kind (ingest process K, the consumer's index
    in the configuration; 0 for a kind of one); label: what its name carries after the kind (K, the
    consumer's name; "" for a kind of one)."""

    kind: Kind
    index: int = 0
    label: str = ""

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.label}" if self.kind in _NUMBERED else str(self.kind)


def ingest(k: int) -> Role:
    return Role(Kind.INGEST, k, str(k))


def gpu(c: int, consumer: str) -> Role:
    return Role(Kind.GPU, c, consumer)


SCHED = Role(Kind.SCHED)
RESULTS = Role(Kind.RESULTS)
METRICS = Role(Kind.METRICS)
BRIDGE = Role(Kind.BRIDGE)
HTTP = Role(Kind.HTTP)


def broker_roles(num_ingest: int, consumers: list[str], metrics: bool, bridge: bool = False,
                 http: bool = False) -> list[Role]:
    """A broker's roles in start order (`consumers`: the consumers' names, in configuration order)."""
    return ([ingest(k) for k in range(num_ingest)] + [SCHED, RESULTS]
            + [gpu(c, name) for c, name in enumerate(consumers)] + ([METRICS] if metrics else [])
            + ([BRIDGE] if bridge else []) + ([HTTP] if http else []))


def kind_of(name: str) -> Kind | None:
    """The kind of the role a name stands for; None for a name no broker role has."""
    try:
        return Kind(name.partition("-")[0])
    except ValueError:
        return None


def parse(name: str, consumers: list[str] | None = None) -> Role:
    """The role a name (`Role.name`) stands for; a gpu role's index is its consumer's place in
    `consumers` (None: 0, for a reader that needs only the kind and label). ValueError: no broker
    role has that name."""
    kind, label = kind_of(name), name.partition("-")[2]
    if kind is None:
        raise ValueError(f"{name!r} names no broker role")
    if kind is Kind.INGEST:
        return ingest(int(label))
    if kind is Kind.GPU:
        return gpu(consumers.index(label) if consumers is not None else 0, label)
    return Role(kind)
