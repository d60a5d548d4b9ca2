"""One segment file: create (preallocated, 0600), map, header, seal with its header index.

Creation allocates every block up front (`posix_fallocate`): a full disk is a
clear `DiskFull` here, never a SIGBUS on a later write through the mapping.
Sealing writes the `.idx` file (every record's offset and header, checksummed;
`layout.py`) by atomic replace, so recovery reads sealed segments without
touching their payload pages.
"""

from __future__ import annotations

import errno
import mmap
import os
import secrets
import struct
import time
from pathlib import Path

import crc32c
import numpy as np

from ..disk import durable
from ..errors import DiskFull
from .acks import atomic_write
from .layout import (
    IDX_ENTRY_BYTES,
    IDX_HEADER_BYTES,
    IDX_MAGIC,
    LAYOUT_VERSION,
    RECORD_HEADER_BYTES,
    SEGMENT_HEADER_BYTES,
    SEGMENT_MAGIC,
    idx_name,
    segment_name,
)
from .records import copy_headers

FILE_MODE = 0o600
CLEAN_FILE = "CLEAN"
_HEADER = struct.Struct("<QIIQQQ20x")


class SegmentFile:
    """A mapped segment file; `buf` is a uint8 view of all of it (read-only unless writable)."""

    def __init__(self, path: Path, first_seq: int, writer: int, fd: int, size: int, writable: bool):
        self.path = path
        self.first_seq = first_seq
        self.writer = writer
        self.fd = fd
        self.size = size
        self.writable = writable
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        # No MAP_POPULATE: on a shared file mapping it maps pages read-only, so every
        # page still takes its write fault (measured: appends 0.93-0.98 GB/s with it,
        # 1.17-1.28 GB/s without).
        self._mmap = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot) if size else None
        self.buf = np.frombuffer(self._mmap, np.uint8) if size else np.empty(0, np.uint8)

    @classmethod
    def create(cls, directory: Path, writer: int, first_seq: int, size: int, *, sparse: bool = False, spare: Path | None = None) -> SegmentFile:
        """A new segment: a spare file (allocated now unless given) gets its header, then its name.

        DiskFull when the blocks cannot be allocated. The header is written
        before the rename, so a `.seg` file always has a valid header.
        """
        if spare is None:
            spare = allocate_spare(directory, size, sparse=sparse)
        path = directory / segment_name(first_seq)
        fd = os.open(spare, os.O_RDWR)
        try:
            seg = cls(path, first_seq, writer, fd, size, True)
            seg.buf[:SEGMENT_HEADER_BYTES] = np.frombuffer(header_bytes(writer, first_seq, size), np.uint8)
            if path.exists():
                raise FileExistsError(f"backlog segment {path} already exists")
            durable.rename(spare, path)
        except BaseException:
            os.close(fd)
            spare.unlink(missing_ok=True)
            raise
        return seg

    @classmethod
    def open(cls, path: Path, *, writable: bool = False) -> SegmentFile:
        """Map an existing segment; ValueError when its header fails the checks."""
        fd = os.open(path, os.O_RDWR if writable else os.O_RDONLY)
        try:
            for attempt in range(3):
                size = os.fstat(fd).st_size
                try:
                    seg = cls(path, 0, 0, fd, size, writable)
                    break
                except ValueError:
                    # its writer sealed it (cut it to its used length) between the fstat and
                    # the mmap: look at its size again
                    if attempt == 2:
                        raise
            seg.first_seq, seg.writer = seg.check_header()
        except BaseException:
            os.close(fd)
            raise
        return seg

    def check_header(self) -> tuple[int, int]:
        raw = bytes(self.buf[:SEGMENT_HEADER_BYTES])
        problem = _header_problem(raw, self.size)
        if problem is not None:
            raise ValueError(f"{self.path}: {problem[1]}")
        _magic, _version, writer, first_seq, _capacity, _created = _HEADER.unpack(raw[: SEGMENT_HEADER_BYTES - 4])
        return first_seq, writer

    def sync(self) -> None:
        durable.fdatasync(self.fd)

    def close(self) -> None:
        """Idempotent. A mapping still viewed by numpy arrays is left to the garbage collector."""
        if self.fd < 0:
            return
        self.buf = np.empty(0, np.uint8)
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass
        os.close(self.fd)
        self.fd = -1


# why a segment header fails its checks (`header_problem`)
# bad magic or header checksum: its bytes rotted (the file's name and place still say what they held)
HEADER_DAMAGED = "damaged"
HEADER_FOREIGN = "foreign"  # a sound header this build cannot take (another layout version, a capacity below the size)


def header_bytes(writer: int, first_seq: int, capacity: int) -> bytes:
    """The 64 bytes of a segment header (layout.py), created now."""
    body = _HEADER.pack(SEGMENT_MAGIC, LAYOUT_VERSION, writer, first_seq, capacity, time.time_ns())
    return body + struct.pack("<I", crc32c.crc32c(body))


