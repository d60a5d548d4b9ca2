"""Batch jobs on disk: `<data_dir>/jobs/<name>/`, one directory a job, three files with one writer each.

| file          | writer                         | what                                                   |
|---------------|--------------------------------|--------------------------------------------------------|
| `job.json`    | `shmbroker submit --job`       | the input (path, sha256 digest, lines, format), when,  |
|               |                                | its phase, items and tokens submitted, lines refused,  |
|               |                                | whether every line was handled, the submitter's pid    |
| `counts.json` | the results process (`tally`)  | results by status, and the sequence numbers counted    |
|               |                                | (so a result delivered twice counts once)              |
| `cancel.json` | `shmbroker cancel`             | when the cancel was asked for, and why (`reason`)      |

Each is replaced whole (`durable.atomic_write`), so a reader sees one version or the next, never a
torn one. A job's name is its producer name: its items' results are the results of that name.
The status (the batch APIs' words) is not stored: `view()` derives it from the three files and
whether the submitter still runs, so no writer can leave it stale.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..disk.durable import atomic_write, mkdir
from ..ring.items import Status
from ..ring.liveness import is_alive

JOBS_DIR = "jobs"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
STATUSES = ("validating", "in_progress", "finalizing", "completed", "cancelling", "cancelled", "failed")
TERMINAL = frozenset({"completed", "cancelled", "failed"})
OK_LABEL = Status.OK.label
CANCELLED_LABEL = Status.CANCELLED.label
REFUSED_LABEL = "invalid_request"  # a line the submitter could not read as a prompt (failed_by_status)


class JobError(Exception):
    """A job that cannot be made, read or changed as asked; the message says why."""


@dataclass
class JobMeta:
    """`job.json`: what `submit --job` knows. `phase` is the submitter's own progress: validating,
    in_progress (submitting, then waiting), finalizing (writing the last results), completed, failed."""

    name: str
    input: str
    digest: str
    lines: int  # non-blank lines: the job's requests
    format: str = "native"
    created_at: float = field(default_factory=time.time)
    phase: str = "validating"
    submitted: int = 0  # items the broker took
    tokens: int = 0  # their prompt tokens
    refused: int = 0  # lines that are not a prompt (each one's error is its own)
    submit_done: bool = False  # every line was submitted or refused
    submitter_pid: int = 0
    submitter_start: int = 0
    error: str | None = None
    finished_at: float | None = None

    def as_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def jobs_root(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / JOBS_DIR


def job_dir(data_dir: str | os.PathLike, name: str) -> Path:
    return jobs_root(data_dir) / name


def check_name(name: str) -> str:
    if not isinstance(name, str) or NAME_RE.fullmatch(name) is None:
        raise JobError(f"a job name is 1 to 63 of A-Z a-z 0-9 . _ - (starting with a letter or digit), got {name!r}")
    return name


def is_job(data_dir: str | os.PathLike, name: str) -> bool:
    return (job_dir(data_dir, name) / "job.json").exists()


def write_meta(data_dir: str | os.PathLike, meta: JobMeta) -> None:
    d = job_dir(data_dir, meta.name)
    mkdir(jobs_root(data_dir))
    mkdir(d)
    atomic_write(d / "job.json", meta.as_json())


def create(data_dir: str | os.PathLike, meta: JobMeta) -> None:
    """A new job's directory, taken exclusively (two submits of one new name: one gets it), and its
    `job.json`. A directory without `job.json` (a crash between the two) is taken over."""
    mkdir(jobs_root(data_dir))
    d = job_dir(data_dir, meta.name)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        if (d / "job.json").exists():
            raise JobError(f"job {meta.name!r} exists") from None
    write_meta(data_dir, meta)


def read_meta(data_dir: str | os.PathLike, name: str) -> JobMeta:
    path = job_dir(data_dir, name) / "job.json"
    try:
        row = json.loads(path.read_bytes())
        return JobMeta(**row)
    except FileNotFoundError:
        raise JobError(f"no job {name!r} in {data_dir}") from None
    except (ValueError, TypeError) as exc:
        raise JobError(f"{path}: unreadable ({exc})") from None


def read_counts(data_dir: str | os.PathLike, name: str) -> dict:
    """`counts.json` as written by the results process ({} before its first result)."""
    try:
        return json.loads((job_dir(data_dir, name) / "counts.json").read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError:
        return {}  # replaced whole, so only a hand-edited file is unreadable: count nothing rather than fail


def cancel_requested(data_dir: str | os.PathLike, name: str) -> float | None:
    try:
        return float(json.loads((job_dir(data_dir, name) / "cancel.json").read_bytes())["requested_at"])
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        return time.time()  # present but unreadable: it was asked for


# why a job was cancelled -> the error code and message of its lines that did not run (the Batch API's)
CANCEL_REASONS = {"cancelled": ("batch_cancelled", "the job was cancelled before this line ran"),
                  "expired": ("batch_expired", "the batch's completion window ended before this line ran")}


def write_cancel(data_dir: str | os.PathLike, name: str, reason: str = "cancelled") -> None:
    assert reason in CANCEL_REASONS, reason
    atomic_write(job_dir(data_dir, name) / "cancel.json",
                 json.dumps({"requested_at": time.time(), "reason": reason}).encode())


def cancel_reason(data_dir: str | os.PathLike, name: str) -> str:
    """Why the job was cancelled (a key of CANCEL_REASONS; "cancelled" when its file does not say)."""
    try:
        reason = json.loads((job_dir(data_dir, name) / "cancel.json").read_bytes()).get("reason")
    except (OSError, ValueError, AttributeError):
        return "cancelled"
    return reason if reason in CANCEL_REASONS else "cancelled"


def submitter_alive(meta: JobMeta) -> bool:
    return meta.submitter_pid > 0 and is_alive(meta.submitter_pid, meta.submitter_start)


def status_of(meta: JobMeta, results: int, cancelled_at: float | None, alive: bool) -> str:
    """The job's status from its files: `results` is how many of its submitted items have one."""
    if meta.phase in ("failed", "validating"):
        return meta.phase if alive or meta.phase == "failed" else "failed"
    all_in = meta.submit_done and results >= meta.submitted
    if meta.submit_done and meta.submitted == 0 and meta.refused and cancelled_at is None:
        return "failed"  # no line of its file was a request (each line's error says why)
    if cancelled_at is not None and meta.phase != "completed":
        if alive and not meta.submit_done:
            return "cancelling"  # the submitter stops at its next chunk
        return "cancelled" if results >= meta.submitted else "cancelling"
    if all_in:
        return "finalizing" if alive and meta.phase in ("in_progress", "finalizing") else "completed"
    return "in_progress"


