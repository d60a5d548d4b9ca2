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

import crc32c
import numpy as np

from ..ring import layout as L
from ..ring.ring import Ring
from ..spill.acks import atomic_write
from .log import CURSOR_FILE, OffsetQueue


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

    def cursor(self, log_end: int) -> list:
        """[first unacknowledged offset, ring, its ring index]: this name's entry in cursor.json."""
        self.inflight.drop_below(self.acked())
        at = self.inflight.first()
        if at is not None:
            return [at, self.ring_id, self.inflight.base]
        at = self.waiting.first() if self.waiting else log_end
        return [at, self.ring_id, self.inflight.end]


class Cursors:
    """Every name's cursor (cursor.json): loaded at start, saved at checkpoints."""

    def __init__(self, root: Path):
        self.path = root / CURSOR_FILE
        self.floor = 0
        self.names: dict[str, list] = {}
        try:
            doc = json.loads(self.path.read_bytes())
            body = {k: v for k, v in doc.items() if k != "crc32c"}
            if "crc32c" in doc and doc["crc32c"] != crc32c.crc32c(json.dumps(body, sort_keys=True).encode()):
                raise ValueError("crc32c mismatch")
            self.floor = int(doc["floor"])
            for name, entry in doc.get("names", {}).items():
                offset, ring_id, index, *rest = entry
                e = [int(offset), ring_id if isinstance(ring_id, str) else None, int(index)]
                if rest:
                    (b,) = rest
                    e.append({"dir": str(b["dir"]), "through": int(b["through"]), "end": int(b["end"])})
                self.names[str(name)] = e
        except FileNotFoundError:
            pass
        except (ValueError, KeyError, TypeError, AttributeError):
            self.damaged = True
            self.floor = 0
            self.names = {}
        self.saved = dict(self.names)

    damaged = False

    def of(self, name: str) -> list:
        return self.names.get(name, [self.floor, None, 0])

    def save(self, names: dict[str, list], floor: int) -> bool:
        """Write the cursors when they changed; True when written."""
        if names == self.saved and floor == self.floor:
            return False
        body = {"floor": floor, "names": names}
        atomic_write(self.path, json.dumps({**body, "crc32c": crc32c.crc32c(json.dumps(body, sort_keys=True).encode())})
                     .encode())
        self.saved = dict(names)
        self.names = dict(names)
        self.floor = floor
        return True


class ReplayPlan:
    """During a replay: what to do with each result of a name at or after its cursor."""

    SKIP, INFLIGHT, PUSH = 0, 1, 2

    def __init__(self, entry: list, outlet: Outlet | None, fresh_reader: bool = False):
        """`fresh_reader`: the ring waits for a new reader's set-up (it will be emptied): what is
        on it counts as not pushed."""
        self.start, ring_id, index = entry[:3]
        self.outlet = outlet
        self.next_index = 0
        self.acked = self.pushed = 0
        if outlet is not None:
            self.next_index = index if ring_id == outlet.ring_id else 0
            h = outlet.ring.header
            self.acked = int(h[L.H_NUM_ACKED])
            self.pushed = self.acked if fresh_reader else int(h[L.H_NUM_PUSHED])
            outlet.inflight = IndexedOffsets(self.acked if self.pushed > self.acked else int(h[L.H_NUM_PUSHED]))

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
