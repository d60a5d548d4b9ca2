"""The API's batches on disk (`<data_dir>/http/batches/<id>.json`) and the Batch object they show.

A batch is a job (`jobs/store.py`) named by its id, run by a `submit --job` process the runner
starts (`runner.py`). Its record holds what the job does not: its owner, endpoint, input, window,
metadata, the ids its output and error files will get, its timestamps and, once it has ended, its
final status and counts. While it runs, its status and counts are the job's (`status` below), so
`shmbroker jobs`, `job`, `cancel`, `top` and the exporter show the same job. Records are replaced
whole (`atomic_write`, fsynced) before the answer that made them: a batch answered 200 is on disk.

| phase        | status shown                                                                   |
|--------------|--------------------------------------------------------------------------------|
| `validating` | `validating` (`cancelling` once a cancel is asked)                             |
| `running`    | the job's: `in_progress`; `finalizing` once every result is in, until the      |
|              | output files are described; `cancelling` after a cancel or past the window     |
| `ended`      | `final`: `completed`, `failed`, `cancelled` or `expired`                       |
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..disk.durable import atomic_write, mkdir
from ..jobs import store
from .files import http_dir
from .objects import ID_RE, not_found

TIMESTAMPS = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at",
              "cancelled_at")


@dataclass
class BatchRecord:
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    output_file_id: str  # reserved at creation: the submitter writes there
    error_file_id: str
    metadata: dict | None = None
    phase: str = "validating"
    final: str | None = None  # the status once ended
    expiring: bool = False  # its cancel came from its window
    errors: list = field(default_factory=list)  # validation errors: {code, message, param, line}
    counts: dict | None = None  # request_counts once ended
    described: dict = field(default_factory=dict)  # output and error file ids that hold lines, once ended
    in_progress_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    created_ns: int = field(default_factory=time.time_ns)  # orders the list (created_at is in seconds)


class BatchStore:
    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = str(data_dir)
        self.dir = http_dir(data_dir) / "batches"
        mkdir(self.dir)
        self._lock = threading.Lock()
        self._records: dict[str, BatchRecord] = {}
        names = {f.name for f in dataclasses.fields(BatchRecord)}
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".json") and ID_RE.fullmatch(entry.name[:-5]):
                try:
                    row = json.loads(Path(entry.path).read_bytes())
                    self._records[row["id"]] = BatchRecord(**{k: v for k, v in row.items() if k in names})
                except (OSError, ValueError, KeyError, TypeError):
                    continue

    def save(self, rec: BatchRecord) -> None:
        atomic_write(self.dir / f"{rec.id}.json", json.dumps(asdict(rec)).encode())
        with self._lock:
            self._records[rec.id] = rec

    def get(self, owner: str, batch_id: str) -> BatchRecord:
        with self._lock:
            rec = self._records.get(batch_id)
        if rec is None or rec.owner != owner:
            raise not_found("Batch", batch_id)
        return rec

    def owned(self, owner: str) -> list[BatchRecord]:
        """A tenant's batches, newest first."""
        with self._lock:
            rows = [r for r in self._records.values() if r.owner == owner]
        return sorted(rows, key=lambda r: (r.created_ns, r.id), reverse=True)

    def active(self) -> list[BatchRecord]:
        with self._lock:
            return [r for r in self._records.values() if r.phase != "ended"]

    def uses_file(self, owner: str, file_id: str) -> BatchRecord | None:
        """A batch not ended that reads or writes this file."""
        return next((r for r in self.active() if r.owner == owner and file_id in (r.input_file_id, r.output_file_id,
                                                                                   r.error_file_id)), None)

    def job_view(self, rec: BatchRecord) -> dict | None:
        if not store.is_job(self.data_dir, rec.id):
            return None
        try:
            return store.view(self.data_dir, rec.id)
        except store.JobError:
            return None


def job_view_ended(view: dict) -> bool:
    """The job has every line's result, or every line was refused: its batch can end. A job failed
    otherwise (its submitter could not reach the broker, or died counting the file) is resumed."""
    if view["status"] == "failed":
        return view["total"] > 0 and view["failed"] >= view["total"]
    return view["status"] in ("completed", "cancelled")


def request_counts(view: dict | None, total: int) -> dict:
    """The API's counts from a job's: every line that did not complete failed (cancelled ones too)."""
    if view is None:
        return {"total": total, "completed": 0, "failed": 0}
    return {"total": view["total"], "completed": view["completed"], "failed": view["failed"] + view["cancelled"]}


def status(rec: BatchRecord, view: dict | None) -> str:
    if rec.phase == "ended":
        return rec.final
    if rec.phase == "validating":
        return "cancelling" if rec.cancelling_at else "validating"
    if rec.cancelling_at:
        return "cancelling"
    job = view["status"] if view is not None else "in_progress"
    return {"completed": "finalizing", "finalizing": "finalizing", "cancelled": "cancelling",
            "cancelling": "cancelling"}.get(job, "in_progress")


def batch_object(rec: BatchRecord, view: dict | None, total: int) -> dict:
    """The API's Batch object (`total`: the input file's lines, before the job counts them)."""
    ended = rec.phase == "ended"
    out = {"id": rec.id, "object": "batch", "endpoint": rec.endpoint, "input_file_id": rec.input_file_id,
           "completion_window": rec.completion_window, "status": status(rec, view),
           "output_file_id": rec.described.get("output") if ended else None,
           "error_file_id": rec.described.get("error") if ended else None,
           "created_at": rec.created_at, "expires_at": rec.expires_at,
           "request_counts": rec.counts if ended and rec.counts else request_counts(view, total),
           "metadata": rec.metadata,
           "errors": {"object": "list", "data": rec.errors} if rec.errors else None}
    out.update({k: getattr(rec, k) for k in TIMESTAMPS})
    return out


def now() -> int:
    return int(time.time())
