"""A job list the scheduler obeys: `<data_dir>/jobs/<file>`, {"names": {job name: [producer ids]}}.

Writers (`cancel`, a job's submitter) change it under an exclusive lock (`jobs/.lock`: two writers
at once both land) and replace it whole (`disk/durable.py`), so a reader never sees it torn. The
scheduler (`IdsWatch`) looks at its stat every poll and reads it when it changed, at start too. The
ids are the jobs' producer ids from the producer book: the scheduler only ever sees ids in item ids.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from pathlib import Path

from ..disk.durable import atomic_write, mkdir
from .store import jobs_root

LOCK_FILE = ".lock"


def read_names(path: Path) -> dict[str, list[int]]:
    try:
        row = json.loads(path.read_bytes())
        return {str(k): [int(i) for i in v] for k, v in row["names"].items()}
    except FileNotFoundError:
        return {}


def update(data_dir: str | os.PathLike, file: str, change: Callable[[dict[str, list[int]]], None]) -> None:
    """Apply `change` to the file's names (a dict it edits in place), under the lock, and replace it."""
    root = jobs_root(data_dir)
    mkdir(root)
    fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        path = root / file
        names = read_names(path)
        change(names)
        atomic_write(path, json.dumps({"names": names}, sort_keys=True).encode())
    finally:
        os.close(fd)


class IdsWatch:
    """Every producer id in the file: `poll()` is one stat when nothing changed."""

    def __init__(self, data_dir: str | os.PathLike, file: str):
        self.path = jobs_root(data_dir) / file
        self._stamp = None
        self.producer_ids: frozenset[int] = frozenset()

    def poll(self) -> frozenset[int] | None:
        """The ids now, when the file changed since the last poll (None: no change)."""
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
        except FileNotFoundError:
            if self._stamp is None:
                return None
            self._stamp, self.producer_ids = None, frozenset()
            return self.producer_ids
        if stamp == self._stamp:
            return None
        try:
            ids = frozenset(i for v in read_names(self.path).values() for i in v)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None  # replaced whole, so never torn; a hand-made bad file is not obeyed
        self._stamp = stamp
        self.producer_ids = ids
        return ids
