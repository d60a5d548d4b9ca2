"""The results process: the durable results log, delivery to producers, and the backlog's acks.

Every GPU process pushes its batches' result records (`ring/wire.py`) on its results ring. This
process, the single writer of all of the following, takes each ring record and

1. appends its bytes to the results log (`<data_dir>/results/<start:020d>.log`, files of up to
   LOG_FILE_BYTES, named by the log offset of their first byte; fsync per the broker's policy);
2. pushes each result on its producer's result ring, found by the producer id in the item id: the
   producer table in the control segment for ids of this broker's lifetime, `producers.json` for
   ids of earlier ones (a producer that reconnects under its name gets them). A result whose
   producer is not connected, or whose ring is full, is parked (its log offset) and pushed when
   it can be;
3. acks the items' backlog records (in memory; `acks.bin` is saved every ACK_SAVE_SECONDS, after
   the log is synced, so an acked item's result is always on disk first), and reclaims segments
   whose records are all done.

Delivery: the log offset below which every result was consumed by its producer (popped from its
ring) or never needs to be is saved in `results/cursor.json`; after a restart the log is replayed
from there, so a result reaches its producer at least once. The client drops duplicates by item id.
"""

from __future__ import annotations

import errno
import json
import time
from collections import deque
from pathlib import Path

import numpy as np

from .control import Control
from .registry import ProducerBook
from .results_log import CURSOR_FILE, RESULTS_DIR, OffsetQueue, ResultsLog
from .ring import layout as L
from .ring import spsc
from .ring.items import SEQ_BITS
from .ring.ring import CONSUMER, PRODUCER, Ring, sleep_on
from .ring.wire import RES_HEADER_BYTES, RES_OK, push_results, result_fields, scan_results
from .spill.acks import atomic_write
from .spill.store import BACKLOG_DIR, Backlog

ACK_SAVE_SECONDS = 0.2
RECLAIM_SECONDS = 2.0
SCAN_MAX = 1 << 16
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_BACKOFF_SECONDS = 0.05
REPLAY_BYTES = 8 << 20


class _Outlet:
    """One producer's result ring and what was pushed on it but not yet consumed."""

    def __init__(self, slot, ring: Ring):
        self.slot = slot
        self.ring = ring
        self.unconsumed: deque = deque()  # (num_pushed after a chunk, log offset of its first record)
        self.waiting = OffsetQueue()  # results parked because the ring was full (or it just connected)


