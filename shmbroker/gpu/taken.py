"""A batch record in a GPU process's window (`window.py`): its rows and how far they went
(`Taken`), and what its rows become: the engine's `Batch` of the runnable ones, the results of the
ones the scheduler failed.
"""

from __future__ import annotations

import numpy as np

from ..engines.base import BatchResults
from ..pack.contract import BATCH_ROW, LOOSE_FAMILY, Batch, Shape
from ..ring.items import Status
from .core import RECOVERED_CORRUPT


class Taken:
    """A batch record in the window: its item locations, how many rows the engine was given, how
    many still wait for a result. Released (in ring order) when that count is 0."""

    __slots__ = ("serial", "locs", "run", "next_row", "open", "in_engine", "start", "budget_ns", "counted", "tokens")

    def __init__(self, serial: int, locs: np.ndarray, run: np.ndarray, start: int = 0, tokens=None):
        self.serial = serial  # the how-manyth record this window took
        self.locs = locs  # every row of the record (runnable, then failed by the scheduler)
        self.run = run  # the rows the engine may run, in the scheduler's order
        self.next_row = 0  # run[:next_row] were added to the engine
        self.open = locs.size  # rows without a result yet
        self.in_engine = 0  # rows added to the engine and not answered yet
        self.start = start  # its ring position (deliveries.py)
        self.budget_ns: int | None = None  # its deadline after the last progress (module docstring), once asked
        self.counted = False  # a padded engine: it holds one of the PADDED_BATCHES_IN places
        self.tokens = tokens  # its rows to run (locs[:n_run]) as `segments.BatchTokens`, options decoded once


def rows_within(units: np.ndarray, room: int, idle: bool) -> int:
    """How many of these rows (each `units` sequences: its samples) fit in `room` sequences; at least
    one when the engine is idle (an item holds at most max_batch_size samples: more fails alone)."""
    count = int(np.searchsorted(np.cumsum(units), room, side="right"))
    return max(count, 1) if idle and units.size else count


def engine_batch(c: int, run: np.ndarray) -> Batch:
    """The rows the engine may run of a record, as consumer c's Batch: its shape is its rows' model,
    family (LOOSE_FAMILY when they are of several: a padded engine's loose rectangle) and lengths."""
    rows = np.zeros(run.size, BATCH_ROW)
    rows["handle"] = run["item_id"]
    rows["num_tokens"] = run["num_tokens"]
    rows["max_new_tokens"] = run["max_new_tokens"]
    rows["prefix_key"] = run["prefix_key"]
    rows["model"] = run["model"]
    keys = run["prefix_key"]
    family = int(keys[0]) if (keys == keys[0]).all() else LOOSE_FAMILY
    return Batch(c, Shape(int(run["model"][0]), family, int(rows["num_tokens"].min()), int(rows["num_tokens"].max())),
                 rows)


def failed_results(failed: np.ndarray) -> BatchResults:
    """The results of the rows the scheduler failed (`aux`: their status), with their errors in words."""
    status = failed["aux"].astype(np.uint32)
    errors = {}
    for i, (code, length) in enumerate(zip(status.tolist(), failed["num_tokens"].tolist())):
        errors[i] = (f"{length} tokens: longer than every consumer of its model takes" if code == Status.TOO_LONG
                     else RECOVERED_CORRUPT if code == Status.CORRUPT
                     else "its job was cancelled before it was dispatched" if code == Status.CANCELLED
                     else "no consumer serves its model" if length else "no tokens")
    return BatchResults(failed["item_id"].astype(np.uint64), status, np.zeros(0, np.uint32),
                        np.zeros(failed.size + 1, np.int64), errors)
