"""The control segment: the producer table and one liveness-and-counters slot per broker process.

One shared-memory segment per running broker, created by the supervisor
(role "control"), read by every process and by `shmbroker status`. Each
field has one writer: the registry (in the supervisor) writes the producer
table, each process writes its own role slot. Readers take int64 words
without locks (aligned 8-byte stores are atomic on x86-64); a producer slot is
published by writing its producer id last, and the table version after it.

Header (int64 words)

| word | field            | writer     | meaning                                          |
|------|------------------|------------|--------------------------------------------------|
| 0    | magic            | supervisor | CONTROL_MAGIC                                    |
| 1    | version          | supervisor | LAYOUT_VERSION                                   |
| 2    | num_roles        | supervisor | role slots in use                                |
| 3    | table_version    | registry   | bumped after every producer-table change         |
| 4    | supervisor_pid   | supervisor |                                                  |
| 5    | started_ns       | supervisor | CLOCK_REALTIME at start                          |
| 6    | stopping         | supervisor | 1: a graceful stop is under way                  |
| 7    | metrics_port     | supervisor | the exporter's TCP port (0: no exporter)         |
| 8    | table_slots      | registry   | producer slots ever used (a retired name's slot  |
|      |                  |            | is empty, producer id 0, until it is reused)     |

Role slot r (ROLE_WORDS int64 words from ROLES_AT + r × ROLE_WORDS)

| word   | field          | writer      | meaning                                                  |
|--------|----------------|-------------|----------------------------------------------------------|
| 0      | pid            | supervisor  | 0 = not running                                          |
| 1      | restarts       | supervisor  | times the supervisor restarted this role                 |
| 2      | beat_ns        | the process | CLOCK_MONOTONIC heartbeat of its loop                    |
| 3      | started_ns     | supervisor  | CLOCK_MONOTONIC when this incarnation started            |
| 4      | compiles       | the process | numba compilations (or cache loads) in it: 0, the        |
|        |                |             | supervisor loaded every kernel before it forked          |
| 5      | seq            | the process | seqlock sequence of the values (`ring/seqlock.py`)        |
| 6      | deadline_ns    | the process | CLOCK_MONOTONIC by which its work must progress (a GPU   |
|        |                |             | process's batch deadline); 0: none. Cleared at spawn     |
| 8      | last_status    | supervisor  | os.waitpid status of its last death (if last_exit_ns)    |
| 9      | last_exit_ns   | supervisor  | CLOCK_REALTIME of its last death; 0: it never died       |
| 10     | crash_loop     | supervisor  | 1 while it crash-loops (`watchdog.RestartPolicy`)        |
| 11     | watchdog_kills | supervisor  | times the watchdog killed it as hung                     |
| 12     | restart_at_ns  | supervisor  | CLOCK_MONOTONIC of its pending restart; 0: none pending  |
| 16-23  | own            | the process | words it keeps across its own deaths (a GPU process:     |
|        |                |             | its deliveries, `gpu/deliveries.py`)                     |
| 32-63  | exception      | the process | the last line of the exception it died of (UTF-8, NUL-   |
|        |                |             | padded), written on its way out; cleared at spawn        |
| 64-95  | last_error     | supervisor  | what its last death was, in words (the status, the       |
|        |                |             | watchdog's reason, the exception line)                   |
| 96-159 | values         | the process | its statistics, named in `stats.STATS` by role kind;     |
|        |                |             | counters carry on across its restarts                    |

Producer slot s (SLOT_BYTES from TABLE_AT; names are NUL-padded ASCII)

| byte | size | field           |
|------|------|-----------------|
| 0    | 8    | producer_id (0 = free; written last)                    |
| 8    | 8    | ingest process index                                    |
| 16   | 64   | producer name                                           |
| 80   | 6×96 | ingest ring segment, data bell, space bell; result ring ditto |
"""

from __future__ import annotations

import time

import numpy as np

from ..ring.owner import Owner
from ..ring.ring import RingNames
from ..ring.shm import Segment

