"""The GPU process: keep its engine full from its batch ring, exactly one result per item out.

`gpu_main` is the process loop: load the consumer's engine (`engines/catalogue.py`), then take
batch records into the in-flight window (`window.py`; item locations, tokens viewed zero-copy in
the backlog's segment files, `segments.py`), poll the engine, write each finished item's result
record to the results ring (`ResultWriter`), release the records whose items all have results;
the statistics (`GpuCounting`) published after each round. What happens to each item is
`ConsumerCore`'s (`core.py`).

For the supervisor's watchdog (`supervisor/watchdog.py`) the loop beats its role slot every round and
publishes the window's batch deadline there (`R_DEADLINE`; 0 while the engine holds nothing, waits
for a retry, or the results ring holds the process up); what a dead predecessor held is the
window's (`deliveries.py`): the delivery words are read once the engine is loaded, so a process
that cannot load its engine counts no delivery.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from ..disk.payloads import PayloadStore
from ..control import roles
from ..control.segment import R_DEADLINE, R_STARTED, beat
from ..engines.base import BatchResults, EngineDead
from ..errors import Full, PeerDead
from ..pack.feeding import window_items
from ..ring import layout as L
from ..ring.items import Status
from ..ring.ring import CONSUMER, PRODUCER, Ring
from ..ring.waits import SLEEP_SLICE_SECONDS
from ..ring.wire import RES_HEADER_BYTES, RES_MAX_ERROR_BYTES, chunk_meta_words, encode_error, encode_one, encode_results_extras
from .backoff import WindowLimits
from .core import ConsumerCore
from .deliveries import Deliveries
from .engine_watch import EngineWatch, WatchedEngine
from .segments import SegmentViews
from .window import WINDOW_COUNTS, Window

# Yields before a GPU process sleeps on its batch ring: the scheduler's next batch usually lands
# within a few of its time slices.
YIELD_ROUNDS = 64
NO_EXTRAS = np.zeros(0, np.uint32)
log = logging.getLogger("shmbroker.gpu")
IDLE_PUBLISH_NS = 500_000_000  # an idle GPU process publishes its idle seconds this often


def extras_columns(res: BatchResults) -> tuple[np.ndarray, np.ndarray]:
    """Each row's extras words as columns: (words, offsets), row k's words[offsets[k]:offsets[k+1]]."""
    offsets = np.zeros(len(res) + 1, np.int64)
    if not res.extras:
        return NO_EXTRAS, offsets
    first = next(iter(res.extras.values()))
    if len(res.extras) == len(res) and all(x is first for x in res.extras.values()):  # one set for all (vectors)
        offsets[1:] = np.arange(1, len(res) + 1) * first.size
        return np.tile(first, len(res)).astype(np.uint32, copy=False), offsets
    rows = [res.extras.get(k, NO_EXTRAS) for k in range(len(res))]
    np.cumsum([r.size for r in rows], out=offsets[1:])
    return np.concatenate(rows).astype(np.uint32, copy=False), offsets


def oversized_failed(res: BatchResults, limit_bytes: int) -> BatchResults:
    """`res` with every result whose record would pass `limit_bytes` failed, engine_error, saying so."""
    items = res.items()
    for r in items:
        size = RES_HEADER_BYTES + 4 * (r.tokens.size + (0 if r.extras is None else r.extras.size))
        if size > limit_bytes:
            r.status, r.tokens, r.extras = Status.ENGINE_ERROR.label, np.zeros(0, np.uint32), None
            r.error = f"its result of {size} bytes is larger than a result record may be ({limit_bytes}: half a " \
                      "result ring; see result_ring_bytes)"
    return BatchResults.of(items)


class ResultWriter:
    """Encodes a batch's results as result records and pushes them to the results ring (in chunks
    that fit its largest record)."""

    def __init__(self, ring, stopping, on_wait=None, result_ring_bytes: int | None = None):
        self.ring = ring
        self.stopping = stopping
        self.on_wait = on_wait  # called while the results ring holds us up (the process beats, no deadline runs)
        self.max_bytes = ring.max_tokens * 4
        self.buf = np.zeros(min(self.max_bytes, 1 << 20), np.uint8)
        # the largest record a producer's result ring takes (half of it, as any ring's), when smaller
        self.record_bytes_max = min(self.max_bytes, (result_ring_bytes or 1 << 62) // 2 - 64)

    def write(self, res: BatchResults, seqs: np.ndarray, writers: np.ndarray) -> None:
        """Runs of records, their tokens and extras words (samples, finishes, cached tokens, a vector's
        mark: `request/extras.py`), in one kernel call each; a failed item with an error text alone.
        A result larger than a record may be (a vector wider than the rings allow) fails alone."""
        xflat, xoffs = extras_columns(res)
        if len(res) and int((np.diff(res.offsets) + np.diff(xoffs)).max()) * 4 + RES_HEADER_BYTES > self.record_bytes_max:
            res = oversized_failed(res, self.record_bytes_max)
            xflat, xoffs = extras_columns(res)
        n = len(res)
        texts = sorted(k for k in res.errors if res.status[k] != Status.OK)
        i = at = 0
        for stop in texts + [n]:
            while i < stop:
                j, at = encode_results_extras(self.buf, at, res.item_ids, seqs, writers, res.status, res.flat,
                                              res.offsets, xflat, xoffs, i, stop)
                if j == i:  # the next record does not fit what is left
                    words = int(res.offsets[i + 1] - res.offsets[i] + xoffs[i + 1] - xoffs[i])
                    at = self._flush(at, RES_HEADER_BYTES + 4 * words + 8)
                i = j
            if stop < n:
                at = self._write_one(res, stop, seqs, writers, at)
                i = stop + 1
        self._flush(at, 0)

    def _write_one(self, res: BatchResults, k: int, seqs: np.ndarray, writers: np.ndarray, at: int) -> int:
        """Item k's record alone: its tokens, its extras words and its error text (when failed)."""
        failed = res.status[k] != Status.OK and k in res.errors
        text = res.errors[k].encode("utf-8", "replace")[:RES_MAX_ERROR_BYTES] if failed else b""
        tokens = res.flat[res.offsets[k] : res.offsets[k + 1]]
        extras = res.extras.get(k, NO_EXTRAS)
        need = RES_HEADER_BYTES + 4 * (tokens.size + extras.size) + len(text) + 8
        if at + need > self.buf.size:
            at = self._flush(at, need)
        if not tokens.size and not extras.size:
            return encode_error(self.buf, at, res.item_ids[k], seqs[k], res.status[k], writers[k],
                                np.frombuffer(text, np.uint8))
        return encode_one(self.buf, at, res.item_ids[k], seqs[k], res.status[k], writers[k],
                          np.ascontiguousarray(tokens, np.uint32), extras, np.frombuffer(text, np.uint8))

    def _flush(self, at: int, need: int) -> int:
        if at:
            payload = self.buf[:at].view(np.uint32)
            while True:
                try:
                    self.ring.push_wait(payload, 0, *chunk_meta_words(at), SLEEP_SLICE_SECONDS * 4)
                    break
                except (Full, PeerDead):  # the results process may be restarting: its ring stays
                    self.ring.heartbeat()
                    if self.on_wait is not None:
                        self.on_wait()
                    if self.stopping() == 2:
                        raise
        if need > self.buf.size:
            if need > self.max_bytes:
                raise ValueError(f"a result of {need} bytes exceeds the results ring's largest record")
            self.buf = np.zeros(need, np.uint8)
        return 0


