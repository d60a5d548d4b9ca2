"""The results log on disk, and the queues of log offsets waiting for delivery.

`<data_dir>/results/<start:020d>.log`: append-only result records (`ring/wire.py`), in files of
about `file_bytes` (LOG_FILE_BYTES at most) named by the log offset of their first byte (mode
0600, in a 0700 directory). Written by the results process alone, one `write` per GPU batch;
synced per the broker's fsync policy; a torn tail (a crash mid-write) is cut when the log is
replayed; files wholly below the delivery cursor (`cursor.json`) are deleted. A name read far
behind has a log of its own of the same kind (`behind.py`).

Blocks are allocated ahead of the writes, PREALLOCATE_BYTES at a time (`fallocate` with
FALLOC_FL_KEEP_SIZE: the size, and so every byte a reader or a replay sees, stays what was
written): a full disk refuses the allocation before any byte of an append is written (the results
process retries after reclaiming), never a write halfway through a record.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections import deque
from pathlib import Path

import numpy as np

from ..config.broker import BrokerConfig
from ..disk import durable

RESULTS_DIR = "results"
CURSOR_FILE = "cursor.json"
LOG_FILE_BYTES = 64 << 20
FILE_BYTES_MIN = 1 << 20
PREALLOCATE_BYTES = 4 << 20
WRITEBACK_BYTES = 4 << 20  # appended bytes after which their writeback is started (`durable.start_writeback`)
FALLOC_FL_KEEP_SIZE = 1
_libc = ctypes.CDLL(None, use_errno=True)


def file_bytes_for(name_bytes: int) -> int:
    """The size of the shared log's files for a per-name bound of `name_bytes`: a quarter of it
    (trimming goes by whole files, so the log stays within the bound plus a quarter), in
    [FILE_BYTES_MIN, LOG_FILE_BYTES]."""
    return max(FILE_BYTES_MIN, min(LOG_FILE_BYTES, name_bytes // 4))


def preallocate(fd: int, size: int) -> bool:
    """Allocate `size` bytes of blocks for the file at `fd` without changing its size; False where
    the filesystem cannot (the file then grows as written). A full disk raises OSError(ENOSPC).
    It changes no byte a reader can see, so the power-loss model (disk/durable.py) need not record it."""
    if _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE, ctypes.c_long(0), ctypes.c_long(size)) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
        return False
    raise OSError(err, os.strerror(err))


class ResultsLog:
    """Append-only result records across files named by their first byte's log offset."""

    def __init__(self, directory: Path, fsync: str = BrokerConfig.fsync, file_bytes: int = LOG_FILE_BYTES,
                 ahead_bytes: int = PREALLOCATE_BYTES):
        """`ahead_bytes`: how far ahead of the writes blocks are allocated (0: each append's own)."""
        self.dir = directory
        self.file_bytes = file_bytes
        self.ahead_bytes = ahead_bytes
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
        self.allocated = self.end  # log offset up to which the current file's blocks are allocated
        self.written_back = self.end  # log offset up to which the disk was told to start writing
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
        if self.end - self.start >= self.file_bytes:
            self._create(self.end)  # first: when this fails, the current file stays in use
            self.sync()
            os.close(self.fd)
            self.files.append(self.end)
            self.start = self.end
            self.fd = os.open(self.path(self.start), os.O_RDWR | os.O_APPEND)
            self.allocated = self.end
        at = self.end
        if at + len(data) > self.allocated:  # a full disk refuses here, before any byte is written
            want = max(len(data), min(self.ahead_bytes, self.file_bytes))
            if preallocate(self.fd, at - self.start + want):
                self.allocated = at + want
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
        elif self.end - (kick := max(self.written_back, self.start)) >= WRITEBACK_BYTES and self.fsync != "never":
            # the disk starts on what the next checkpoint's sync would wait for: that sync, which holds
            # up routing, finds little left (vectors make results as large as prompts)
            durable.start_writeback(self.fd, kick - self.start, self.end - kick)
            self.written_back = self.end
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
        durable.ftruncate(self.fd, at - self.start)  # (frees the blocks allocated past it too)
        self.end = self.allocated = at
        self.written_back = min(self.written_back, at)
        return dropped

    def truncate_to(self, at: int) -> int:
        """Drop everything from log offset `at` on (whole newer files, then the newest's tail);
        returns the bytes dropped."""
        dropped = 0
        while len(self.files) > 1 and self.files[-1] >= at:
            dropped += self.end - self.start
            os.close(self.fd)
            durable.unlink(self.path(self.files.pop()), missing_ok=True)
            self.start = self.files[-1]
            self.fd = os.open(self.path(self.start), os.O_RDWR | os.O_APPEND)
            self.end = self.allocated = self.start + os.fstat(self.fd).st_size
        if self.end > at:
            dropped += self.cut(max(at, self.start))
        return dropped

    def size_bytes(self) -> int:
        """Bytes the log's files hold now."""
        return self.end - self.files[0]

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


OFFSET_CHUNK = 4096  # offsets a chunk of an OffsetQueue holds (32 KiB)


class OffsetQueue:
    """Log offsets waiting for delivery, in order, packed 8 bytes a result into chunks of
    OFFSET_CHUNK (a result ring pushes a few at a time: one small array each would cost about
    100 bytes a result, and a reader far behind holds millions). Chunks start small and double:
    a name with one result waiting holds 128 bytes."""

    def __init__(self):
        self._chunks: deque = deque()  # int64 arrays; the last is filled up to _fill
        self._head = 0  # position in the first chunk
        self._fill = 0
        self._size = 0

    def extend(self, offsets: np.ndarray) -> None:
        offsets = np.asarray(offsets, np.int64).reshape(-1)
        done, n = 0, offsets.size
        while done < n:
            if not self._chunks or self._fill == self._chunks[-1].size:
                grow = min(OFFSET_CHUNK, 2 * self._chunks[-1].size) if self._chunks else 16
                self._chunks.append(np.empty(max(grow, n - done), np.int64))
                self._fill = 0
            last = self._chunks[-1]
            k = min(n - done, last.size - self._fill)
            last[self._fill : self._fill + k] = offsets[done : done + k]
            self._fill += k
            done += k
        self._size += n

    def __bool__(self) -> bool:
        return self._size > 0

    def __len__(self) -> int:
        return self._size

    def first(self) -> int:
        return int(self._chunks[0][self._head])

    def pop(self) -> None:
        self.drop(1)

    def drop(self, count: int) -> None:
        """Forget the first `count` offsets (at most all of them)."""
        count = min(count, self._size)
        self._size -= count
        if self._size == 0:
            self.clear()
            return
        while count:
            end = self._fill if len(self._chunks) == 1 else self._chunks[0].size
            k = min(count, end - self._head)
            self._head += k
            count -= k
            if self._head == end:
                self._chunks.popleft()
                self._head = 0

    def clear(self) -> None:
        self._chunks.clear()
        self._head = self._fill = self._size = 0

    def peek_all(self) -> list:
        """The offsets, as arrays in order (views; nothing changes)."""
        if not self._size:
            return []
        parts = list(self._chunks)
        parts[-1] = parts[-1][: self._fill]
        parts[0] = parts[0][self._head :]
        return parts

    def take_all(self) -> list:
        parts = self.peek_all()
        self.clear()
        return parts

    def replace(self, parts: list) -> None:
        """Hold the offsets of `parts` (arrays, in order) instead of those held now."""
        self.clear()
        for part in parts:
            self.extend(part)
