"""The vectors of a line whose inputs are several items, held until its last one came.

An embeddings line of n inputs is n items, ordered by the broker each on its own, so its vectors
come back far apart. A result is acknowledged to the broker once it is durable where its reader put
it (`commands/common.py` ResultSink), and acknowledgements are a cursor: a line's earlier vectors
cannot wait unacknowledged for its last. So each waits in `jobs/<name>/parts.bin`, appended and
synced before the acknowledgement (`sync`); when a line's last vector comes, its others are read
back and the whole line is written. A run of the job that starts again (`--resume`, or `results`)
reads the file first, so no vector is lost or asked for twice. Memory holds only where each waiting
vector lies in the file, not the vectors.

A record (little-endian, at 8-byte aligned offsets):

| byte | size | field   | meaning                                                   |
|------|------|---------|-----------------------------------------------------------|
| 0    | 4    | magic   | `SMBP`                                                    |
| 4    | 4    | length  | the record's bytes, a multiple of 8                       |
| 8    | 4    | crc     | crc32c of bytes 12..length                                |
| 12   | 4    | part    | the input's index in its line                             |
| 16   | 4    | parts   | the line's inputs                                         |
| 20   | 4    | tokens  | the input's prompt tokens (its usage)                     |
| 24   | 4    | key     | the line's key's UTF-8 bytes k (`jobrun.key_of`)          |
| 28   | 4    | values  | the vector's float32 values m                             |
| 32   | ...  |         | the key, zero padding to 4 bytes, the m values, zero padding to 8 |

A torn or damaged record ends the file: it and what follows are cut at the next open (their
results were never acknowledged, so they come again).
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import numpy as np

FILE_NAME = "parts.bin"
MAGIC = b"SMBP"
HEAD = struct.Struct("<4sII5I")  # magic, length, crc, part, parts, tokens, key bytes, values


class LineParts:
    """Waiting vectors of a job's lines, by line key; `path` is created at the first one."""

    def __init__(self, path: str | os.PathLike, written: set[str] = frozenset()):
        self.path = Path(path)
        self._fd: int | None = None
        self._end = 0
        self._where: dict[str, dict[int, tuple[int, int]]] = {}  # key -> {part: (offset, bytes)}
        self._parts: dict[str, int] = {}  # key -> the line's inputs
        if self.path.exists():
            self._load(written)

    def add(self, key: str, part: int, parts: int, vector: np.ndarray, tokens: int):
        """Hold one input's vector; once the line holds all of them, ([its vectors, in order], its
        prompt tokens) and the line is forgotten; else None (a part held already is ignored)."""
        have = self._where.setdefault(key, {})
        self._parts[key] = parts
        if part not in have:
            have[part] = self._append(key, part, parts, vector, tokens)
        return self.take(key) if len(have) == parts else None

    def take(self, key: str):
        """([the line's vectors, in order], its prompt tokens), the line forgotten; its parts must all be held."""
        have = self._where[key]
        got = [self._read(*have[k]) for k in range(self._parts[key])]
        self.forget(key)
        return [v for v, _ in got], sum(t for _, t in got)

    def whole(self) -> list[str]:
        """The lines all of whose vectors are held: a run killed after holding a line's last vector and
        before its line was durable in the output (that result came again, or was acknowledged)."""
        return [key for key, have in self._where.items() if len(have) == self._parts[key]]

    def forget(self, key: str) -> None:
        """The line is written (or failed): its held vectors are no longer needed."""
        self._where.pop(key, None)
        self._parts.pop(key, None)

    def holds(self, key: str, part: int) -> bool:
        """Whether the vector of the line's input `part` is held (its result will not come again)."""
        return part in self._where.get(key, ())

    def waiting(self) -> int:
        """Lines with vectors held."""
        return len(self._where)

    def sync(self) -> None:
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the file; remove it when no line waits any more."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if not self._where and self.path.exists():
            self.path.unlink()

    def _append(self, key: str, part: int, parts: int, vector: np.ndarray, tokens: int) -> tuple[int, int]:
        raw = key.encode()
        values = np.ascontiguousarray(vector, "<f4")
        body = raw + b"\0" * (-len(raw) % 4) + values.tobytes()
        length = HEAD.size + len(body) + (-(HEAD.size + len(body)) % 8)
        tail = struct.pack("<5I", part, parts, tokens, len(raw), values.size) + body
        tail += b"\0" * (length - 12 - len(tail))
        record = struct.pack("<4sII", MAGIC, length, crc32c.crc32c(tail)) + tail
        if self._fd is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        os.pwrite(self._fd, record, self._end)
        at, self._end = self._end, self._end + length
        return at, length

    def _read(self, at: int, length: int) -> tuple[np.ndarray, int]:
        record = os.pread(self._fd, length, at)
        _, _, crc, _, _, tokens, k, m = HEAD.unpack_from(record)
        if crc32c.crc32c(record[12:]) != crc:
            raise OSError(f"{self.path}: a held vector at byte {at} no longer matches its checksum")
        start = HEAD.size + k + (-k % 4)
        return np.frombuffer(record, "<f4", m, start).copy(), tokens

    def _load(self, written: set[str]) -> None:
        """Index the file's sound records (of lines not written yet); cut a torn or damaged tail."""
        self._fd = os.open(self.path, os.O_RDWR, 0o600)
        size = os.fstat(self._fd).st_size
        at = 0
        while at + HEAD.size <= size:
            head = os.pread(self._fd, HEAD.size, at)
            magic, length, crc, part, parts, _, k, _ = HEAD.unpack(head)
            if magic != MAGIC or length < HEAD.size or length % 8 or at + length > size:
                break
            record = os.pread(self._fd, length, at)
            if crc32c.crc32c(record[12:]) != crc:
                break
            key = record[HEAD.size : HEAD.size + k].decode("utf-8", "replace")
            if key not in written:
                self._where.setdefault(key, {})[part] = (at, length)
                self._parts[key] = parts
            at += length
        if at < size:
            os.ftruncate(self._fd, at)
            os.fsync(self._fd)
        self._end = at
