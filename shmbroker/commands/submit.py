"""`shmbroker submit`: push prompts from a JSONL file (its own lines, OpenAI Batch request lines, or a
Mooncake-format trace) to a running broker, or with --cluster to a cluster's prompts stream on NATS
(a `RemoteProducer`); with --job as a batch job (`jobrun.py`) that has a status and a cancel.

`submit` streams the file in chunks (`Producer.submit_many`); a bad line costs only itself (an error
on stderr naming file and line, and with --wait a row of its own). Progress: `jobs/progress.py`; how
long --wait waits: `waiting.py`.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import Counter
from contextlib import ExitStack

import numpy as np

from ..jobs.progress import Progress
from ..jobs.store import CANCEL_REASONS, job_dir
from ..jobs.prompts import U32_MAX, LineError, Prompt
from ..ring.items import DEFAULT_MODEL
from .common import IdLog, ResultSink, config_data_dir, load_ids, open_output, open_producer, print_error, result_row, written_ids
from .reading import count_lines, read_prompts, read_trace
from .waiting import ItemModels, Patience

CHUNK_ITEMS = 1024  # prompts handed to submit_many at once
CHUNK_TOKENS = 1 << 20
SUBMIT_STALL_SECONDS = 60.0  # an ingest ring that stays full this long ends the submit


class _Submission:
    """One `submit` run: pushes chunks, records ids, and (--wait) collects the results."""

    def __init__(self, producer, idlog: IdLog, path: str, data_dir: str, job=None, progress=None):
        self.producer = producer
        self.data_dir = data_dir  # where the id sidecar lives (a remote producer's too)
        self.idlog = idlog
        self.job = job
        self.progress = progress
        self.sink = None  # with --wait: ResultSink, or a job's JobSink
        self.path = path
        self.submitted = 0
        self.refused = 0
        self.skipped = 0  # lines an earlier run of the job submitted
        self.cancelled = 0  # lines left unsubmitted because the job was cancelled
        self.ids: dict[int, str | int] = {}
        self.outstanding: set[int] = set()
        self.item_models = ItemModels()  # the model of each item in `outstanding`
        self.statuses: Counter[str] = Counter()
        self.generated = 0
        self.models: Counter[str | None] = Counter()  # items submitted per model name
        self._old_ids: dict | None = None

    def refuse(self, line: int, message: str, cid=None) -> None:
        self.refused += 1
        print_error(f"{self.path}:{line}: {message}")
        if self.job is not None and self.sink is not None:
            self.sink.line(line, message, cid)

    def push(self, chunk: list[Prompt]) -> None:
        """Submit a chunk in runs of one model and one prefix kind (submit_many's shared settings), in order."""
        if self.job is not None:
            if self.job.done_lines:
                kept = [p for p in chunk if p.line not in self.job.done_lines]
                self.skipped += len(chunk) - len(kept)
                chunk = kept
            if self.job.cancel_asked():  # the rest stays unsubmitted: cancelled
                self.cancelled += len(chunk)
                code, message = CANCEL_REASONS[self.job.cancel_reason]
                for p in chunk if self.sink is not None else ():
                    self.sink.line(p.line, message, p.id, code=code, status="cancelled")
                return
        start = 0
        for i in range(1, len(chunk) + 1):
            if i == len(chunk) or _run_key(chunk[i]) != _run_key(chunk[start]):
                self._push_run(chunk[start:i])
                start = i
        self.idlog.flush()
        if self.sink is not None:
            self.drain(0.0)
        self.show()

    def _intend(self, run: list[Prompt]) -> None:
        """A job's entries for a run, written (and flushed) before it is pushed (jobrun.py)."""
        if self.job is None:
            return
        first = self.producer.next_item_id
        for k, p in enumerate(run):
            self.idlog.write_row(self.job.entry(first + k, p))
        self.idlog.flush()

    def _push_run(self, run: list[Prompt]) -> None:
        from ..errors import Full

        lengths = np.array([p.tokens.size for p in run], np.int64)
        offsets = np.zeros(len(run) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate([p.tokens for p in run]) if len(run) > 1 else run[0].tokens
        max_new = [p.max_new_tokens for p in run]
        prefix = None if run[0].prefix_len is None else np.array([p.prefix_len for p in run], np.int64)
        self._intend(run)
        try:
            ids = self.producer.submit_many(
                flat, offsets, max_new_tokens=max_new[0] if len(set(max_new)) == 1 else np.array(max_new, np.int64),
                prefix_len=prefix, model=run[0].model, options=run[0].options)
        except (ValueError, TypeError):
            # one item is refused: find it (and keep the others) one submit at a time
            for p in run:
                self._intend([p])
                try:
                    item = self.producer.submit(p.tokens, max_new_tokens=p.max_new_tokens, prefix_len=p.prefix_len,
                                                model=p.model, options=p.options)
                except (ValueError, TypeError) as exc:
                    self.refuse(p.line, f"refused by the producer: {exc}", p.id)
                else:
                    self._record(p, item)
            return
        except Full as exc:
            for p, item in zip(run, exc.ids):
                self._record(p, int(item))
            raise
        for p, item in zip(run, ids.tolist()):
            self._record(p, item)

    def _record(self, p: Prompt, item: int) -> None:
        self.submitted += 1
        self.models[p.model] += 1
        if self.sink is not None:
            self.outstanding.add(item)
            self.item_models.add(item, p.model)
        if self.job is not None:
            self.job.pushed(1, int(p.tokens.size))
        elif p.id is not None:
            self.ids[item] = p.id
            self.idlog.write(item, p.id, p.line)

    def drain(self, timeout_seconds: float) -> int:
        """Write the results that came (waiting up to `timeout_seconds` for more, while any is missing);
        returns how many."""
        n = 0
        for r in self.producer.results(timeout_seconds=timeout_seconds if self.outstanding else 0.0, auto_ack=False):
            self.outstanding.discard(r.item_id)
            if self._write(r):
                self.statuses[r.status] += 1
                self.generated += r.tokens.size
            n += 1
            if timeout_seconds and not self.outstanding:
                break  # all in: take what already came without waiting for more
        if timeout_seconds and not self.outstanding:
            n += self.drain(0.0)
        if n:
            self.sink.commit()
            self.show()
        return n

    def _write(self, r) -> bool:
        if self.job is not None:
            if r.status == "cancelled" and self.job.cancel_asked():  # the cancel's code for its lines
                self.sink.cancel = CANCEL_REASONS[self.job.cancel_reason]
            return self.sink.result(r, self.job.entries.pop(r.item_id, None))
        ids = self.ids
        if r.item_id not in ids and self._old_ids is None:
            self._old_ids = load_ids(self.data_dir, self.producer.name)  # an earlier run's
        if r.item_id not in ids:
            ids = self._old_ids
        return self.sink.write(r.item_id, result_row(r, ids))

    def show(self) -> None:
        if self.progress is not None:
            ok = self.statuses.get("ok", 0)
            self.progress.update(submitted=self.submitted + self.skipped, results=sum(self.statuses.values()),
                                 ok=ok, failed=sum(self.statuses.values()) - ok + self.refused, tokens=self.generated,
                                 status="cancelling" if self.cancelled else "")

    def wait(self, patience: Patience) -> bool:
        """Read results until every submitted item has one; False once `patience` gives up (waiting.py)."""
        while self.outstanding:
            if self.drain(patience.read_seconds()):
                patience.result_came()
            elif patience.gives_up(lambda: self.item_models.of(self.outstanding)):
                return False
            else:
                self.show()
        return True


def _run_key(p: Prompt) -> tuple:
    return p.model, p.prefix_len is None, p.options


def _checks(args) -> str | None:
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= U32_MAX:
        return f"--max-new-tokens must be in 1..{U32_MAX}, got {args.max_new_tokens}"
    if not os.path.isfile(args.file) or not os.access(args.file, os.R_OK):
        return f"{args.file}: no such readable file"
    job = args.job is not None or args.resume
    if job and args.name is not None:
        return "--job names the producer too: give --job or --name, not both"
    if job and getattr(args, "cluster", None):
        return "a job is kept in a broker's data directory: --job and --resume do not go with --cluster"
    if args.resume and args.job is None:
        return "--resume needs --job NAME (the job to take up again)"
    if (args.out_format != "native" or args.error_file) and not job:
        return "--out-format openai and --error-file are a job's: add --job NAME"
    if args.error_file and args.out_format != "openai":
        return "--error-file goes with --out-format openai (the native format keeps errors in its rows)"
    if args.idle_timeout is not None and not (args.wait and args.idle_timeout > 0):
        return "--idle-timeout goes with --wait and takes a number of seconds > 0"
    return None


def submit(args) -> int:
    from ..errors import BrokerError, Full
    from .jobrun import open_tokenizer

    data_dir = config_data_dir(args)
    if data_dir is None:
        return 2
    problem = _checks(args)
    if problem:
        print_error(problem)
        return 2
    tokenizer, code = open_tokenizer(args.tokenizer, data_dir)
    if code:
        return code
    named = _job_and_name(args, data_dir)
    if named is None:
        return 2
    job, name = named
    try:
        producer = open_producer(args, name, data_dir, timeout_seconds=SUBMIT_STALL_SECONDS)
    except ValueError as exc:  # a producer name the cluster refuses
        print_error(str(exc))
        return _failed(job, str(exc), 2)
    except (BrokerError, OSError) as exc:
        print_error(str(exc))
        return _failed(job, str(exc), 1)
    _announce(args, job, name, producer)
    t0 = time.monotonic()
    idlog = IdLog(data_dir, name)
    total = job.meta.lines if job is not None else count_lines(args.file)
    progress = Progress(f"job {name}" if job is not None else "submit", total, plain_seconds=args.progress_seconds)
    run = _Submission(producer, idlog, args.file, data_dir, job, progress)
    complete = True
    try:
        with producer, ExitStack() as files, progress:
            if args.wait:
                _attach_sink(args, run, files, tokenizer)
            _submit_all(args, run, tokenizer)
            print_error(f"{_submitted_line(run)}, in {time.monotonic() - t0:.2f} s (producer {name!r})")
            if args.wait:
                complete = _wait_all(args, run, name)
    except Full as exc:
        print_error(f"the {'cluster' if getattr(args, 'cluster', None) else 'broker'} took no item for {SUBMIT_STALL_SECONDS:.0f} s ({exc}); stopped after "
             f"{run.submitted} items: the rest of {args.file} was not submitted")
        return 1
    except BrokerError as exc:
        print_error(f"{exc} (after {run.submitted} items)")
        return 1
    except OSError as exc:  # the --out file, or the prompts file gone meanwhile
        print_error(f"{exc} (after {run.submitted} items)")
        return 2 if run.submitted == 0 else 1
    except KeyboardInterrupt:
        print_error(f"interrupted after {run.submitted} items (producer {name!r})")
        return 130
    finally:
        idlog.close()
        producer.close()
        if job is not None and job.meta.submitter_pid:
            job.meta.submitter_pid = 0  # this run is over: the status need not wait for its pid to go
            job.save()
    return 0 if run.refused == 0 and complete else 1


def _job_and_name(args, data_dir: str):
    """(the JobRun of --job/--resume or None, the producer name); None when the job cannot begin
    (why is printed)."""
    from ..jobs.store import JobError
    from .jobrun import JobRun

    if args.job is None and not args.resume:
        # a default name no other run can have had (a pid is reused; the results of an earlier run's
        # name would come to this one)
        return None, args.name or f"submit-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        job = JobRun.begin(data_dir, args.job or None, args.file, "trace" if args.trace else "jsonl", args.resume)
    except (JobError, OSError, ValueError) as exc:  # ValueError: a damaged producer book
        print_error(str(exc))
        return None
    return job, job.name


def _announce(args, job, name: str, producer) -> None:
    """Take the job (when there is one) for this run, and say on stderr what is being submitted."""
    if job is None:
        where = f" --cluster {args.cluster}" if getattr(args, "cluster", None) else ""
        print_error(f"submitting {args.file} as producer {name!r} (results: shmbroker results --name {name}{where})")
        return
    job.claim()
    job.attach(producer)
    if not args.wait:
        job.entries.clear()  # no results to write: the sidecar keeps them
    again = f", resumed: {len(job.done_lines)} lines submitted before" if job.resumed else ""
    print_error(f"job {name!r}: {job.meta.lines} lines of {args.file}{again} (shmbroker job {name}; shmbroker cancel {name})")


def _attach_sink(args, run: _Submission, files: ExitStack, tokenizer) -> None:
    """--wait: where the run's results go (--out, and a job's error file), opened in `files`."""
    from .jobsink import JobSink, error_path, written_keys

    out = files.enter_context(open_output(args.out))
    job = run.job
    if job is None:
        run.sink = ResultSink(out, run.producer, written_ids(args.out))
        return
    errors_at = (args.error_file or error_path(args.out)) if args.out_format == "openai" else None
    errors = files.enter_context(open_output(errors_at)) if errors_at is not None else None
    written = written_keys(args.out, errors_at)
    run.sink = JobSink(out, errors, run.producer, args.out_format, tokenizer, written, job_dir(run.data_dir, job.name))
    files.callback(run.sink.close)
    run.sink.write_whole(job.entries.values())
    run.outstanding |= (waiting := job.waiting_for(run.sink.written, run.sink.holds))
    for item in sorted(waiting):
        run.item_models.add(item, job.entries[item].get("model"))
    job.keep_entries = True


def _submit_all(args, run: _Submission, tokenizer) -> None:
    """Push the file's prompts in chunks (a bad line refused alone), then tell the job it is all in."""
    lines = read_trace(args.file, args.max_new_tokens) if args.trace else \
        read_prompts(args.file, args.max_new_tokens, tokenizer, args.model)
    chunk: list[Prompt] = []
    tokens = 0
    for entry in lines:
        if isinstance(entry, LineError):
            run.refuse(entry.line, entry.message, entry.id)
            continue
        chunk.append(entry)
        tokens += entry.tokens.size
        if len(chunk) >= CHUNK_ITEMS or tokens >= CHUNK_TOKENS:
            run.push(chunk)
            chunk, tokens = [], 0
    if chunk:
        run.push(chunk)
    if run.job is not None:
        run.job.submit_done(run.refused)
    if not getattr(args, "cluster", None):
        _unserved(run.data_dir, run.models)


def _submitted_line(run: _Submission) -> str:
    more = f", {run.skipped} submitted by an earlier run" if run.skipped else ""
    more += f", {run.cancelled} not submitted (the job was cancelled)" if run.cancelled else ""
    return f"submitted {run.submitted} items, refused {run.refused} line{'' if run.refused == 1 else 's'}{more}"


def _wait_all(args, run: _Submission, name: str) -> bool:
    """--wait: every result written (or the wait gave up, `waiting.Patience`); whether all came."""
    job = run.job
    patience = Patience(None if getattr(args, "cluster", None) else run.data_dir, args.idle_timeout)
    try:
        complete = run.wait(patience)
    finally:
        patience.close()
    if job is not None and complete:
        job.meta.phase = "finalizing"
        job.save()
    run.sink.commit()
    counts = ", ".join(f"{k} {v}" for k, v in sorted(run.statuses.items()))
    where = f" to {args.out}" if args.out else ""
    print_error(f"{sum(run.statuses.values())} results ({counts or 'none'}) written{where}")
    if not complete:
        print_error(f"gave up waiting: {patience.why}; {len(run.outstanding)} items still without a result "
                    f"(later: shmbroker results --name {name})")
    elif job is not None:
        job.finished(cancelled=job.cancelled)
    return complete


def _unserved(data_dir: str, models) -> None:
    """Say which of the models submitted no consumer of the broker serves (their items come back
    `invalid`): an OpenAI Batch file names its model in every line, a broker's consumers may name none."""
    from .jobrun import broker_description

    try:
        served = set(broker_description(data_dir)["models"])
    except (KeyError, TypeError):
        return  # a remote producer, or a broker that has not described itself: nothing to compare
    for model, n in sorted(models.items(), key=lambda kv: str(kv[0])):
        if (model or DEFAULT_MODEL) not in served:
            print_error(f"no consumer of this broker serves model {model!r} ({n} items: they come back invalid); it serves "
                 f"{', '.join(sorted(served))} (--model NAME sets every line's model; --model default: the default one)")


def _failed(job, message: str, code: int) -> int:
    if job is not None:
        job.let_go(message)
    return code
