"""The durable-I/O seam: the calls by which the storage code puts bytes and names on disk.

The backlog (`spill/`: segments, seal indexes, the ack file, the clean-shutdown marker, the
writer's sequence reservation), the results log and the small bookkeeping files
(`results/cursor.json`, `producers.json`) write, sync, create, rename, truncate and unlink
through these functions. In production each one is the `os` call it names: `_observer` is None,
and the seam costs one global load per system call.

A test installs an observer (`observe`): every call then runs as `observer.run(op, fn, args)`,
which calls `fn(*args)` (or raises an injected error, such as ENOSPC, or answers `free_bytes`
for a disk of its own size) and records it, so that `tests/spill/test_power_loss.py` can build the
disk image a power loss at any point could leave; `observer.boot_id()` stands for the boot (a
simulated power loss starts a new one). Writes through a shared mapping (a segment's header,
recovery zeroing a torn tail) and metadata calls made elsewhere (reclaim's unlinks) do not pass
here: the observer finds them by looking at the files at its next call, so only the syncs
*must* pass here. `mkdir` makes a directory's own name durable (a file in a directory whose
entry is lost is lost with it).

`atomic_write` is the one composite: the replace-by-rename idiom every bookkeeping file uses
(temp file, fsync, rename, fsync of the directory). On a full disk it deletes a space reserve on
the same filesystem (`keep_reserve`: one this process keeps), when there is one, and tries once
more: the step that frees space (a checkpoint: save the acks and the cursor, reclaim segments)
is never the step a full disk blocks. A reserve is made again only once the filesystem has room
for two (a reserve just given up is not taken back from the step it was given up for).
"""

from __future__ import annotations

import errno
import os
import secrets
import uuid
from pathlib import Path

DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
RESERVE_FILE = ".reserve"  # a directory's space reserve (no `.tmp` suffix: recovery's temp sweep keeps it)
RESERVE_BYTES = 1 << 20  # acks.bin of 65k out-of-order ranges; cursor.json and producers.json far less

_observer = None
_reserves: set[Path] = set()  # directories this process keeps a space reserve in


def _read_boot_id() -> bytes:
    try:
        return uuid.UUID(Path("/proc/sys/kernel/random/boot_id").read_text().strip()).bytes
    except (OSError, ValueError):
        return secrets.token_bytes(16)  # unknown: every start looks like the first after a power loss


_BOOT_ID = _read_boot_id()


def observe(observer):
    """Install `observer` (None: none) for every later call; returns the previous one."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def boot_id() -> bytes:
    """This boot's identity (16 bytes). A file written in this boot is as its writer left it even when
    that process was killed (the page cache survives a process); after a reboot (a power loss, an
    OS crash) it holds what reached the disk. An observer's simulated power loss starts a new boot."""
    if _observer is None:
        return _BOOT_ID
    return _observer.boot_id()


def create(path: str | os.PathLike, flags: int = os.O_RDWR, mode: int = 0o600) -> int:
    """os.open(path, flags | O_CREAT, mode): a file descriptor."""
    if _observer is None:
        return os.open(path, flags | os.O_CREAT, mode)
    return _observer.run("create", os.open, (path, flags | os.O_CREAT, mode))


def write(fd: int, data) -> int:
    if _observer is None:
        return os.write(fd, data)
    return _observer.run("write", os.write, (fd, data))


def pwrite(fd: int, data, offset: int) -> int:
    if _observer is None:
        return os.pwrite(fd, data, offset)
    return _observer.run("pwrite", os.pwrite, (fd, data, offset))


def fsync(fd: int) -> None:
    if _observer is None:
        return os.fsync(fd)
    return _observer.run("fsync", os.fsync, (fd,))


def fdatasync(fd: int) -> None:
    if _observer is None:
        return os.fdatasync(fd)
    return _observer.run("fdatasync", os.fdatasync, (fd,))


_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, wait for none
_libc = None


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Start writing back a file range's dirty pages and return at once (Linux `sync_file_range` with
    SYNC_FILE_RANGE_WRITE): a hint, not a sync. It promises nothing about durability (a power loss
    may still take those bytes), so it passes no observer; a later `fdatasync` finds little left to
    write and blocks its caller for less. A no-op where the call is missing."""
    global _libc
    if _libc is None:
        import ctypes

        lib = ctypes.CDLL(None, use_errno=True)
        _libc = getattr(lib, "sync_file_range", False)
        if _libc:
            _libc.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    if _libc:
        _libc(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make the names in directory `path` durable (creates, renames, unlinks in it)."""
    if _observer is None:
        return _fsync_dir(path)
    return _observer.run("fsync_dir", _fsync_dir, (path,))