def _header_problem(raw: bytes, size: int) -> tuple[str, str] | None:
    if len(raw) < SEGMENT_HEADER_BYTES:
        return HEADER_FOREIGN, f"{len(raw)} bytes, shorter than a segment header"
    magic, version, _writer, _first_seq, capacity, _created = _HEADER.unpack(raw[: SEGMENT_HEADER_BYTES - 4])
    (crc,) = struct.unpack("<I", raw[SEGMENT_HEADER_BYTES - 4 :])
    if magic != SEGMENT_MAGIC or crc != crc32c.crc32c(raw[: SEGMENT_HEADER_BYTES - 4]):
        return HEADER_DAMAGED, "not a backlog segment (bad magic or header checksum)"
    if version != LAYOUT_VERSION:
        return HEADER_FOREIGN, f"layout version {version}, this build reads {LAYOUT_VERSION}"
    if capacity < size:
        return HEADER_FOREIGN, f"header capacity {capacity} < file size {size}"
    return None


def header_problem(path: Path) -> tuple[str, str] | None:
    """(HEADER_DAMAGED or HEADER_FOREIGN, why) when a segment file's header fails the checks `open` makes,
    else None; reads its first 64 bytes only (FileNotFoundError when it is gone)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return _header_problem(os.pread(fd, SEGMENT_HEADER_BYTES, 0), os.fstat(fd).st_size)
    finally:
        os.close(fd)


def rewrite_header(path: Path, writer: int, first_seq: int) -> bytes:
    """Write a sound header over a damaged one, from what the file's place and name say (writer,
    first_seq; capacity: its size), and sync it; returns the damaged 64 bytes."""
    fd = os.open(path, os.O_RDWR)
    try:
        old = os.pread(fd, SEGMENT_HEADER_BYTES, 0)
        durable.pwrite(fd, header_bytes(writer, first_seq, os.fstat(fd).st_size), 0)
        durable.fdatasync(fd)
    finally:
        os.close(fd)
    return old


def allocate_spare(directory: Path, size: int, *, sparse: bool = False) -> Path:
    """A nameless (temp-named) file of `size` bytes with every block allocated; DiskFull when it cannot be."""
    path = directory / f".spare-{secrets.token_hex(6)}.tmp"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, FILE_MODE)
    try:
        if sparse:
            os.ftruncate(fd, size)
        else:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        path.unlink(missing_ok=True)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise DiskFull(f"no space for a {size}-byte backlog segment in {directory}: {exc.strerror}") from None
        raise
    finally:
        os.close(fd)
    return path


def write_idx(directory: Path, first_seq: int, index: bytes) -> Path:
    """Seal: write a segment's header index (from `idx_bytes`) by atomic replace; returns its path."""
    path = directory / idx_name(first_seq)
    atomic_write(path, index, FILE_MODE)
    return path


def idx_bytes(seg: SegmentFile, offsets: np.ndarray, end: int) -> bytes:
    """The content of a segment's header index (layout.py)."""
    offsets = np.asarray(offsets, np.uint64)
    entries = np.empty((offsets.size, IDX_ENTRY_BYTES), np.uint8)
    entries[:, :8] = offsets.astype("<u8").view(np.uint8).reshape(-1, 8)
    headers = np.empty((offsets.size, RECORD_HEADER_BYTES), np.uint8)
    copy_headers(seg.buf, offsets.astype(np.int64), headers)
    entries[:, 8:] = headers
    body = entries.tobytes()
    head = struct.pack("<QQQ", IDX_MAGIC, offsets.size, end).ljust(IDX_HEADER_BYTES - 4, b"\0")
    head += struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(head)))
    return head + body


def read_idx(path: Path) -> tuple[np.ndarray, np.ndarray, int] | None:
    """(offsets, headers (n, 64) uint8, end) from a seal index, or None when missing or failing its checks."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    if len(data) < IDX_HEADER_BYTES:
        return None
    head = data[: IDX_HEADER_BYTES - 4]
    magic, count, end = struct.unpack_from("<QQQ", head)
    (crc,) = struct.unpack_from("<I", data, IDX_HEADER_BYTES - 4)
    body = data[IDX_HEADER_BYTES:]
    if magic != IDX_MAGIC or len(body) != count * IDX_ENTRY_BYTES or crc != crc32c.crc32c(body, crc32c.crc32c(head)):
        return None
    entries = np.frombuffer(body, np.uint8).reshape(count, IDX_ENTRY_BYTES)
    offsets = entries[:, :8].copy().view("<u8").reshape(count).astype(np.int64)
    return offsets, entries[:, 8:], int(end)


def fsync_dir(path: Path) -> None:
    durable.fsync_dir(path)


_CLEAN = struct.Struct("<QQQQ")  # magic, active segment first_seq, end offset, next_seq; then crc32c
CLEAN_MAGIC = 0x4E41454C43424D53  # "SMBCLEAN"


def write_clean_marker(directory: Path, segment: int, end: int, next_seq: int) -> None:
    """A writer closed cleanly with its active segment ending at `end` (recovery may skip the CRC scan)."""
    body = _CLEAN.pack(CLEAN_MAGIC, segment, end, next_seq)
    atomic_write(directory / CLEAN_FILE, body + struct.pack("<I", crc32c.crc32c(body)), FILE_MODE)


def read_clean_marker(directory: Path) -> tuple[int, int, int] | None:
    """(segment, end, next_seq) of a clean shutdown, or None."""
    try:
        data = (directory / CLEAN_FILE).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != _CLEAN.size + 4 or struct.unpack("<I", data[-4:])[0] != crc32c.crc32c(data[:-4]):
        return None
    magic, segment, end, next_seq = _CLEAN.unpack(data[:-4])
    return (segment, end, next_seq) if magic == CLEAN_MAGIC else None
