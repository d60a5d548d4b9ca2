"""The records a scheduler recovered at start and could not index yet, waiting on disk for room.

A restart finds the whole pending backlog (billions of tokens, millions of records); the packing
index holds `index_items`. The rest used to wait in the scheduler's memory, with the block hashes
of every item. Now it waits in a scratch file, `<data_dir>/sched/recovered.bin` (mode 0600, in a
0700 directory; rewritten at every start, never synced: what it holds is rebuilt from the
backlog by the next start), as PENDING_DTYPE rows in the order the scan found them (per writer,
in sequence order). `take(n)` reads the next `n` rows back and computes their locations and
block hashes then, one segment mapped at a time: the scheduler's memory is the index plus a
chunk, whatever the backlog holds. When the scratch file cannot be written (a full disk) the rows
stay in memory, as before, and `on_disk` says so.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np

from .. import durable
from .layout import PENDING_DTYPE, writer_dir_name
from .locate import recovered_locations

SCRATCH_DIR = "sched"
SCRATCH_FILE = "recovered.bin"
ROW_BYTES = PENDING_DTYPE.itemsize
WRITE_ROWS = 1 << 16


class RecoveredQueue:
    """Recovered pending records not yet indexed, read back in order, `take(n)` at a time."""

    def __init__(self, data_dir: str | os.PathLike, rows: np.ndarray):
        self.count = int(rows.size)
        self.next = 0
        self.fd = -1
        self.rows: np.ndarray | None = None  # in memory when the scratch file could not be written
        if self.count == 0:
            return
        directory = Path(data_dir) / SCRATCH_DIR
        self.path = directory / SCRATCH_FILE
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(directory, 0o700)
            self.path.unlink(missing_ok=True)
            self.fd = durable.create(self.path, os.O_RDWR | os.O_TRUNC, 0o600)
            for at in range(0, self.count, WRITE_ROWS):
                view = memoryview(rows[at : at + WRITE_ROWS].tobytes())
                while view:
                    view = view[os.write(self.fd, view) :]
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._drop_file()
            self.rows = rows.copy()

    @property
    def on_disk(self) -> bool:
        return self.fd >= 0

    def __len__(self) -> int:
        return self.count - self.next

    def take(self, n: int, backlog, block_tokens: int):
        """The next `n` (at most) rows' (records, LOC rows, hash_offsets, hashes); `backlog` maps the
        segments (its `segment()`/`forget_segment()`). Rows whose segment is gone (every record in
        it done since the scan) are dropped and returned apart: (taken, gone)."""
        n = min(n, len(self))
        if self.rows is not None:
            rows = self.rows[self.next : self.next + n]
        else:
            data = os.pread(self.fd, n * ROW_BYTES, self.next * ROW_BYTES)
            assert len(data) == n * ROW_BYTES, "the scratch file is shorter than written"
            rows = np.frombuffer(data, PENDING_DTYPE)
        self.next += n
        if len(self) == 0:
            self.close()
        gone = np.zeros(rows.size, bool)
        for w, s in {(int(w), int(s)) for w, s in zip(rows["writer"].tolist(), rows["segment"].tolist())}:
            if not (backlog.root / writer_dir_name(w) / f"{s:020d}.seg").exists():
                gone |= (rows["writer"] == w) & (rows["segment"] == s)
        live = rows[~gone]
        return (live, *recovered_locations(backlog, live, block_tokens)), rows[gone]

    def _drop_file(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass

    def close(self) -> None:
        self._drop_file()
        self.rows = None