def rename(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """os.replace: `dst`, when it exists, is replaced in one step."""
    if _observer is None:
        return os.replace(src, dst)
    return _observer.run("rename", os.replace, (src, dst))


def unlink(path: str | os.PathLike, missing_ok: bool = False) -> None:
    try:
        if _observer is None:
            os.unlink(path)
        else:
            _observer.run("unlink", os.unlink, (path,))
    except FileNotFoundError:
        if not missing_ok:
            raise


def ftruncate(fd: int, size: int) -> None:
    if _observer is None:
        return os.ftruncate(fd, size)
    return _observer.run("ftruncate", os.ftruncate, (fd, size))


def fallocate(fd: int, offset: int, length: int) -> None:
    """posix_fallocate: every block of [offset, offset + length) allocated (the size grows to cover it)."""
    if _observer is None:
        return os.posix_fallocate(fd, offset, length)
    return _observer.run("fallocate", os.posix_fallocate, (fd, offset, length))


def mkdir(path: str | os.PathLike, mode: int = 0o700) -> None:
    """Create directory `path` and any missing parents, each made durable (its parent fsynced): a
    name in a directory is only as durable as the directory's own name. `path`'s parent is synced
    even when `path` exists (a process killed between its mkdir and that sync left it in the page
    cache only)."""
    target = path = Path(os.path.abspath(path))
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    synced = set()
    for d in reversed(missing):
        try:
            os.mkdir(d, mode)
        except FileExistsError:
            pass
        fsync_dir(d.parent)
        synced.add(d.parent)
    if target.parent not in synced:
        fsync_dir(target.parent)


def free_bytes(path: str | os.PathLike) -> int:
    """Bytes an unprivileged writer can still allocate on the filesystem of `path`."""
    if _observer is None:
        return _free_bytes(path)
    return _observer.run("free_bytes", _free_bytes, (path,))


def _free_bytes(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- composites ----------------------------------------------------------------------------------


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write temp, fsync, rename over `path`, fsync the directory. On a full disk, a space reserve on
    the same filesystem (when there is one) is given up and the write tried once more."""
    path = Path(path)
    try:
        _replace(path, data, mode)
    except OSError as exc:
        if exc.errno not in DISK_FULL_ERRNOS or not release_reserve(path.parent):
            raise
        _replace(path, data, mode)
    fsync_dir(path.parent)


def _replace(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = create(tmp, os.O_WRONLY | os.O_TRUNC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[write(fd, view) :]
            fsync(fd)
        finally:
            os.close(fd)
        rename(tmp, path)
    except BaseException:
        unlink(tmp, missing_ok=True)  # a failed write (a full disk) leaves nothing behind
        raise


def keep_reserve(directory: Path, size: int | None = None) -> bool:
    """Make sure `directory` holds a space reserve (`size` allocated bytes, RESERVE_BYTES unless
    given) that this process's `atomic_write`s may give up on a full disk; best effort: False when
    the filesystem has no room for two now (a later call tries again)."""
    size = RESERVE_BYTES if size is None else size
    directory = Path(directory)
    _reserves.add(directory)
    path = directory / RESERVE_FILE
    if path.exists():
        return True
    if free_bytes(directory) < 2 * size:
        return False
    tmp = path.with_name(f"{RESERVE_FILE}.{os.getpid()}.tmp")
    try:
        fd = create(tmp, os.O_WRONLY | os.O_TRUNC, 0o600)
        try:
            fallocate(fd, 0, size)
            fsync(fd)
        finally:
            os.close(fd)
        rename(tmp, path)  # whole or not at all: a reserve is never smaller than it says
    except OSError as exc:
        unlink(tmp, missing_ok=True)
        if exc.errno in DISK_FULL_ERRNOS:
            return False
        raise
    return True


def release_reserve(near: Path) -> bool:
    """Delete a space reserve on the filesystem of directory `near` (its own, else one this process
    keeps) to make room on a full disk; False when there is none."""
    near = Path(near)
    try:
        dev = os.stat(near).st_dev
    except FileNotFoundError:
        return False
    for directory in [near] + sorted(_reserves - {near}):
        try:
            if os.stat(directory).st_dev != dev:
                continue
            unlink(directory / RESERVE_FILE)
        except FileNotFoundError:
            continue
        return True
    return False
