"""A batch engine (a `padded` one: transformers) behind the streaming interface (`base.py`).

`BatchStream` runs each added batch whole on a worker thread, in order, while the GPU process takes
and prepares the next; `poll` hands back the outcomes of the batches finished meanwhile. A batch
that raises runs item by item (`run_isolated`), judged by `deaths.py`: a bad item fails alone, a
dead engine fails none.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from ..request.options import Task
from .base import ENGINE_ERROR, BatchResults, EngineBatch, EngineDead, EngineDown, EngineOutcome, ItemResult, merge_outcomes
from .deaths import PROBE_ITEM_ID, PROBE_TOKENS, Streak


class BatchStream:
    """A batch engine (one that defines `run(batch)`) behind the streaming interface: each added
    batch runs whole on a worker thread, in order, while the caller prepares the next; `poll`
    hands back the outcomes of the batches finished meanwhile. A batch that raises runs item by
    item, judged by a `Streak` (`run_isolated`); one raising EngineDown is handed back whole. Once
    the engine is dead the batch it ran and those after it get no result: `add`, and `poll` once
    the finished ones are out, raise the EngineDead, and `gone()` (any thread) says why."""

    def __init__(self, engine):
        self.engine = engine
        self.mode = engine.mode
        self.engine_name = getattr(engine, "engine_name", type(engine).__name__)
        self.honours = getattr(engine, "honours", frozenset())
        self.task = getattr(engine, "task", Task.GENERATE)
        self.streak = Streak(self.engine_name, getattr(engine, "fatal_types", ()))
        self.probe = EngineBatch(np.array([PROBE_ITEM_ID], np.uint64), [PROBE_TOKENS], np.ones(1, np.int64))
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._pending = 0
        self._thread: threading.Thread | None = None
        self._dead: EngineDead | None = None

    def add(self, batch: EngineBatch) -> None:
        if self._dead is not None:
            raise self._dead
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="engine", daemon=True)
            self._thread.start()
        self._pending += len(batch)
        self._todo.put(batch)

    def pending(self) -> int:
        return self._pending

    def gone(self) -> str | None:
        """Why the engine is dead, or None while it runs (cheap; any thread)."""
        return None if self._dead is None else str(self._dead)

    def poll(self, timeout_seconds: float) -> EngineOutcome:
        outs = []
        try:
            wait = self._pending and timeout_seconds > 0 and self._dead is None
            outs.append(self._done.get(timeout=timeout_seconds) if wait else self._done.get_nowait())
            while True:
                outs.append(self._done.get_nowait())
        except queue.Empty:
            pass
        outs = [o for o in outs if o is not None]
        if not outs:
            if self._dead is not None:
                raise self._dead
            return EngineOutcome([])
        out = merge_outcomes(outs)
        self._pending -= len(out.results) + (0 if out.down is None else out.down.item_ids.size)
        return out

    def run(self, batch: EngineBatch) -> EngineOutcome:
        return run_isolated(self.engine, batch, self.streak, self.probe)

    def _work(self) -> None:
        while True:
            batch = self._todo.get()
            if batch is None:
                return
            try:
                self._done.put(answered(batch, run_isolated(self.engine, batch, self.streak, self.probe)))
            except EngineDown as exc:
                self._done.put(EngineOutcome([], down=EngineDown(str(exc), batch.item_ids)))
            except EngineDead as exc:
                self._dead = exc
                self._done.put(None)  # wakes a poll waiting for this batch
                return

    def close(self) -> None:
        if self._thread is not None:
            self._todo.put(None)
            self._thread.join(timeout=60)
        self.engine.close()


def run_isolated(engine, batch: EngineBatch, streak, probe: EngineBatch) -> EngineOutcome:
    """engine.run(batch), judged by `streak` (engines/deaths.py): the batch raising is one failure
    (EngineDead at once when it means death); then each item alone, a success ending the streak, a
    failure charged to its item once the engine answers `probe`. A dead engine fails no item."""
    try:
        out = engine.run(batch)
    except (EngineDown, EngineDead):
        raise
    except Exception as exc:  # noqa: BLE001 - judged: death, or run item by item below
        if len(batch) == 1:
            return EngineOutcome([streak.charge(batch.item_ids[0], exc, lambda: engine.run(probe))])
        streak.failed(exc)
    else:
        streak.answered()
        return out
    parts = []
    for k in range(len(batch)):
        try:
            parts.append(engine.run(batch.rows([k])))
        except (EngineDown, EngineDead):
            raise
        except Exception as exc:  # noqa: BLE001 - its item's failure once the engine answers the probe
            parts.append(EngineOutcome([streak.charge(batch.item_ids[k], exc, lambda: engine.run(probe))]))
        else:
            streak.answered()
    return merge_outcomes(parts)


def answered(batch: EngineBatch, outcome: EngineOutcome) -> EngineOutcome:
    """The outcome with exactly one result per item of the batch, in its order: an item the engine
    gave no result for is an engine_error, a result for an item it was not given is dropped."""
    res = outcome.results
    if isinstance(res, BatchResults) and np.array_equal(res.item_ids, batch.item_ids):
        return outcome
    rs = res.items() if isinstance(res, BatchResults) else res
    by_id = {r.item_id: r for r in rs}
    outcome.results = [by_id.get(int(i)) or ItemResult(int(i), ENGINE_ERROR, error="the engine returned no result for it")
                       for i in batch.item_ids]
    return outcome