CONTROL_MAGIC = 0x4C525443424D4853  # "SHMBCTRL"
LAYOUT_VERSION = 3

C_MAGIC, C_VERSION, C_NUM_ROLES, C_TABLE_VERSION, C_SUPERVISOR_PID, C_STARTED_NS, C_STOPPING, C_METRICS_PORT = range(8)
C_TABLE_SLOTS = 8
HEADER_WORDS = 64
ROLE_WORDS = 160
MAX_ROLES = 128
R_PID, R_RESTARTS, R_BEAT, R_STARTED, R_COMPILES, R_SEQ, R_DEADLINE = range(7)
R_LAST_STATUS, R_LAST_EXIT_NS, R_CRASH_LOOP, R_WATCHDOG_KILLS, R_RESTART_AT = range(8, 13)
R_OWN, OWN_WORDS = 16, 8
R_EXCEPTION, R_LAST_ERROR, TEXT_WORDS = 32, 64, 32
R_VALUES = 96
VALUE_WORDS = ROLE_WORDS - R_VALUES
ROLES_AT = HEADER_WORDS
TABLE_AT = (ROLES_AT + MAX_ROLES * ROLE_WORDS) * 8
NAME_BYTES = 96
SLOT_BYTES = 80 + 6 * NAME_BYTES
MAX_PRODUCERS = 1024
CONTROL_BYTES = TABLE_AT + MAX_PRODUCERS * SLOT_BYTES

class Control:
    """A view of the control segment (the supervisor creates it; others attach by name)."""

    def __init__(self, segment: Segment, roles: list[str] | None = None):
        self.segment = segment
        self.words = segment.buf[:TABLE_AT].view(np.int64)
        self.table = segment.buf[TABLE_AT:CONTROL_BYTES]
        self.roles = roles or []

    @classmethod
    def create(cls, owner: Owner, roles: list[str]) -> Control:
        if len(roles) > MAX_ROLES:
            raise ValueError(f"at most {MAX_ROLES} broker processes, asked for {len(roles)}")
        seg = owner.segment("control", CONTROL_BYTES)
        ctl = cls(seg, roles)
        w = ctl.words
        w[C_VERSION] = LAYOUT_VERSION
        w[C_NUM_ROLES] = len(roles)
        w[C_STARTED_NS] = time.time_ns()
        w[C_MAGIC] = CONTROL_MAGIC
        return ctl

    @classmethod
    def attach(cls, name: str, roles: list[str] | None = None, *, readonly: bool = False) -> Control:
        """Attach by name; readonly (a watcher: `top`, `status`, the exporter) maps it PROT_READ."""
        seg = Segment.attach(name, readonly=readonly)
        ctl = cls(seg, roles)
        if int(ctl.words[C_MAGIC]) != CONTROL_MAGIC or int(ctl.words[C_VERSION]) != LAYOUT_VERSION:
            seg.close()
            raise ValueError(f"{name} is not a shmbroker control segment of layout {LAYOUT_VERSION}")
        return ctl

    # -- role slots ----------------------------------------------------------------

    def role(self, r: int) -> np.ndarray:
        at = ROLES_AT + r * ROLE_WORDS
        return self.words[at : at + ROLE_WORDS]

    def values(self, r: int) -> np.ndarray:
        """Role r's published statistics words (read them through `stats.read_role`)."""
        return self.role(r)[R_VALUES:]

    def own(self, r: int) -> np.ndarray:
        """Role r's own words: what the process keeps across its deaths (OWN_WORDS)."""
        return self.role(r)[R_OWN : R_OWN + OWN_WORDS]

    # -- producer table ------------------------------------------------------------

    def slot(self, s: int) -> np.ndarray:
        return self.table[s * SLOT_BYTES : (s + 1) * SLOT_BYTES]

    def write_producer(self, s: int, producer_id: int, ingest: int, name: str, ingest_names: RingNames,
                       result_names: RingNames) -> None:
        raw = self.slot(s)
        head = raw[:16].view(np.int64)
        head[0] = 0
        head[1] = ingest
        _put(raw, 16, 64, name)
        names = (ingest_names.segment, ingest_names.data_bell, ingest_names.space_bell,
                 result_names.segment, result_names.data_bell, result_names.space_bell)
        for k, value in enumerate(names):
            _put(raw, 80 + k * NAME_BYTES, NAME_BYTES, value)
        head[0] = producer_id  # published last
        self.words[C_TABLE_SLOTS] = max(int(self.words[C_TABLE_SLOTS]), s + 1)
        self.words[C_TABLE_VERSION] += 1

    def clear_producer(self, s: int) -> None:
        """Empty slot s (its name retired: `registry.Registry.retire_idle`)."""
        self.slot(s)[:16].view(np.int64)[0] = 0
        self.words[C_TABLE_VERSION] += 1

    def producers(self) -> list[ProducerSlot]:
        out = []
        for s in range(min(MAX_PRODUCERS, int(self.words[C_TABLE_SLOTS]))):
            raw = self.slot(s)
            head = raw[:16].view(np.int64)
            pid = int(head[0])
            if pid == 0:
                continue  # an empty slot (never used, or its name retired)
            names = [_get(raw, 80 + k * NAME_BYTES, NAME_BYTES) for k in range(6)]
            out.append(ProducerSlot(s, pid, int(head[1]), _get(raw, 16, 64), RingNames(*names[:3]),
                                    RingNames(*names[3:])))
        return out

    @property
    def table_version(self) -> int:
        return int(self.words[C_TABLE_VERSION])

    def close(self) -> None:
        self.words = None
        self.table = None
        if not self.segment.creator:
            self.segment.close()


