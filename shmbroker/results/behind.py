"""Producer names read far behind: their results kept in a log of their own, not in the shared one.

One name that never reads would keep every result after its cursor in the shared results log
(the log is trimmed only below the smallest cursor), and so the whole log, and at last the disk.
When a name's cursor falls more than `results_name_bytes` behind the shared log's end, the
results process copies the results it owes that name into the name's own log,

    <data_dir>/results/behind/<crc32c of the name, 8 hex digits>-<n>/<start:020d>.log

(a `ResultsLog`: the same records, files and preallocation), and from then on copies each new
result of that name there as it routes it. The name's offsets (on its ring, waiting, parked) are
offsets in its own log; the shared log is trimmed past it. Once its reader has acknowledged
everything, the name goes back to the shared log and its own is deleted. Its results wait on
disk as the backlog's items do: a name far behind costs disk, never the other names' space.

The name's entry in `cursor.json` carries a fourth element, `{"dir": d, "through": T, "end": E}`:
its results in the shared log below offset T are all in its own log, whose first E bytes were
synced before the entry was saved. A replay cuts the name's log to E, replays it from the name's
cursor, then copies the name's results from T on again: the same records in the same order as
before the crash, so ring indexes (`delivery.py`) still hold. A directory not named by an entry
(a crash before the entry was saved, or after it was dropped) is deleted at start.

`NameLog` is one name's own log; `FarBehind` holds them all and decides, at each checkpoint,
which name moves to its own log and which comes back (`rebalance`).
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import crc32c
import numpy as np

from .delivery import BehindEntry, Cursor, Cursors
from .log import ResultsLog
from .recipients import Recipients
from .slots import C_DISK_FULL, C_MOVED

BEHIND_DIR = "behind"
COPY_CHUNK_BYTES = 4 << 20


def record_sizes(data: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """The byte size (the first little-endian uint32 of a result record) of each record at `rows`."""
    rows = np.asarray(rows, np.int64)
    b = [data[rows + i].astype(np.int64) for i in range(4)]
    return b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)


class NameLog:
    """One name's own results log while it is read far behind."""

    def __init__(self, root: Path, name: str, fsync: str, file_bytes: int, entry: BehindEntry | None = None):
        """`entry`: what the name's saved `cursor.json` entry says of its log (an existing log, cut to
        what was synced); None: a new log (a fresh directory)."""
        self.name = name
        base = root / BEHIND_DIR
        if entry is None:
            stem = f"{crc32c.crc32c(name.encode()):08x}"
            n = 0
            while (base / f"{stem}-{n}").exists():
                n += 1
            self.dir_name = f"{stem}-{n}"
        else:
            self.dir_name = entry.dir_name
        # blocks allocated per append only: there may be many such logs, most of them small
        self.log = ResultsLog(base / self.dir_name, fsync, file_bytes, ahead_bytes=0)
        self.through = 0  # shared-log offset below which every result of the name is in this log
        if entry is not None:
            self.through = entry.through
            self.log.truncate_to(entry.end)

    def details(self, through: int) -> BehindEntry:
        """This log's part of the name's cursor entry, as of the shared log's offset `through`."""
        return BehindEntry(self.dir_name, through, self.log.end)

    def append(self, data: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Copy the records at `rows` of `data` (in order) to the end of this log; their offsets here."""
        sizes = record_sizes(data, rows)
        if rows.size == 1:
            chunk = data[int(rows[0]) : int(rows[0]) + int(sizes[0])]
        else:
            chunk = np.concatenate([data[r : r + s] for r, s in zip(rows.tolist(), sizes.tolist())])
        at = self.log.append(chunk)
        out = np.empty(rows.size, np.int64)
        out[0] = at
        np.cumsum(sizes[:-1], out=out[1:])
        out[1:] += at
        return out

    def copy_from(self, shared: ResultsLog, offsets: np.ndarray) -> np.ndarray:
        """Copy the records at `offsets` of the shared log (in order) here; their offsets here."""
        out = np.empty(offsets.size, np.int64)
        done = 0
        for k, start in enumerate(shared.files):
            end = shared.files[k + 1] if k + 1 < len(shared.files) else shared.end
            mine = np.flatnonzero((offsets >= start) & (offsets < end))
            if mine.size == 0:
                continue
            assert mine[0] == done, "offsets out of log order"
            size = shared.file_end(start) - start
            with open(shared.path(start), "rb") as f:
                mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            # unmapped when the last view goes (not closed here: a raised error's traceback holds them)
            self._copy_file(np.frombuffer(mm, np.uint8), offsets[mine] - start, out[done : done + mine.size])
            del mm
            done += mine.size
        assert done == offsets.size, "an offset outside the shared log"
        return out

    def _copy_file(self, data: np.ndarray, rows: np.ndarray, out: np.ndarray) -> None:
        sizes = record_sizes(data, rows)
        ends = np.cumsum(sizes)
        lo = 0
        while lo < rows.size:  # in chunks: memory stays COPY_CHUNK_BYTES, not the name's backlog
            hi = max(int(np.searchsorted(ends, ends[lo] - sizes[lo] + COPY_CHUNK_BYTES, "right")), lo + 1)
            out[lo:hi] = self.append(data, rows[lo:hi])
            lo = hi

    def remove(self) -> None:
        self.log.close()
        shutil.rmtree(self.log.dir, ignore_errors=True)


def names_behind(results_dir: Path, cursors: Cursors) -> list[dict]:
    """[{"name", "bytes"}] of the names read far behind per `cursors`, with the bytes their own
    logs hold (for `status`)."""
    out = []
    for name, cursor in sorted(cursors.names.items()):
        if cursor.behind is not None:
            d = results_dir / BEHIND_DIR / cursor.behind.dir_name
            size = sum(p.stat().st_size for p in d.glob("*.log")) if d.is_dir() else 0
            out.append({"name": name, "bytes": size})
    return out


class BehindNow(NamedTuple):
    """The gauges of the names read far behind."""

    num_names: int
    num_bytes: int  # their own logs hold


class FarBehind:
    """The names read far behind: each one's `NameLog`, the move to it and back.

    `shared` is the shared results log; `counters` the results role's statistics (`slots.py`).
    A name's offsets, wherever they wait (`Recipients`), are in the log `log_of(name)` gives."""

    def __init__(self, root: Path, shared: ResultsLog, name_bytes: int, counters: np.ndarray,
                 saved: dict[str, Cursor]):
        """`saved`: the cursor entries loaded at start; a name's own log is opened (cut to what its
        entry says was synced) where its entry has one, and every other name log is deleted."""
        self.root = root
        self.shared = shared
        self.fsync = shared.fsync
        self.name_bytes = name_bytes
        self.counters = counters
        self._logs: dict[str, NameLog] = {}
        for name, cursor in saved.items():
            if cursor.behind is not None:
                self._logs[name] = NameLog(root, name, self.fsync, shared.file_bytes, cursor.behind)
        remove_strays(root, {nl.dir_name for nl in self._logs.values()})
        self._dropped: list[NameLog] = []  # back on the shared log: their logs go once the cursors say so

    def __contains__(self, name: str | None) -> bool:
        return name in self._logs

    def __len__(self) -> int:
        return len(self._logs)

    def get(self, name: str | None) -> NameLog | None:
        """The name's own log while it is read far behind, else None."""
        return self._logs.get(name)

    def logs(self) -> dict[str, ResultsLog]:
        """Each name's own log, by name."""
        return {name: behind.log for name, behind in self._logs.items()}

    def details(self, shared_end: int) -> list[tuple[str, BehindEntry]]:
        """Each name's part of its cursor entry (`shared_end`: the shared log's end now)."""
        return [(name, behind.details(shared_end)) for name, behind in self._logs.items()]

    def log_of(self, name: str) -> ResultsLog:
        """The log a name's offsets are in: its own while it is read far behind, else the shared one."""
        behind = self._logs.get(name)
        return self.shared if behind is None else behind.log

    def behind_now(self) -> BehindNow:
        return BehindNow(len(self._logs), sum(b.log.size_bytes() for b in self._logs.values()))

    def rebalance(self, cursors: dict[str, Cursor], recipients: Recipients) -> None:
        """Move a name whose cursor (of `cursors`, every name's as of now) is more than
        `name_bytes` behind the shared log's end to a log of its own; bring a name far behind whose
        reader has caught up back (its log is deleted once the cursors saved no longer name it)."""
        end = self.shared.end
        for name, cursor in cursors.items():
            behind = self._logs.get(name)
            if behind is not None:
                if cursor.offset >= behind.log.end and not recipients.is_held(name):  # it owes the name nothing
                    del self._logs[name]
                    self._dropped.append(behind)
            elif end - cursor.offset > self.name_bytes:
                try:
                    self._move(name, recipients)
                except OSError as exc:  # a full disk: the name stays where it was; tried again next time
                    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    self.counters[C_DISK_FULL] += 1
                    return

    def _move(self, name: str, recipients: Recipients) -> None:
        """Copy what the name is owed to its own log, then switch its offsets there; all or nothing (a
        full disk midway leaves the name as it was, its copy deleted, and raises)."""
        behind = NameLog(self.root, name, self.fsync, self.shared.file_bytes)
        outlet = recipients.outlet_named(name)
        queue = recipients.parked.get(name)
        try:
            unacked = behind.copy_from(self.shared, outlet.unacked_offsets()) if outlet is not None else None
            waiting = [behind.copy_from(self.shared, part) for part in outlet.waiting.peek_all()] if outlet else []
            parked = [behind.copy_from(self.shared, part) for part in queue.peek_all()] if queue is not None else []
        except BaseException:
            behind.remove()
            raise
        if outlet is not None:
            outlet.relocate(unacked, waiting)
        if queue is not None:
            queue.replace(parked)
        behind.through = self.shared.end
        self._logs[name] = behind
        self.counters[C_MOVED] += 1

    def sync(self) -> None:
        for behind in self._logs.values():
            behind.log.sync()

    def saved(self, cursors: dict[str, Cursor]) -> None:
        """The cursor file now holds `cursors`: each name's own log holds everything of it the shared
        log has, and is trimmed below its cursor."""
        for name, behind in self._logs.items():
            behind.through = self.shared.end
            behind.log.trim(cursors[name].offset)

    def remove_dropped(self) -> None:
        """Delete the logs of the names back on the shared log (no saved entry names them any more)."""
        for behind in self._dropped:
            behind.remove()
        self._dropped.clear()

    def close(self) -> None:
        for behind in self._logs.values():
            behind.log.close()


def remove_strays(root: Path, keep: set[str]) -> int:
    """Delete the name logs no `cursor.json` entry names; returns how many."""
    base = root / BEHIND_DIR
    if not base.is_dir():
        return 0
    removed = 0
    for d in base.iterdir():
        if d.name not in keep:
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else os.unlink(d)
            removed += 1
    return removed
