"""The API's files on disk: `<data_dir>/http/files/`, one data file and one description a file.

| path               | what                                                                      |
|--------------------|---------------------------------------------------------------------------|
| `<id>`             | the bytes: an upload, or a batch's output or error file                   |
| `<id>.json`        | its description: owner (tenant), filename, purpose, bytes, lines, created |
|                    | and, for an upload, its lines' urls and repeated custom_ids (`requests`)  |
| `.upload-<random>` | an upload being received; left by a crash, it is removed at start         |

A file exists once its description does. An upload is written to `.upload-*`, fsynced, renamed to
its id (the directory fsynced), and only then described (`atomic_write`, fsynced): an upload
answered 200 is on disk, and a torn one leaves no file. A delete removes the description first. The
descriptions are read once at start and kept in memory: this process is their one writer.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from ..disk.durable import atomic_write, fsync, fsync_dir, mkdir, rename, unlink
from .objects import FILE_PREFIX, ID_RE, new_id, not_found

HTTP_DIR = "http"
UPLOAD_PREFIX = ".upload-"
PURPOSES = ("batch",)  # what an upload may be for; a batch's results are "batch_output"
OUTPUT_PURPOSE = "batch_output"
COUNT_CHUNK_BYTES = 1 << 20


def http_dir(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / HTTP_DIR


class FileStore:
    def __init__(self, data_dir: str | os.PathLike):
        mkdir(http_dir(data_dir))
        self.dir = http_dir(data_dir) / "files"
        mkdir(self.dir)
        self._lock = threading.Lock()
        self._meta: dict[str, dict] = {}
        for entry in os.scandir(self.dir):
            if entry.name.startswith(UPLOAD_PREFIX):
                unlink(entry.path, missing_ok=True)  # torn: never answered 200
            elif entry.name.endswith(".json") and ID_RE.fullmatch(entry.name[:-5]):
                try:
                    self._meta[entry.name[:-5]] = json.loads(Path(entry.path).read_bytes())
                except (OSError, ValueError):
                    continue  # replaced whole, so only a hand-edited description is unreadable

    def path(self, file_id: str) -> Path:
        return self.dir / file_id

    def begin_upload(self) -> tuple[int, Path]:
        """(fd, path) of a new upload's temporary file (owner-only)."""
        tmp = self.dir / f"{UPLOAD_PREFIX}{new_id('')}"
        return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), tmp

    def commit(self, fd: int, tmp: Path, owner: str, filename: str, purpose: str, size: int, lines: int,
               requests: dict | None = None) -> dict:
        """The upload made a file: synced, renamed to its id, described. Closes `fd`."""
        try:
            fsync(fd)
        finally:
            os.close(fd)
        file_id = new_id(FILE_PREFIX)
        rename(tmp, self.path(file_id))
        fsync_dir(self.dir)
        return self.describe(file_id, owner, filename, purpose, size, lines, requests)

    def describe(self, file_id: str, owner: str, filename: str, purpose: str, size: int, lines: int,
                 requests: dict | None = None) -> dict:
        """`requests`: what the upload read of its lines (`upload.Lines.summary`)."""
        meta = {"id": file_id, "owner": owner, "filename": filename, "purpose": purpose, "bytes": size,
                "lines": lines, "created_at": int(time.time()), "created_ns": time.time_ns(), "requests": requests}
        atomic_write(self.dir / f"{file_id}.json", json.dumps(meta).encode())
        with self._lock:
            self._meta[file_id] = meta
        return meta

    def get(self, owner: str, file_id: str) -> dict:
        """A tenant's file; another's, or none, is not found."""
        with self._lock:
            meta = self._meta.get(file_id)
        if meta is None or meta["owner"] != owner:
            raise not_found("File", file_id)
        return meta

    def lines(self, owner: str, file_id: str) -> int:
        """A tenant's file's lines (0 when it is gone): a batch's total before its job counts them."""
        with self._lock:
            meta = self._meta.get(file_id)
        return meta.get("lines", 0) if meta is not None and meta["owner"] == owner else 0

    def owned(self, owner: str) -> list[dict]:
        """A tenant's files, newest first."""
        with self._lock:
            rows = [m for m in self._meta.values() if m["owner"] == owner]
        return sorted(rows, key=lambda m: (m.get("created_ns", 0), m["id"]), reverse=True)

    def usage(self, owner: str) -> tuple[int, int]:
        """(files, bytes) a tenant keeps."""
        rows = self.owned(owner)
        return len(rows), sum(m["bytes"] for m in rows)

    def delete(self, owner: str, file_id: str) -> None:
        self.get(owner, file_id)
        unlink(self.dir / f"{file_id}.json")
        with self._lock:
            self._meta.pop(file_id, None)
        unlink(self.path(file_id), missing_ok=True)

    def register_output(self, owner: str, file_id: str, filename: str) -> str | None:
        """A batch's output or error file, written by its submitter at `path(file_id)`, synced and
        described; None when it holds no line (the API then gives no file). Seconds for gigabytes:
        the runner calls it holding no lock a request waits on."""
        path = self.path(file_id)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fsync(fd)
            size, lines = count_lines(fd)
        finally:
            os.close(fd)
        if lines == 0:
            unlink(path, missing_ok=True)
            return None
        os.chmod(path, 0o600)  # the submitter made it with its umask
        self.describe(file_id, owner, filename, OUTPUT_PURPOSE, size, lines)
        return file_id


def count_lines(fd: int) -> tuple[int, int]:
    """(bytes, lines) of the file at `fd` from its start, a last line without its newline counted
    too. Read in chunks counted by `bytes.count`, not line by line: about ten times faster on a file
    of short lines, and the reads let the event loop's thread run meanwhile."""
    size = lines = 0
    last = b"\n"
    while chunk := os.pread(fd, COUNT_CHUNK_BYTES, size):
        lines += chunk.count(b"\n")
        size += len(chunk)
        last = chunk[-1:]
    return size, lines + (last != b"\n")
