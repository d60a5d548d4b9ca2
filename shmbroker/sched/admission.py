"""What the scheduler admits into its index: items no consumer can ever take, and items of cancelled
jobs, are refused and handed back as failed rows (LOC rows whose `aux` is their status). They ride
the next batch records, so a GPU process writes their results and the results process acks them like
any other.

    admission = Admission(packer.model_max, cancelled, values)
    admitted = admission.split(announcement)  # .servable: an Announcement; .refused: failed rows

An item is refused, counted by reason in the statistics words, when
- it has no tokens: `invalid` (`rejected_empty`),
- no consumer serves its model: `invalid` (`rejected_no_consumer`),
- it is longer than every contract of its model: `too_long` (`rejected_too_long`),
- its producer's job was cancelled: `cancelled` (`cancelled`).
The work is numpy per announcement (a loop over the models it names), never per item.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..ring.items import SEQ_BITS, Status
from ..ring.wire import LOC_DTYPE, Announcement
from .pending import S_CANCELLED, S_EMPTY, S_NO_CONSUMER, S_TOO_LONG

NO_ROWS = np.zeros(0, LOC_DTYPE)  # refused when nothing is: shared, read-only
NO_ROWS.flags.writeable = False


class Admitted(NamedTuple):
    """An announcement split by admission: the items some consumer can take, and the refused rest as
    failed rows (`aux` = status; NO_ROWS when none)."""

    servable: Announcement
    refused: np.ndarray


class Admission:
    """Which items some consumer can take, given each model's longest servable item and the producer
    ids of cancelled jobs; counts each refusal into the statistics words `values`."""

    def __init__(self, model_max: dict[int, int], cancelled, values: np.ndarray):
        self.model_max = model_max  # model id -> the longest item some consumer of it takes
        self.cancelled = np.array(sorted(cancelled), np.uint64)  # producer ids, sorted
        self.values = values

    def split(self, ann: Announcement) -> Admitted:
        """`ann` as servable items and refused rows; `ann` itself (no copy) when all are servable."""
        status = self._status(ann.locs)
        if status is None:
            return Admitted(ann, NO_ROWS)
        keep = status == 0
        refused = ann.locs[~keep].copy()
        refused["aux"] = status[~keep]
        return Admitted(ann.subset(keep), refused)

    def _status(self, locs: np.ndarray) -> np.ndarray | None:
        """Each item's refusal status (0: servable), counted by reason; None when all are servable."""
        status = np.zeros(locs.size, np.uint32)
        lengths = locs["num_tokens"]
        empty = lengths == 0
        status[empty] = Status.INVALID
        models = locs["model"]
        for m in np.unique(models).tolist():
            mine = models == m
            top = self.model_max.get(int(m))
            if top is None:
                nobody = mine & ~empty
                status[nobody] = Status.INVALID
                self.values[S_NO_CONSUMER] += int(nobody.sum())
            else:
                long = mine & (lengths > top) & (status == 0)
                status[long] = Status.TOO_LONG
                self.values[S_TOO_LONG] += int(long.sum())
        if self.cancelled.size:
            gone = self.is_cancelled(locs) & (status == 0)
            status[gone] = Status.CANCELLED
            self.values[S_CANCELLED] += int(gone.sum())
        if not status.any():
            return None
        self.values[S_EMPTY] += int(empty.sum())
        return status

    def cancel(self, producer_ids) -> None:
        """Refuse every item of these producers from now on."""
        self.cancelled = np.union1d(self.cancelled, np.array(sorted(producer_ids), np.uint64))

    def is_cancelled(self, locs: np.ndarray) -> np.ndarray:
        """Per LOC row: whether its producer's job was cancelled."""
        return np.isin(locs["item_id"] >> np.uint64(SEQ_BITS), self.cancelled)

    def count_cancelled(self, num_items: int) -> None:
        """Count items answered `cancelled` outside admission (taken back from the index)."""
        self.values[S_CANCELLED] += num_items
