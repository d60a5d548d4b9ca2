"""The items a scheduler has no room for in its packing index, waiting on disk.

The packing index holds `index_items`. What comes beyond it, announced by ingest while the index
is full or recovered by a start, waits in scratch files, `<data_dir>/sched/waiting/<first row>.bin`
(mode 0600, in 0700 directories; removed at every start, never synced: what they hold is rebuilt
from the backlog by the next start's scan), as WAIT_DTYPE rows (an item's location, its arrival
time), up to CHUNK_ROWS a file. Rows are numbered in arrival order and read back by number, in
whatever order the scheduler's waiting groups (`pack/groups.py`) let them into the index: a file is
mapped read-only and rows are gathered from it, their block hashes computed then, one backlog
segment mapped at a time. A file is deleted once every row in it was taken (`forget_below`).
The scheduler's memory is the index and the groups, whatever the tokens.

When a file cannot be written (a full disk) the rows wait in memory (`in_memory`, which the
scheduler bounds by `overflow_items`); the disk is tried again once none of them waits.
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


class _Piece:
    """Rows [start, end): a file's (mapped read-only, `path` set) or, on a full disk, memory's."""

    __slots__ = ("end", "path", "rows", "start")

    def __init__(self, start: int, rows: np.ndarray, path: Path | None, end: int):
        self.start, self.rows, self.path, self.end = start, rows, path, end


class WaitingQueue:
    """Rows of items waiting for room in the index: `append(locs, arrival_ns)` numbers them from
    `tail` on; `take(rows, block_tokens)` reads them back by number."""

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
        self.tail = 0  # the next row's number
        self.pieces: list[_Piece] = []  # by start
        self.in_memory = 0  # rows waiting in memory pieces
        self._fd = -1  # the last file's, while it has room

    @property
    def files(self) -> int:
        return len(list(self.dir.glob("*.bin")))

    def append(self, locs: np.ndarray, arrival_ns: int) -> int:
        """Rows for these items; the first one's number."""
        rows = np.empty(locs.size, WAIT_DTYPE)
        for name in LOC_DTYPE.names:
            rows[name] = locs[name]
        rows["arrival_ns"] = arrival_ns
        first = self.tail
        at = 0 if self.in_memory else self._write(rows)
        if at < rows.size:
            self._close_fd()
            self.pieces.append(_Piece(self.tail, rows[at:].copy(), None, self.tail + rows.size - at))
            self.in_memory += rows.size - at
            self.tail += rows.size - at
        return first

    def _write(self, rows: np.ndarray) -> int:
        """Write rows to files from the tail on; how many were written (fewer on a full disk)."""
        at = 0
        while at < rows.size:
            last = self.pieces[-1] if self.pieces else None
            if last is None or self._fd < 0 or last.end - last.start >= CHUNK_ROWS:
                try:
                    last = self._new_file()
                except OSError as exc:
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    return at
            n = min(rows.size - at, CHUNK_ROWS - (last.end - last.start))
            data = rows[at : at + n].tobytes()
            try:
                done = 0
                while done < len(data):
                    done += os.pwrite(self._fd, data[done:], (last.end - last.start) * ROW_BYTES + done)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self._close_fd()
                return at
            last.end += n
            self.tail += n
            at += n
        return at

    def _new_file(self) -> _Piece:
        """A file for rows from the tail on, sized for CHUNK_ROWS (sparse) and mapped."""
        self._close_fd()
        path = self.dir / f"{self.tail:016d}.bin"
        fd = durable.create(path, os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, CHUNK_ROWS * ROW_BYTES)
            rows = np.memmap(path, WAIT_DTYPE, mode="r", shape=(CHUNK_ROWS,))
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        self._fd = fd
        piece = _Piece(self.tail, rows, path, self.tail)
        self.pieces.append(piece)
        return piece

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def gather(self, rows: np.ndarray) -> np.ndarray:
        """The WAIT_DTYPE rows of these numbers (each below `tail`, in a piece not forgotten)."""
        out = np.empty(rows.size, WAIT_DTYPE)
        starts = [p.start for p in self.pieces]
        which = np.searchsorted(np.array(starts, np.int64), rows, side="right") - 1
        for k in np.unique(which).tolist():
            piece = self.pieces[k]
            sel = which == k
            at = rows[sel] - piece.start
            assert at.size == 0 or int(at.max()) < piece.end - piece.start, "a row past its piece"
            out[sel] = piece.rows[at]
        return out

    def taken(self, rows: np.ndarray) -> None:
        """Count these rows out of the memory pieces they wait in."""
        if not self.in_memory:
            return
        starts = np.array([p.start for p in self.pieces], np.int64)
        which = np.searchsorted(starts, rows, side="right") - 1
        for k, n in zip(*np.unique(which, return_counts=True)):
            piece = self.pieces[int(k)]
            if piece.path is None:
                self.in_memory -= int(n)

    def forget_below(self, head: int) -> None:
        """Drop the pieces whose every row is below `head` (all taken): files deleted, memory freed."""
        while self.pieces and self.pieces[0].end <= head:
            piece = self.pieces.pop(0)
            if not self.pieces:  # the file being written: the next row starts another
                self._close_fd()
            if piece.path is not None:
                piece.rows = None
                piece.path.unlink(missing_ok=True)

    def head_arrival_ns(self, head: int) -> int | None:
        """When row `head` came (None when it is not a waiting row)."""
        if head >= self.tail or not self.pieces or head < self.pieces[0].start:
            return None
        return int(self.gather(np.array([head], np.int64))["arrival_ns"][0])

    def hashes_of(self, locs: np.ndarray, block_tokens: int):
        """(hash_offsets, hashes) of backlog items at these LOC rows (`locate.block_hashes`)."""
        if self.backlog is None:
            self.backlog = Backlog(self.backlog_dir, self.segment_bytes)
        return block_hashes(self.backlog, locs, block_tokens)

    def take(self, rows: np.ndarray, block_tokens: int) -> tuple[TakenItems, np.ndarray]:
        """The waiting items of these row numbers, their block hashes computed from the backlog's
        segments. Rows whose segment is gone (every record in it done meanwhile) are dropped and
        returned apart: (taken, gone)."""
        got = self.gather(rows)
        self.taken(rows)
        if self.backlog is None:
            self.backlog = Backlog(self.backlog_dir, self.segment_bytes)
        root = self.backlog.root
        gone = np.zeros(got.size, bool)
        for w, s in {(int(w), int(s)) for w, s in zip(got["writer"].tolist(), got["segment"].tolist())}:
            if not (root / writer_dir_name(w) / segment_name(s)).exists():
                gone |= (got["writer"] == w) & (got["segment"] == s)
        live = got[~gone]
        locs = np.zeros(live.size, LOC_DTYPE)
        for name in LOC_DTYPE.names:
            locs[name] = live[name]
        hash_offsets, hashes = self.hashes_of(locs, block_tokens)
        arrival = int(live["arrival_ns"].min()) if live.size else 0
        return TakenItems(locs, hash_offsets, hashes, arrival), got[gone]

    def idle(self) -> None:
        """Nothing waits: unmap the backlog's segments."""
        if self.backlog is not None:
            self.backlog.close()
            self.backlog = None

    def close(self) -> None:
        self.idle()
        self._close_fd()
        for piece in self.pieces:
            piece.rows = None
        self.pieces.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.in_memory = 0
