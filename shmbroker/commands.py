"""`shmbroker submit`, `shmbroker results`, `shmbroker status`: the user-facing commands around a running broker.

    shmbroker submit prompts.jsonl [--trace] [--name N] [--wait [--out F]]
    shmbroker results --name N [--out F] [--timeout S]
    shmbroker status [--json]

`submit` streams the file in chunks (`Producer.submit_many`); a bad line costs
only itself (an error on stderr naming file and line). A prompt's `id` is kept
in `<data_dir>/submit-ids/<name>.jsonl` ({"item_id", "id", "line"} a line), so
`results` (or `submit --wait`) hands it back with the item's result. Results
are written as JSON lines {"item_id", "id", "status", "tokens", "error"},
appended to --out (a result is read from the broker once: a second run must
not overwrite the first one's). `status` reads the control segment twice, half
a second apart, and shows processes, consumers, backlog and rates.

Exit status: 0 done; 1 some lines refused, a result missing, no broker; 2 a
bad configuration, file or option.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import numpy as np

from .prompts import U32_MAX, LineError, Prompt, parse_line

IDS_DIR = "submit-ids"
CHUNK_ITEMS = 1024  # prompts handed to submit_many at once
CHUNK_TOKENS = 1 << 20
TRACE_CHUNK_LINES = 256  # trace lines synthesised at once
SUBMIT_STALL_SECONDS = 60.0  # an ingest ring that stays full this long ends the submit
WAIT_IDLE_SECONDS = 60.0  # --wait gives up when no result came for this long
RATE_SECONDS = 0.5  # `status` samples the counters twice, this far apart


# -- shared ------------------------------------------------------------------------------


def _err(message: str) -> None:
    print(f"shmbroker: {message}", file=sys.stderr, flush=True)


def _data_dir(args) -> str | None:
    from . import settings

    try:
        return settings.load(args.config, data_dir=args.data_dir).data_dir
    except settings.ConfigError as exc:
        _err(str(exc))
        return None


@contextmanager
def _output(path: str | None):
    """The results file (appended to: results are read once) or standard output."""
    if path is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    with open(path, "a", encoding="utf-8") as fh:
        yield fh


def _ids_path(data_dir: str, name: str) -> Path:
    return Path(data_dir) / IDS_DIR / f"{name}.jsonl"


def _load_ids(data_dir: str, name: str) -> dict[int, str | int]:
    """item id -> user id from the sidecar of producer `name` (a torn last line is skipped)."""
    out: dict[int, str | int] = {}
    try:
        fh = open(_ids_path(data_dir, name), encoding="utf-8")
    except FileNotFoundError:
        return out
    with fh:
        for line in fh:
            try:
                row = json.loads(line)
                out[int(row["item_id"])] = row["id"]
            except (ValueError, KeyError, TypeError):
                continue
    return out


class _IdLog:
    """Appends {"item_id", "id", "line"} for every submitted prompt that has an id; opened on first use."""

    def __init__(self, data_dir: str, name: str):
        self.path = _ids_path(data_dir, name)
        self._fh = None

    def write(self, item_id: int, user_id, line: int) -> None:
        if self._fh is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path.parent, 0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.fchmod(fd, 0o600)
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
        self._fh.write(json.dumps({"item_id": item_id, "id": user_id, "line": line}) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _result_row(r, ids: dict) -> str:
    return json.dumps({"item_id": r.item_id, "id": ids.get(r.item_id), "status": r.status,
                       "tokens": r.tokens.tolist(), "error": r.error})


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
    """Mooncake trace lines as Prompts (tokens synthesised as `bench.trace.load` does), LineError per bad line."""
    from .bench.trace import TRACE_BLOCK_TOKENS, synthesise

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

    def __init__(self, producer, idlog: _IdLog, out, path: str):
        self.producer = producer
        self.idlog = idlog
        self.out = out
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
        from .errors import Full

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
        for r in self.producer.results(timeout_seconds=timeout_seconds if self.outstanding else 0.0):
            self.outstanding.discard(r.item_id)
            ids = self.ids
            if r.item_id not in ids and self._old_ids is None:
                self._old_ids = _load_ids(self.producer.data_dir, self.producer.name)  # an earlier run's
            if r.item_id not in ids:
                ids = self._old_ids
            self.out.write(_result_row(r, ids) + "\n")
            self.statuses[r.status] += 1
            n += 1
            if timeout_seconds and not self.outstanding:
                break  # all in: take what already came without waiting for more
        if timeout_seconds and not self.outstanding:
            n += self.drain(0.0)
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
    from .client import Producer
    from .errors import BrokerError, Full

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    if args.max_new_tokens is not None and not 1 <= args.max_new_tokens <= U32_MAX:
        _err(f"--max-new-tokens must be in 1..{U32_MAX}, got {args.max_new_tokens}")
        return 2
    if not os.path.isfile(args.file) or not os.access(args.file, os.R_OK):
        _err(f"{args.file}: no such readable file")
        return 2
    name = args.name or f"submit-{os.getpid()}"
    try:
        producer = Producer(name, data_dir=data_dir, timeout_seconds=SUBMIT_STALL_SECONDS)
    except BrokerError as exc:
        _err(str(exc))
        return 1
    _err(f"submitting {args.file} as producer {name!r} (results: shmbroker results --name {name})")
    t0 = time.monotonic()
    idlog = _IdLog(data_dir, name)
    job = _Submission(producer, idlog, None, args.file)
    complete = True
    try:
        with producer, (_output(args.out) if args.wait else nullcontext()) as out, _progress("submit") as bar:
            job.out = out
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
        _err(f"the broker took no item for {SUBMIT_STALL_SECONDS:.0f} s ({exc}); stopped after "
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


# -- results -----------------------------------------------------------------------------


def results(args) -> int:
    from .client import Producer
    from .errors import BrokerError

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    ids = _load_ids(data_dir, args.name)
    try:
        producer = Producer(args.name, data_dir=data_dir)
    except BrokerError as exc:
        _err(str(exc))
        return 1
    count = 0
    statuses: Counter[str] = Counter()
    try:
        with producer, _output(args.out) as out:
            for r in producer.results(timeout_seconds=max(0.0, args.timeout)):
                out.write(_result_row(r, ids) + "\n")
                statuses[r.status] += 1
                count += 1
    except BrokerError as exc:
        _err(f"{exc} (after {count} results)")
        return 1
    except OSError as exc:  # the --out file
        _err(f"{exc} (after {count} results)")
        return 2 if count == 0 else 1
    except KeyboardInterrupt:
        _err(f"interrupted after {count} results")
        return 130
    counts = ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
    where = f" to {args.out}" if args.out else ""
    _err(f"{count} results for producer {args.name!r}" + (f" ({counts})" if counts else "") + f" written{where}")
    return 0


# -- status ------------------------------------------------------------------------------


def _sample(ctl) -> dict:
    from .control import R_BEAT, R_PID, R_RESTARTS, R_STARTED

    roles = []
    for r, role in enumerate(ctl.roles):
        slot = ctl.role(r)
        roles.append({"role": role, "pid": int(slot[R_PID]), "restarts": int(slot[R_RESTARTS]),
                      "beat_ns": int(slot[R_BEAT]), "started_ns": int(slot[R_STARTED]),
                      "counters": ctl.counter_dict(r)})
    return {"t_ns": time.monotonic_ns(), "roles": {x["role"]: x for x in roles}}


def _alive(pid: int) -> bool:
    from .ring.liveness import is_alive, start_ticks

    ticks = start_ticks(pid) if pid > 0 else None
    return ticks is not None and is_alive(pid, ticks)


def _backlog_on_disk(data_dir: str) -> dict:
    from .spill.store import BACKLOG_DIR

    size = segments = 0
    for root, _dirs, files in os.walk(Path(data_dir) / BACKLOG_DIR):
        for f in files:
            try:
                size += os.stat(os.path.join(root, f)).st_size
            except FileNotFoundError:  # acked and deleted meanwhile
                continue
            segments += f.endswith(".seg")
    return {"bytes": size, "segments": segments}


def _rate(a: dict, b: dict, key: str, seconds: float) -> float:
    return max(0.0, (b["counters"][key] - a["counters"][key]) / seconds) if seconds > 0 else 0.0


def _report(data_dir: str, info: dict, header: dict, producers: list, first: dict, second: dict) -> dict:
    now = second["t_ns"]
    seconds = (second["t_ns"] - first["t_ns"]) / 1e9
    roles = second["roles"]
    processes = [{"role": x["role"], "pid": x["pid"], "restarts": x["restarts"],
                  "heartbeat_age_seconds": (now - x["beat_ns"]) / 1e9 if x["beat_ns"] else None,
                  "uptime_seconds": (now - x["started_ns"]) / 1e9 if x["started_ns"] else None,
                  "alive": _alive(x["pid"])} for x in roles.values()]
    ingest_roles = [r for r in roles if r.startswith("ingest-")]
    ingest: Counter[str] = Counter()
    for r in ingest_roles:
        ingest.update(roles[r]["counters"])
    consumers, consumer_rates = {}, {}
    for name in info.get("consumers", []):
        role = f"gpu-{name}"
        if role not in roles:
            continue
        c = dict(roles[role]["counters"])
        c["hit_rate"] = c["hit_blocks"] / c["queried_blocks"] if c.get("queried_blocks") else None
        consumers[name] = c
        consumer_rates[name] = {"items_per_second": _rate(first["roles"][role], roles[role], "items", seconds),
                                "tokens_per_second": _rate(first["roles"][role], roles[role], "tokens", seconds)}
    rates = {"interval_seconds": seconds,
             "ingest": {k + "_per_second": sum(_rate(first["roles"][r], roles[r], k, seconds) for r in ingest_roles)
                        for k in ("items", "tokens")},
             "consumers": consumer_rates}
    return {
        "data_dir": data_dir,
        "pid": info.get("pid"),
        "uptime_seconds": max(0.0, (time.time_ns() - header["started_ns"]) / 1e9) if header["started_ns"] else None,
        "stopping": header["stopping"],
        "processes": processes,
        "producers": producers,
        "consumers": consumers,
        "ingest": dict(ingest),
        "scheduler": dict(roles["sched"]["counters"]) if "sched" in roles else {},
        "results": dict(roles["results"]["counters"]) if "results" in roles else {},
        "backlog": _backlog_on_disk(data_dir),
        "rates": rates,
    }


def status(args) -> int:
    from .control import C_STARTED_NS, C_STOPPING, Control
    from .registry import request

    data_dir = _data_dir(args)
    if data_dir is None:
        return 2
    try:
        info = request(data_dir, {"op": "info"}, 1.0)
    except (OSError, ValueError):
        info = {}
    if not info.get("ok") or not info.get("control"):
        _err(f"no broker is running on data directory {data_dir!r}")
        return 1
    try:
        ctl = Control.attach(info["control"], info["roles"])
    except (OSError, ValueError) as exc:
        _err(f"no broker is running on data directory {data_dir!r} ({exc})")
        return 1
    try:
        first = _sample(ctl)
        time.sleep(RATE_SECONDS)
        second = _sample(ctl)
        header = {"started_ns": int(ctl.words[C_STARTED_NS]), "stopping": bool(ctl.words[C_STOPPING])}
        producers = [{"name": p.name, "producer_id": p.producer_id} for p in ctl.producers()]
    finally:
        ctl.close()
    report = _report(data_dir, info, header, producers, first, second)
    if args.json:
        print(json.dumps(report))
    else:
        _render(report)
    return 0


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.1f}"
    return f"{value:,}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)


def _render(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    up = report["uptime_seconds"]
    console.print(f"shmbroker on [bold]{escape(report['data_dir'])}[/bold]: supervisor pid {report['pid']}, "
                  f"up {_fmt(up)} s, {len(report['producers'])} producer(s) connected"
                  + (", [red]stopping[/red]" if report["stopping"] else ""), highlight=False)
    t = Table(title="processes", title_justify="left")
    for col in ("role", "pid", "restarts", "heartbeat age s", "alive"):
        t.add_column(col, justify="left" if col == "role" else "right")
    for p in report["processes"]:
        age = p["heartbeat_age_seconds"]
        t.add_row(p["role"], str(p["pid"] or "-"), str(p["restarts"]), "-" if age is None else f"{age:.2f}",
                  "[green]yes[/green]" if p["alive"] else "[red]no[/red]")
    console.print(t)
    t = Table(title="consumers", title_justify="left")
    t.add_column("")
    names = list(report["consumers"])
    for name in names:
        t.add_column(name, justify="right")
    rows = ("batches", "items", "tokens", "ok", "too_long", "invalid", "engine_errors", "guard_violations", "hit_rate")
    for key in rows:
        t.add_row(key, *(_fmt(report["consumers"][n].get(key)) for n in names))
    for key in ("items_per_second", "tokens_per_second"):
        t.add_row(key.replace("_per_second", "/s"), *(_fmt(report["rates"]["consumers"][n][key]) for n in names))
    console.print(t)
    t = Table(title="broker", title_justify="left")
    for col in ("", "", "value"):
        t.add_column(col, justify="right" if col else "left")
    ing, sch, res, bl = report["ingest"], report["scheduler"], report["results"], report["backlog"]
    rate = report["rates"]["ingest"]
    rows = [("ingest", "items", _fmt(ing.get("items"))), ("", "tokens", _fmt(ing.get("tokens"))),
            ("", "bytes", _bytes(ing.get("bytes", 0))), ("", "items/s", _fmt(rate["items_per_second"])),
            ("", "tokens/s", _fmt(rate["tokens_per_second"])),
            ("scheduler", "pending items", _fmt(sch.get("pending_items"))), ("", "batches", _fmt(sch.get("batches"))),
            ("results", "results", _fmt(res.get("results"))), ("", "delivered", _fmt(res.get("delivered"))),
            ("", "acked", _fmt(res.get("acked"))), ("", "parked", _fmt(res.get("parked"))),
            ("backlog", "on disk", _bytes(bl["bytes"])), ("", "segment files", _fmt(bl["segments"]))]
    for row in rows:
        t.add_row(*row)
    console.print(t)