def view(data_dir: str | os.PathLike, name: str) -> dict:
    """One job as the commands, `top` and the exporter show it (`jobs --json` prints these)."""
    meta = read_meta(data_dir, name)
    tally = read_counts(data_dir, name)
    counts = tally.get("counts", {})
    results = sum(int(v) for v in counts.values())
    cancelled_at = cancel_requested(data_dir, name)
    alive = submitter_alive(meta)
    status = status_of(meta, results, cancelled_at, alive)
    failed_by_status = {k: int(v) for k, v in sorted(counts.items()) if k not in (OK_LABEL, CANCELLED_LABEL) and v}
    if meta.refused:
        failed_by_status[REFUSED_LABEL] = meta.refused
    cancelled = int(counts.get(CANCELLED_LABEL, 0))
    if status == "cancelled":  # lines never submitted count as cancelled too
        cancelled += max(0, meta.lines - meta.refused - meta.submitted)
    return {"name": name, "status": status, "total": meta.lines, "completed": int(counts.get(OK_LABEL, 0)),
            "failed": sum(failed_by_status.values()), "cancelled": cancelled, "failed_by_status": failed_by_status,
            "submitted": max(meta.submitted, results), "results": results, "tokens": meta.tokens,
            "generated_tokens": int(tally.get("generated_tokens", 0)), "input": meta.input,
            "digest": meta.digest, "format": meta.format, "created_at": meta.created_at,
            "finished_at": meta.finished_at, "cancel_requested_at": cancelled_at, "submitter_pid": meta.submitter_pid if alive else None,
            "error": meta.error}


def names(data_dir: str | os.PathLike) -> list[str]:
    try:
        entries = sorted(os.scandir(jobs_root(data_dir)), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    return [e.name for e in entries if e.is_dir() and NAME_RE.fullmatch(e.name) and (Path(e.path) / "job.json").exists()]


def views(data_dir: str | os.PathLike) -> list[dict]:
    """Every job, oldest first (a job whose files cannot be read is left out)."""
    out = []
    for name in names(data_dir):
        try:
            out.append(view(data_dir, name))
        except JobError:
            continue
    return sorted(out, key=lambda v: v["created_at"])


class JobsWatch:
    """What `top`, `status` and the exporter show of the jobs, read again only where a file changed:
    jobs per status (all of them), and the live ones (not completed, cancelled or failed) in full,
    so what is shown is bounded by what runs, not by history."""

    LIVE_MAX = 64  # live jobs shown at most (the newest)

    def __init__(self, data_dir: str | os.PathLike):
        self.data_dir = data_dir
        self._cache: dict[str, tuple[tuple, dict]] = {}

    def summary(self) -> dict:
        by_status = dict.fromkeys(STATUSES, 0)
        live = []
        seen = set()
        for name in names(self.data_dir):
            seen.add(name)
            d = job_dir(self.data_dir, name)
            stamp = tuple(_mtime(d / f) for f in ("job.json", "counts.json", "cancel.json"))
            hit = self._cache.get(name)
            if hit is not None and hit[0] == stamp and hit[1]["status"] in TERMINAL:
                v = hit[1]  # a finished job's files no longer change
            else:
                try:
                    v = view(self.data_dir, name)
                except JobError:
                    continue
                self._cache[name] = (stamp, v)
            by_status[v["status"]] += 1
            if v["status"] not in TERMINAL:
                live.append({k: v[k] for k in ("name", "status", "total", "submitted", "completed", "failed",
                                                "cancelled", "created_at")})
        for name in set(self._cache) - seen:
            del self._cache[name]
        live.sort(key=lambda v: v["created_at"])
        return {"by_status": by_status, "live": live[-self.LIVE_MAX :]}


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except FileNotFoundError:
        return 0
