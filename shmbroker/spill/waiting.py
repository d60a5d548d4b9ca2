"""The items a scheduler has no room for in its packing index, waiting on disk in arrival order.

The packing index holds `index_items`. What comes beyond it, announced by ingest while the index
is full or recovered by a start, used to wait in the scheduler's memory with the block hashes of
every item, so the scheduler grew with the backlog (and a live broker stopped taking items past
`overflow_items`). Now it waits in scratch files, `<data_dir>/sched/waiting/<first row>.bin`
(mode 0600, in 0700 directories; removed at every start, never synced: what they hold is rebuilt
from the backlog by the next start's scan), as WAIT_DTYPE rows (an item's location, its arrival
time), CHUNK_ROWS a file. `take(n)` reads the next rows back and computes their block hashes then,
one segment mapped at a time; a file read to its end is deleted. The scheduler's memory is the
index plus one chunk, whatever the backlog holds.

When a file cannot be written (a full disk) the rows wait in memory behind those on disk
(`in_memory`, which the scheduler bounds by `overflow_items`); the disk is tried again once they
have all been read.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..disk import durable
from ..ring.wire import LOC_DTYPE
from .layout import segment_name, writer_dir_name
from .locate import block_hashes
from .store import BACKLOG_DIR, Backlog

SCRATCH_DIR = "sched"
WAITING_DIR = "waiting"
WAIT_DTYPE = np.dtype(LOC_DTYPE.descr + [("arrival_ns", "<i8")])
ROW_BYTES = WAIT_DTYPE.itemsize
CHUNK_ROWS = 1 << 18  # 18 MiB files


class TakenItems(NamedTuple):
    """Waiting items taken back (`WaitingQueue.take`), in the form of an announcement
    (`ring.wire.read_announcement`): their LOC rows, item i's block hashes at
    hashes[hash_offsets[i]:hash_offsets[i + 1]], and when the first of them came."""

    locs: np.ndarray
    hash_offsets: np.ndarray
    hashes: np.ndarray
    arrival_ns: int


class WaitingQueue:
    """Items waiting for room in the index, first in first out: `append(locs, arrival_ns)`,
    `take(n, backlog, block_tokens)`."""

    def __init__(self, data_dir: str | os.PathLike, segment_bytes: int):
        self.backlog_dir = Path(data_dir) / BACKLOG_DIR
        self.segment_bytes = segment_bytes
        self.backlog: Backlog | None = None  # maps the segments of the rows read back, while any wait
        self.dir = Path(data_dir) / SCRATCH_DIR / WAITING_DIR
        shutil.rmtree(self.dir, ignore_errors=True)  # a dead scheduler's: the scan found its rows again
        self.dir.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.dir.parent, 0o700)
        self.dir.mkdir(mode=0o700, exist_ok=True)
        os.chmod(self.dir, 0o700)
        self.written = 0  # rows written to files (row k: file k // CHUNK_ROWS)
        self.next = 0  # the next row to read, of those on disk
        self.memory: list[np.ndarray] = []  # rows behind those on disk, when the disk was full
        self.in_memory = 0
        self._fd = -1  # the file being written
        self._fd_chunk = -1
        self._dropped = 0  # files below this chunk are deleted

    def __len__(self) -> int:
        return self.written - self.next + self.in_memory

    @property
    def files(self) -> int:
        return len(list(self.dir.glob("*.bin")))

    def append(self, locs: np.ndarray, arrival_ns: int) -> None:
        rows = np.empty(locs.size, WAIT_DTYPE)
        for name in LOC_DTYPE.names:
            rows[name] = locs[name]
        rows["arrival_ns"] = arrival_ns
        self.append_rows(rows)

    def append_rows(self, rows: np.ndarray) -> None:
        if self.in_memory or not self._write(rows):
            self.memory.append(rows)
            self.in_memory += rows.size

    def _write(self, rows: np.ndarray) -> bool:
        """Write rows after those on disk; False (nothing counted written) on a full disk."""
        at = 0
        while at < rows.size:
            chunk, within = divmod(self.written, CHUNK_ROWS)
            n = min(rows.size - at, CHUNK_ROWS - within)
            try:
                fd = self._file(chunk)
                data = rows[at : at + n].tobytes()
                done = 0
                while done < len(data):
                    done += os.pwrite(fd, data[done:], within * ROW_BYTES + done)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                if at:  # the rows written stay counted; the rest wait in memory
                    self.memory.append(rows[at:].copy())
                    self.in_memory += rows.size - at
                    return True
                return False
            self.written += n
            at += n
        return True

    def _file(self, chunk: int) -> int:
        if self._fd_chunk != chunk:
            self._close_fd()
            self._fd = durable.create(self._path(chunk), os.O_RDWR, 0o600)
            self._fd_chunk = chunk
        return self._fd

    def _path(self, chunk: int) -> Path:
        return self.dir / f"{chunk * CHUNK_ROWS:016d}.bin"

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd, self._fd_chunk = -1, -1

    def _read(self, n: int) -> np.ndarray:
        """The next n rows (at most), from disk first, then memory."""
        on_disk = self.written - self.next
        if on_disk:
            chunk, within = divmod(self.next, CHUNK_ROWS)
            n = min(n, on_disk, CHUNK_ROWS - within)
            data = self._pread(chunk, within, n)
            assert len(data) == n * ROW_BYTES, "a waiting file is shorter than written"
            rows = np.frombuffer(data, WAIT_DTYPE).copy()
            self.next += n
            if self.next % CHUNK_ROWS == 0 or self.next == self.written:
                self._drop_read()
            return rows
        if not self.memory:
            return np.zeros(0, WAIT_DTYPE)
        first = self.memory[0]
        rows, rest = first[:n], first[n:]
        if rest.size:
            self.memory[0] = rest
        else:
            self.memory.pop(0)
        self.in_memory -= rows.size
        return rows

    def _pread(self, chunk: int, within: int, n: int) -> bytes:
        """n rows from row `within` of file `chunk` (through the write descriptor when it is that one)."""
        if chunk == self._fd_chunk:
            return os.pread(self._fd, n * ROW_BYTES, within * ROW_BYTES)
        fd = os.open(self._path(chunk), os.O_RDONLY)
        try:
            return os.pread(fd, n * ROW_BYTES, within * ROW_BYTES)
        finally:
            os.close(fd)

    def _drop_read(self) -> None:
        """Delete the files read to their end; when all on disk is read, start again from row 0."""
        for chunk in range(self._dropped, self.next // CHUNK_ROWS):
            if chunk == self._fd_chunk:
                self._close_fd()
            self._path(chunk).unlink(missing_ok=True)
        self._dropped = self.next // CHUNK_ROWS
        if self.next == self.written:
            self._close_fd()
            for path in self.dir.glob("*.bin"):
                path.unlink(missing_ok=True)
            self.written = self.next = self._dropped = 0

    def head_arrival_ns(self) -> int | None:
        """When the oldest waiting item came (None when none waits)."""
        if self.written > self.next:
            chunk, within = divmod(self.next, CHUNK_ROWS)
            try:
                data = self._pread(chunk, within, 1)
            except OSError:
                return None
            return int(np.frombuffer(data, WAIT_DTYPE)["arrival_ns"][0])
        return int(self.memory[0]["arrival_ns"][0]) if self.memory else None

    def take(self, n: int, block_tokens: int) -> tuple[TakenItems, np.ndarray]:
        """The next `n` (at most) waiting items, their block hashes computed from the backlog's
        segments. Rows whose segment is gone (every record in it done meanwhile) are dropped and
        returned apart: (taken, gone)."""
        rows = self._read(n)
        if self.backlog is None:
            self.backlog = Backlog(self.backlog_dir, self.segment_bytes)
        backlog = self.backlog
        gone = np.zeros(rows.size, bool)
        for w, s in {(int(w), int(s)) for w, s in zip(rows["writer"].tolist(), rows["segment"].tolist())}:
            if not (backlog.root / writer_dir_name(w) / segment_name(s)).exists():
                gone |= (rows["writer"] == w) & (rows["segment"] == s)
        live = rows[~gone]
        locs = np.zeros(live.size, LOC_DTYPE)
        for name in LOC_DTYPE.names:
            locs[name] = live[name]
        hash_offsets, hashes = block_hashes(backlog, locs, block_tokens)
        if not len(self):
            self._close_backlog()
        arrival = int(live["arrival_ns"][0]) if live.size else 0
        return TakenItems(locs, hash_offsets, hashes, arrival), rows[gone]

    def _close_backlog(self) -> None:
        if self.backlog is not None:
            self.backlog.close()
            self.backlog = None

    def close(self) -> None:
        self._close_backlog()
        self._close_fd()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.memory.clear()
        self.in_memory = 0

