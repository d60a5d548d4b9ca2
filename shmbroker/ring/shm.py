"""Shared-memory segments and doorbells (posix_ipc), and who may remove them.

Lifecycle rules:

- Only the creator unlinks. The owner (the broker's supervisor) creates every
  segment and doorbell; other processes attach and close. posix_ipc has no
  resource tracker, so an attaching process never removes a name by accident.
- Names carry the instance and a random token, "/shmb.<instance>.<token>.<role>",
  so two brokers, or a broker and the leftovers of its crashed predecessor,
  never collide.
- Manifest before create: the owner records a name in
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
import json
import mmap
import os
import re
import secrets
from pathlib import Path
from types import TracebackType
from typing import Callable, TypeVar

import numpy as np
import posix_ipc

_PART = re.compile(r"[A-Za-z0-9_-]+")
_NAME = re.compile(r"/shmb\.[A-Za-z0-9_-]+\.[0-9a-f]{12}\.[A-Za-z0-9_-]+")
NAME_LENGTH_MAX = 200
MODE = 0o600
DIR_MODE = 0o700
KINDS = ("segment", "doorbell")
MANIFEST_FILE = "shm-manifest.json"
_Obj = TypeVar("_Obj", "Segment", "Doorbell")
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


def _unlink_name(kind: str, name: str) -> bool:
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
            _unlink_name(self.kind, self.name)
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
            _unlink_name("segment", name)  # rollback: the name must not outlive the error
            raise

    @classmethod
    def attach(cls, name: str) -> Segment:
        try:
            shm = posix_ipc.SharedMemory(name, 0)
        except posix_ipc.ExistentialError as e:
            raise FileNotFoundError(f"shared memory segment {name!r} does not exist") from e
        try:
            size = shm.size
            if size == 0:
                raise ValueError(f"shared memory segment {name!r} has size 0 (creator not finished?)")
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


class Manifest:
    """JSON file <data_dir>/shm-manifest.json listing live names:
    {"owner_pid": int, "segments": [...], "doorbells": [...]}"""

    def __init__(self, data_dir: str | os.PathLike[str]) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        if self.data_dir.stat().st_uid == os.getuid():
            os.chmod(self.data_dir, DIR_MODE)
        self.path = self.data_dir / MANIFEST_FILE

    def names(self) -> dict[str, list[str]]:
        if not self.path.exists():
            return {"segments": [], "doorbells": []}
        record = json.loads(self.path.read_text())
        out: dict[str, list[str]] = {}
        for key in ("segments", "doorbells"):  # check the record before trusting it
            listed = record.get(key)
            if not isinstance(listed, list) or not all(isinstance(n, str) and _NAME.fullmatch(n) for n in listed):
                raise ValueError(f"{self.path}: {key} must be a list of shmbroker names, got {listed!r}")
            out[key] = listed
        return out

    def add(self, kind: str, name: str) -> None:
        """Record a name; call BEFORE creating it so a crash right after is still swept."""
        assert _NAME.fullmatch(name), name
        names = self.names()
        listed = names[self._key(kind)]
        if name not in listed:
            listed.append(name)
            self._write(names)

    def remove(self, kind: str, name: str) -> None:
        names = self.names()
        listed = names[self._key(kind)]
        if name in listed:
            listed.remove(name)
            self._write(names)

    def sweep(self) -> list[str]:
        """Unlink every listed name that still exists, clear the file; return those unlinked."""
        names = self.names()
        unlinked = [n for kind in KINDS for n in names[self._key(kind)] if _unlink_name(kind, n)]
        self._write({"segments": [], "doorbells": []})
        return unlinked

    @staticmethod
    def _key(kind: str) -> str:
        if kind not in KINDS:
            raise ValueError(f"kind {kind!r} must be one of {KINDS}")
        return kind + "s"

    def _write(self, names: dict[str, list[str]]) -> None:
        record = {"owner_pid": os.getpid(), **names}
        tmp = self.path.with_name(f".{MANIFEST_FILE}.{os.getpid()}.tmp")
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, MODE), "wb") as f:
            os.fchmod(f.fileno(), MODE)
            f.write(json.dumps(record).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        dir_fd = os.open(self.data_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


class Owner:
    """The creating side (the broker). Creates segments and doorbells for one
    instance, records each in the manifest first, unlinks them all on close."""

    def __init__(self, data_dir: str | os.PathLike[str], instance: str, sweep: bool = True) -> None:
        make_name(instance, "probe")  # validate early
        self.instance = instance
        self.manifest = Manifest(data_dir)
        self.swept: list[str] = self.manifest.sweep() if sweep else []
        self._objects: dict[str, Segment | Doorbell] = {}
        self._closed = False

    def segment(self, role: str, size: int) -> Segment:
        return self._create("segment", role, lambda name: Segment.create(name, size))

    def doorbell(self, role: str) -> Doorbell:
        return self._create("doorbell", role, Doorbell.create)

    def _create(self, kind: str, role: str, create: Callable[[str], _Obj]) -> _Obj:
        if self._closed:
            raise ValueError(f"owner of instance {self.instance!r} is closed")
        name = make_name(self.instance, role)
        self.manifest.add(kind, name)
        try:
            obj = create(name)
        except BaseException:
            self.manifest.remove(kind, name)
            raise
        self._objects[name] = obj
        return obj

    def release(self, obj: Segment | Doorbell) -> None:
        """Close and unlink one object this owner created, and forget it."""
        if self._objects.get(obj.name) is not obj:
            raise ValueError(f"{obj.name!r} was not created by this owner")
        obj.close()
        obj.unlink()
        self.manifest.remove(obj.kind, obj.name)
        del self._objects[obj.name]

    def close(self) -> None:
        """Release everything this owner created; idempotent. Raises the first error after trying all."""
        self._closed = True
        first: BaseException | None = None
        for obj in list(self._objects.values()):
            try:
                self.release(obj)
            except Exception as e:  # keep releasing the rest
                first = first or e
        if first is not None:
            raise first

    def __enter__(self) -> Owner:
        return self

    def __exit__(self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
