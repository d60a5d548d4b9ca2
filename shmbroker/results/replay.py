"""The results process's replay of its logs after a restart.

`Replay` is given the route step (`Router.route`), the shared log and the own logs of the names
read far behind (`behind.py`), the cursors, the statistics, a producer id's name and the backlog's
acks. Every record from each name's cursor on is routed again (`delivery.ReplayPlan` says which are
acknowledged, which are still on a live reader's ring). A damaged record (its crc32c, its frame)
or a run of zeros is skipped: the scan goes on at the next valid record (`wire.resync_results`)
and it is counted; when its frame is whole, its item's producer is known and its backlog record
is done, the item is told `corrupt` (a notice appended to the log). Only a torn tail of the
newest file (nothing valid after it) is cut.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np

from ..ring.items import SEQ_BITS, Status
from ..ring.wire import (
    RES_BAD,
    RES_HEADER_BYTES,
    RES_OK,
    encode_error,
    res_bytes,
    result_head,
    resync_results,
    scan_results,
)
from ..spill.acks import Acks
from .delivery import Cursors, Outlet, ReplayPlan
from .log import ResultsLog
from .slots import C_BAD_BYTES, C_BAD_RECORDS, C_NOTICES

CORRUPT_MESSAGE = b"its result record was damaged in the results log on disk (crc mismatch)"


class RouteStep(Protocol):
    """The results process's routing of the records at `rows` of `data` (log offset `at` of the
    shared log, or with `own_log`, of a name's own log); returns how many (`Router.route`)."""

    def __call__(self, data: np.ndarray, rows: np.ndarray, at: int, ack: bool, own_log: bool = False,
                 plans: ReplayPlans | None = None) -> int: ...


class ReplayPlans:
    """While replaying: each name's `ReplayPlan`, made from its cursor when its first result comes."""

    def __init__(self, cursors: Cursors, held: frozenset[str]):
        """`held`: the names whose ring waits for a new reader's set-up (it will be emptied)."""
        self.cursors = cursors
        self.held = held
        self._plans: dict[str, ReplayPlan] = {}

    def mask(self, name: str | None, outlet: Outlet | None, offsets: np.ndarray) -> np.ndarray:
        """Which of one name's results (at `offsets`, in its log) to route (a mask: those
        acknowledged are dropped, those still on its ring are noted as in flight)."""
        if name is None:
            return np.ones(offsets.size, bool)
        plan = self._plans.get(name)
        if plan is None:
            plan = self._plans[name] = ReplayPlan(self.cursors.of(name), outlet, fresh_reader=name in self.held)
        act = plan.actions(offsets)
        if outlet is not None:
            inflight = act == ReplayPlan.INFLIGHT
            if inflight.any():
                outlet.pushed(offsets[inflight])
        return act == ReplayPlan.PUSH


class FileReplayed(NamedTuple):
    """What the replay of one log file did."""

    records: int  # routed
    cut_at: int | None  # log offset of a torn tail to cut; None: none


