"""`shmbroker jobs`, `shmbroker job NAME [--watch]`, `shmbroker cancel NAME`: batch jobs in a data directory.

They read the job files (`jobs/store.py`), so they work whether or not a broker runs; `cancel`
writes the job's cancel and adds its producer ids to the list the scheduler obeys
(`jobs/cancels.py`): items not yet dispatched come back `cancelled`, items in flight finish.
"""

from __future__ import annotations

import json
import sys
import time

from .common import config_data_dir, print_error

WATCH_POLL_SECONDS = 0.5


def _table(views: list[dict]):
    from rich.table import Table

    t = Table(box=None, header_style="bold")
    for col in ("name", "status", "total", "completed", "failed", "cancelled", "submitted", "created"):
        t.add_column(col, justify="right" if col in ("total", "completed", "failed", "cancelled", "submitted") else "left")
    for v in views:
        t.add_row(v["name"], v["status"], f"{v['total']:,}", f"{v['completed']:,}", f"{v['failed']:,}",
                  f"{v['cancelled']:,}", f"{v['submitted']:,}", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])))
    return t


def jobs(args) -> int:
    from ..jobs import store

    data_dir = config_data_dir(args)
    if data_dir is None:
        return 2
    views = store.views(data_dir)
    if args.json:
        print(json.dumps(views))
        return 0
    if not views:
        print(f"no jobs in {data_dir}")
        return 0
    from rich.console import Console

    Console().print(_table(views))
    return 0


def _show(v: dict) -> None:
    rows = [("job", v["name"]), ("status", v["status"]), ("input", f"{v['input']} ({v['digest']})"),
            ("total", f"{v['total']:,} lines"), ("submitted", f"{v['submitted']:,} items, {v['tokens']:,} tokens"),
            ("completed", f"{v['completed']:,}"),
            ("failed", f"{v['failed']:,}" + (f" ({', '.join(f'{k} {n}' for k, n in v['failed_by_status'].items())})"
                                            if v["failed_by_status"] else "")),
            ("cancelled", f"{v['cancelled']:,}"),
            ("created", time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(v["created_at"])))]
    if v["error"]:
        rows.append(("error", v["error"]))
    for k, val in rows:
        print(f"{k:>10}: {val}")


def _named(args) -> tuple[str | None, dict | None, int]:
    """(data dir, the job's view, exit status when either is missing: 2 a bad configuration, 1 no such job)."""
    from ..jobs import store

    data_dir = config_data_dir(args)
    if data_dir is None:
        return None, None, 2
    try:
        return data_dir, store.view(data_dir, args.name), 0
    except store.JobError as exc:
        print_error(str(exc))
        return data_dir, None, 1


def job(args) -> int:
    data_dir, v, code = _named(args)
    if v is None:
        return code
    if args.watch:
        return _watch(data_dir, args.name, v, args.progress_seconds)
    if args.json:
        print(json.dumps(v))
    else:
        _show(v)
    return 0


def _watch(data_dir: str, name: str, v: dict, plain_seconds: float | None) -> int:
    """The progress display of a job submitted elsewhere, until it is completed, cancelled or failed."""
    from ..jobs import store
    from ..jobs.progress import Progress

    progress = Progress(f"job {name}", v["total"], plain_seconds=plain_seconds)
    progress.fig.t0 = time.monotonic() - max(0.0, time.time() - v["created_at"])  # the job's age, its rates since
    try:
        with progress:
            while True:
                results = v["completed"] + v["failed"] + v["cancelled"]
                progress.update(submitted=v["submitted"], results=results, ok=v["completed"],
                                failed=v["failed"], tokens=v["generated_tokens"], status=v["status"])
                if v["status"] in store.TERMINAL:
                    break
                time.sleep(WATCH_POLL_SECONDS)
                v = store.view(data_dir, name)
    except KeyboardInterrupt:
        return 130
    print(f"shmbroker: job {name} {v['status']}: {v['completed']:,} completed, {v['failed']:,} failed, "
          f"{v['cancelled']:,} cancelled of {v['total']:,}", file=sys.stderr)
    return 0 if v["status"] == "completed" else 1


def cancel(args) -> int:
    from ..httpapi.runner import cancel_job
    from ..jobs import store

    data_dir, v, code = _named(args)
    if v is None:
        return code
    if v["status"] in ("cancelling", "cancelled"):
        print_error(f"job {args.name!r} is {v['status']} already")
        return 0
    if v["status"] in store.TERMINAL:
        print_error(f"job {args.name!r} is {v['status']}: nothing to cancel")
        return 1
    cancel_job(data_dir, args.name)
    print_error(f"cancelling job {args.name!r}: its items not yet dispatched come back cancelled, those in flight finish "
         f"(shmbroker job {args.name} --watch)")
    return 0
