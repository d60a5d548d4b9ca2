"""The GPU process's core: what it does around its engine, item by item, with no ring in sight.

`ConsumerCore` (docs/design.md "Feeding an engine"):

1. `take(batch, tokens)`: the shape guard again (a batch that is not shape-pure or breaks the
   contract is counted, `guard_violations`, and still served: its results are right either way),
   the per-batch accounting (families, switches, tokens), and the items the contract cannot take
   failed back here, never searched for by the scheduler: `too_long` (with the lengths in the
   error) and `invalid` (no tokens); then each other item's backlog record is checked (its crc32c,
   and that it is the record its location names: `segments.SegmentViews.check`) and one that fails
   is `corrupt`, never run on damaged tokens; an item whose request options are not readable or
   not honoured by the engine is `invalid`, naming them (`requests.py`);
2. `add(ids, tokens, max_new)`: the rest to the streaming engine, with their options; a group it refuses at admission
   is added item by item, so only the item that causes it fails (`engine_error` with the message);
3. `poll(timeout_seconds)`: the results of the items the engine finished, each once, counted; what
   an engine that is down hands back (or one whose poll raises held) waits in `returned` for the
   caller to add again (`take_returned`; engines/base.py "Failures");
4. `process(batch, tokens)`: all three for one batch at a time (benchmarks, tests).

Results come back in columns (`BatchResults`), so a batch costs a handful of array operations,
not a Python object per item.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from ..engines.base import (
    RUN_DEADLINE_SECONDS,
    BatchResults,
    EngineBatch,
    EngineDead,
    EngineDown,
    ItemResult,
    engine_error,
)
from ..engines.batch_stream import BatchStream
from ..pack.contract import Batch, Contract, Mode
from ..pack.guard import Guard
from ..request.options import Task
from ..ring.items import Status
from ..spill.records import CHECK_CRC, CHECK_GONE, CHECK_OK
from .requests import RequestReader
from .segments import BatchTokens

NUM_CODES = len(Status)
MAX_FAMILIES_TRACKED = 1 << 16  # families a consumer remembers for its excess-switch count
CORRUPT_REASONS = {
    CHECK_CRC: "its backlog record fails its crc32c check: the prompt was damaged on disk",
    CHECK_GONE: "its backlog segment file is gone or its header is damaged",
}
CORRUPT_FRAME = "the backlog holds no intact record of this item at its location (length, magic or ids differ)"
# a record that failed its crc32c where recovery read it, sent by the scheduler as a failed row
RECOVERED_CORRUPT = ("its backlog record failed its crc32c check when the broker recovered it: the prompt was damaged "
                     "on disk")


@dataclass
class ConsumerStats:
    batches: int = 0
    items: int = 0
    ok: int = 0
    too_long: int = 0
    invalid: int = 0
    engine_errors: int = 0
    corrupt: int = 0  # items whose backlog record failed its check (never run)
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
    # switches back to a family already served: switches - (families - 1) (docs/design.md "Words"),
    # counted as they happen so that a restarted process can continue the count
    excess_shape_switches: int = 0


class ConsumerCore:
    """What a GPU process does with each batch record, around a streaming engine (`engines/base.py`):

    - `take(batch, tokens)`: the guard and the per-batch accounting, the contract's failures
      (`too_long`, `invalid`) and damaged records (`corrupt`) as results at once, the rest handed to
      the engine (`add`);
    - `poll(timeout_seconds)`: the results of the items the engine finished, checked and counted;
    - `process(batch, tokens)`: both, one batch at a time, results in the batch's order.

    An engine without add/poll (a batch engine with only `run`) is put behind `BatchStream`."""

    def __init__(self, contract: Contract, engine, *, tolerance: float | None = None, payloads=None):
        self.contract = contract
        if not callable(getattr(engine, "add", None)):
            engine = BatchStream(engine)
        self.engine = engine
        self.guard = Guard(tolerance if engine.mode == Mode.PADDED else None)
        # the request options this engine honours (its registry entry's; none for an engine made
        # without the registry): an item asking for another fails alone (`requests.py`)
        self.requests = RequestReader(getattr(engine, "engine_name", type(engine).__name__),
                                      frozenset(getattr(engine, "honours", ())), contract.max_batch_size, payloads,
                                      getattr(engine, "task", Task.GENERATE))
        self.stats = ConsumerStats()
        self._last_family: int | None = None
        # the families served, for excess switches: the last MAX_FAMILIES_TRACKED of them (a card that
        # serves more distinct families than that counts a return to a forgotten one as a new family)
        self._families: OrderedDict[int, None] = OrderedDict()
        self.in_flight = np.zeros(0, np.uint64)  # item ids added to the engine and not answered yet
        # handed back by an engine that is down (base.py "Failures"), for the caller to add again
        # later (`take_returned`), and why: EngineDown, or what a failing poll raised
        self.returned = np.zeros(0, np.uint64)
        self.failure: Exception | None = None

    @property
    def last_family(self) -> int | None:
        """The prefix family of the last batch taken (None: none yet)."""
        return self._last_family

    def resume_family(self, family: int) -> None:
        """Go on from a predecessor's run (a restarted process): `family`, its last batch's, was served."""
        self._last_family = family
        self._families[family] = None

    def take(self, batch: Batch, tokens) -> tuple[BatchResults | None, np.ndarray]:
        """Account for one batch record and fail what the contract cannot take and what its backlog
        record does not hold intact (tokens viewed in the segments, `BatchTokens`: each record is
        checked here, before any engine reads it); (those results or None, the rows of the batch that
        may run, ascending). The caller adds those rows (`add`), all at once or in parts."""
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
                self._families[family] = None
                stats.families += 1
                if len(self._families) > MAX_FAMILIES_TRACKED:
                    self._families.popitem(last=False)
            else:
                self._families.move_to_end(family)
            stats.input_tokens += int(batch.lengths.sum())
        lengths = batch.lengths
        limit = self.contract.max_input_len
        bad = (lengths == 0) | (lengths > limit)
        checks = None
        refused: dict = {}  # row -> why its request options cannot run here (requests.Refusal)
        if isinstance(tokens, BatchTokens):
            fits = np.flatnonzero(~bad)
            checks = np.full(n, CHECK_OK, np.int64)
            checks[fits] = tokens.check(fits)
            bad |= checks != CHECK_OK
            fine = np.flatnonzero(~bad)
            column, refused = tokens.options(self.requests, fine)
            refused = {**refused, **self.requests.wrong_task(column, fine)}
            bad[list(refused)] = True
        if not bad.any():
            return None, np.arange(n)
        rows = np.flatnonzero(bad)
        status = np.where(lengths[rows] == 0, Status.INVALID, Status.TOO_LONG).astype(np.uint32)
        errors = {k: ("no tokens" if lengths[r] == 0 else f"{int(lengths[r])} tokens > max_input_len {limit}")
                  for k, r in enumerate(rows.tolist())}
        if checks is not None:
            for k, r in enumerate(rows.tolist()):
                if checks[r] != CHECK_OK:
                    status[k] = Status.CORRUPT
                    errors[k] = CORRUPT_REASONS.get(int(checks[r]), CORRUPT_FRAME)
                elif r in refused:
                    status[k], errors[k] = refused[r]
        failed = _empty(batch.handles[rows].astype(np.uint64), status, errors)
        self.count(failed)
        return failed, np.flatnonzero(~bad)

    def add(self, ids: np.ndarray, tokens, max_new: np.ndarray) -> BatchResults | None:
        """Hand items to the engine; those it refuses at admission come back as results (a group it
        refuses is added item by item, so only the item that causes it fails)."""
        ids = np.asarray(ids, np.uint64)
        if not ids.size:
            return None
        options = tokens.options(self.requests)[0] if isinstance(tokens, BatchTokens) else None
        batch = EngineBatch(ids, tokens, np.asarray(max_new, np.int64), options=options)
        try:
            self.engine.add(batch)
            self.in_flight = np.concatenate([self.in_flight, ids])
            return None
        except EngineDown as exc:  # not the items' fault: handed back
            self._hand_back(ids, exc)
            return None
        except EngineDead:
            raise
        except Exception as exc:  # noqa: BLE001 - isolate the item(s) that fail, below
            if ids.size == 1:
                return self.count(BatchResults.of([engine_error(ids[0], exc)]))
        refused = []
        for k in range(ids.size):
            try:
                self.engine.add(batch.rows([k]))
                self.in_flight = np.concatenate([self.in_flight, ids[k : k + 1]])
            except EngineDown as exc:
                self._hand_back(ids[k:], exc)
                break
            except EngineDead:
                raise
            except Exception as exc:  # noqa: BLE001 - an engine error fails its item, not the process
                refused.append(engine_error(ids[k], exc))
        return self.count(BatchResults.of(refused)) if refused else None

    def poll(self, timeout_seconds: float) -> BatchResults | None:
        """Results of the items the engine finished (each once; a result for an item not in flight is
        dropped). What the engine hands back as down, or held when its poll raised, goes to `returned`
        (not failed); EngineDead is raised on."""
        if not self.in_flight.size:
            return None
        try:
            outcome = self.engine.poll(timeout_seconds)
        except EngineDead:
            raise
        except Exception as exc:  # noqa: BLE001 - the engine broke: what it held is handed back, not failed
            self._hand_back(self.in_flight, exc)
            self.in_flight = np.zeros(0, np.uint64)
            return None
        if outcome.down is not None and outcome.down.item_ids.size:
            back = outcome.down.item_ids[np.isin(outcome.down.item_ids, self.in_flight)]
            self.in_flight = self.in_flight[~np.isin(self.in_flight, back)]
            self._hand_back(back, outcome.down)
        s = self.stats
        s.hit_blocks += outcome.hit_blocks
        s.queried_blocks += outcome.queried_blocks
        s.engine_seconds += outcome.engine_seconds
        s.padded_tokens += outcome.padded_tokens
        s.rect_tokens += outcome.rect_tokens
        s.reused_tokens += outcome.reused_tokens
        res = outcome.results
        if not isinstance(res, BatchResults):
            res = BatchResults.of(res)
        if not len(res):
            return None
        ids = res.item_ids.astype(np.uint64)
        n = ids.size
        if n <= self.in_flight.size and np.array_equal(self.in_flight[:n], ids):  # the oldest, in order
            self.in_flight = self.in_flight[n:]
            return self.count(res)
        mine = np.isin(ids, self.in_flight)
        _, first = np.unique(ids, return_index=True)
        if first.size < ids.size:  # an item answered twice: the first answer counts
            once = np.zeros(ids.size, bool)
            once[first] = True
            mine &= once
        if not mine.all():
            if not mine.any():
                return None
            res = rows_of(res, np.flatnonzero(mine))
            ids = res.item_ids
        self.in_flight = self.in_flight[~np.isin(self.in_flight, ids)]
        return self.count(res)

    def _hand_back(self, ids: np.ndarray, why: Exception) -> None:
        self.returned = np.concatenate([self.returned, np.asarray(ids, np.uint64)])
        self.failure = why

    def take_returned(self) -> tuple[np.ndarray, Exception | None]:
        """The items the engine handed back since the last call (base.py "Failures") and why."""
        ids, why = self.returned, self.failure
        self.returned, self.failure = np.zeros(0, np.uint64), None
        return ids, why

    def process(self, batch: Batch, tokens) -> BatchResults:
        """One batch at a time: results in the batch's order, one per item."""
        n = len(batch)
        failed, runnable = self.take(batch, tokens)
        parts = [p for p in (failed,) if p is not None]
        if runnable.size:
            sub = _Pick(tokens, runnable) if runnable.size < n else tokens
            refused = self.add(batch.handles[runnable], sub, batch.max_new_tokens[runnable])
            if refused is not None:
                parts.append(refused)
            want = batch.handles[runnable].astype(np.uint64)
            deadline = time.monotonic() + RUN_DEADLINE_SECONDS
            while np.isin(want, self.in_flight).any() and time.monotonic() < deadline:
                got = self.poll(0.05)
                if got is not None:
                    parts.append(got)
        return _in_order(batch.handles.astype(np.uint64), parts)

    def count(self, res: BatchResults) -> BatchResults:
        """Count results in the statistics by status; the results."""
        counts = np.bincount(res.status, minlength=NUM_CODES)
        s = self.stats
        s.ok += int(counts[Status.OK])
        s.too_long += int(counts[Status.TOO_LONG])
        s.invalid += int(counts[Status.INVALID])
        s.engine_errors += int(counts[Status.ENGINE_ERROR])
        s.corrupt += int(counts[Status.CORRUPT])
        return res


def _in_order(ids: np.ndarray, parts: list) -> BatchResults:
    """The results of `parts` in the order of `ids`, one per id (a missing one: engine_error)."""
    by_id = {}
    for p in parts:
        for r in p.items():
            by_id[r.item_id] = r
    return BatchResults.of([by_id.get(int(i)) or ItemResult(int(i), Status.ENGINE_ERROR.label, error="the engine returned no result")
                            for i in ids])


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


# -- the process -----------------------------------------------------------------------------

def rows_of(res: BatchResults, ks: np.ndarray) -> BatchResults:
    """Rows ks of res, as columns."""
    ks = np.asarray(ks, np.int64)
    counts = np.diff(res.offsets)[ks]
    offsets = np.zeros(ks.size + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    take = np.repeat(res.offsets[ks] - offsets[:-1], counts) + np.arange(int(offsets[-1]), dtype=np.int64)
    errors = {j: res.errors[k] for j, k in enumerate(ks.tolist()) if k in res.errors} if res.errors else {}
    extras = {j: res.extras[k] for j, k in enumerate(ks.tolist()) if k in res.extras} if res.extras else {}
    return BatchResults(res.item_ids[ks], res.status[ks], res.flat[take], offsets, errors, extras)
