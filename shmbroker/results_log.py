"""The results log on disk, and the queues of log offsets waiting for delivery.

`<data_dir>/results/<start:020d>.log`: append-only result records (`ring/wire.py`), in files of
up to LOG_FILE_BYTES named by the log offset of their first byte (mode 0600, in a 0700
directory). Written by the results process alone, one `write` per GPU batch; synced per the
broker's fsync policy; a torn tail (a crash mid-write) is cut when the log is replayed; files
wholly below the delivery cursor (`cursor.json`) are deleted.
"""

from __future__ import annotations

import os
from collections import deque
from pathlib import Path

import numpy as np

from . import durable

RESULTS_DIR = "results"
CURSOR_FILE = "cursor.json"
LOG_FILE_BYTES = 64 << 20


class ResultsLog:
    """Append-only result records across files named by their first byte's log offset."""

    def __init__(self, directory: Path, fsync: str = "interval"):
        self.dir = directory
        durable.mkdir(self.dir, 0o700)  # its name durable too
        os.chmod(self.dir, 0o700)
        self.fsync = fsync
        self.files = sorted(int(p.stem) for p in self.dir.glob("*.log") if p.stem.isdigit())
        if not self.files:
            self.files = [0]
            self._create(0)
        self.start = self.files[-1]
        self.fd = os.open(self.path(self.start), os.O_RDWR | os.O_APPEND)
        self.end = self.start + os.fstat(self.fd).st_size
        # what a killed predecessor wrote may be in the page cache only: the first sync syncs it
        self.dirty = True

    def path(self, start: int) -> Path:
        return self.dir / f"{start:020d}.log"

    def _create(self, start: int) -> None:
        fd = durable.create(self.path(start), os.O_RDWR | os.O_EXCL, 0o600)
        os.close(fd)
        durable.fsync_dir(self.dir)

    def append(self, data) -> int:
        """Write `data` (a uint8 array of whole records); returns the log offset of its first byte.
        A failed write (a full disk) raises OSError and leaves no part of `data` behind."""
        if self.end - self.start >= LOG_FILE_BYTES:
            self._create(self.end)  # first: when this fails, the current file stays in use
            self.sync()
            os.close(self.fd)
            self.files.append(self.end)
            self.start = self.end
            self.fd = os.open(self.path(self.start), os.O_RDWR | os.O_APPEND)
        at = self.end
        view = memoryview(data).cast("B")
        try:
            while view:
                view = view[durable.write(self.fd, view) :]
        except OSError:
            durable.ftruncate(self.fd, at - self.start)  # a torn record here would end every later replay
            raise
        self.end += len(data)
        self.dirty = True
        if self.fsync == "always":
            self.sync()
        return at

    def sync(self) -> None:
        if self.dirty and self.fsync != "never":
            durable.fdatasync(self.fd)
        self.dirty = False

    def read(self, at: int, size: int) -> np.ndarray:
        """Bytes [at, at + size) of the log (within one file)."""
        k = max(i for i, s in enumerate(self.files) if s <= at)
        start = self.files[k]
        fd = os.open(self.path(start), os.O_RDONLY)
        try:
            return np.frombuffer(os.pread(fd, size, at - start), np.uint8)
        finally:
            os.close(fd)

    def file_end(self, start: int) -> int:
        if start == self.start:
            return self.end
        return start + os.stat(self.path(start)).st_size

    def cut(self, at: int) -> int:
        """Cut a torn tail at log offset `at` (in the newest file); returns the bytes dropped."""
        dropped = self.end - at
        durable.ftruncate(self.fd, at - self.start)
        self.end = at
        return dropped

    def trim(self, floor: int) -> int:
        """Delete files wholly below `floor`; returns how many."""
        removed = 0
        while len(self.files) > 1 and self.files[1] <= floor:
            durable.unlink(self.path(self.files.pop(0)), missing_ok=True)
            removed += 1
        return removed

    def close(self) -> None:
        if self.fd >= 0:
            self.sync()
            os.close(self.fd)
            self.fd = -1


class OffsetQueue:
    """Log offsets waiting for delivery, in increasing order, held as arrays (8 bytes a result)."""

    def __init__(self):
        self._parts: deque = deque()
        self._head = 0  # position in the first part

    def extend(self, offsets: np.ndarray) -> None:
        if offsets.size:
            self._parts.append(np.asarray(offsets, np.int64))

    def __bool__(self) -> bool:
        return bool(self._parts)

    def __len__(self) -> int:
        return sum(p.size for p in self._parts) - self._head

    def first(self) -> int:
        return int(self._parts[0][self._head])

    def pop(self) -> None:
        self._head += 1
        if self._head == self._parts[0].size:
            self._parts.popleft()
            self._head = 0

    def take_all(self) -> list:
        parts = list(self._parts)
        if parts:
            parts[0] = parts[0][self._head :]
        self._parts.clear()
        self._head = 0
        return parts
