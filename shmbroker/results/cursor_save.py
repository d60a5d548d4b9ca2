"""Saving the results process's delivery cursors: what each producer name's entry says, and the log trim it allows.

`CursorKeeper` computes every name's `Cursor` (`delivery.py`) from where its results are: on its
ring and waiting for room (its `Outlet`), parked by name (`Recipients`), in a log of its own
(`FarBehind`). It writes them to `results/cursor.json` through `Cursors`; once saved, the shared
results log is trimmed below the smallest entry (the floor), and each own log below its name's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import numpy as np

from .delivery import BehindEntry, Cursor, Cursors
from .log import ResultsLog
from .recipients import Recipients


class NamesBehind(Protocol):
    """What the keeper needs of the names read far behind (`behind.FarBehind`)."""

    def log_of(self, name: str) -> ResultsLog: ...

    def details(self, shared_end: int) -> Iterable[tuple[str, BehindEntry]]:
        """Each name's part of its cursor entry (`shared_end`: the shared log's end now)."""
        ...

    def sync(self) -> None: ...

    def saved(self, cursors: dict[str, Cursor]) -> None:
        """The cursor file now holds `cursors`: trim each name's own log."""
        ...

    def remove_dropped(self) -> None: ...


class CursorKeeper:
    """Every name's cursor entry as of now, its save, and the trims it allows."""

    def __init__(self, cursors: Cursors, shared: ResultsLog, recipients: Recipients, behind: NamesBehind):
        self.cursors = cursors
        self.shared = shared
        self.recipients = recipients
        self.behind = behind

    def entries(self, again: dict[str, np.ndarray] | None = None) -> dict[str, Cursor]:
        """Every name's cursor entry as of now (`again`: names about to be reset for a new reader,
        with the offsets they will get again). Only once replayed: every record appended is routed."""
        log_of = self.behind.log_of
        entries = {name: Cursor(log_of(name).end, None, 0) for name in self.cursors.names}
        for name, queue in self.recipients.parked.items():
            entries[name] = Cursor(queue.first() if queue else log_of(name).end, None, 0)
        for outlet in self.recipients.connected():
            end = log_of(outlet.name).end
            if again is not None and outlet.name in again:
                entries[outlet.name] = outlet.reader_cursor(again[outlet.name], end)
            else:
                entries[outlet.name] = outlet.cursor(end)
        for name, details in self.behind.details(self.shared.end):
            cursor = entries.get(name)
            if cursor is None:
                cursor = Cursor(details.end, None, 0)
            entries[name] = cursor._replace(behind=details)
        return entries

    def floor(self, entries: dict[str, Cursor]) -> int:
        """The shared-log offset below which no name needs anything (a name far behind: its `through`)."""
        return min([self.shared.end] + [c.offset if c.behind is None else c.behind.through for c in entries.values()])

    def save(self, again: dict[str, np.ndarray] | None = None) -> None:
        """Save every name's entry (`again`: as `entries`) when it changed, then trim the logs."""
        # every offset an entry names is synced first: a cursor past what a power loss leaves would
        # skip the results that item runs again write there
        self.shared.sync()
        self.behind.sync()
        entries = self.entries(again)
        floor = self.floor(entries)
        if self.cursors.save(entries, floor):
            self.shared.trim(floor)
            self.behind.saved(entries)
        self.behind.remove_dropped()  # no entry names their logs any more
