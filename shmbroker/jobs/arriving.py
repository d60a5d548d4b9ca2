"""The jobs whose file is still arriving: `<data_dir>/jobs/arriving.json`, {"names": {name: [producer ids]}}.

A job's submitter (`submit --job`) adds its producer id once connected and takes its name out once
every line is submitted (`namefile.update`). The scheduler (`IdsWatch`) holds such a producer's
items back a short while (`job_hold_seconds`) when its cards have other work, so a prefix group's
first member does not run before the members still to come: see `sched/scheduler.py`. A submitter
that dies leaves its id behind; that costs its items at most the hold, and its `--resume` connects
under a new id and takes the name out at its end.
"""

from __future__ import annotations

import os

from .namefile import IdsWatch, update

ARRIVING_FILE = "arriving.json"


def add(data_dir: str | os.PathLike, name: str, producer_id: int) -> None:
    """Job `name`'s producer `producer_id` is submitting its file."""

    def widen(names: dict[str, list[int]]) -> None:
        names[name] = sorted(set(names.get(name, [])) | {int(producer_id)})

    update(data_dir, ARRIVING_FILE, widen)


def done(data_dir: str | os.PathLike, name: str) -> None:
    """Every line of job `name` is submitted (or it stopped trying)."""
    update(data_dir, ARRIVING_FILE, lambda names: names.pop(name, None))


def watch(data_dir: str | os.PathLike) -> IdsWatch:
    return IdsWatch(data_dir, ARRIVING_FILE)
