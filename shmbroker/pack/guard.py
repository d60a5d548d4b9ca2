"""The shape guard: refuses any batch that is not shape-pure or breaks its contract.

The packer runs it on every batch it builds before committing it; the GPU
process runs it again on what it receives. A refusal is counted by reason and
nothing is dispatched (the packer's items stay in the index).

A padded engine's batch is a rectangle, so its contract bounds count x
longest; a packed engine's is an ordered group whose count bounds only the
records' overhead (docs/design.md "Feeding an engine": the contract is its
admission limit, max_batch_tokens a step's token budget, which the engine
enforces itself), so it is not checked against count x longest.

Checks, in order (the first failure is the reason):
  empty      no items
  count      count > max_batch_size
  too_long   an item longer than max_input_len
  tokens     (padded engines) count x longest > max_batch_tokens
  model      an item of another model than the contract's
  family     an item of another family than the batch's shape (a loose rectangle's
             shape, LOOSE_FAMILY, takes rows of any family, on a padded engine, each
             generating: `loose.py`)
  band       an item outside the shape's length band, or (padded engines) a
             prefill-only batch wider than the padding tolerance: longest > (1 + tol) x
             shortest (a batch that generates is shaped by its decode: sweep.py)
"""

from __future__ import annotations

from collections import Counter
from enum import IntEnum

import numpy as np

from ..jit import kernel
from .contract import LOOSE_FAMILY, Batch, Contract, Mode, Shape, as_mode


class Verdict(IntEnum):
    """The guard's verdict on a batch: OK, or the first check it fails (module docstring, in order)."""

    OK = 0
    EMPTY = 1
    COUNT = 2
    TOO_LONG = 3
    TOKENS = 4
    MODEL = 5
    FAMILY = 6
    BAND = 7

    @property
    def label(self) -> str:
        """The reason's name in the refusal counts and the metrics."""
        return self.name.lower()


# the kernels' view of the verdicts: plain int constants
OK, EMPTY, COUNT, TOO_LONG, TOKENS, MODEL, FAMILY, BAND = (int(v) for v in Verdict)


@kernel
def check_rows(rows, n, family, model, length_min, length_max, tol, max_batch_size, max_batch_tokens,
               max_input_len, rectangle):
    """The guard over rows[:n] (BATCH_ROW records): a `Verdict`, OK or the first failing check's.
    rectangle: the batch is a padded engine's (count x longest <= max_batch_tokens)."""
    if n == 0:
        return EMPTY
    if n > max_batch_size:
        return COUNT
    lo = rows[0].num_tokens
    hi = rows[0].num_tokens
    for i in range(n):
        if rows[i].num_tokens > max_input_len:
            return TOO_LONG
        lo = min(lo, rows[i].num_tokens)
        hi = max(hi, rows[i].num_tokens)
    if rectangle and n * hi > max_batch_tokens:
        return TOKENS
    for i in range(n):
        if rows[i].model != model:
            return MODEL
    loose = family == np.uint64(LOOSE_FAMILY)
    for i in range(n):
        if loose:
            if not rectangle or rows[i].max_new_tokens <= 1:
                return FAMILY
        elif rows[i].prefix_key != family:
            return FAMILY
    if lo < length_min or hi > length_max:
        return BAND
    generating = False  # a padded batch that generates is shaped by its decode (`sweep.select_padded`),
    for i in range(n):  # not by the input band: the tolerance bounds prefill-only batches
        if rows[i].max_new_tokens > 1:
            generating = True
    if hi > lo * (1.0 + tol) and not (generating and tol > 0.0):
        return BAND
    return OK


class Guard:
    """Counts refusals by reason; `check` returns None or the reason.

    tolerance: the padding tolerance of a padded engine; None for a packed one (any spread).
    mode: "padded" checks count x longest, "packed" does not; by default the tolerance says
    which (a number: padded; None: packed, which is what a packed consumer passes)."""

    def __init__(self, tolerance: float | None, mode: Mode | None = None):
        mode = None if mode is None else as_mode(mode, "guard mode")
        self.tolerance = float("inf") if tolerance is None else float(tolerance)
        self.rectangle = (tolerance is not None) if mode is None else mode == Mode.PADDED
        self.refusals: Counter = Counter()

    @property
    def num_refusals(self) -> int:
        return sum(self.refusals.values())

    def count(self, code: int) -> str | None:
        if code == OK:
            return None
        reason = Verdict(code).label
        self.refusals[reason] += 1
        return reason

    def check_batch(self, batch: Batch, contract: Contract) -> str | None:
        """Check a batch as received (each row carries its family and model)."""
        s = batch.shape
        return self.count(check_rows(batch.rows, len(batch), np.uint64(s.family), s.model, s.length_min,
                                     s.length_max, self.tolerance, contract.max_batch_size,
                                     contract.max_batch_tokens, contract.max_input_len, self.rectangle))

    def check(self, families, models, lengths, shape: Shape, contract: Contract) -> str | None:
        """Check a proposed batch given as columns."""
        return self.check_batch(Batch.of(-1, shape, np.zeros(len(lengths), np.uint64), lengths,
                                         np.ones(len(lengths), np.int64), None, families, models), contract)