POLL_SHORT_SECONDS = 0.002  # the engine's poll while the window has room and the ring may bring more


def gpu_main(c: int, cfg, control, batch_ring, results_ring, stopping) -> None:
    """GPU process c: keep consumer c's engine full from its batch ring and write every item's result."""
    if cfg.consumers[c].device is not None:  # pinned to its card (tiers.py) before any engine import
        import os

        os.environ.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(cfg.consumers[c].device))
    from pathlib import Path

    from ..control.stats import StatsWriter
    from ..engines.catalogue import load_engine
    from ..spill.store import BACKLOG_DIR

    consumer = cfg.consumers[c]
    role = control.roles.index(roles.gpu(c, consumer.name).name)
    slot = control.role(role)
    stats = StatsWriter(control, role)
    engine = load_engine(consumer.engine, consumer.engine_settings, block_tokens=cfg.block_tokens,
                         contract=consumer.contract)
    ring = batch_ring.attach(CONSUMER)
    out = results_ring.attach(PRODUCER)
    views = SegmentViews(Path(cfg.data_dir) / BACKLOG_DIR)

    def held_up() -> None:  # the results ring is full: not the engine's time
        beat(slot)
        slot[R_DEADLINE] = 0

    deliveries = Deliveries(control.own(role), int(ring.header[L.H_TAIL]), cfg.poison_attempts)
    watch = EngineWatch(consumer.name, slot, engine, deliveries, report=lambda: window.in_flight_words(),
                        counted=lambda: counting.engine_died())
    core = ConsumerCore(consumer.contract, WatchedEngine(engine, watch, call_seconds(cfg, consumer.contract)),
                        tolerance=cfg.padding_tolerance, payloads=PayloadStore(cfg.data_dir, cfg.max_payload_bytes))
    window = Window(core, ring, ResultWriter(out, stopping, held_up, cfg.result_ring_bytes), views, c,
                    window_items(consumer.contract.max_batch_size, engine.mode), deliveries=deliveries,
                    limits=WindowLimits.of(cfg))
    counting = GpuCounting(stats, core, window)
    counting.loaded(consumer.name, slot, deliveries)
    window.on_event = counting.publish_window
    watch.start()
    try:
        _serve(window, counting, ring, slot, stopping)
    except EngineDead as exc:
        watch.end(str(exc))
    finally:
        watch.stop()
        slot[R_DEADLINE] = 0
        views.close()
        ring.close()
        out.close()
        engine.close()


