"""The GPU process: one batch in, exactly one result per item out.

`ConsumerCore.process(batch, tokens)` is what a GPU process does with each batch:

1. the shape guard again: a batch that is not shape-pure or breaks the contract is counted
   (`guard_violations`) and still served, since its results are right either way;
2. items the contract cannot take are failed back here, never searched for by the scheduler:
   `too_long` (with the lengths in the error) and `invalid` (no tokens);
3. the engine runs the rest as one batch; if it raises, each item runs alone so that an engine
   error fails only the items that cause it (`engine_error` with the message), never the batch or
   the process; an engine that returns a result for the wrong item, or none, fails that item the
   same way.

Results come back in columns (`BatchResults`), so a batch costs a handful of array operations,
not a Python object per item. `gpu_main` is the process loop: take the next batch record from
its batch ring (item locations; the ring keeps it until its results are out, so a crash
redelivers it), view each item's tokens zero-copy in the backlog's segment files, process, write
the result records to the results ring, release the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..errors import Full, PeerDead
from ..pack.contract import BATCH_ROW, Batch, Contract, Shape
from ..pack.guard import Guard
from ..ring import layout as L
from ..ring.ring import CONSUMER, PRODUCER, SLEEP_SLICE_SECONDS
from ..ring.wire import LOC_DTYPE, LOC_WORDS, RES_HEADER_BYTES, RES_MAX_ERROR_BYTES, encode_error, encode_results
from ..spill.layout import RECORD_HEADER_BYTES, writer_dir_name
from ..spill.segment import SegmentFile
from .engines.base import (
    ENGINE_ERROR,
    INVALID,
    STATUS_CODES,
    TOO_LONG,
    BatchResults,
    EngineBatch,
    EngineOutcome,
    ItemResult,
)

# Yields before a GPU process sleeps on its batch ring: the scheduler's next batch usually lands
# within a few of its time slices.
YIELD_ROUNDS = 64
IDLE_PUBLISH_NS = 500_000_000  # an idle GPU process publishes its idle seconds this often

CODE_OK, CODE_TOO_LONG, CODE_INVALID, CODE_ENGINE_ERROR = (STATUS_CODES[s] for s in ("ok", TOO_LONG, INVALID,
                                                                                      ENGINE_ERROR))


@dataclass
class ConsumerStats:
    batches: int = 0
    items: int = 0
    ok: int = 0
    too_long: int = 0
    invalid: int = 0
    engine_errors: int = 0
    guard_violations: int = 0
    hit_blocks: int = 0
    queried_blocks: int = 0
    engine_seconds: float = 0.0
    input_tokens: int = 0
    padded_tokens: int = 0
    rect_tokens: int = 0
    reused_tokens: int = 0  # prefix tokens the engine served from a cache
    shape_switches: int = 0  # consecutive batches of different families
    families: int = 0  # distinct families served
    # switches back to a family already served: switches - (families - 1) (DESIGN.md "Words"),
    # counted as they happen so that a restarted process can continue the count
    excess_shape_switches: int = 0


class ConsumerCore:
    def __init__(self, contract: Contract, engine, *, tolerance: float | None = None):
        self.contract = contract
        self.engine = engine
        self.guard = Guard(tolerance if engine.mode == "padded" else None)
        self.stats = ConsumerStats()
        self._last_family: int | None = None
        self._families: set[int] = set()

    def process(self, batch: Batch, tokens) -> BatchResults:
        """Results in the batch's order, one per item. tokens[i] holds item i's token ids (read only
        when the engine asks for them)."""
        n = len(batch)
        assert len(tokens) == n, "one token array per item"
        stats = self.stats
        stats.batches += 1
        stats.items += n
        if n and self.guard.check_batch(batch, self.contract) is not None:
            stats.guard_violations += 1
        if n:
            family = int(batch.shape.family)
            if self._last_family is not None and family != self._last_family:
                stats.shape_switches += 1
                if family in self._families:
                    stats.excess_shape_switches += 1
            self._last_family = family
            if family not in self._families:
                self._families.add(family)
                stats.families += 1
            stats.input_tokens += int(batch.lengths.sum())
        ids = batch.keys.astype(np.uint64)
        lengths = batch.lengths
        limit = self.contract.max_input_len
        status = np.zeros(n, np.uint32)
        status[lengths == 0] = CODE_INVALID
        status[lengths > limit] = CODE_TOO_LONG
        errors = {int(i): f"{int(lengths[i])} tokens > max_input_len {limit}" for i in np.flatnonzero(lengths > limit)}
        errors.update({int(i): "no tokens" for i in np.flatnonzero(lengths == 0)})
        runnable = np.flatnonzero(status == 0)
        if runnable.size == n:
            out = self._run(ids, tokens, batch.max_new_tokens.astype(np.int64))
        else:
            out = _empty(ids, status, errors)
            if runnable.size:
                sub = self._run(ids[runnable], _Pick(tokens, runnable), batch.max_new_tokens[runnable].astype(np.int64))
                out = _merge(out, runnable, sub)
        counts = np.bincount(out.status, minlength=4)
        stats.ok += int(counts[CODE_OK])
        stats.too_long += int(counts[CODE_TOO_LONG])
        stats.invalid += int(counts[CODE_INVALID])
        stats.engine_errors += int(counts[CODE_ENGINE_ERROR])
        return out

    def _run(self, ids: np.ndarray, tokens, max_new: np.ndarray) -> BatchResults:
        sub = EngineBatch(ids, tokens, max_new)
        try:
            return self._checked(sub, self.engine.run(sub))
        except Exception as exc:  # noqa: BLE001 - isolate the item(s) that fail, below
            if len(ids) == 1:
                return BatchResults.of([_engine_error(ids[0], exc)])
        out = []
        for k in range(len(ids)):
            one = EngineBatch(ids[k : k + 1], [tokens[k]], max_new[k : k + 1])
            try:
                out.extend(self._checked(one, self.engine.run(one)).items())
            except Exception as exc:  # noqa: BLE001 - an engine error fails its item, not the process
                out.append(_engine_error(ids[k], exc))
        return BatchResults.of(out)

    def _checked(self, sub: EngineBatch, outcome: EngineOutcome) -> BatchResults:
        self.stats.hit_blocks += outcome.hit_blocks
        self.stats.queried_blocks += outcome.queried_blocks
        self.stats.engine_seconds += outcome.engine_seconds
        self.stats.padded_tokens += outcome.padded_tokens
        self.stats.rect_tokens += outcome.rect_tokens
        self.stats.reused_tokens += outcome.reused_tokens
        res = outcome.results
        if isinstance(res, BatchResults):
            if np.array_equal(res.item_ids, sub.item_ids):
                return res
            res = res.items()
        by_id = {r.item_id: r for r in res}
        return BatchResults.of([by_id.get(int(i)) or ItemResult(int(i), ENGINE_ERROR,
                                                                 error="the engine returned no result for it")
                                for i in sub.item_ids])


class _Pick:
    """tokens[rows[i]] as a sequence, without touching the tokens."""

    def __init__(self, tokens, rows):
        self.tokens, self.rows = tokens, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.tokens[int(r)] for r in self.rows[i]]
        return self.tokens[int(self.rows[i])]


def _empty(ids, status, errors) -> BatchResults:
    return BatchResults(ids, status.copy(), np.zeros(0, np.uint32), np.zeros(ids.size + 1, np.int64), dict(errors))


def _merge(out: BatchResults, rows: np.ndarray, sub: BatchResults) -> BatchResults:
    """out with rows `rows` replaced by sub's results."""
    n = len(out)
    counts = np.diff(out.offsets)
    counts[rows] = np.diff(sub.offsets)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    flat = np.zeros(int(offsets[-1]), np.uint32)
    for k, r in enumerate(rows.tolist()):
        flat[offsets[r] : offsets[r + 1]] = sub.flat[sub.offsets[k] : sub.offsets[k + 1]]
    status = out.status.copy()
    status[rows] = sub.status
    errors = dict(out.errors)
    errors.update({int(rows[k]): text for k, text in sub.errors.items()})
    return BatchResults(out.item_ids, status, flat, offsets, errors)


