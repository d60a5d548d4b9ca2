"""The batches' runner: a thread of the HTTP process that takes each batch through its phases.

- `validating`: the input's lines are read; a line naming another endpoint than the batch's, or a
  custom_id given twice, fails the batch (`errors.data`, with line numbers). A line that is not a
  request is left to the submitter, which writes it to the error file with its line number.
- `running`: a `shmbroker submit FILE --job <batch id> --wait --out-format openai` process writes
  the output and error files under the ids the record reserved. The runner starts it, and starts it
  again with `--resume` whenever it is not running and its job has not ended: after a SIGKILL of
  the submitter, of this process (its submitters die with it, PR_SET_PDEATHSIG) or of the whole
  broker. `--resume` submits only lines without a result and writes each custom_id once.
- past its window (`expires_at`) a running batch is cancelled and ends `expired`.
- `ended`: once the job's every line has its result and the submitter has exited, the output and
  error files are described as files of the batch's owner, and the final status and counts are kept.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from ..jobs import cancels, store
from ..jobs.embeddings import EMBEDDINGS
from .batches import BatchRecord, BatchStore, job_view_ended, now, request_counts
from .files import FileStore, http_dir

log = logging.getLogger("shmbroker.http")
ERRORS_KEPT = 100  # validation errors a failed batch lists
RESPAWN_SECONDS = 2.0  # a submitter that exited is started again at most this often
TICK_SECONDS = 0.25


def cancel_job(data_dir: str, name: str, reason: str = "cancelled") -> None:
    """Cancel job `name` (`reason`: a key of store.CANCEL_REASONS): its cancel file, and its producer
    ids in the scheduler's cancels (`jobs/cancels.py`)."""
    from ..frontdoor.producer_book import ProducerBook

    store.write_cancel(data_dir, name, reason)
    cancels.add(data_dir, name, ProducerBook(data_dir).names.get(name, []))


def validate(path, endpoint: str, summary: dict | None = None) -> list[dict]:
    """The errors that fail a batch: lines naming another endpoint, custom_ids given twice. With the
    upload's `summary` (`upload.Lines`), a file whose lines all name the endpoint and repeat no
    custom_id passes without being read again."""
    if summary is not None and set(summary.get("urls", {})) <= {endpoint} and not summary.get("duplicates"):
        return []
    errors: list[dict] = []
    seen: set = set()
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                continue  # not a request: the submitter writes it to the error file
            if not isinstance(row, dict):
                continue
            url, cid = row.get("url"), row.get("custom_id")
            if isinstance(url, str) and url != endpoint:
                errors.append({"code": "invalid_url", "line": number, "param": "url",
                               "message": f"this batch's endpoint is {endpoint}; line {number} is for {url}"})
            if isinstance(cid, str):
                if cid in seen:
                    errors.append({"code": "duplicate_custom_id", "line": number, "param": "custom_id",
                                   "message": f"custom_id {cid!r} of line {number} is given on an earlier line too"})
                seen.add(cid)
            if len(errors) >= ERRORS_KEPT:
                break
    return errors


def _die_with_parent() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


