"""What the scheduler admits: items no consumer can ever take, and items of cancelled jobs, are failed
back (they ride the next batch records as failed rows, so a GPU process writes their results and the
results process acks them like any other). A mixin of `sched.Scheduler`: it reads the scheduler's
index, slots, `front` and statistics words."""

from __future__ import annotations

import numpy as np

from ..control.stats import slot_of
from ..ring.items import SEQ_BITS, Status
from ..ring.wire import announced_subset
from .pending import S_EMPTY, S_NO_CONSUMER, S_TOO_LONG

S_CANCELLED = slot_of("sched", "cancelled")


class Admission:
    def _servable(self, locs, hash_offsets, hashes, counted: bool = False):
        """The items some consumer can take; the others go to a batch record as failed rows (and,
        `counted`: already counted pending, out of the gauges)."""
        bad = self._unservable(locs)
        if bad is None:
            return locs, hash_offsets, hashes
        status, keep = bad
        failed = locs[~keep].copy()
        failed["aux"] = status[~keep]
        self.failed.append(failed)
        if counted:
            self.pending.count_locs(failed, -1)
        return announced_subset(locs, hash_offsets, hashes, keep)

    def _unservable(self, locs):
        """(status, keep) of items no consumer can ever take, counted by reason; None when all can be."""
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
            gone = np.isin(locs["item_id"] >> np.uint64(SEQ_BITS), self.cancelled) & (status == 0)
            status[gone] = Status.CANCELLED
            self.values[S_CANCELLED] += int(gone.sum())
        keep = status == 0
        if keep.all():
            return None
        self.values[S_EMPTY] += int(empty.sum())
        return status, keep

    def cancel(self, producer_ids) -> int:
        """Answer `cancelled` for every item of these producers not yet dispatched: those in the index and
        in `front` now, those beyond it and those still to come as they arrive (`_unservable`). The
        items in batch records already pushed (or held for a full ring) run."""
        self.cancelled = np.union1d(self.cancelled, np.array(sorted(producer_ids), np.uint64))
        slots, handles = self.packer.index.live()
        handles = handles.astype(np.int64)
        gone = np.isin(self.slots["item_id"][handles] >> np.uint64(SEQ_BITS), self.cancelled)
        for slot in slots[gone].tolist():
            self.packer.index.remove(slot)
        out = [self.slots[handles[gone]]]
        self._free(handles[gone])
        for _ in range(len(self.front)):
            locs, hash_offsets, hashes, arrival_ns = self.front.popleft()
            keep = ~np.isin(locs["item_id"] >> np.uint64(SEQ_BITS), self.cancelled)
            out.append(locs[~keep])
            if keep.any():
                self.front.append((*announced_subset(locs, hash_offsets, hashes, keep), arrival_ns))
        failed = np.concatenate(out)
        failed["aux"] = Status.CANCELLED
        self.pending.count_locs(failed, -1)
        self.failed.append(failed)
        self.values[S_CANCELLED] += failed.size
        self._waited()
        return int(failed.size)