def _engine_error(item_id, exc: Exception) -> ItemResult:
    return ItemResult(int(item_id), ENGINE_ERROR, error=f"{type(exc).__name__}: {exc}")


# -- the process -----------------------------------------------------------------------------

class SegmentViews:
    """Read-only mappings of backlog segment files, kept while batches use them."""

    MAX_OPEN = 64

    def __init__(self, root):
        self.root = root
        self.maps: dict[tuple[int, int], SegmentFile] = {}

    def tokens(self, writer: int, segment: int, offset: int, length: int) -> np.ndarray:
        key = (writer, segment)
        seg = self.maps.get(key)
        if seg is None:
            if len(self.maps) >= self.MAX_OPEN:
                old = next(iter(self.maps))
                self.maps.pop(old).close()
            seg = SegmentFile.open(self.root / writer_dir_name(writer) / f"{segment:020d}.seg")
            self.maps[key] = seg
        start = offset + RECORD_HEADER_BYTES
        return seg.buf[start : start + 4 * length].view(np.uint32)

    def close(self) -> None:
        for seg in self.maps.values():
            seg.close()
        self.maps.clear()


class BatchTokens:
    """Item i's tokens as a zero-copy view into its segment file, made when first asked for."""

    def __init__(self, views: SegmentViews, locs: np.ndarray):
        self.views, self.locs = views, locs

    def __len__(self):
        return self.locs.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        r = self.locs[i]
        return self.views.tokens(int(r["writer"]), int(r["segment"]), int(r["offset"]), int(r["length"]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))