def call_seconds(cfg, contract) -> float:
    """How long one call into the engine may block past its own timeout (`engine_watch.py`)."""
    return cfg.engine_call_seconds + cfg.batch_deadline_token_seconds * contract.max_batch_tokens


def _serve(window: Window, counting: GpuCounting, ring: Ring, slot: np.ndarray, stopping) -> None:
    """The process loop (module docstring) until a stop: take records into the window, poll the
    engine, release the records done; the role slot beaten and the statistics published as it goes."""
    events = window.events
    if events:
        counting.publish_window()
    mark = time.monotonic_ns()  # busy (window not empty) or idle time is counted from here
    idle_from = mark
    while True:
        beat(slot)
        slot[R_DEADLINE] = window.deadline_ns()
        if window.events != events:
            events = window.events
            counting.publish_window()
        if stopping() == 2 or (stopping() and window.backoff.down):
            break  # stop now, or stop while the engine is down: what is not released comes again next start
        was_empty = window.empty
        taking = time.monotonic_ns()  # busy from here: taking adds to the engine, which may start at once
        window.take_more()
        if window.empty:
            if stopping():
                break
            try:
                ring.wait_readable(SLEEP_SLICE_SECONDS, YIELD_ROUNDS)
            except PeerDead:
                pass  # the scheduler is restarting; its ring and our batches stay
            now = time.monotonic_ns()
            if now - idle_from >= IDLE_PUBLISH_NS:  # a long idle shows as it happens, not at the next batch
                counting.idle(now - idle_from)
                idle_from = mark = now
            continue
        if was_empty:  # the window just filled: what went before was idle
            counting.idle(max(0, taking - idle_from))
            mark = taking
        room = window.num_admitted < window.limit and not window.padded
        done = window.poll(POLL_SHORT_SECONDS if room else SLEEP_SLICE_SECONDS)
        if done or window.taken[0].open == 0:
            window.admit()
            now = time.monotonic_ns()
            # counted before the release: a crash in between re-runs those items and counts them
            # again (the engine did run them twice), but a record is never released uncounted
            counting.batch(now - mark, 0, window.wait_ns)
            window.wait_ns = 0
            mark = now
            window.release_done()
            if window.empty:
                idle_from = time.monotonic_ns()


