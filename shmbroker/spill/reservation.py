"""A backlog writer's sequence reservation: the `RESERVED` file, and where a writer continues.

Sequence numbers are never reused, even after a power loss took records whose
results or acks reached the disk (the results process would ack a new record
that took such a number from its old result, and the new item would never
run): before a batch takes numbers at or above the writer's reservation, the
reservation is raised (`RESERVED`, atomic replace: written and synced before
any of those numbers is on disk) by `writer.RESERVE_SEQS` past the batch. A
writer that starts in another boot than the one that wrote the reservation
(the machine went down: the page cache is gone, and with it perhaps records
whose numbers were handed out) continues at the reservation, in a new
segment, and that number is the boot's floor; in the same boot (a killed
process: its page cache is intact from the floor on) it continues where
recovery found the last record, never below the floor. A close brings the
reservation down to `next_seq`.

<writer dir>/RESERVED: which sequence numbers may have been handed out

| byte | size | field                                                                  |
|------|------|------------------------------------------------------------------------|
| 0    | 8    | RESERVED_MAGIC                                                         |
| 8    | 16   | boot id of the boot that wrote it                                      |
| 24   | 8    | floor: where that boot's writers began (below it, numbers of an earlier |
|      |      | boot, perhaps lost with its page cache)                                |
| 32   | 8    | reserved: no number at or above it handed out                          |
| 40   | 4    | crc32c of bytes 0..39                                                  |
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c

from ..disk import durable
from ..errors import DiskFull

RESERVED_FILE = "RESERVED"
RESERVED_MAGIC = int.from_bytes(b"SHMBRSV2", "little")
_RESERVED = struct.Struct("<Q16sQQ")


def read_reservation(directory: Path) -> tuple[bytes, int, int] | None:
    """(boot id, floor, reserved) from a writer directory's RESERVED, or None when missing or damaged."""
    try:
        data = (Path(directory) / RESERVED_FILE).read_bytes()
    except FileNotFoundError:
        return None
    if len(data) != _RESERVED.size + 4 or struct.unpack("<I", data[-4:])[0] != crc32c.crc32c(data[:-4]):
        return None
    magic, boot, floor, reserved = _RESERVED.unpack(data[:-4])
    return (boot, floor, reserved) if magic == RESERVED_MAGIC and floor <= reserved else None


def write_reservation(directory: Path, floor: int, reserved: int) -> None:
    body = _RESERVED.pack(RESERVED_MAGIC, durable.boot_id(), floor, reserved)
    durable.atomic_write(Path(directory) / RESERVED_FILE, body + struct.pack("<I", crc32c.crc32c(body)))


def continue_at(directory: Path, recovered: int, jump_seqs: int) -> tuple[int, int, int]:
    """(next sequence number, the boot's floor, the reservation found) of a writer starting where
    recovery found `recovered` next; `jump_seqs`: how far past its batch a reservation reaches."""
    found = read_reservation(directory)
    if found is None:
        # a new writer (or one from before reservations): nothing handed out above what recovery found;
        # damaged: jump the most a reservation reaches past its batch
        damaged = (Path(directory) / RESERVED_FILE).exists()
        start = recovered + (jump_seqs if damaged else 0)
        return start, start, recovered
    boot, floor, reserved = found
    if boot == durable.boot_id():
        # a process of this boot left it: the page cache holds all it wrote from the floor on
        return max(recovered, floor), floor, reserved
    start = max(recovered, reserved)
    return start, start, reserved


def raise_to(directory: Path, floor: int, reserved: int) -> None:
    """Write the reservation `reserved` before any number below it is on disk; DiskFull when it cannot."""
    try:
        write_reservation(directory, floor, reserved)
    except OSError as exc:
        if exc.errno not in durable.DISK_FULL_ERRNOS:
            raise
        raise DiskFull(f"no space for the sequence reservation in {directory}: {exc.strerror}") from None


def lower_to(directory: Path, floor: int, next_seq: int) -> bool:
    """On close: nothing at or above next_seq was handed out. False when there is no reservation
    file or no room to write it (a full disk keeps the higher one)."""
    if not (Path(directory) / RESERVED_FILE).exists():
        return False
    try:
        write_reservation(directory, floor, next_seq)
    except OSError as exc:
        if exc.errno not in durable.DISK_FULL_ERRNOS:
            raise
        return False
    return True