class ResultWriter:
    """Encodes a batch's results as result records and pushes them to the results ring (in chunks
    that fit its largest record)."""

    def __init__(self, ring, stopping):
        self.ring = ring
        self.stopping = stopping
        self.max_bytes = ring.max_tokens * 4
        self.buf = np.zeros(min(self.max_bytes, 1 << 20), np.uint8)

    def write(self, res: BatchResults, seqs: np.ndarray, writers: np.ndarray) -> None:
        """Runs of plain records in one kernel call each; a failed item with an error text alone."""
        n = len(res)
        texts = sorted(k for k in res.errors if res.status[k] != CODE_OK)
        i = at = 0
        for stop in texts + [n]:
            while i < stop:
                j, at = encode_results(self.buf, at, res.item_ids, seqs, writers, res.status, res.flat, res.offsets,
                                       i, stop)
                if j == i:  # the next record does not fit what is left
                    at = self._flush(at, RES_HEADER_BYTES + 4 * int(res.offsets[i + 1] - res.offsets[i]) + 8)
                i = j
            if stop < n:
                text = res.errors[stop].encode("utf-8", "replace")[:RES_MAX_ERROR_BYTES]
                need = RES_HEADER_BYTES + len(text) + 8
                if at + need > self.buf.size:
                    at = self._flush(at, need)
                at = encode_error(self.buf, at, res.item_ids[stop], seqs[stop], res.status[stop], writers[stop],
                                  np.frombuffer(text, np.uint8))
                i = stop + 1
        self._flush(at, 0)

    def _flush(self, at: int, need: int) -> int:
        if at:
            payload = self.buf[:at].view(np.uint32)
            while True:
                try:
                    self.ring.push_wait(payload, 0, at, 0, 0, 0, SLEEP_SLICE_SECONDS * 4)
                    break
                except (Full, PeerDead):  # the results process may be restarting: its ring stays
                    self.ring.heartbeat()
                    if self.stopping() == 2:
                        raise
        if need > self.buf.size:
            if need > self.max_bytes:
                raise ValueError(f"a result of {need} bytes exceeds the results ring's largest record")
            self.buf = np.zeros(need, np.uint8)
        return 0


def gpu_main(c: int, cfg, control, batch_ring, results_ring, stopping) -> None:
    """GPU process c: run consumer c's batches through its engine and write every item's result."""
    if cfg.consumers[c].device is not None:  # pinned to its card (tiers.py) before any engine import
        import os

        os.environ.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=str(cfg.consumers[c].device))
    from pathlib import Path

    from ..spill.store import BACKLOG_DIR
    from ..stats import StatsWriter
    from .engines.base import load_engine

    consumer = cfg.consumers[c]
    role = control.roles.index(f"gpu-{consumer.name}")
    slot = control.role(role)
    stats = StatsWriter(control, role)
    engine = load_engine(consumer.engine, consumer.engine_settings, block_tokens=cfg.block_tokens,
                         contract=consumer.contract)
    core = ConsumerCore(consumer.contract, engine, tolerance=cfg.padding_tolerance)
    counting = GpuCounting(stats, core)
    ring = batch_ring.attach(CONSUMER)
    out = results_ring.attach(PRODUCER)
    views = SegmentViews(Path(cfg.data_dir) / BACKLOG_DIR)
    writer = ResultWriter(out, stopping)
    positions = np.empty(1, np.int64)
    data = ring.data_words
    idle_from = time.monotonic_ns()
    try:
        while True:
            slot[2] = time.monotonic_ns()
            n, new_tail = ring.peek_many(positions, 1)
            if n == 0:
                if stopping():
                    break
                try:
                    ring.wait_readable(SLEEP_SLICE_SECONDS, YIELD_ROUNDS)
                except PeerDead:
                    pass  # the scheduler is restarting; its ring and our batches stay
                now = time.monotonic_ns()
                if now - idle_from >= IDLE_PUBLISH_NS:  # a long idle shows as it happens, not at the next batch
                    counting.idle(now - idle_from)
                    idle_from = now
                continue
            taken_ns = time.monotonic_ns()
            pos = int(positions[0])
            n_run, n_failed = int(data[pos + 4]), int(data[pos + 5])
            packed_ns = int(data[pos + 6]) | int(data[pos + 7]) << 32
            locs = data[pos + L.RECORD_HEADER_WORDS : pos + L.RECORD_HEADER_WORDS + (n_run + n_failed) * LOC_WORDS] \
                .view(LOC_DTYPE)
            run, failed = locs[:n_run], locs[n_run:]
            res = core.process(_batch(c, run), BatchTokens(views, run)) if n_run else None
            if n_failed:
                fail = _failed_results(failed)
                res = fail if res is None else _concat(res, fail)
            writer.write(res, locs["seq"], locs["writer"])
            # counted before the release: a crash in between re-runs the batch and counts it again (the
            # engine did run it twice), but a batch is never released uncounted
            busy_ns = time.monotonic_ns() - taken_ns  # the whole batch: tokens, guard, engine, results
            counting.batch(busy_ns, taken_ns - idle_from, max(0, taken_ns - packed_ns) if packed_ns else 0)
            ring.release(new_tail, 1)
            idle_from = time.monotonic_ns()
    finally:
        views.close()
        ring.close()
        out.close()
        engine.close()


