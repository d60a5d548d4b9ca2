"""The results process's replay of its log after a restart (a part of `results.Router`).

Every record from each name's cursor on is routed again (`delivery.ReplayPlan` says which are
acknowledged, which are still on a live reader's ring). A damaged record (its crc32c, its frame)
or a run of zeros is skipped: the scan goes on at the next valid record (`wire.resync_results`)
and it is counted; when its frame is whole, its item's producer is known and its backlog record
is done, the item is told `corrupt` (a notice appended to the log). Only a torn tail of the
newest file (nothing valid after it) is cut.
"""

from __future__ import annotations

import mmap
import time

import numpy as np

from ..control.stats import slot_of
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
from .delivery import Outlet, ReplayPlan

C_BAD_RECORDS, C_BAD_BYTES, C_NOTICES = (
    slot_of("results", k) for k in ("log_bad_records", "log_bad_bytes", "corrupt_notices"))


class Replayer:
    """`Router`'s replay: it uses the router's log, counters, cursors, held names and `_route`."""

    def replay(self) -> dict:
        """After a restart: route every result from each name's cursor to the log's end again."""
        t0 = time.perf_counter()
        self.plans = {}
        self.held = {o.name for o in self.by_name.values() if o.session_pending()}
        count = 0
        notices: list[np.ndarray] = []
        # names read far behind first: their own logs from their cursors, then (below) what the
        # shared log holds for them past `through`, copied again in the same order
        for name, behind in self.behind.items():
            count += self._replay_log(behind.log, self.cursors.of(name)[0], notices, behind)
        count += self._replay_log(self.log, self.floor, notices, None)
        for record in notices:  # after any cut: a notice is appended at the log's end
            where = self.log.append(record)
            n, _stop, _outcome = scan_all(record, self._pos, check_crc=False)
            self._route(record, n, where, ack=False)
            self.counters[C_NOTICES] += 1
        self.plans = None
        self.replayed = True
        self.answer_readers()
        self.checkpoint(force=True)
        return {"seconds": time.perf_counter() - t0, "results": count, "corrupt_notices": len(notices)}

    def _replay_log(self, log, first: int, notices: list, source) -> int:
        """Route every record of `log` from offset `first` on; a torn tail of its newest file is cut."""
        count = 0
        at = max(first, log.files[0])
        for start in list(log.files):
            end = log.file_end(start)
            if end > at:
                n, cut_at = self._replay_file(log, start, max(at, start), end, notices, source)
                count += n
                if cut_at is not None:
                    log.cut(cut_at)  # a torn tail (a crash mid-write): cut
                    end = log.end
            at = end
        return count

    def _replay_file(self, log, start: int, first: int, end: int, notices: list, source):
        """Route the records of one log file in [first, end); returns (records, where to cut or None)."""
        size = end - start
        with open(log.path(start), "rb") as f:
            mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) if size else None
        try:
            data = np.frombuffer(mm, np.uint8) if mm is not None else np.zeros(0, np.uint8)
            pos, count = first - start, 0
            while pos < size:
                n, stop, outcome = scan_results(data, pos, size, self._pos, True)
                count += self._route(data, n, start, ack=True, source=source)
                pos = stop
                if outcome == RES_OK or pos >= size:
                    continue
                # a damaged record, zeros (pages a power loss left unwritten) or a few stray bytes:
                # go on at the next valid record; with none after it, the newest file's is a torn tail
                nxt = int(resync_results(data, pos, size))
                if nxt >= size and start == log.start:
                    # a torn tail; but a whole frame up to the end is a damaged last record, not a tear
                    notice = self._notice(data, pos, nxt) if outcome == RES_BAD else None
                    if notice is not None:
                        self.counters[C_BAD_RECORDS] += 1
                        self.counters[C_BAD_BYTES] += nxt - pos
                        notices.append(notice)
                    del data
                    return count, start + pos
                self.counters[C_BAD_RECORDS] += 1
                self.counters[C_BAD_BYTES] += nxt - pos
                notice = self._notice(data, pos, nxt) if outcome == RES_BAD else None
                if notice is not None:
                    notices.append(notice)
                pos = nxt
            del data
            return count, None
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
        if self._name_of(item_id >> SEQ_BITS) is None:
            return None
        if not self.backlog.acks.done_mask(writer, np.array([seq], np.uint64))[0]:
            return None  # its backlog record is not done: the item runs again and gets its result
        err = np.frombuffer(b"its result record was damaged in the results log on disk (crc mismatch)", np.uint8)
        out = np.zeros(res_bytes(0, err.size), np.uint8)
        encode_error(out, 0, item_id, seq, int(Status.CORRUPT), writer, err)
        return out

    def _plan(self, name: str | None, outlet: Outlet | None, offsets: np.ndarray) -> np.ndarray:
        """While replaying: which of one name's results (at `offsets`, in its log) to route (a mask:
        those acknowledged are dropped, those still on its ring are noted as in flight)."""
        if name is None:
            return np.ones(offsets.size, bool)
        plan = self.plans.get(name)
        if plan is None:
            plan = self.plans[name] = ReplayPlan(self.cursors.of(name), outlet, fresh_reader=name in self.held)
        act = plan.actions(offsets)
        if outlet is not None:
            inflight = act == ReplayPlan.INFLIGHT
            if inflight.any():
                outlet.pushed(offsets[inflight])
        return act == ReplayPlan.PUSH


def scan_all(data: np.ndarray, out_pos: np.ndarray, check_crc: bool = True):
    n, stop, outcome = scan_results(data, 0, data.size, out_pos, check_crc)
    if n == out_pos.size:
        raise ValueError("more result records in one read than the scan holds")
    return n, stop, outcome