def beat(slot: np.ndarray) -> None:
    """A process's heartbeat: its loop is going (`watchdog.Watchdog` reads it against `R_STARTED`)."""
    slot[R_BEAT] = time.monotonic_ns()


def mark_started(slot: np.ndarray) -> None:
    """The supervisor, before it forks a role's process: its first beat comes after this."""
    slot[R_STARTED] = time.monotonic_ns()


def still_starting(slot: np.ndarray) -> bool:
    """Whether the role's current incarnation has not beaten since its start: its loop has not begun
    (an engine loading). Meaningful while its pid runs."""
    return int(slot[R_BEAT]) <= int(slot[R_STARTED])


class ProducerSlot:
    __slots__ = ("slot", "producer_id", "ingest", "name", "ingest_names", "result_names")

    def __init__(self, slot, producer_id, ingest, name, ingest_names, result_names):
        self.slot = slot
        self.producer_id = producer_id
        self.ingest = ingest
        self.name = name
        self.ingest_names = ingest_names
        self.result_names = result_names


def _put(raw: np.ndarray, at: int, size: int, text: str) -> None:
    data = text.encode("ascii")
    if len(data) > size:
        raise ValueError(f"name {text!r} longer than {size} bytes")
    raw[at : at + size] = 0
    raw[at : at + len(data)] = np.frombuffer(data, np.uint8)


def _get(raw: np.ndarray, at: int, size: int) -> str:
    return bytes(raw[at : at + size]).rstrip(b"\0").decode("ascii")


def put_text(slot: np.ndarray, at: int, text: str) -> None:
    """A text field of a role slot (TEXT_WORDS words from `at`): UTF-8, cut to fit, NUL-padded."""
    raw = slot[at : at + TEXT_WORDS].view(np.uint8)
    data = text.encode("utf-8", "replace")[: raw.size]
    while data:  # not cut inside a character
        try:
            data.decode("utf-8")
            break
        except UnicodeDecodeError:
            data = data[:-1]
    raw[len(data):] = 0
    raw[: len(data)] = np.frombuffer(data, np.uint8)


def get_text(slot: np.ndarray, at: int) -> str | None:
    """A text field of a role slot; None when empty."""
    data = bytes(slot[at : at + TEXT_WORDS].view(np.uint8)).split(b"\0", 1)[0]
    return data.decode("utf-8", "replace") or None