class Router:
    def __init__(self, data_dir: str, cfg, control: Control, counters=None):
        self.data_dir = data_dir
        self.root = Path(data_dir) / RESULTS_DIR
        self.log = ResultsLog(self.root, cfg.fsync)
        self.control = control
        self.counters = counters if counters is not None else np.zeros(8, np.int64)
        self.backlog = Backlog(Path(data_dir) / BACKLOG_DIR, cfg.segment_bytes)
        self.backlog.acks = _load_acks(self.backlog.root)
        self.outlets: dict[int, _Outlet] = {}  # producer id -> outlet (ids of this lifetime)
        self.by_name: dict[str, _Outlet] = {}
        self.names: dict[int, str] = {}  # producer id -> name, every id ever given
        self.parked: dict[str, OffsetQueue] = {}  # results for names not connected
        self.seen_version = -1
        self.floor = _load_cursor(self.root)
        self._pos = np.empty(SCAN_MAX, np.int64)
        self._cols = (np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint32),
                      np.empty(SCAN_MAX, np.uint32))
        self.last_save = time.monotonic()
        self.last_reclaim = time.monotonic()

    # -- producers -------------------------------------------------------------------

    def refresh(self) -> None:
        if self.control.table_version == self.seen_version:
            return
        self.seen_version = self.control.table_version
        for p in self.control.producers():
            if p.producer_id in self.outlets:
                continue
            outlet = _Outlet(p.slot, Ring.attach(p.result_names, PRODUCER))
            self.outlets[p.producer_id] = outlet
            self.by_name[p.name] = outlet
            self.names[p.producer_id] = p.name
            queue = self.parked.pop(p.name, None)
            if queue is not None:
                for part in queue.take_all():
                    outlet.waiting.extend(part)

    def parked_now(self) -> int:
        """Results waiting for a producer: parked by name, or for a full ring."""
        return sum(len(q) for q in self.parked.values()) + sum(len(o.waiting) for o in self.outlets.values())

    def _name_of(self, producer_id: int) -> str | None:
        name = self.names.get(producer_id)
        if name is None:
            self.names.update(ProducerBook(self.data_dir).name_of())
            name = self.names.get(producer_id)
        return name

    # -- the flow ----------------------------------------------------------------------

    def replay(self) -> dict:
        """After a restart: route every result from the saved cursor to the log's end again."""
        t0 = time.perf_counter()
        count = 0
        at = max(self.floor, self.log.files[0])
        for start in list(self.log.files):
            end = self.log.file_end(start)
            if end <= at:
                continue
            pos_in_file = max(at, start)
            piece = REPLAY_BYTES
            while pos_in_file < end:  # in pieces: memory stays bounded
                data = self.log.read(pos_in_file, min(piece, end - pos_in_file))
                n, stop, outcome = scan_results(data, 0, data.size, self._pos, True)
                count += self._route(data, n, pos_in_file, ack=True)
                pos_in_file += stop
                grown, piece = piece != REPLAY_BYTES, REPLAY_BYTES
                if outcome == RES_OK or (stop and pos_in_file < end and data.size == REPLAY_BYTES):
                    continue  # the scan's room was full, or the piece cut a record: go on from there
                if stop == 0 and not grown and pos_in_file < end and data.size >= RES_HEADER_BYTES:
                    size = int(data[:4].view(np.uint32)[0])
                    if data.size < size <= end - pos_in_file:
                        piece = size  # one record larger than a piece
                        continue
                if pos_in_file < end and start == self.log.start:
                    self.log.cut(pos_in_file)  # a torn tail (a crash mid-write): cut
                    end = self.log.end
                break
            at = end
        return {"seconds": time.perf_counter() - t0, "results": count}

    def take(self, ring: Ring) -> int:
        """Log, route and ack what one GPU's results ring holds; the records it released."""
        positions = self._pos[:1]
        taken = 0
        words = ring.data_words
        while True:
            n, new_tail = ring.peek_many(positions, 1)
            if n == 0:
                return taken
            pos = int(positions[0])
            nbytes = int(words[pos + 4])
            start = (pos + L.RECORD_HEADER_WORDS) * 4
            data = ring.buf[L.HEADER_BYTES + start : L.HEADER_BYTES + start + nbytes]
            at = self.log.append(data)
            self.counters[4] += nbytes
            # from our own GPU process through shared memory: framed by the ring, no CRC to check
            # (the CRC protects the copy on disk, checked when the log is replayed)
            count, _stop, _outcome = _scan_all(data, self._pos, check_crc=False)
            self._route(data, count, at, ack=True)
            ring.release(new_tail, 1)
            taken += 1

    def _route(self, data: np.ndarray, n: int, at: int, ack: bool) -> int:
        item_ids, seqs, status, writers = (c[:n] for c in self._cols)
        pos = self._pos[:n]
        result_fields(data, pos, n, item_ids, seqs, writers, status)
        if ack:
            for w, mine in _groups(writers):
                self.backlog.ack(w, seqs if mine is None else seqs[mine])
            self.counters[2] += n
        self.counters[0] += n
        producers = (item_ids >> np.uint64(SEQ_BITS)).astype(np.int64)
        for p, mine in _groups(producers):
            rows = pos if mine is None else pos[mine]
            outlet = self.outlets.get(p)
            if outlet is None:
                name = self._name_of(p)
                outlet = self.by_name.get(name) if name is not None else None
            if outlet is None:
                self.parked.setdefault(name or f"#{p}", OffsetQueue()).extend(rows + at)
                self.counters[3] += rows.size
                continue
            if outlet.waiting:
                outlet.waiting.extend(rows + at)
                continue
            rows = np.ascontiguousarray(rows)
            pushed, wake = push_results(outlet.ring.buf, data, rows, 0, rows.size)
            if wake:
                outlet.ring.data_bell.ring()
            if pushed:
                outlet.unconsumed.append((int(outlet.ring.header[L.H_NUM_PUSHED]), at + int(rows[0])))
                self.counters[1] += pushed
            if pushed < rows.size:
                outlet.waiting.extend(rows[pushed:] + at)
        return n

    def retry_waiting(self) -> int:
        """Push parked results of connected producers whose rings have room again."""
        moved = 0
        for outlet in self.by_name.values():
            while outlet.waiting:
                at = outlet.waiting.first()
                head = self.log.read(at, RES_HEADER_BYTES)
                size = int(head.view(np.uint32)[0])
                data = self.log.read(at, size)
                pushed, wake = push_results(outlet.ring.buf, data, np.zeros(1, np.int64), 0, 1)
                if wake:
                    outlet.ring.data_bell.ring()
                if not pushed:
                    break
                outlet.waiting.pop()
                outlet.unconsumed.append((int(outlet.ring.header[L.H_NUM_PUSHED]), at))
                self.counters[1] += 1
                moved += 1
        return moved

    # -- checkpoints --------------------------------------------------------------------

    def consumed_floor(self) -> int:
        """The log offset below which nothing waits for a producer."""
        floor = self.log.end
        for outlet in self.by_name.values():
            popped = int(outlet.ring.header[L.H_NUM_POPPED])
            q = outlet.unconsumed
            while q and q[0][0] <= popped:
                q.popleft()
            if q:
                floor = min(floor, q[0][1])
            if outlet.waiting:
                floor = min(floor, outlet.waiting.first())
        for queue in self.parked.values():
            if queue:
                floor = min(floor, queue.first())
        return floor

    def checkpoint(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_save < ACK_SAVE_SECONDS:
            return
        self.last_save = now
        self.log.sync()  # results on disk before the acks that say their items are done
        self.backlog.save_acks()
        self.counters[5] += 1
        floor = self.consumed_floor()
        if floor != self.floor:
            self.floor = floor
            atomic_write(self.root / CURSOR_FILE, json.dumps({"floor": floor}).encode())
            self.log.trim(floor)
        if force or now - self.last_reclaim > RECLAIM_SECONDS:
            self.last_reclaim = now
            self.backlog.reclaim()

    def close(self) -> None:
        self.checkpoint(force=True)
        self.log.close()
        self.backlog.close()
        for outlet in self.by_name.values():
            outlet.ring.close()


def _groups(values: np.ndarray) -> list:
    """[(value, mask)] of the distinct values; one value (the usual batch) without sorting or a mask."""
    if values.size == 0:
        return []
    lo, hi = values.min(), values.max()
    if lo == hi:
        return [(int(lo), None)]
    return [(int(v), values == v) for v in np.unique(values).tolist()]


def _scan_all(data: np.ndarray, out_pos: np.ndarray, check_crc: bool = True):
    n, stop, outcome = scan_results(data, 0, data.size, out_pos, check_crc)
    if n == out_pos.size:
        raise ValueError("more result records in one read than the scan holds")
    return n, stop, outcome


def _load_acks(root: Path):
    from .spill.acks import AckFileCorrupt, Acks

    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return Acks.load(root)
    except AckFileCorrupt:
        return Acks()


def _load_cursor(root: Path) -> int:
    try:
        return int(json.loads((root / CURSOR_FILE).read_text())["floor"])
    except (FileNotFoundError, ValueError, KeyError):
        return 0


GAUGE_SECONDS = 0.25  # the parked gauge is counted this often


def results_main(cfg, control: Control, results_rings, bell, stopping) -> None:
    from .stats import StatsWriter, slot_of

    role = control.roles.index("results")
    slot = control.role(role)
    stats = StatsWriter(control, role)
    parked_at = slot_of("results", "parked_now")
    router = Router(cfg.data_dir, cfg, control, stats.values)
    rings = [r.attach(CONSUMER) for r in results_rings]
    next_gauges = 0.0
    try:
        router.refresh()
        router.replay()
        while True:
            slot[2] = time.monotonic_ns()
            router.refresh()
            try:
                got = sum(router.take(r) for r in rings)
                router.retry_waiting()
                router.checkpoint()
            except OSError as exc:
                if exc.errno not in DISK_ERRNOS:
                    raise
                # a full disk: nothing taken is lost (a GPU's ring record is released only once
                # logged); wait and take it again, the GPUs wait on their full rings meanwhile
                router.counters[6] += 1
                stats.publish()
                time.sleep(DISK_FULL_BACKOFF_SECONDS)
                continue
            now = time.monotonic()
            if now >= next_gauges:
                stats.values[parked_at] = router.parked_now()
                next_gauges = now + GAUGE_SECONDS
                stats.publish()
            elif got:
                stats.publish()
            if got == 0:
                if stopping() and all(_gpu_gone(r) for r in rings):
                    break
                sleep_on(bell, rings)
    finally:
        router.close()
        stats.publish()
        for r in rings:
            r.close()


def _gpu_gone(ring: Ring) -> bool:
    return not spsc.readable(ring.buf) and not ring.peer_alive()