class Runner:
    def __init__(self, data_dir: str, files: FileStore, batches: BatchStore):
        self.data_dir, self.files, self.batches = data_dir, files, batches
        self.procs: dict[str, subprocess.Popen] = {}
        self.started: dict[str, float] = {}
        self.bell = threading.Event()
        # a record is changed by this thread and by a cancel from a request: each change and its
        # save under this lock, and nothing else (no file read, described or synced but the record)
        self.lock = threading.Lock()
        self.logs = http_dir(data_dir) / "logs"
        os.makedirs(self.logs, mode=0o700, exist_ok=True)

    def run(self, stopping, beat=lambda: None) -> None:
        """Step every batch not ended until `stopping()`; then stop the submitters (resumed at the next start)."""
        try:
            while not stopping():
                beat()
                for rec in self.batches.active():
                    try:
                        self.step(rec)
                    except Exception:  # noqa: BLE001 - one batch's trouble must not stop the others
                        log.exception("batch %s", rec.id)
                self.bell.wait(TICK_SECONDS)
                self.bell.clear()
        finally:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.procs.values():
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()

    def step(self, rec: BatchRecord) -> None:
        if rec.phase == "validating":
            self._validate(rec)
        elif rec.phase == "running":
            self._watch(rec)

    def cancel(self, rec: BatchRecord, expired: bool = False) -> bool:
        """Ask a batch to stop (its job cancelled, its unfinished lines `cancelled`, or expired): the
        ask is saved in its record and this thread does the rest at its next step. False when the
        batch had ended already. Called from a request too: it waits for no disk work but the
        record's own save (see `lock`)."""
        with self.lock:
            if rec.phase == "ended":
                return False
            if not rec.cancelling_at:
                rec.cancelling_at = now()
                rec.expiring = expired
                self.batches.save(rec)
        self.bell.set()
        return True

    def _validate(self, rec: BatchRecord) -> None:
        if rec.cancelling_at:
            self._end(rec, None)
            return
        meta = self.files.get(rec.owner, rec.input_file_id)
        errors = validate(self.files.path(rec.input_file_id), rec.endpoint, meta.get("requests"))
        if errors:
            self._end(rec, None, errors)
            return
        with self.lock:
            if rec.cancelling_at:
                return  # asked while the file was read: ended at the next step
            rec.phase, rec.in_progress_at = "running", now()
            self.batches.save(rec)
        self._spawn(rec)

    def _watch(self, rec: BatchRecord) -> None:
        if time.time() > rec.expires_at and not rec.cancelling_at:
            self.cancel(rec, expired=True)
        view = self.batches.job_view(rec)
        if rec.cancelling_at and view is not None and view["cancel_requested_at"] is None \
                and view["status"] not in store.TERMINAL:
            cancel_job(self.data_dir, rec.id, "expired" if rec.expiring else "cancelled")
        proc = self.procs.get(rec.id)
        if proc is not None and proc.poll() is None:
            return
        self.procs.pop(rec.id, None)
        if view is not None and view["submitter_pid"] is None and job_view_ended(view):
            self._end(rec, view)
        elif view is None or view["submitter_pid"] is None:
            if time.monotonic() - self.started.get(rec.id, -RESPAWN_SECONDS) >= RESPAWN_SECONDS:
                self._spawn(rec)

    def _spawn(self, rec: BatchRecord) -> None:
        resume = store.is_job(self.data_dir, rec.id)
        argv = [sys.executable, "-m", "shmbroker.cli", "submit", str(self.files.path(rec.input_file_id)),
                "--data-dir", self.data_dir, "--job", rec.id, "--wait", "--out-format", "openai",
                "--out", str(self.files.path(rec.output_file_id)), "--error-file", str(self.files.path(rec.error_file_id))]
        with open(self.logs / f"{rec.id}.log", "ab") as err:
            self.procs[rec.id] = subprocess.Popen(argv + (["--resume"] if resume else []), stdin=subprocess.DEVNULL,
                                                  stdout=subprocess.DEVNULL, stderr=err, preexec_fn=_die_with_parent)
        self.started[rec.id] = time.monotonic()
        proc = self.procs[rec.id]
        threading.Thread(target=lambda: (proc.wait(), self.bell.set()), name=f"wait-{proc.pid}", daemon=True).start()
        log.info("batch %s: submitter pid %d%s", rec.id, self.procs[rec.id].pid, " (resumed)" if resume else "")

    def _end(self, rec: BatchRecord, view: dict | None, errors: list | None = None) -> None:
        """End a batch: `errors`, its validation's (it failed); else as its job ended (`view`), or
        cancelled or expired when that was asked before the end is saved. The output files are
        described first, without the lock (an output of gigabytes takes seconds to sync and count)."""
        began, described = now(), {}
        for kind, file_id in (("output", rec.output_file_id), ("error", rec.error_file_id)):
            got = self.files.register_output(rec.owner, file_id, f"{rec.id}_{kind}.jsonl")
            if got is not None:
                described[kind] = got
        counts = request_counts(view, self.files.lines(rec.owner, rec.input_file_id))
        if view is not None and rec.endpoint == EMBEDDINGS:  # its job counts inputs: the requests are its lines
            counts.update(completed=self.files.lines(rec.owner, described.get("output", "")),
                          failed=self.files.lines(rec.owner, described.get("error", "")))
        t = now()
        with self.lock:
            final = "failed" if errors else "expired" if rec.expiring else "cancelled" if rec.cancelling_at \
                else view["status"]
            rec.errors = errors or rec.errors
            rec.finalizing_at = rec.finalizing_at or (began if view is not None else None)
            rec.described, rec.counts = described, counts
            rec.final, rec.phase = final, "ended"
            setattr(rec, {"completed": "completed_at", "failed": "failed_at", "cancelled": "cancelled_at",
                          "expired": "expired_at"}[final], t)
            self.batches.save(rec)
        log.info("batch %s %s: %s", rec.id, final, rec.counts)