class Replay:
    """One replay of the results logs after a restart, given what it reads and what it tells."""

    def __init__(self, route: RouteStep, shared: ResultsLog, own_logs: dict[str, ResultsLog], cursors: Cursors,
                 held: frozenset[str], counters: np.ndarray, name_of: Callable[[int], str | None], acks: Acks):
        """`own_logs`: the logs of the names read far behind, by name; `held`: as `ReplayPlans`;
        `counters`: the results role's statistics (`slots.py`); `name_of`: a producer id's name
        (None: unknown); `acks`: the backlog's, which say whether an item is done."""
        self.route = route
        self.shared = shared
        self.own_logs = own_logs
        self.cursors = cursors
        self.counters = counters
        self.name_of = name_of
        self.acks = acks
        self.plans = ReplayPlans(cursors, held)
        self._pos = np.empty(SCAN_MAX, np.int64)

    def run(self) -> dict:
        """Route every result from each name's cursor to the log's end again; {"seconds",
        "results", "corrupt_notices"}."""
        t0 = time.perf_counter()
        count = 0
        notices: list[np.ndarray] = []
        # names read far behind first: their own logs from their cursors, then (below) what the
        # shared log holds for them past `through`, copied again in the same order
        for name, log in self.own_logs.items():
            count += self._replay_log(log, self.cursors.of(name).offset, notices, own_log=True)
        count += self._replay_log(self.shared, self.cursors.floor, notices, own_log=False)
        for record in notices:  # after any cut: a notice is appended at the log's end
            where = self.shared.append(record)
            n, _stop, _outcome = scan_all(record, self._pos, check_crc=False)
            self.route(record, self._pos[:n], where, ack=False, plans=self.plans)
            self.counters[C_NOTICES] += 1
        return {"seconds": time.perf_counter() - t0, "results": count, "corrupt_notices": len(notices)}

    def _replay_log(self, log: ResultsLog, first: int, notices: list, own_log: bool) -> int:
        """Route every record of `log` from offset `first` on; a torn tail of its newest file is cut."""
        count = 0
        at = max(first, log.files[0])
        for start in list(log.files):
            end = log.file_end(start)
            if end > at:
                done = self._replay_file(log, start, max(at, start), end, notices, own_log)
                count += done.records
                if done.cut_at is not None:
                    log.cut(done.cut_at)  # a torn tail (a crash mid-write): cut
                    end = log.end
            at = end
        return count

    def _replay_file(self, log: ResultsLog, start: int, first: int, end: int, notices: list,
                     own_log: bool) -> FileReplayed:
        """Route the records in [first, end) of the log file that starts at log offset `start`."""
        size = end - start
        with open(log.path(start), "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        try:
            data = np.frombuffer(mm, np.uint8) if mm is not None else np.zeros(0, np.uint8)
            pos, count = first - start, 0
            while pos < size:
                n, stop, outcome = scan_results(data, pos, size, self._pos, True)
                count += self.route(data, self._pos[:n], start, ack=True, own_log=own_log, plans=self.plans)
                pos = stop
                if outcome == RES_OK or pos >= size:
                    continue
                # a damaged record, zeros (pages a power loss left unwritten) or a few stray bytes:
                # go on at the next valid record; with none after it, the newest file's is a torn tail
                nxt = int(resync_results(data, pos, size))
                torn = nxt >= size and start == log.start
                notice = self._notice(data, pos, nxt) if outcome == RES_BAD else None
                if not torn or notice is not None:
                    # a torn tail is not counted; but a whole frame up to the end is a damaged
                    # last record, not a tear
                    self.counters[C_BAD_RECORDS] += 1
                    self.counters[C_BAD_BYTES] += nxt - pos
                if notice is not None:
                    notices.append(notice)
                if torn:
                    del data
                    return FileReplayed(count, start + pos)
                pos = nxt
            del data
            return FileReplayed(count, None)
        finally:
            if mm is not None:
                mm.close()

    def _notice(self, data: np.ndarray, at: int, nxt: int) -> np.ndarray | None:
        """A `corrupt` result for the item a damaged record names, when its frame is whole (its
        length leads to the next valid record), the item's producer is known and its backlog record
        is done (acked: it will not run again); else None."""
        if nxt - at < RES_HEADER_BYTES:
            return None
        length, item_id, seq, _status, writer = result_head(data, at)
        if length != nxt - at:
            return None
        if self.name_of(item_id >> SEQ_BITS) is None:
            return None
        if not self.acks.done_mask(writer, np.array([seq], np.uint64))[0]:
            return None  # its backlog record is not done: the item runs again and gets its result
        err = np.frombuffer(CORRUPT_MESSAGE, np.uint8)
        out = np.zeros(res_bytes(0, err.size), np.uint8)
        encode_error(out, 0, item_id, seq, int(Status.CORRUPT), writer, err)
        return out


SCAN_MAX = 1 << 16  # result records one scan finds at most (one ring record, one call of the replay's scan)


def scan_all(data: np.ndarray, out_pos: np.ndarray, check_crc: bool = True):
    """Scan every result record of `data` into `out_pos`: (records, where the scan stopped, its outcome)."""
    n, stop, outcome = scan_results(data, 0, data.size, out_pos, check_crc)
    if n == out_pos.size:
        raise ValueError("more result records in one read than the scan holds")
    return n, stop, outcome
