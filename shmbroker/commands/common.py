"""What the commands share: the data directory, error lines, the results output, the id sidecar and result rows.

A prompt's `id` is kept in `<data_dir>/submit-ids/<name>.jsonl` ({"item_id",
"id", "line"} a line), so `results` (or `submit --wait`) hands it back with the
item's result. Results are written as JSON lines {"item_id", "id", "status",
"tokens", "error"}, appended to --out (a second run must not overwrite the first
one's). A result is acknowledged to the broker only after its line is flushed and
fsynced (`ResultSink`), so a reader killed mid-stream loses none; what it wrote but
had not acknowledged comes again, and a run on the same --out skips the item ids
already in it, so the file holds each result once.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from contextlib import contextmanager
from pathlib import Path

IDS_DIR = "submit-ids"
COMMIT_ROWS = 4096  # results written between two flush+fsync+ack steps, at most
COMMIT_SECONDS = 0.5  # and seconds


def print_error(message: str) -> None:
    """A command's error line on standard error, "shmbroker: <message>"."""
    print(f"shmbroker: {message}", file=sys.stderr, flush=True)


def config_data_dir(args) -> str | None:
    """The data directory the command's --config and --data-dir name; None once the configuration's
    error was printed."""
    from ..config import settings

    try:
        return settings.load(args.config, data_dir=args.data_dir).data_dir
    except settings.ConfigError as exc:
        print_error(str(exc))
        return None


def open_producer(args, name: str, data_dir: str, **kw):
    """The producer a command submits and reads through: a `Producer` on the data directory's broker,
    or with --cluster URL[,URL...] a `RemoteProducer` on those NATS servers. Raises BrokerError or
    OSError (no broker, no server) and ValueError (a name the cluster refuses)."""
    if getattr(args, "cluster", None):
        from ..cluster.remote import RemoteProducer

        return RemoteProducer(name, servers=tuple(u.strip() for u in args.cluster.split(",") if u.strip()), **kw)
    from ..client.producer import Producer

    return Producer(name, data_dir=data_dir, **kw)


ITEM_ID_RE = re.compile(rb'"item_id": (\d+)')


def written_ids(path: str | None) -> set[int]:
    """The item ids already in an output file (its whole lines)."""
    if path is None:
        return set()
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return set()
    return {int(m) for m in ITEM_ID_RE.findall(data)}


@contextmanager
def open_output(path: str | None):
    """The results file (appended to: results are read once) or standard output."""
    if path is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    _cut_torn_line(path)
    with open(path, "a", encoding="utf-8") as fh:
        yield fh


def _cut_torn_line(path: str) -> None:
    """A run killed mid-write can leave half a line at the end of the file: its result was never
    acknowledged, so it comes again; cut the half line so the next run's first line stays whole."""
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return
    try:
        size = os.fstat(fd).st_size
        end = size
        while end > 0:
            start = max(0, end - 65536)
            piece = os.pread(fd, end - start, start)
            if end == size and piece.endswith(b"\n"):
                return
            k = piece.rfind(b"\n")
            if k >= 0:
                end = start + k + 1
                break
            end = start
        os.ftruncate(fd, end)
        os.fsync(fd)
    finally:
        os.close(fd)


def _ids_path(data_dir: str, name: str) -> Path:
    return Path(data_dir) / IDS_DIR / f"{name}.jsonl"


def load_entries(data_dir: str, name: str) -> dict[int, dict]:
    """item id -> its sidecar row, of producer `name` (the last row written for an id wins: a job's run
    refused part way writes its ids again; a torn last line is skipped: its run was never pushed)."""
    out: dict[int, dict] = {}
    try:
        fh = open(_ids_path(data_dir, name), encoding="utf-8")
    except FileNotFoundError:
        return out
    with fh:
        for line in fh:
            try:
                row = json.loads(line)
                out[int(row["item_id"])] = row
            except (ValueError, KeyError, TypeError):
                continue
    return out


def load_ids(data_dir: str, name: str) -> dict[int, str | int]:
    """item id -> user id from the sidecar of producer `name`."""
    return {i: row.get("id") for i, row in load_entries(data_dir, name).items()}


class IdLog:
    """Appends {"item_id", "id", "line"} for every submitted prompt that has an id; opened on first use."""

    def __init__(self, data_dir: str, name: str):
        self.path = _ids_path(data_dir, name)
        self._fh = None

    def _open(self) -> None:
        self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.path.parent, 0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        self._fh = os.fdopen(fd, "a", encoding="utf-8")

    def write(self, item_id: int, user_id, line: int) -> None:
        self.write_row({"item_id": item_id, "id": user_id, "line": line})

    def write_row(self, row: dict) -> None:
        if self._fh is None:
            self._open()
        self._fh.write(json.dumps(row) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def result_row(r, ids: dict) -> str:
    return json.dumps({"item_id": r.item_id, "id": ids.get(r.item_id), "status": r.status,
                       "tokens": r.tokens.tolist(), "error": r.error})


class ResultSink:
    """Result rows to an output (and, where the format has one, failed results to an error file),
    acknowledged to the broker once they are durable there: every COMMIT_ROWS rows or COMMIT_SECONDS,
    and at `commit()`, the files are flushed and fsynced (where they can be: a pipe or a terminal
    cannot) and then the producer's results are acked. `jobrun.JobSink` keys a job's rows by custom_id."""

    def __init__(self, out, producer, written: set | None = None, errors=None):
        self.out = out
        self.errors = errors
        self.producer = producer
        self.written = written or set()  # the keys (here item ids) the output holds already (an earlier run's)
        self.skipped = 0
        self.rows = 0
        self.since = time.monotonic()

    def write(self, item_id: int, row: str) -> bool:
        """Write one result's row (False: the output had it already)."""
        if item_id in self.written:
            self.skipped += 1
            return False
        self._put(self.out, row)
        return True

    def _put(self, fh, row: str) -> None:
        fh.write(row + "\n")
        self.rows += 1
        if self.rows >= COMMIT_ROWS or time.monotonic() - self.since >= COMMIT_SECONDS:
            self.commit()

    def commit(self) -> None:
        for fh in (self.out, self.errors):
            if fh is None:
                continue
            fh.flush()
            try:
                os.fsync(fh.fileno())
            except (OSError, ValueError, AttributeError):
                pass  # not a file (a pipe, a terminal, a StringIO): flushed is all there is
        self.producer.ack()
        self.rows = 0
        self.since = time.monotonic()
