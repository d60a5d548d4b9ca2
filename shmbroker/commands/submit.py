"""`shmbroker submit`: push prompts from a JSONL file (or a Mooncake-format trace) to a running broker,
or with --cluster to a cluster's prompts stream on NATS (a `RemoteProducer`).

`submit` streams the file in chunks (`Producer.submit_many`); a bad line costs
only itself (an error on stderr naming file and line).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import time
from collections import Counter
from contextlib import nullcontext

import numpy as np

from ..prompts import U32_MAX, LineError, Prompt, parse_line
from .common import ResultSink, _data_dir, _err, _IdLog, _load_ids, _open_producer, _output, _result_row, _written_ids

CHUNK_ITEMS = 1024  # prompts handed to submit_many at once
CHUNK_TOKENS = 1 << 20
TRACE_CHUNK_LINES = 256  # trace lines synthesised at once
SUBMIT_STALL_SECONDS = 60.0  # an ingest ring that stays full this long ends the submit
WAIT_IDLE_SECONDS = 60.0  # --wait gives up when no result came for this long


def _progress(what: str):
    """A rich progress bar on stderr; a no-op when stderr is not a terminal."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
    from rich.text import Text

    class Rate(ProgressColumn):
        def render(self, task) -> Text:
            speed = task.finished_speed or task.speed
            return Text("-- items/s" if speed is None else f"{speed:,.0f} items/s")

    return Progress(TextColumn(what), BarColumn(), MofNCompleteColumn(), Rate(), TimeElapsedColumn(),
                    console=Console(stderr=True), disable=not sys.stderr.isatty())


# -- reading prompts ---------------------------------------------------------------------


