"""Delivery of results to producer names: exactly what each reader has acknowledged, durably.

The results process pushes each producer's results on its result ring in the order of their log
offsets (a name's results are never pushed out of log order: later ones queue behind parked
ones). A reader pops them and acknowledges a prefix of what it popped (`H_NUM_ACKED`, written
by the client after its own write). So one number per name says what it has: its **cursor**,
the log offset of its first result not acknowledged, with the ring index that result has (or
gets) on the name's result ring. `results/cursor.json` keeps every name's cursor:

    {"floor": F, "names": {"<name>": [offset, "<result ring segment>" or null, ring_index]},
     "crc32c": crc32c of the JSON of the rest (sorted keys)}

(a name read far behind has a fourth element, and its offset is in its own log: `behind.py`).
In memory an entry is a `Cursor`.

`floor` (the smallest cursor) is where a replay starts and what the log may be trimmed to. A
damaged file (not JSON, or its crc32c differs) is counted and replaced by floor 0: the whole log
is replayed, so results come again (duplicates at the client), none is lost.

- **A reader dies, another attaches** (same broker): the new reader bumps `H_SESSION` and pops
  nothing until the results process has answered with `H_SESSION_READY`. Before answering it
  empties the ring (the dead reader's side of it is free), pushes again what was pushed but
  not acknowledged, in order, and saves the cursor.
- **The results process restarts** (same rings): the replay walks the log from `floor`; for a
  name, its k-th result at or after its cursor has ring index `ring_index + k` (on the ring the
  cursor names; on any other ring, counting from 0: that ring was new when it got the cursor's
  first result). A result below the ring's `H_NUM_ACKED` was acknowledged (skipped), one below
  `H_NUM_PUSHED` is in the ring (noted as in flight), the rest is pushed.
- **The broker restarts** (new rings): each name gets its results from its cursor on; what was
  acknowledged after the last save (at most ACK_SAVE_SECONDS of acknowledgements) comes again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import crc32c
import numpy as np

from ..ring import layout as L
from ..ring.ring import Ring
from ..spill.acks import atomic_write
from .log import CURSOR_FILE, OffsetQueue


class BehindEntry(NamedTuple):
    """The fourth element of a name's cursor entry while it is read far behind (`behind.py`)."""

    dir_name: str  # its own log's directory under results/behind/
    through: int  # shared-log offset below which every result of the name is in its own log
    end: int  # bytes of its own log synced before the entry was saved

    def to_json(self) -> dict:
        return {"dir": self.dir_name, "through": self.through, "end": self.end}

    @classmethod
    def from_json(cls, doc: dict) -> BehindEntry:
        return cls(str(doc["dir"]), int(doc["through"]), int(doc["end"]))


class Cursor(NamedTuple):
    """One name's entry in cursor.json: its first result not acknowledged and that result's ring index.

    On disk a list, `[offset, ring_id, ring_index]`, with `behind.to_json()` appended for a name
    read far behind."""

    offset: int  # log offset (in the name's own log while it is read far behind)
    ring_id: str | None  # the result ring segment `ring_index` counts on; None: no ring yet
    ring_index: int
    behind: BehindEntry | None = None

    def to_json(self) -> list:
        out = [self.offset, self.ring_id, self.ring_index]
        if self.behind is not None:
            out.append(self.behind.to_json())
        return out

    @classmethod
    def from_json(cls, entry: list) -> Cursor:
        offset, ring_id, index, *rest = entry
        behind = None
        if rest:
            (doc,) = rest
            behind = BehindEntry.from_json(doc)
        return cls(int(offset), ring_id if isinstance(ring_id, str) else None, int(index), behind)


