"""The cancelled jobs the scheduler obeys: `<data_dir>/jobs/cancels.json`, {"names": {name: [producer ids]}}.

`shmbroker cancel` adds a job under an exclusive lock (`jobs/.lock`: two cancels at once both land)
and replaces the file whole; the scheduler (`CancelWatch`) looks at its stat every poll and reads
it when it changed, at start too, so a cancel survives a restart. The ids are the job's producer
ids from the producer book: a name gets a new id in each broker lifetime it connects in, and the
scheduler only ever sees ids in item ids.
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..disk.durable import atomic_write, mkdir
from .store import jobs_root

CANCELS_FILE = "cancels.json"
LOCK_FILE = ".lock"


def _read(path: Path) -> dict[str, list[int]]:
    try:
        row = json.loads(path.read_bytes())
        return {str(k): [int(i) for i in v] for k, v in row["names"].items()}
    except FileNotFoundError:
        return {}


def add(data_dir: str | os.PathLike, name: str, producer_ids: list[int]) -> None:
    """Add (or widen) job `name`'s cancel to the producer ids given."""
    root = jobs_root(data_dir)
    mkdir(root)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = root / CANCELS_FILE
        names = _read(path)
        names[name] = sorted(set(names.get(name, [])) | {int(i) for i in producer_ids})
        atomic_write(path, json.dumps({"names": names}, sort_keys=True).encode())
    finally:
        os.close(fd)


class CancelWatch:
    """The scheduler's view of the cancel list: `poll()` is one stat when nothing changed."""

    def __init__(self, data_dir: str | os.PathLike):
        self.path = jobs_root(data_dir) / CANCELS_FILE
        self._stamp = None
        self.producer_ids: frozenset[int] = frozenset()

    def poll(self) -> frozenset[int] | None:
        """The producer ids cancelled since the last poll (None: no change)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            return None
        if stamp == self._stamp:
            return None
        try:
            ids = frozenset(i for v in _read(self.path).values() for i in v)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # replaced whole, so never torn; a hand-made bad file is not obeyed
        self._stamp = stamp
        new = ids - self.producer_ids
        self.producer_ids = ids
        return new or None
