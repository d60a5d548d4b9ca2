"""Which records are done: per writer, a cursor plus the out-of-order completions above it.

Consumers finish records out of order. For each writer the state is
`cursor` (every sequence number below it is done) and `ranges`, sorted,
disjoint, half-open [lo, hi) runs of done sequence numbers above the cursor.
Acks are buffered and merged in bulk (`compact`), so acking is cheap and the
state stays small: its size is the number of gaps, not of records.

File `<data_dir>/backlog/acks.bin`, written by atomic replace (temp file,
fsync, rename, fsync of the directory: `durable.atomic_write`), mode 0600:

| byte | size | field                                                     |
|------|------|-----------------------------------------------------------|
| 0    | 8    | ACKS_MAGIC                                                |
| 8    | 4    | version                                                   |
| 12   | 4    | number of writers W                                       |
| 16   | ...  | W × (writer u32, pad u32, cursor u64, n u64, n × (lo u64, hi u64)) |
| end-4| 4    | crc32c of all bytes before it                             |
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import numpy as np

from ..disk.durable import atomic_write, keep_reserve

ACKS_MAGIC = 0x314B434142484D53  # "SHMBACK1"
ACKS_VERSION = 1
ACKS_FILE = "acks.bin"
COMPACT_EVERY = 1 << 16


class AckFileCorrupt(ValueError):
    """The ack file failed its checks (recovery then treats nothing as acked: at-least-once)."""


class Acks:
    """Done sets for every writer."""

    def __init__(self) -> None:
        self.cursor: dict[int, int] = {}
        self.ranges: dict[int, np.ndarray] = {}  # (n, 2) uint64 [lo, hi)
        self._buffer: dict[int, list[np.ndarray]] = {}
        self._buffered = 0

    # -- updates -------------------------------------------------------------------

    def high(self, writer: int) -> int:
        """One past the highest sequence number of `writer` marked done (0 when none)."""
        self.compact()
        r = self.ranges.get(writer)
        top = int(r[-1, 1]) if r is not None and r.size else 0
        return max(top, self.cursor.get(writer, 0))

    def ack(self, writer: int, seqs) -> None:
        """Mark these sequence numbers of `writer` done (any order, duplicates fine). A copy is kept:
        the caller may reuse its array (the results process acks from buffers it refills)."""
        arr = np.array(seqs, dtype=np.uint64, ndmin=1)
        if arr.size == 0:
            return
        self._buffer.setdefault(writer, []).append(arr)
        self._buffered += arr.size
        if self._buffered >= COMPACT_EVERY:
            self.compact()

    def compact(self) -> None:
        """Merge buffered acks into cursor + ranges."""
        for writer, chunks in self._buffer.items():
            new = np.unique(np.concatenate(chunks))
            starts = np.concatenate([self.ranges.get(writer, np.empty((0, 2), np.uint64))[:, 0], new])
            ends = np.concatenate([self.ranges.get(writer, np.empty((0, 2), np.uint64))[:, 1], new + np.uint64(1)])
            order = np.argsort(starts, kind="stable")
            starts, ends = starts[order], ends[order]
            cursor = self.cursor.get(writer, 0)
            merged = _merge(starts, ends)
            # absorb the run that starts at the cursor
            keep = merged[:, 1] > cursor
            merged = merged[keep]
            if merged.size and int(merged[0, 0]) <= cursor:
                cursor = int(merged[0, 1])
                merged = merged[1:]
            self.cursor[writer] = cursor
            self.ranges[writer] = merged
        self._buffer.clear()
        self._buffered = 0

    def set_floor(self, writer: int, seq: int) -> None:
        """Everything below `seq` is done (records before the writer's oldest live segment)."""
        self.compact()
        if seq > self.cursor.get(writer, 0):
            self.cursor[writer] = seq
            r = self.ranges.get(writer)
            if r is not None and r.size:
                r = r[r[:, 1] > seq]
                if r.size and int(r[0, 0]) <= seq:
                    self.cursor[writer] = int(r[0, 1])
                    r = r[1:]
                self.ranges[writer] = r

    # -- queries -------------------------------------------------------------------

    def done_mask(self, writer: int, seqs: np.ndarray) -> np.ndarray:
        """Boolean array: which of `seqs` are done."""
        self.compact()
        seqs = np.asarray(seqs, dtype=np.uint64)
        done = seqs < np.uint64(self.cursor.get(writer, 0))
        r = self.ranges.get(writer)
        if r is not None and r.size:
            i = np.searchsorted(r[:, 0], seqs, side="right") - 1
            inside = (i >= 0) & (seqs < r[np.maximum(i, 0), 1])
            done |= inside
        return done

    def all_done(self, writer: int, lo: int, hi: int) -> bool:
        """Are all of lo..hi-1 done? (Ranges are merged, so the rest must lie in one range.)"""
        self.compact()
        a = max(lo, self.cursor.get(writer, 0))
        if a >= hi:
            return True
        r = self.ranges.get(writer)
        if r is None or not r.size:
            return False
        i = int(np.searchsorted(r[:, 0], np.uint64(a), side="right")) - 1
        return i >= 0 and a < int(r[i, 1]) and hi <= int(r[i, 1])

    def num_ranges(self) -> int:
        self.compact()
        return sum(int(r.shape[0]) for r in self.ranges.values())

    # -- persistence ---------------------------------------------------------------

    def to_bytes(self) -> bytes:
        self.compact()
        writers = sorted(set(self.cursor) | set(self.ranges))
        parts = [struct.pack("<QII", ACKS_MAGIC, ACKS_VERSION, len(writers))]
        for w in writers:
            r = self.ranges.get(w, np.empty((0, 2), np.uint64)).astype("<u8")
            parts.append(struct.pack("<IIQQ", w, 0, self.cursor.get(w, 0), r.shape[0]))
            parts.append(r.tobytes())
        body = b"".join(parts)
        return body + struct.pack("<I", crc32c.crc32c(body))

    @classmethod
    def from_bytes(cls, data: bytes) -> Acks:
        if len(data) < 20:
            raise AckFileCorrupt(f"ack file is {len(data)} bytes, too short")
        body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
        if crc32c.crc32c(body) != crc:
            raise AckFileCorrupt("ack file checksum mismatch")
        magic, version, count = struct.unpack_from("<QII", body, 0)
        if magic != ACKS_MAGIC or version != ACKS_VERSION:
            raise AckFileCorrupt("ack file magic/version mismatch")
        acks = cls()
        pos = 16
        for _ in range(count):
            w, _pad, cursor, n = struct.unpack_from("<IIQQ", body, pos)
            pos += 24
            r = np.frombuffer(body, dtype="<u8", count=2 * n, offset=pos).reshape(n, 2).astype(np.uint64)
            pos += 16 * n
            acks.cursor[w] = cursor
            acks.ranges[w] = r
        if pos != len(body):
            raise AckFileCorrupt("ack file has trailing bytes")
        return acks

    def save(self, directory: Path) -> None:
        """Atomic replace of `directory/acks.bin`. The directory keeps a space reserve (`disk/durable.py`)
        that a full disk's save uses up, so the checkpoint that reclaims segments is never the step a
        full disk blocks; the reserve is made again by a later save, once there is room."""
        atomic_write(Path(directory) / ACKS_FILE, self.to_bytes())
        keep_reserve(Path(directory))

    @classmethod
    def load(cls, directory: Path) -> Acks:
        """The saved state, or an empty one when there is no file (AckFileCorrupt when it fails its checks)."""
        path = Path(directory) / ACKS_FILE
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return cls()
        return cls.from_bytes(data)


def _merge(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Merge sorted-by-start half-open intervals that overlap or touch."""
    if starts.size == 0:
        return np.empty((0, 2), np.uint64)
    reach = np.maximum.accumulate(ends)
    new_run = np.empty(starts.size, bool)
    new_run[0] = True
    new_run[1:] = starts[1:] > reach[:-1]
    run_id = np.cumsum(new_run) - 1
    out = np.empty((int(run_id[-1]) + 1, 2), np.uint64)
    out[:, 0] = starts[new_run]
    last = np.r_[np.nonzero(new_run)[0][1:] - 1, starts.size - 1]
    out[:, 1] = reach[last]
    return out