U64_MASK = (1 << 64) - 1


class GpuCounting:
    """A GPU process's statistics (`stats.GPU`): the core's counts of this incarnation on top of
    what its predecessors published, plus the process's own clocks."""

    KEYS = ("batches", "items", "ok", "too_long", "invalid", "engine_errors", "guard_violations", "hit_blocks",
            "queried_blocks", "padded_tokens", "rect_tokens", "reused_tokens", "shape_switches", "excess_shape_switches",
            "families")

    def __init__(self, stats, core: ConsumerCore):
        self.stats = stats
        self.core = core
        v = stats.values
        self.base = v.copy()
        self.at = {k: stats.index[k] for k in (*self.KEYS, "tokens", "busy_ns", "idle_ns", "batch_wait_ns",
                                                "engine_own_ns", "last_family")}
        if stats["batches"]:  # a restart continues the predecessor's run: its last family is served
            core._last_family = stats["last_family"] & U64_MASK
            core._families.add(core._last_family)

    def idle(self, idle_ns: int) -> None:
        self.stats.values[self.at["idle_ns"]] += idle_ns
        self.stats.publish()

    def batch(self, busy_ns: int, idle_ns: int, wait_ns: int) -> None:
        s, v, base, at = self.core.stats, self.stats.values, self.base, self.at
        for k in self.KEYS:
            v[at[k]] = base[at[k]] + getattr(s, k)
        v[at["tokens"]] = base[at["tokens"]] + s.input_tokens
        v[at["engine_own_ns"]] = base[at["engine_own_ns"]] + int(s.engine_seconds * 1e9)
        v[at["busy_ns"]] += busy_ns
        v[at["idle_ns"]] += idle_ns
        v[at["batch_wait_ns"]] += wait_ns
        family = self.core._last_family
        if family is not None:
            v[at["last_family"]] = family - (1 << 64) if family >= 1 << 63 else family
        self.stats.publish()


def _batch(c: int, run: np.ndarray) -> Batch:
    rows = np.zeros(run.size, BATCH_ROW)
    rows["key"] = run["item_id"]
    rows["length"] = run["length"]
    rows["max_new"] = run["max_new"]
    rows["family"] = run["family"]
    rows["model"] = run["model"]
    return Batch(c, Shape(int(run["model"][0]), int(run["family"][0]), int(rows["length"].min()),
                          int(rows["length"].max())), rows)


def _failed_results(failed: np.ndarray) -> BatchResults:
    status = failed["aux"].astype(np.uint32)
    errors = {}
    for i, (code, length) in enumerate(zip(status.tolist(), failed["length"].tolist())):
        errors[i] = (f"{length} tokens: longer than every consumer of its model takes" if code == CODE_TOO_LONG
                     else "no consumer serves its model" if length else "no tokens")
    return BatchResults(failed["item_id"].astype(np.uint64), status, np.zeros(0, np.uint32),
                        np.zeros(failed.size + 1, np.int64), errors)


def _concat(a: BatchResults, b: BatchResults) -> BatchResults:
    offsets = np.concatenate([a.offsets, a.offsets[-1] + b.offsets[1:]])
    errors = dict(a.errors)
    errors.update({len(a) + k: v for k, v in b.errors.items()})
    return BatchResults(np.concatenate([a.item_ids, b.item_ids]), np.concatenate([a.status, b.status]),
                        np.concatenate([a.flat, b.flat]), offsets, errors)
