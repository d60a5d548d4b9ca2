"""`submit --job`: the job a submit makes or resumes (its results' files: `jobsink.py`).

A job's name is its producer name. Before a run of prompts is pushed, each prompt's entry
({"item_id", "id", "line", "n", "max_new", "model"}: the item id it will get, its key, its line,
its prompt tokens, max_new_tokens and model; an OpenAI line's also its "endpoint" and "tail", the
prompt's last ids its output text is decoded after, `jobs/text.py`) is appended to the id sidecar and flushed, so a
SIGKILL at any point leaves every pushed item named there. `--resume` then counts a line as
submitted when its item was pushed: an item id of this broker lifetime below the producer's next
sequence number, one the backlog on disk still holds (an earlier lifetime's), or one the job's
tally counted a result for (read after the backlog: `attach`); every other line is submitted again.
A line of several items (an embeddings line's inputs) counts as submitted once all of them were.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from pathlib import Path

import numpy as np

from ..jobs import arriving, store
from ..jobs.store import JobError, JobMeta
from ..jobs.text import DECODE_CONTEXT_TOKENS
from ..ring.items import SEQ_BITS, SEQ_MASK
from .common import load_entries, print_error
from .jobsink import key_of

META_SECONDS = 1.0  # job.json is rewritten at most this often while submitting
CANCEL_POLL_SECONDS = 0.5
TALLY_WAIT_SECONDS = 5.0  # `submit --wait` waits this long at most for the job's counts to hold its results


def digest_and_lines(path: str) -> tuple[str, int]:
    """(sha256 of the file, its non-blank lines), one pass over its bytes."""
    h = hashlib.sha256()
    lines = 0
    tail = b""
    with open(path, "rb") as fh:
        while block := fh.read(1 << 20):
            h.update(block)
            parts = (tail + block).split(b"\n")
            tail = parts.pop()
            lines += sum(1 for p in parts if p.strip())
    lines += 1 if tail.strip() else 0
    return f"sha256:{h.hexdigest()}", lines


def new_name() -> str:
    return f"job-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def whole_lines(entries: list[dict]) -> set[int]:
    """The lines all of whose items these entries name (a line of several items, an embeddings line's
    inputs, names its count `parts` and each item's `part`); a line only partly named is submitted
    again whole, and the results of the parts it had are still read (each part counted once)."""
    parts: dict[int, set[int]] = {}
    whole = set()
    for e in entries:
        line, want = int(e["line"]), int(e.get("parts", 1))
        if want == 1:
            whole.add(line)
        else:
            got = parts.setdefault(line, set())
            got.add(int(e.get("part", 0)))
            if len(got) == want:
                whole.add(line)
    return whole


class JobRun:
    """The job of one `submit --job` run."""

    def __init__(self, data_dir: str, meta: JobMeta, resumed: bool):
        self.data_dir = data_dir
        self.meta = meta
        self.name = meta.name
        self.resumed = resumed
        self.entries: dict[int, dict] = {}  # item id -> entry, of the items whose results this run waits for
        self.keep_entries = False  # --wait: entries are kept until their result is written
        self.done_lines: set[int] = set()  # lines an earlier run submitted (resume skips them)
        self._saved_at = 0.0
        self._cancel_at = 0.0
        self.cancelled = False
        self.cancel_reason = "cancelled"  # a key of store.CANCEL_REASONS, once cancelled
        self.producer_id: int | None = None

    @classmethod
    def begin(cls, data_dir: str, name: str | None, path: str, fmt: str, resume: bool) -> JobRun:
        """Make the job (its directory taken exclusively, then validating: the file's digest and lines) or
        check that it may be taken up again; JobError says why not. Nothing of a resumed job is written
        before `claim`, once its producer name is held (the registry gives a name to one live process)."""
        name = store.check_name(name or new_name())
        if store.is_job(data_dir, name):
            meta = store.read_meta(data_dir, name)
            v = store.view(data_dir, name)
            if not resume:
                raise JobError(f"job {name!r} exists ({v['status']}, {meta.input}); --resume submits what has no result yet")
            digest, _ = digest_and_lines(path)
            if meta.digest != digest:
                raise JobError(f"job {name!r} was made from another input ({meta.digest}); {path} is {digest}")
            # A cancelled job may be taken up too: it submits nothing more (its lines left are written
            # as cancelled) and writes the results its output lacks.
            if v["submitter_pid"] is not None:
                raise JobError(f"job {name!r} is being submitted by pid {v['submitter_pid']}")
            return cls(data_dir, meta, True)
        if resume:
            raise JobError(f"no job {name!r} to resume in {data_dir}")
        from ..frontdoor.producer_book import ProducerBook

        if name in ProducerBook(data_dir).names:
            raise JobError(f"{name!r} is a producer name submitted under without a job; pick another job name")
        meta = JobMeta(name, os.path.abspath(path), "", 0, fmt)
        run = cls(data_dir, meta, False)
        run.own_pid()
        store.create(data_dir, meta)  # validating: seen as such while the file is read
        meta.digest, meta.lines = digest_and_lines(path)
        run.save()
        return run

    def own_pid(self) -> None:
        """This process is the job's submitter (its pid and start time in the job's record)."""
        from ..ring.liveness import start_ticks

        self.meta.submitter_pid, self.meta.submitter_start = os.getpid(), start_ticks(os.getpid()) or 0

    def claim(self) -> None:
        """This run submits the job now (its producer is connected): in_progress, under this pid."""
        self.own_pid()
        self.meta.phase, self.meta.error, self.meta.finished_at = "in_progress", None, None
        self.meta.submit_done = False
        self.save()

    def let_go(self, message: str) -> None:
        """The run could not connect: a job it made is failed (nothing was submitted); a resumed one is
        left as it was (another run may hold it)."""
        if not self.resumed:
            self.fail(message)

    def fail(self, message: str) -> None:
        self.meta.phase, self.meta.error, self.meta.finished_at = "failed", message, time.time()
        self.save()
        arriving.done(self.data_dir, self.name)

    def save(self) -> None:
        store.write_meta(self.data_dir, self.meta)
        self._saved_at = time.monotonic()

    # -- resume ---------------------------------------------------------------------------

    def attach(self, producer) -> None:
        """Find what an earlier run pushed (module docstring), once the producer is connected."""
        self.producer_id = producer.producer_id
        arriving.add(self.data_dir, self.name, producer.producer_id)  # held a moment while its lines come
        self.entries = load_entries(self.data_dir, self.name)
        if not self.entries:
            return
        current, next_seq = producer.producer_id, producer.next_item_id & SEQ_MASK
        from ..jobs.tally import JobTally

        ids = np.fromiter(self.entries, np.uint64, len(self.entries))
        pids, seqs = (ids >> np.uint64(SEQ_BITS)).astype(np.int64), (ids & np.uint64(SEQ_MASK)).astype(np.int64)
        pushed = (pids == current) & (seqs < next_seq)
        # The backlog is read before the tally. The results process saves its counts before its
        # acks, so an item the backlog no longer holds when read was counted on disk before the
        # tally is read; read the other way round, a checkpoint between the two reads loses it
        # from both, and it would run twice.
        earlier = pids != current
        if earlier.any():
            pushed |= np.isin(ids, self._backlog_ids()) & earlier
        tally = JobTally(self.data_dir, self.name)
        counted = np.zeros(ids.size, bool)
        for p in np.unique(pids).tolist():
            if p in tally.seen:
                mine = pids == p
                counted[mine] = tally.seen[p].contains(seqs[mine])
        submitted = pushed | counted
        self.done_lines = whole_lines([self.entries[int(i)] for i in ids[submitted].tolist()])
        self.meta.submitted = len(self.done_lines)
        self.meta.tokens = sum(int(self.entries[int(i)].get("n", 0)) for i in ids[submitted].tolist())
        self.entries = {i: self.entries[i] for i in ids[submitted].tolist()}

    def waiting_for(self, written: set[str], held=lambda entry: False) -> set[int]:
        """The items of earlier runs whose results this run waits for: those not in the output, nor
        `held` (an input's vector kept for its line, `jobsink.JobSink.holds`). A result is acknowledged
        only once written or held, so each of them comes to this run's reader (still to come, or again:
        popped by the killed run and never acknowledged), however far the job's tally has counted it.
        The entries of the others are dropped."""
        self.entries = {i: e for i, e in self.entries.items()
                        if key_of(e.get("id"), int(e["line"])) not in written and not held(e)}
        return set(self.entries)

    def _backlog_ids(self) -> np.ndarray:
        """The item ids the backlog on disk holds not done (read only, as the scheduler's start does)."""
        from ..spill.store import Backlog

        backlog, _ = Backlog.open(self.data_dir, readonly=True)
        try:
            return backlog.pending()["item_id"].copy()
        finally:
            backlog.close()

    # -- while submitting -----------------------------------------------------------------

    def entry(self, item_id: int, p) -> dict:
        e = {"item_id": item_id, "id": p.id, "line": p.line, "n": int(p.tokens.size), "max_new": p.max_new_tokens,
             "model": p.model}
        if p.endpoint is not None:
            e["endpoint"] = p.endpoint
        if p.endpoint is not None and p.max_new_tokens:
            e["tail"] = p.tokens[-DECODE_CONTEXT_TOKENS:].tolist()  # its output's text is decoded after them
        if p.reply:
            e.update(p.reply)
        if self.keep_entries:
            self.entries[item_id] = e
        return e

    def pushed(self, items: int, tokens: int) -> None:
        self.meta.submitted += items
        self.meta.tokens += tokens
        if time.monotonic() - self._saved_at >= META_SECONDS:
            self.save()

    def cancel_asked(self) -> bool:
        now = time.monotonic()
        if not self.cancelled and now >= self._cancel_at:
            self._cancel_at = now + CANCEL_POLL_SECONDS
            self.cancelled = store.cancel_requested(self.data_dir, self.name) is not None
            self.cancel_reason = store.cancel_reason(self.data_dir, self.name) if self.cancelled else "cancelled"
            if self.cancelled and self.producer_id is not None:  # an id the cancel could not know yet
                from ..jobs import cancels

                cancels.add(self.data_dir, self.name, [self.producer_id])
        return self.cancelled

    def submit_done(self, refused: int) -> None:
        self.meta.refused = refused
        self.meta.submit_done = True
        self.save()
        arriving.done(self.data_dir, self.name)

    def finished(self, cancelled: bool) -> None:
        """Every result is written (a cancelled job's phase stays: its status comes from the cancel).
        The results process saves its counts every checkpoint: wait (a bounded while) until they hold
        every result, so that the job's status and counts are final when `submit --wait` returns."""
        deadline = time.monotonic() + TALLY_WAIT_SECONDS
        while time.monotonic() < deadline:
            counts = store.read_counts(self.data_dir, self.name).get("counts", {})
            if sum(int(v) for v in counts.values()) >= self.meta.submitted:
                break
            time.sleep(0.05)
        if not cancelled:
            self.meta.phase = "completed"
        self.meta.finished_at = time.time()
        self.meta.submitter_pid = 0
        self.save()


def open_tokenizer(path: str | None, data_dir: str | None = None):
    """(the tokenizer lookup, 0): the tokenizer at `path` for every model, else the broker's
    `[tokenizers]` table (broker.json), else None; or (None, 2) after saying why it cannot be read."""
    from ..jobs.text import TextError, Tokenizer, Tokenizers

    if not path:
        paths = broker_description(data_dir).get("tokenizers") if data_dir else None
        return (Tokenizers(paths) if isinstance(paths, dict) and paths else None), 0
    try:
        return Tokenizer(path), 0
    except TextError as exc:
        print_error(str(exc))
        return None, 2


def broker_description(data_dir: str) -> dict:
    """The running broker's broker.json, or {} (none running, a remote producer, not described yet)."""
    from ..observe.watch import BROKER_FILE

    try:
        desc = json.loads((Path(data_dir) / BROKER_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return desc if isinstance(desc, dict) else {}
