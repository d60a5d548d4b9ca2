"""The cancelled jobs the scheduler obeys: `<data_dir>/jobs/cancels.json`, {"names": {name: [producer ids]}}.

`shmbroker cancel` adds a job (`namefile.update`: under the jobs' lock, the file replaced whole);
the scheduler (`CancelWatch`) looks at its stat every poll and reads it when it changed, at start
too, so a cancel survives a restart. The ids are the job's producer ids from the producer book: a
name gets a new id in each broker lifetime it connects in, and the scheduler only ever sees ids in
item ids.
"""

from __future__ import annotations

import os

from .namefile import IdsWatch, update

CANCELS_FILE = "cancels.json"


def add(data_dir: str | os.PathLike, name: str, producer_ids: list[int]) -> None:
    """Add (or widen) job `name`'s cancel to the producer ids given."""

    def widen(names: dict[str, list[int]]) -> None:
        names[name] = sorted(set(names.get(name, [])) | {int(i) for i in producer_ids})

    update(data_dir, CANCELS_FILE, widen)


class CancelWatch:
    """The scheduler's view of the cancel list: `poll()` is one stat when nothing changed."""

    def __init__(self, data_dir: str | os.PathLike):
        self.watch = IdsWatch(data_dir, CANCELS_FILE)

    @property
    def producer_ids(self) -> frozenset[int]:
        return self.watch.producer_ids

    def poll(self) -> frozenset[int] | None:
        """The producer ids cancelled since the last poll (None: no change)."""
        before = self.watch.producer_ids
        ids = self.watch.poll()
        if ids is None:
            return None
        return (ids - before) or None
