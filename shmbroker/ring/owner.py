"""The owner of an instance's shared memory, and the manifest that lets a restarted owner sweep.

The owner (the broker side) creates every segment and doorbell of an
instance (`shm.py`), writes each name to `<data_dir>/shm-manifest.json`
before creating it (atomic replace: temp file, fsync, rename, fsync of the
directory; mode 0600 in a 0700 directory), and unlinks them all on close.
A crash at any point leaves at worst a listed name that does not exist; the
next owner on the data directory sweeps whatever is still there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType
from typing import Callable, Collection, TypeVar

from .shm import KINDS, MODE, NAME_RE, Doorbell, Segment, make_name, unlink_name

DIR_MODE = 0o700
MANIFEST_FILE = "shm-manifest.json"
_Obj = TypeVar("_Obj", Segment, Doorbell)


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
            if not isinstance(listed, list) or not all(isinstance(n, str) and NAME_RE.fullmatch(n) for n in listed):
                raise ValueError(f"{self.path}: {key} must be a list of shmbroker names, got {listed!r}")
            out[key] = listed
        return out

    def add(self, kind: str, name: str) -> None:
        """Record a name; call BEFORE creating it so a crash right after is still swept."""
        assert NAME_RE.fullmatch(name), name
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

    def sweep(self, keep: Collection[str] = ()) -> list[str]:
        """Unlink every listed name that still exists but those to `keep` (they stay listed); return
        those unlinked."""
        names = self.names()
        unlinked = [n for kind in KINDS for n in names[self._key(kind)] if n not in keep and unlink_name(kind, n)]
        self._write({key: [n for n in listed if n in keep] for key, listed in names.items()})
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

    def __init__(self, data_dir: str | os.PathLike[str], instance: str, sweep: bool = True,
                 keep: Collection[str] = ()) -> None:
        """`keep`: names of a dead owner that the sweep leaves (listed, not unlinked)."""
        make_name(instance, "probe")  # validate early
        self.instance = instance
        self.manifest = Manifest(data_dir)
        self.swept: list[str] = self.manifest.sweep(keep) if sweep else []
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

    def names(self) -> set[str]:
        """The names of what this owner created (and has not released)."""
        return set(self._objects)

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
