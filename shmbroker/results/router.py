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

A full disk may stop a ring record midway, in a copy to a name's own log (`behind.py`): the record
stays on its ring and is taken again from where it stopped (`routed.Taking`), before any other, so
no record is written twice and no result is acked, counted or delivered twice.

Delivery (`delivery.py`): each producer name's cursor (its first result the reader has not
acknowledged) is saved in `results/cursor.json`; a reader that dies leaves what it did not
acknowledge to the next reader under its name, and a replay after a restart gives each name its
results from its cursor on. A damaged record in the log is skipped (the scan resyncs on the next
valid record) and counted; when its frame is whole, so that its item id can be read, the item is
told `corrupt`. Only a torn tail of the newest file (nothing valid after it) is cut.

The `Router` owns the log, the backlog and its collaborators, each behind its own methods:
`Recipients` (`recipients.py`: who a result goes to, what is parked or held), `FarBehind`
(`behind.py`: the names read far behind and their own logs), `CursorKeeper` (`cursor_save.py`:
the cursor entries, their save and the trims) and, after a restart, a `Replay` (`replay.py`)
given the route step and what it reads. Its statistics are the results role's, by name
(`slots.py`).
"""

from __future__ import annotations

import errno
import time
from pathlib import Path

import numpy as np

from ..control.segment import Control, beat
from ..jobs.tally import JobTallies
from ..ring import layout as L
from ..ring import spsc
from ..ring.items import SEQ_BITS
from ..ring.ring import CONSUMER, Ring
from ..ring.waits import sleep_on
from ..ring.wire import RES_HEADER_BYTES, chunk_bytes, push_results, result_fields, result_head
from ..spill.store import BACKLOG_DIR, Backlog
from .behind import BehindNow, FarBehind
from .cursor_save import CursorKeeper
from .delivery import Cursors, Outlet
from .log import RESULTS_DIR, OffsetQueue, ResultsLog, file_bytes_for
from .recipients import Recipients
from .replay import SCAN_MAX, Replay, ReplayPlans, scan_all
from .routed import Columns, Placed, Taking, groups
from .slots import (
    C_ACKED,
    C_CHECKPOINTS,
    C_DELIVERED,
    C_DISK_FULL,
    C_LOG_BYTES,
    C_PARKED,
    C_READERS,
    C_REDELIVERED,
    C_RESULTS,
    G_BEHIND,
    G_BEHIND_BYTES,
    G_PARKED_NOW,
    NUM_SLOTS,
)

ACK_SAVE_SECONDS = 0.2
RECLAIM_SECONDS = 2.0
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
DISK_FULL_BACKOFF_SECONDS = 0.05


class Router:
    """The results process's single writer: it owns the shared results log, the backlog's acks,
    who each result goes to (`Recipients`), the names read far behind (`FarBehind`), the cursors
    (`CursorKeeper`), and routes every record through them."""

    def __init__(self, data_dir: str, cfg, control: Control, counters: np.ndarray | None = None):
        """`counters`: the results role's statistics (`slots.py`; the process's `StatsWriter.values`)."""
        self.control = control
        self.counters = counters if counters is not None else np.zeros(NUM_SLOTS, np.int64)
        root = Path(data_dir) / RESULTS_DIR
        self.log = ResultsLog(root, cfg.fsync, file_bytes_for(cfg.results_name_bytes))
        self.backlog = Backlog(Path(data_dir) / BACKLOG_DIR, cfg.segment_bytes)
        self.backlog.acks = _load_acks(self.backlog.root)
        self.recipients = Recipients(data_dir)
        self.cursors = Cursors(root)
        # names read far behind (behind.py): their results in a log of their own
        self.behind = FarBehind(root, self.log, cfg.results_name_bytes, self.counters, self.cursors.names)
        self.keeper = CursorKeeper(self.cursors, self.log, self.recipients, self.behind)
        self.replayed = False  # readers are set up (and cursors saved) only once the replay is done
        self._pos = np.empty(SCAN_MAX, np.int64)
        self._taking: Taking | None = None  # a ring record logged and not all routed (a full disk)
        self._cols = Columns.scratch()
        self.last_save = time.monotonic()
        self.last_reclaim = time.monotonic()
        self.jobs = JobTallies(data_dir, self.recipients.name_of)  # each job's results by status (`jobs/tally.py`)

    @property
    def parked(self) -> dict[str, OffsetQueue]:
        """Results for names not connected, by name (their log offsets)."""
        return self.recipients.parked

    def behind_now(self) -> BehindNow:
        """(names read far behind, bytes their own logs hold)."""
        return self.behind.behind_now()

    def parked_now(self) -> int:
        """Results waiting for a producer: parked by name, or for a full ring."""
        return self.recipients.parked_now()

    # -- producers -------------------------------------------------------------------

    def refresh(self) -> None:
        """Follow the producer table (`Recipients.refresh`); set up a new name's reader at once (a
        returning one's at the next checkpoint)."""
        if self.recipients.refresh(self.control) and self.replayed:
            self.answer_readers()

    def answer_readers(self) -> int:
        """Set up the rings whose new reader announced itself: what the earlier reader popped and
        never acknowledged is pushed again, in order, before anything newer."""
        fresh = self.recipients.new_readers()
        if not fresh:
            return 0
        again = {o.name: o.unacked_offsets() for o in fresh}
        # the cursor first: a crash between here and the answer leaves a cursor that is right
        # both for the ring as it is and as reset (see delivery.py)
        self.keeper.save(again)
        for outlet in fresh:
            outlet.reset_for_reader()
            self.recipients.release(outlet.name)
            self.counters[C_REDELIVERED] += again[outlet.name].size
            self.counters[C_READERS] += 1
            outlet.answer_reader()
        return len(fresh)

    # -- the flow ----------------------------------------------------------------------

    def take(self, ring: Ring) -> int:
        """Log, route and ack what one GPU's results ring holds; the records it released.

        A ring record is released only once routed. A full disk may stop its route midway (a copy
        to a name's own log): it raises, and the next take goes on from where that one stopped
        (`Taking`), never writing a record or counting a result twice. Until then no other ring's
        record is taken: every name's results stay in log order."""
        if self._taking is not None and self._taking.ring is not ring:
            return 0
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
            if self._taking is None:
                self._taking = Taking(ring, pos, self.log.append(data), {})
                self.counters[C_LOG_BYTES] += nbytes
            assert self._taking.pos == pos, "a ring record half taken must be the first taken again"
            # from our own GPU process through shared memory: framed by the ring, no CRC to check
            # (the CRC protects the copy on disk, checked when the log is replayed)
            count, _stop, _outcome = scan_all(data, self._pos, check_crc=False)
            self.route(data, self._pos[:count], self._taking.at, ack=True, copied=self._taking.copied)
            ring.release(new_tail, 1)
            self._taking = None
            taken += 1

    def route(self, data: np.ndarray, rows: np.ndarray, at: int, ack: bool, own_log: bool = False,
              plans: ReplayPlans | None = None, copied: dict[int, np.ndarray] | None = None) -> int:
        """Route the records at positions `rows` of `data`, which lie at log offset `at` of the
        shared log (with `own_log`, of their name's own log: a replay of it); returns how many.
        `ack`: fresh from a GPU or replayed (not a notice): their backlog records are acked.
        `plans`: while replaying, which results each name still needs. `copied`: the copies made
        to names' own logs, by producer id (`place`), kept by the caller across a full disk.

        The copies come first, the only step that writes to disk; the acks, counts and deliveries
        after them, all or none: a route a full disk stopped has changed nothing but copies."""
        n = rows.size
        cols = self._cols.head(n)
        result_fields(data, rows, n, cols.item_ids, cols.seqs, cols.writers, cols.status)
        producers = (cols.item_ids >> np.uint64(SEQ_BITS)).astype(np.int64)
        by_producer = groups(producers)
        copied = {} if copied is None else copied
        places = [self.place(p, data, rows if mine is None else rows[mine], at, own_log, plans, copied)
                  for p, mine in by_producer]
        if ack:
            for w, mine in groups(cols.writers):
                self.backlog.ack(w, cols.seqs if mine is None else cols.seqs[mine])
            self.counters[C_ACKED] += n
        self.counters[C_RESULTS] += n
        for (p, mine), (name, outlet, mine_rows, offsets) in zip(by_producer, places):
            if ack:  # fresh from a GPU (not a replay): a job's results are counted
                self.jobs.count(p, mine, cols.item_ids, cols.status, data, rows if mine is None else rows[mine])
            if mine_rows.size == 0:
                continue
            if plans is not None:
                keep = plans.mask(name, outlet, offsets)
                mine_rows, offsets = mine_rows[keep], offsets[keep]
                if mine_rows.size == 0:
                    continue
            if outlet is None:
                self.recipients.park(name or f"#{p}", offsets)
                self.counters[C_PARKED] += mine_rows.size
            else:
                self._deliver(outlet, data, mine_rows, offsets)
        return n

    def place(self, p: int, data: np.ndarray, rows: np.ndarray, at: int, own_log: bool, plans: ReplayPlans | None,
              copied: dict[int, np.ndarray]) -> Placed:
        """Where producer `p`'s records at `rows` of `data` (at shared-log offset `at`) go: a name read
        far behind gets them copied to its own log, once (`copied`, by producer id, holds the copies
        made); a replay (`plans`) copies only those at or past the name's `through`."""
        outlet, name = self.recipients.find(p)
        offsets = rows + at
        behind = self.behind.get(name) if name is not None else None
        if behind is None or own_log:
            return Placed(name, outlet, rows, offsets)
        if plans is not None:  # replaying: those below `through` are there already
            keep = offsets >= behind.through
            rows, offsets = rows[keep], offsets[keep]
        if p not in copied and rows.size:
            copied[p] = behind.append(data, rows)
        return Placed(name, outlet, rows, copied.get(p, offsets))

    def _deliver(self, outlet: Outlet, data: np.ndarray, rows: np.ndarray, offsets: np.ndarray) -> None:
        """Push the records at `rows` of `data` (at log `offsets`) on a connected name's ring; what
        does not fit, or may not go yet, waits behind what already waits."""
        if outlet.waiting or self.recipients.is_held(outlet.name):
            outlet.waiting.extend(offsets)
            return
        rows = np.ascontiguousarray(rows)
        pushed, wake = push_results(outlet.ring.buf, data, rows, 0, rows.size)
        if wake:
            outlet.ring.data_bell.ring()
        if pushed:
            outlet.pushed(offsets[:pushed])
            self.counters[C_DELIVERED] += pushed
        if pushed < rows.size:
            outlet.waiting.extend(offsets[pushed:])

    def retry_waiting(self) -> int:
        """Push parked results of connected producers whose rings have room again."""
        moved = 0
        for outlet in self.recipients.connected():
            if self.recipients.is_held(outlet.name):
                continue
            log = self.behind.log_of(outlet.name)
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
                self.counters[C_DELIVERED] += 1
                moved += 1
        return moved

    # -- replay and checkpoints ----------------------------------------------------------

    def replay(self) -> dict:
        """After a restart: route every result from each name's cursor to the log's end again
        (`replay.py`); then set up the readers waiting and save a checkpoint."""
        held = self.recipients.hold_new_readers()
        report = Replay(self.route, self.log, self.behind.logs(), self.cursors, held, self.counters,
                        self.recipients.name_of, self.backlog.acks).run()
        self.replayed = True
        self.answer_readers()
        self.checkpoint(force=True)
        return report

    def checkpoint(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_save < ACK_SAVE_SECONDS:
            return
        self.last_save = now
        if self.replayed and self._taking is None:  # no name moves while a record is half routed
            self.behind.rebalance(self.keeper.entries(), self.recipients)
        self.log.sync()  # results on disk before the acks that say their items are done
        self.behind.sync()
        self.jobs.save()  # after the results it counts are synced, before the acks that say they are done
        # reclaim before the ack file is saved: on a full disk, the step that frees space comes
        # first (a segment is reclaimed only once all its results are synced, just above, and
        # recovery takes a missing segment's sequence numbers as done)
        if force or now - self.last_reclaim > RECLAIM_SECONDS:
            self.last_reclaim = now
            self.backlog.reclaim()
        self.backlog.save_acks()
        self.counters[C_CHECKPOINTS] += 1
        if self.replayed:
            self.answer_readers()
            self.keeper.save()

    def close(self) -> None:
        self.checkpoint(force=True)
        self.log.close()
        self.behind.close()
        self.backlog.close()
        self.recipients.close()


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
                router.counters[C_DISK_FULL] += 1
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
                stats.values[G_PARKED_NOW] = router.parked_now()
                stats.values[G_BEHIND], stats.values[G_BEHIND_BYTES] = router.behind_now()
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
