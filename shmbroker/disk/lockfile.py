"""Exclusive locks on files: one live holder, released by the kernel when the holder dies.

`flock_exclusive(path)` is the mechanism (an `flock` on an owner-only file);
`InstanceLock` is the supervisor's: `<data_dir>/supervisor.lock` holding the
pid and start time of the supervisor that holds it, so a second supervisor on
the same data directory is refused with a message naming the first, and a
lock left by a dead one (the kernel released its flock) is taken over. Forked
children inherit the descriptor: the lock stays held while any process of the
broker lives.
"""

from __future__ import annotations

import fcntl
import os

from ..errors import BrokerError
from ..ring.liveness import start_ticks

LOCK_FILE = "supervisor.lock"


class AlreadyRunning(BrokerError):
    """Another live process holds the lock."""

    def __init__(self, path: str, holder: str):
        super().__init__(f"{path} is held by a running broker ({holder}); stop it first")
        self.path = path
        self.holder = holder


def flock_exclusive(path: str | os.PathLike) -> int | None:
    """Open (creating, mode 0600) and flock `path`; the descriptor, or None when another holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class InstanceLock:
    """The supervisor's lock on a data directory."""

    def __init__(self, path: str, fd: int, previous: str):
        self.path = path
        self._fd: int | None = fd
        self.previous = previous  # what a dead holder left in the file ("" when none)

    @classmethod
    def acquire(cls, data_dir: str | os.PathLike) -> "InstanceLock":
        path = os.path.join(os.fspath(data_dir), LOCK_FILE)
        fd = flock_exclusive(path)
        if fd is None:
            raise AlreadyRunning(path, _describe(_read(path)))
        previous = _read_fd(fd)
        record = f"pid {os.getpid()} start {start_ticks(os.getpid())}\n".encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        os.fsync(fd)
        return cls(path, fd, previous)

    @property
    def took_over(self) -> bool:
        """True when a dead holder had left its record in the file."""
        return bool(self.previous)

    def release(self) -> None:
        """Remove the file and drop the lock (idempotent)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "InstanceLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def _read(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        return _read_fd(fd)
    finally:
        os.close(fd)


def _read_fd(fd: int) -> str:
    return os.pread(fd, 256, 0).decode("ascii", "replace").strip()


def _describe(record: str) -> str:
    return record or "holder unknown: it has not written its pid yet"
