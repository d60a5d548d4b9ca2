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

Delivery (`delivery.py`): each producer name's cursor (its first result the reader has not
acknowledged) is saved in `results/cursor.json`; a reader that dies leaves what it did not
acknowledge to the next reader under its name, and a replay after a restart gives each name its
results from its cursor on. A damaged record in the log is skipped (the scan resyncs on the next
valid record) and counted; when its frame is whole, so that its item id can be read, the item is
told `corrupt`. Only a torn tail of the newest file (nothing valid after it) is cut.
"""

from __future__ import annotations

import errno
import sys
import time
from pathlib import Path

import numpy as np

from ..control.segment import Control, beat
from ..control.stats import slot_of
from ..frontdoor.registry import ProducerBook
from ..jobs.tally import JobTallies
from ..ring import layout as L
from ..ring import spsc
from ..ring.items import SEQ_BITS
from ..ring.ring import CONSUMER, PRODUCER, Ring
from ..ring.waits import sleep_on
from ..ring.wire import RES_HEADER_BYTES, chunk_bytes, push_results, result_fields, result_head
from ..spill.store import BACKLOG_DIR, Backlog
from .behind import C_BEHIND, C_BEHIND_BYTES, BehindNames, NameLog, remove_strays
from .cursor_save import CursorSaves
from .delivery import Cursors, Outlet, ReplayPlan
from .log import RESULTS_DIR, OffsetQueue, ResultsLog, file_bytes_for
from .replay import Replayer, scan_all

ACK_SAVE_SECONDS = 0.2
RECLAIM_SECONDS = 2.0
SCAN_MAX = 1 << 16
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_BACKOFF_SECONDS = 0.05
C_READERS, C_REDELIVERED = (slot_of("results", k) for k in ("readers", "redelivered"))


class Router(Replayer, BehindNames, CursorSaves):
    def __init__(self, data_dir: str, cfg, control: Control, counters=None):
        self.data_dir = data_dir
        self.root = Path(data_dir) / RESULTS_DIR
        self.name_bytes = cfg.results_name_bytes
        self.fsync = cfg.fsync
        self.log = ResultsLog(self.root, cfg.fsync, file_bytes_for(self.name_bytes))
        self.control = control
        self.counters = counters if counters is not None else np.zeros(16, np.int64)
        self.backlog = Backlog(Path(data_dir) / BACKLOG_DIR, cfg.segment_bytes)
        self.backlog.acks = _load_acks(self.backlog.root)
        self.outlets: dict[int, Outlet] = {}  # producer id -> outlet (ids of this lifetime)
        self.by_name: dict[str, Outlet] = {}
        self.names: dict[int, str] = {}  # producer id -> name, every id ever given
        self.parked: dict[str, OffsetQueue] = {}  # results for names not connected
        self.seen_version = -1
        self.cursors = Cursors(self.root)
        self.floor = self.cursors.floor
        # names read far behind (behind.py): their results in a log of their own
        self.behind: dict[str, NameLog] = {}
        for name, entry in self.cursors.names.items():
            if len(entry) > 3:
                self.behind[name] = NameLog(self.root, name, cfg.fsync, self.log.file_bytes, entry[3])
        remove_strays(self.root, {nl.dir_name for nl in self.behind.values()})
        self.dropped: list[NameLog] = []  # names back on the shared log: their logs go once the cursors say so
        self.plans: dict[str, ReplayPlan] | None = None  # while replaying: each name's plan
        self.replayed = False  # readers are set up (and cursors saved) only once the replay is done
        self.unattachable: dict[int, str] = {}  # producer id -> why its result ring could not be attached
        self.held: set[str] = set()  # names whose ring waits for its new reader's set-up: push nothing yet
        self._pos = np.empty(SCAN_MAX, np.int64)
        self._cols = (np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint64), np.empty(SCAN_MAX, np.uint32),
                      np.empty(SCAN_MAX, np.uint32))
        self.last_save = time.monotonic()
        self.last_reclaim = time.monotonic()
        self.jobs = JobTallies(data_dir, self._name_of)  # each job's results by status (`jobs/tally.py`)

    # -- producers -------------------------------------------------------------------

    def refresh(self) -> None:
        if self.control.table_version != self.seen_version:
            self.seen_version = self.control.table_version
            table = self.control.producers()
            live = {p.producer_id for p in table}
            for producer_id in [i for i in self.outlets if i not in live]:
                self._retire(producer_id)
            for p in table:
                if p.producer_id in self.outlets:
                    continue
                try:
                    ring = Ring.attach(p.result_names, PRODUCER, untrusted=True)
                except (OSError, ValueError, RuntimeError) as exc:  # resized or unlinked by a hostile producer
                    if p.producer_id not in self.unattachable:
                        self.unattachable[p.producer_id] = str(exc)
                        sys.stderr.write(f"shmbroker results: cannot attach the result ring of {p.name!r}: {exc}\n")
                    continue
                outlet = Outlet(p.name, p.slot, ring)
                self.outlets[p.producer_id] = outlet
                self.by_name[p.name] = outlet
                self.names[p.producer_id] = p.name
                queue = self.parked.pop(p.name, None)
                if queue is not None:
                    for part in queue.take_all():
                        outlet.waiting.extend(part)
            if self.replayed:
                self.answer_readers()  # a new name's reader at once; a returning one at the next checkpoint

    def _retire(self, producer_id: int) -> None:
        """The registry retired this name (nothing was left to do for it): let go of its ring. A
        result pushed meanwhile and not acknowledged, and any waiting, waits by name for its next
        connect, first."""
        outlet = self.outlets.pop(producer_id)
        if self.by_name.get(outlet.name) is outlet:
            del self.by_name[outlet.name]
        queue = OffsetQueue()
        queue.extend(outlet.unacked_offsets())
        for part in outlet.waiting.take_all():
            queue.extend(part)
        old = self.parked.pop(outlet.name, None)
        if old is not None:
            for part in old.take_all():
                queue.extend(part)
        if queue:
            self.parked[outlet.name] = queue
        outlet.ring.close()

    def answer_readers(self) -> int:
        """Set up the rings whose new reader announced itself: what the earlier reader popped and
        never acknowledged is pushed again, in order, before anything newer."""
        fresh = [o for o in self.by_name.values() if o.session_pending()]
        if not fresh:
            return 0
        again = {o.name: o.unacked_offsets() for o in fresh}
        # the cursor first: a crash between here and the answer leaves a cursor that is right
        # both for the ring as it is and as reset (see delivery.py)
        self._save_cursors(again)
        for outlet in fresh:
            outlet.reset_for_reader()
            self.held.discard(outlet.name)
            self.counters[C_REDELIVERED] += again[outlet.name].size
            self.counters[C_READERS] += 1
            outlet.answer_reader()
        return len(fresh)

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
            nbytes = chunk_bytes(words, pos)
            start = (pos + L.RECORD_HEADER_WORDS) * 4
            data = ring.buf[L.HEADER_BYTES + start : L.HEADER_BYTES + start + nbytes]
            at = self.log.append(data)
            self.counters[4] += nbytes
            # from our own GPU process through shared memory: framed by the ring, no CRC to check
            # (the CRC protects the copy on disk, checked when the log is replayed)
            count, _stop, _outcome = scan_all(data, self._pos, check_crc=False)
            self._route(data, count, at, ack=True)
            ring.release(new_tail, 1)
            taken += 1

    def _route(self, data: np.ndarray, n: int, at: int, ack: bool, source: NameLog | None = None) -> int:
        """Route the `n` records of `data`, which lie at log offset `at` of the shared log (or, with
        `source`, of that name's own log)."""
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
            if ack:  # fresh from a GPU (not a replay): a job's results are counted
                self.jobs.count(p, mine, item_ids, status, data, rows)
            outlet = self.outlets.get(p)
            name = outlet.name if outlet is not None else self._name_of(p)
            if outlet is None and name is not None:
                outlet = self.by_name.get(name)
            offsets = rows + at
            behind = self.behind.get(name) if name is not None else None
            if behind is not None and source is None:  # a name read far behind: copied to its own log
                if self.plans is not None:  # replaying: those below `through` are there already
                    keep = offsets >= behind.through
                    rows, offsets = rows[keep], offsets[keep]
                    if rows.size == 0:
                        continue
                offsets = behind.append(data, rows)
            if self.plans is not None:
                keep = self._plan(name, outlet, offsets)
                rows, offsets = rows[keep], offsets[keep]
                if rows.size == 0:
                    continue
            if outlet is None:
                self.parked.setdefault(name or f"#{p}", OffsetQueue()).extend(offsets)
                self.counters[3] += rows.size
                continue
            if outlet.waiting or name in self.held:
                outlet.waiting.extend(offsets)
                continue
            rows = np.ascontiguousarray(rows)
            pushed, wake = push_results(outlet.ring.buf, data, rows, 0, rows.size)
            if wake:
                outlet.ring.data_bell.ring()
            if pushed:
                outlet.pushed(offsets[:pushed])
                self.counters[1] += pushed
            if pushed < rows.size:
                outlet.waiting.extend(offsets[pushed:])
        return n

    def retry_waiting(self) -> int:
        """Push parked results of connected producers whose rings have room again."""
        moved = 0
        for outlet in self.by_name.values():
            if outlet.name in self.held:
                continue
            log = self._log_of(outlet.name)
            while outlet.waiting:
                at = outlet.waiting.first()
                head = log.read(at, RES_HEADER_BYTES)
                size = result_head(head, 0)[0]
                data = log.read(at, size)
                pushed, wake = push_results(outlet.ring.buf, data, np.zeros(1, np.int64), 0, 1)
                if wake:
                    outlet.ring.data_bell.ring()
                if not pushed:
                    break
                outlet.waiting.pop()
                outlet.pushed(np.array([at], np.int64))
                self.counters[1] += 1
                moved += 1
        return moved

    # -- checkpoints (the cursor file: `cursor_save.py`) ---------------------------------

    def checkpoint(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_save < ACK_SAVE_SECONDS:
            return
        self.last_save = now
        if self.replayed:
            self._rebalance()
        self.log.sync()  # results on disk before the acks that say their items are done
        for behind in self.behind.values():
            behind.log.sync()
        self.jobs.save()  # after the results it counts are synced, before the acks that say they are done
        # reclaim before the ack file is saved: on a full disk, the step that frees space comes
        # first (a segment is reclaimed only once all its results are synced, just above, and
        # recovery takes a missing segment's sequence numbers as done)
        if force or now - self.last_reclaim > RECLAIM_SECONDS:
            self.last_reclaim = now
            self.backlog.reclaim()
        self.backlog.save_acks()
        self.counters[5] += 1
        if self.replayed:
            self.answer_readers()
            self._save_cursors()

    def close(self) -> None:
        self.checkpoint(force=True)
        self.log.close()
        for behind in self.behind.values():
            behind.log.close()
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


def _load_acks(root: Path):
    from ..spill.acks import AckFileCorrupt, Acks

    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        return Acks.load(root)
    except AckFileCorrupt:
        return Acks()


GAUGE_SECONDS = 0.25  # the parked gauge is counted this often


def results_main(cfg, control: Control, results_rings, bell, stopping) -> None:
    from ..control.stats import StatsWriter

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
            beat(slot)
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
                try:
                    router.checkpoint()  # it reclaims what is done: the space a full disk needs
                except OSError as again:
                    if again.errno not in DISK_ERRNOS:
                        raise
                stats.publish()
                time.sleep(DISK_FULL_BACKOFF_SECONDS)
                continue
            now = time.monotonic()
            if now >= next_gauges:
                stats.values[parked_at] = router.parked_now()
                stats.values[C_BEHIND], stats.values[C_BEHIND_BYTES] = router.behind_now()
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