def _read_prompts(path: str, default_max_new: int | None):
    """Prompt or LineError per non-blank line; `default_max_new` fills in a missing max_new_tokens."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                if default_max_new is not None and '"max_new_tokens"' not in line:
                    row = json.loads(line)
                    if isinstance(row, dict):
                        row["max_new_tokens"] = default_max_new
                        line = json.dumps(row)
                yield parse_line(line, number)
            except ValueError as exc:
                msg = str(exc)
                if isinstance(exc, json.JSONDecodeError):
                    msg = f"not JSON ({exc.msg} at column {exc.colno})"
                yield LineError(path, number, msg)


def _read_trace(path: str, default_max_new: int | None):
    """Mooncake trace lines as Prompts (tokens synthesised as `workloads.trace.load` does), LineError per bad line."""
    from ..workloads.trace import TRACE_BLOCK_TOKENS, synthesise

    rows: list[tuple[int, int, int, list[int]]] = []

    def flush():
        lengths = np.array([r[1] for r in rows], np.int64)
        offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        hash_offsets = np.zeros(len(rows) + 1, np.int64)
        np.cumsum([len(r[3]) for r in rows], out=hash_offsets[1:])
        hashes = np.array([h for r in rows for h in r[3]], np.int64)
        tokens = np.empty(int(offsets[-1]), np.uint32)
        synthesise(hashes, hash_offsets, lengths, TRACE_BLOCK_TOKENS, 32_000, tokens, offsets)
        out = [Prompt(r[0], tokens[offsets[i] : offsets[i + 1]], r[2]) for i, r in enumerate(rows)]
        rows.clear()
        return out

    with open(path, encoding="utf-8", errors="replace") as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                n = int(row["input_length"])
                hashes = [int(x) for x in row["hash_ids"]]
                if "output_length" in row:
                    max_new = max(1, int(row["output_length"]))
                else:
                    max_new = default_max_new if default_max_new is not None else 1
            except (ValueError, KeyError, TypeError) as exc:
                yield LineError(path, number, f"not a Mooncake trace record ({type(exc).__name__}: {exc})")
                continue
            b = TRACE_BLOCK_TOKENS
            if n < 1 or not hashes or (len(hashes) - 1) * b >= n or len(hashes) * b < n:
                yield LineError(path, number, f"input_length {n} does not match {len(hashes)} blocks of {b} tokens")
                continue
            if not all(-(1 << 63) <= h < (1 << 63) for h in hashes):
                yield LineError(path, number, "hash_ids must be 64-bit integers")
                continue
            rows.append((number, n, max_new, hashes))
            if len(rows) >= TRACE_CHUNK_LINES:
                yield from flush()
    if rows:
        yield from flush()


def _count_lines(path: str) -> int:
    with open(path, "rb") as fh:
        return sum(1 for line in fh if line.strip())


# -- submit ------------------------------------------------------------------------------


class _Submission:
    """One `submit` run: pushes chunks, records ids, and (--wait) collects the results."""

    def __init__(self, producer, idlog: _IdLog, out, path: str, data_dir: str):
        self.producer = producer
        self.data_dir = data_dir  # where the id sidecar lives (a remote producer's too)
        self.idlog = idlog
        self.out = out
        self.sink = None
        self.path = path
        self.submitted = 0
        self.refused = 0
        self.ids: dict[int, str | int] = {}
        self.outstanding: set[int] = set()
        self.statuses: Counter[str] = Counter()
        self._old_ids: dict | None = None

    def refuse(self, line: int, message: str) -> None:
        self.refused += 1
        _err(f"{self.path}:{line}: {message}")

    def push(self, chunk: list[Prompt]) -> None:
        """Submit a chunk in runs of one model and one prefix kind (submit_many's shared settings), in order."""
        start = 0
        for i in range(1, len(chunk) + 1):
            if i == len(chunk) or _run_key(chunk[i]) != _run_key(chunk[start]):
                self._push_run(chunk[start:i])
                start = i
        self.idlog.flush()
        if self.out is not None:
            self.drain(0.0)

    def _push_run(self, run: list[Prompt]) -> None:
        from ..errors import Full

        lengths = np.array([p.tokens.size for p in run], np.int64)
        offsets = np.zeros(len(run) + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate([p.tokens for p in run]) if len(run) > 1 else run[0].tokens
        max_new = [p.max_new_tokens for p in run]
        prefix = None if run[0].prefix_len is None else np.array([p.prefix_len for p in run], np.int64)
        try:
            ids = self.producer.submit_many(
                flat, offsets, max_new_tokens=max_new[0] if len(set(max_new)) == 1 else np.array(max_new, np.int64),
                prefix_len=prefix, model=run[0].model)
        except (ValueError, TypeError):
            # one item is refused: find it (and keep the others) one submit at a time
            for p in run:
                try:
                    item = self.producer.submit(p.tokens, max_new_tokens=p.max_new_tokens, prefix_len=p.prefix_len,
                                                model=p.model)
                except (ValueError, TypeError) as exc:
                    self.refuse(p.line, f"refused by the producer: {exc}")
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
        if self.out is not None:
            self.outstanding.add(item)
        if p.id is not None:
            self.ids[item] = p.id
            self.idlog.write(item, p.id, p.line)

    def drain(self, timeout_seconds: float) -> int:
        """Write the results that came (waiting up to `timeout_seconds` for more, while any is missing);
        returns how many."""
        n = 0
        for r in self.producer.results(timeout_seconds=timeout_seconds if self.outstanding else 0.0, auto_ack=False):
            self.outstanding.discard(r.item_id)
            ids = self.ids
            if r.item_id not in ids and self._old_ids is None:
                self._old_ids = _load_ids(self.data_dir, self.producer.name)  # an earlier run's
            if r.item_id not in ids:
                ids = self._old_ids
            if self.sink.write(r.item_id, _result_row(r, ids)):
                self.statuses[r.status] += 1
            n += 1
            if timeout_seconds and not self.outstanding:
                break  # all in: take what already came without waiting for more
        if timeout_seconds and not self.outstanding:
            n += self.drain(0.0)
        if n:
            self.sink.commit()
        return n

    def wait(self) -> bool:
        """Read results until every submitted item has one; False after WAIT_IDLE_SECONDS without any."""
        last = time.monotonic()
        while self.outstanding:
            if self.drain(min(1.0, WAIT_IDLE_SECONDS)):
                last = time.monotonic()
            elif time.monotonic() - last > WAIT_IDLE_SECONDS:
                return False
        return True


def _run_key(p: Prompt) -> tuple:
    return p.model, p.prefix_len is None


def submit(args) -> int:
    from ..errors import BrokerError, Full

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= U32_MAX:
        _err(f"--max-new-tokens must be in 1..{U32_MAX}, got {args.max_new_tokens}")
        return 2
    if not os.path.isfile(args.file) or not os.access(args.file, os.R_OK):
        _err(f"{args.file}: no such readable file")
        return 2
    # a default name no other run can have had (a pid is reused; the results of an earlier run's
    # name would come to this one)
    name = args.name or f"submit-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        producer = _open_producer(args, name, data_dir, timeout_seconds=SUBMIT_STALL_SECONDS)
    except ValueError as exc:  # a producer name the cluster refuses
        _err(str(exc))
        return 2
    except (BrokerError, OSError) as exc:
        _err(str(exc))
        return 1
    where = f" --cluster {args.cluster}" if getattr(args, "cluster", None) else ""
    _err(f"submitting {args.file} as producer {name!r} (results: shmbroker results --name {name}{where})")
    t0 = time.monotonic()
    idlog = _IdLog(data_dir, name)
    job = _Submission(producer, idlog, None, args.file, data_dir)
    complete = True
    try:
        with producer, (_output(args.out) if args.wait else nullcontext()) as out, _progress("submit") as bar:
            job.out = out
            job.sink = ResultSink(out, producer, _written_ids(args.out)) if out is not None else None
            task = bar.add_task("submit", total=None if bar.disable else _count_lines(args.file))
            lines = (_read_trace if args.trace else _read_prompts)(args.file, args.max_new_tokens)
            chunk: list[Prompt] = []
            tokens = 0
            for entry in lines:
                if isinstance(entry, LineError):
                    job.refuse(entry.line, entry.message)
                    bar.advance(task)
                    continue
                chunk.append(entry)
                tokens += entry.tokens.size
                if len(chunk) >= CHUNK_ITEMS or tokens >= CHUNK_TOKENS:
                    job.push(chunk)
                    bar.advance(task, len(chunk))
                    chunk, tokens = [], 0
            if chunk:
                job.push(chunk)
                bar.advance(task, len(chunk))
            bar.stop()
            _err(f"submitted {job.submitted} items, refused {job.refused} line{'' if job.refused == 1 else 's'}, in "
                 f"{time.monotonic() - t0:.2f} s (producer {name!r})")
            if args.wait:
                complete = job.wait()
                counts = ", ".join(f"{k} {v}" for k, v in sorted(job.statuses.items()))
                where = f" to {args.out}" if args.out else ""
                _err(f"{sum(job.statuses.values())} results ({counts or 'none'}) written{where}")
                if not complete:
                    _err(f"no result came for {WAIT_IDLE_SECONDS:.0f} s; {len(job.outstanding)} items still "
                         f"without one (later: shmbroker results --name {name})")
    except Full as exc:
        _err(f"the {'cluster' if getattr(args, 'cluster', None) else 'broker'} took no item for {SUBMIT_STALL_SECONDS:.0f} s ({exc}); stopped after "
             f"{job.submitted} items: the rest of {args.file} was not submitted")
        return 1
    except BrokerError as exc:
        _err(f"{exc} (after {job.submitted} items)")
        return 1
    except OSError as exc:  # the --out file, or the prompts file gone meanwhile
        _err(f"{exc} (after {job.submitted} items)")
        return 2 if job.submitted == 0 else 1
    except KeyboardInterrupt:
        _err(f"interrupted after {job.submitted} items (producer {name!r})")
        return 130
    finally:
        idlog.close()
        producer.close()
    return 0 if job.refused == 0 and complete else 1