class IndexedOffsets:
    """Log offsets of the results pushed on one ring and not acknowledged, by ring index."""

    def __init__(self, base: int = 0):
        self.base = base  # ring index of the first offset held
        self._queue = OffsetQueue()

    def __len__(self) -> int:
        return len(self._queue)

    @property
    def end(self) -> int:
        """The ring index the next push gets."""
        return self.base + len(self._queue)

    def append(self, offsets: np.ndarray) -> None:
        self._queue.extend(offsets)

    def drop_below(self, index: int) -> None:
        """Forget the offsets whose ring index is below `index` (acknowledged)."""
        if index > self.base:
            count = min(index - self.base, len(self._queue))
            self._queue.drop(count)
            self.base += count

    def first(self) -> int | None:
        return self._queue.first() if self._queue else None

    def peek_all(self) -> np.ndarray:
        parts = self._queue.peek_all()
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def take_all(self) -> np.ndarray:
        self.base += len(self._queue)
        parts = self._queue.take_all()
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class Outlet:
    """One producer name's result ring: what is on it, unacknowledged, and what waits for room."""

    def __init__(self, name: str, slot, ring: Ring):
        self.name = name
        self.slot = slot
        self.ring = ring
        self.ring_id = ring.segment.name
        h = ring.header
        self.inflight = IndexedOffsets(int(h[L.H_NUM_PUSHED]))
        self.waiting = OffsetQueue()  # results parked because the ring was full (or it just connected)

    def pushed(self, offsets: np.ndarray) -> None:
        self.inflight.append(offsets)

    def track_from(self, index: int) -> None:
        """Forget what was noted as on the ring: the next offset pushed (or noted) has ring index `index`."""
        self.inflight = IndexedOffsets(index)

    def relocate(self, unacked: np.ndarray, waiting: list[np.ndarray]) -> None:
        """The name's results moved to another log: the same results, in the same order and at
        the same ring indexes, now at offsets `unacked` (pushed, not acknowledged) and `waiting`."""
        inflight = IndexedOffsets(self.inflight.base)
        inflight.append(unacked)
        self.inflight = inflight
        self.waiting.replace(waiting)

    def acked(self) -> int:
        return int(self.ring.header[L.H_NUM_ACKED])

    def session_pending(self) -> bool:
        h = self.ring.header
        return int(h[L.H_SESSION]) != int(h[L.H_SESSION_READY])

    def unacked_offsets(self) -> np.ndarray:
        """The offsets pushed and not acknowledged, in ring order (a copy; nothing changes)."""
        self.inflight.drop_below(self.acked())
        return self.inflight.peek_all()

    def reset_for_reader(self) -> np.ndarray:
        """A new reader announced itself: empty the ring (its reader side is ours until we answer)
        and queue the offsets pushed but not acknowledged to be pushed again, first."""
        h = self.ring.header
        self.inflight.drop_below(int(h[L.H_NUM_ACKED]))
        again = self.inflight.take_all()
        h[L.H_TAIL] = h[L.H_HEAD]
        h[L.H_TAIL_CACHE] = h[L.H_HEAD]
        h[L.H_NUM_POPPED] = h[L.H_NUM_PUSHED]
        h[L.H_NUM_ACKED] = h[L.H_NUM_PUSHED]
        self.inflight = IndexedOffsets(int(h[L.H_NUM_PUSHED]))
        if again.size:
            rest = self.waiting.take_all()
            self.waiting.extend(again)
            for part in rest:
                self.waiting.extend(part)
        return again

    def answer_reader(self) -> None:
        h = self.ring.header
        h[L.H_SESSION_READY] = h[L.H_SESSION]

    def cursor(self, log_end: int) -> Cursor:
        """This name's entry in cursor.json: its first unacknowledged offset and that result's ring
        index (`log_end`, the end of the log its offsets are in, when nothing is owed)."""
        self.inflight.drop_below(self.acked())
        at = self.inflight.first()
        if at is not None:
            return Cursor(at, self.ring_id, self.inflight.base)
        at = self.waiting.first() if self.waiting else log_end
        return Cursor(at, self.ring_id, self.inflight.end)

    def reader_cursor(self, again: np.ndarray, log_end: int) -> Cursor:
        """The entry as it will be once `reset_for_reader` has run (`again`: the offsets it will
        push again): the first of them, or of what waits, at the ring's next index."""
        if again.size:
            at = int(again[0])
        else:
            at = self.waiting.first() if self.waiting else log_end
        return Cursor(at, self.ring_id, self.ring.num_pushed())


class Cursors:
    """Every name's cursor (cursor.json): loaded at start, saved at checkpoints."""

    def __init__(self, root: Path):
        self.path = root / CURSOR_FILE
        self.floor = 0
        self.names: dict[str, Cursor] = {}
        try:
            doc = json.loads(self.path.read_bytes())
            body = {k: v for k, v in doc.items() if k != "crc32c"}
            if "crc32c" in doc and doc["crc32c"] != crc32c.crc32c(json.dumps(body, sort_keys=True).encode()):
                raise ValueError("crc32c mismatch")
            self.floor = int(doc["floor"])
            for name, entry in doc.get("names", {}).items():
                self.names[str(name)] = Cursor.from_json(entry)
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, AttributeError):
            self.damaged = True
            self.floor = 0
            self.names = {}
        self.saved = dict(self.names)

    damaged = False

    def of(self, name: str) -> Cursor:
        return self.names.get(name, Cursor(self.floor, None, 0))

    def save(self, names: dict[str, Cursor], floor: int) -> bool:
        """Write the cursors when they changed; True when written."""
        if names == self.saved and floor == self.floor:
            return False
        body = {"floor": floor, "names": {name: cursor.to_json() for name, cursor in names.items()}}
        atomic_write(self.path, json.dumps({**body, "crc32c": crc32c.crc32c(json.dumps(body, sort_keys=True).encode())})
                     .encode())
        self.saved = dict(names)
        self.names = dict(names)
        self.floor = floor
        return True


class ReplayPlan:
    """During a replay: what to do with each result of a name at or after its cursor."""

    SKIP, INFLIGHT, PUSH = 0, 1, 2

    def __init__(self, cursor: Cursor, outlet: Outlet | None, fresh_reader: bool = False):
        """`fresh_reader`: the ring waits for a new reader's set-up (it will be emptied): what is
        on it counts as not pushed."""
        self.start = cursor.offset
        self.outlet = outlet
        self.next_index = 0
        self.acked = self.pushed = 0
        if outlet is not None:
            self.next_index = cursor.ring_index if cursor.ring_id == outlet.ring_id else 0
            h = outlet.ring.header
            self.acked = int(h[L.H_NUM_ACKED])
            self.pushed = self.acked if fresh_reader else int(h[L.H_NUM_PUSHED])
            outlet.track_from(self.acked if self.pushed > self.acked else int(h[L.H_NUM_PUSHED]))

    def actions(self, offsets: np.ndarray) -> np.ndarray:
        """One action per offset (in log order, this name's only)."""
        act = np.full(offsets.size, self.PUSH, np.int8)
        act[offsets < self.start] = self.SKIP
        mine = np.flatnonzero(offsets >= self.start)
        if self.outlet is None or mine.size == 0:
            return act
        index = self.next_index + np.arange(mine.size, dtype=np.int64)
        self.next_index += mine.size
        act[mine[index < self.pushed]] = self.INFLIGHT
        act[mine[index < self.acked]] = self.SKIP
        return act