U64_MASK = (1 << 64) - 1


class GpuCounting:
    """A GPU process's statistics (`stats.GPU`): the core's counts of this incarnation on top of
    what its predecessors published, plus the process's own clocks."""

    KEYS = ("batches", "items", "ok", "too_long", "invalid", "engine_errors", "corrupt", "guard_violations",
            "hit_blocks", "queried_blocks", "padded_tokens", "rect_tokens", "reused_tokens", "shape_switches",
            "excess_shape_switches", "families")

    def __init__(self, stats, core: ConsumerCore, window: Window | None = None):
        self.stats = stats
        self.core = core
        self.window = window
        v = stats.values
        self.base = v.copy()
        self.at = {k: stats.index[k] for k in (*self.KEYS, *WINDOW_COUNTS, "tokens", "busy_ns", "idle_ns",
                                                "batch_wait_ns", "engine_own_ns", "last_family", "engine_down",
                                                "engine_deaths", "engine_restart_ns", "engine_load_ns")}
        self.deliveries = None  # a fresh engine's deliveries, while its restart is to be measured
        self.consumer = ""
        if stats["batches"]:  # a restart continues the predecessor's run: its last family is served
            core.resume_family(stats["last_family"] & U64_MASK)

    def loaded(self, consumer: str, slot: np.ndarray, deliveries: Deliveries) -> None:
        """The engine is loaded: the seconds since the process started, and the restart to measure at
        its first result when an engine died before it (`engine_watch.py`)."""
        load_ns = max(0, time.monotonic_ns() - int(slot[R_STARTED]))
        self.stats.values[self.at["engine_load_ns"]] = load_ns
        log.info("consumer %s: engine loaded in %.1f s", consumer, load_ns / 1e9)
        self.consumer = consumer
        self.deliveries = deliveries
        self.stats.publish()

    def engine_died(self) -> None:
        self.stats.values[self.at["engine_deaths"]] += 1
        self.stats.publish()

    def _restarted(self) -> None:
        """The first result since the engine's start: an engine death's restart, when one came before."""
        seconds = self.deliveries.restart_seconds(time.monotonic_ns())
        self.deliveries = None
        if seconds is not None:
            self.stats.values[self.at["engine_restart_ns"]] = int(seconds * 1e9)
            log.warning("consumer %s: the engine restarted %.1f s after its predecessor died (death to first result)",
                        self.consumer, seconds)

    def idle(self, idle_ns: int) -> None:
        self.stats.values[self.at["idle_ns"]] += idle_ns
        self.stats.publish()

    def _window(self) -> None:
        w, v, base, at = self.window, self.stats.values, self.base, self.at
        if w is None:
            return
        for k in WINDOW_COUNTS:
            v[at[k]] = base[at[k]] + w.counts[k]
        v[at["engine_down"]] = int(w.backoff.down)

    def publish_window(self) -> None:
        """The window's counts changed (an engine down or up, a redelivery, a poison item)."""
        s, v, base, at = self.core.stats, self.stats.values, self.base, self.at
        for k in ("ok", "engine_errors", "items"):
            v[at[k]] = base[at[k]] + getattr(s, k)
        self._window()
        self.stats.publish()

    def batch(self, busy_ns: int, idle_ns: int, wait_ns: int) -> None:
        if self.deliveries is not None:
            self._restarted()
        s, v, base, at = self.core.stats, self.stats.values, self.base, self.at
        for k in self.KEYS:
            v[at[k]] = base[at[k]] + getattr(s, k)
        v[at["tokens"]] = base[at["tokens"]] + s.input_tokens
        v[at["engine_own_ns"]] = base[at["engine_own_ns"]] + int(s.engine_seconds * 1e9)
        v[at["busy_ns"]] += busy_ns
        v[at["idle_ns"]] += idle_ns
        v[at["batch_wait_ns"]] += wait_ns
        family = self.core.last_family
        if family is not None:
            v[at["last_family"]] = family - (1 << 64) if family >= 1 << 63 else family
        self._window()
        self.stats.publish()
