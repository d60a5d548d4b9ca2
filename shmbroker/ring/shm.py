"""Shared-memory segments and doorbells (posix_ipc), and who may remove them.

Lifecycle rules:

- Only the creator unlinks. The owner (the broker's supervisor) creates every
  segment and doorbell; other processes attach and close. posix_ipc has no
  resource tracker, so an attaching process never removes a name by accident.
- Names carry the instance and a random token, "/shmb.<instance>.<token>.<role>",
  so two brokers, or a broker and the leftovers of its crashed predecessor,
  never collide.
- Manifest before create (`owner.py`): the owner records a name in
  <data_dir>/shm-manifest.json (atomic replace, fsync) before creating it, so a
  crash at any point leaves at worst a listed name that does not exist. A
  restarted owner sweeps the manifest and unlinks what is still there.
- A failed create rolls back: a segment that exists but could not be mapped
  is unlinked before the error propagates.
- close() is idempotent. It drops the numpy view first; if callers still hold
  views, the mapping is left to the garbage collector instead of raising.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import secrets
from types import TracebackType
from typing import TypeVar

import numpy as np
import posix_ipc

_PART = re.compile(r"[A-Za-z0-9_-]+")
NAME_RE = re.compile(r"/shmb\.[A-Za-z0-9_-]+\.[0-9a-f]{12}\.[A-Za-z0-9_-]+")  # what make_name makes
NAME_LENGTH_MAX = 200
MODE = 0o600
KINDS = ("segment", "doorbell")
_Self = TypeVar("_Self", bound="_Named")


def make_name(instance: str, role: str) -> str:
    """Return "/shmb.<instance>.<12 hex random>.<role>"; ValueError if invalid."""
    for what, part in (("instance", instance), ("role", role)):
        if not isinstance(part, str) or not _PART.fullmatch(part):
            raise ValueError(f"{what} {part!r} must match [A-Za-z0-9_-]+")
    name = f"/shmb.{instance}.{secrets.token_hex(6)}.{role}"
    if len(name) > NAME_LENGTH_MAX:
        raise ValueError(f"name {name!r} longer than {NAME_LENGTH_MAX} characters")
    return name


def unlink_name(kind: str, name: str) -> bool:
    """Unlink a shm segment or semaphore by name; False if it was already gone."""
    unlink = posix_ipc.unlink_shared_memory if kind == "segment" else posix_ipc.unlink_semaphore
    try:
        unlink(name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _reserve_pages(fd: int, name: str, size: int) -> None:
    """Allocate every page now: /dev/shm does not refuse an oversized segment at
    create, and touching a page it cannot back later raises SIGBUS. fallocate
    turns that into a clear error here, and saves the first writer the faults."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.ENOMEM):
            raise OSError(e.errno, f"not enough shared memory for segment {name!r} ({size} bytes): {e.strerror}") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def _map(fd: int, size: int) -> mmap.mmap:
    """Map shared, with the page tables filled in at once (MAP_POPULATE) where the OS has it."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=flags)


class _Named:
    """What segments and doorbells share: a name, who created it, unlink rules, context manager."""

    kind = ""
    name: str
    creator: bool
    _unlinked = False

    def close(self) -> None:  # overridden by both kinds
        """Release this process's handle (idempotent)."""

    def unlink(self) -> None:
        """Remove the name (creator only); idempotent, already gone is fine."""
        if not self.creator:
            raise PermissionError(f"{self.kind} {self.name!r}: only the creator unlinks it")
        if not self._unlinked:
            unlink_name(self.kind, self.name)
            self._unlinked = True

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class Segment(_Named):
    """One mapped POSIX shared-memory segment; `buf` is a uint8 view of all of it."""

    kind = "segment"

    def __init__(self, name: str, size: int, creator: bool, mapping: mmap.mmap) -> None:
        self.name = name
        self.size = size
        self.creator = creator
        self._mmap: mmap.mmap | None = mapping
        self._buf: np.ndarray | None = np.frombuffer(mapping, dtype=np.uint8)

    @property
    def buf(self) -> np.ndarray:
        if self._buf is None:
            raise ValueError(f"segment {self.name!r} is closed")
        return self._buf

    @classmethod
    def create(cls, name: str, size: int) -> Segment:
        if size <= 0:
            raise ValueError(f"segment {name!r}: size {size} must be > 0")
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=MODE, size=size)
        except posix_ipc.ExistentialError as e:
            raise FileExistsError(f"shared memory segment {name!r} already exists") from e
        try:
            try:
                os.fchmod(shm.fd, MODE)
                _reserve_pages(shm.fd, name, size)
                mapping = _map(shm.fd, size)
            finally:
                shm.close_fd()
            return cls(name, size, True, mapping)
        except BaseException:
            unlink_name("segment", name)  # rollback: the name must not outlive the error
            raise

    @classmethod
    def attach(cls, name: str, *, readonly: bool = False, length: int | None = None) -> Segment:
        """Map an existing segment. readonly: mapped PROT_READ (`buf` is a read-only array), and
        `length` bytes of it only when given (a watcher reading a ring's header maps one page)."""
        try:
            shm = posix_ipc.SharedMemory(name, 0, read_only=readonly)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(f"shared memory segment {name!r} does not exist") from e
        try:
            size = shm.size
            if size == 0:
                raise ValueError(f"shared memory segment {name!r} has size 0 (creator not finished?)")
            if readonly:
                size = min(size, length) if length is not None else size
                mapping = mmap.mmap(shm.fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            else:
                mapping = _map(shm.fd, size)
        finally:
            shm.close_fd()
        return cls(name, size, False, mapping)

    def close(self) -> None:
        self._buf = None
        mapping, self._mmap = self._mmap, None
        if mapping is None:
            return
        try:
            mapping.close()
        except BufferError:
            pass  # numpy views still exported: the mapping closes when they die


class Doorbell(_Named):
    """A POSIX semaphore used as a wake-up doorbell: ring() posts, sleep() waits with a deadline."""

    kind = "doorbell"

    def __init__(self, name: str, creator: bool, sem: posix_ipc.Semaphore) -> None:
        self.name = name
        self.creator = creator
        self._sem: posix_ipc.Semaphore | None = sem

    @classmethod
    def create(cls, name: str) -> Doorbell:
        try:
            sem = posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=MODE, initial_value=0)
        except posix_ipc.ExistentialError as e:
            raise FileExistsError(f"doorbell semaphore {name!r} already exists") from e
        return cls(name, True, sem)

    @classmethod
    def attach(cls, name: str) -> Doorbell:
        try:
            sem = posix_ipc.Semaphore(name, 0)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(f"doorbell semaphore {name!r} does not exist") from e
        return cls(name, False, sem)

    def _live(self) -> posix_ipc.Semaphore:
        if self._sem is None:
            raise ValueError(f"doorbell {self.name!r} is closed")
        return self._sem

    def ring(self) -> None:
        self._live().release()

    def sleep(self, timeout_seconds: float) -> bool:
        """Wait for a ring at most timeout_seconds; True if woken, False on timeout."""
        try:
            self._live().acquire(max(0.0, timeout_seconds))
        except posix_ipc.BusyError:
            return False
        except posix_ipc.SignalError:
            return True  # interrupted by a signal: a spurious wake-up, the caller looks again
        return True

    def close(self) -> None:
        sem, self._sem = self._sem, None
        if sem is not None:
            sem.close()
