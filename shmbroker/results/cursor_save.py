"""Saving the results process's delivery cursors: what each producer name's entry says, and the log trim it allows.

A mixin of the results process's `Router` (`results.py`): it reads the Router's outlets, parked
queues and far-behind names (`behind.py`) and writes `results/cursor.json` through `Cursors`
(`delivery.py`); once saved, the shared results log is trimmed below the smallest entry.
"""

from __future__ import annotations


class CursorSaves:
    """The cursor entries of every name and the floor of the shared log (mixed into `Router`)."""

    def _entries(self, again: dict | None = None) -> dict[str, list]:
        """Every name's cursor entry as of now (`again`: names about to be reset for a new reader,
        with the offsets they will get again). Only once replayed: every record appended is routed."""
        entries = {name: [self._log_of(name).end, None, 0] for name in self.cursors.names}
        for name, queue in self.parked.items():
            entries[name] = [queue.first() if queue else self._log_of(name).end, None, 0]
        for name, outlet in self.by_name.items():
            end = self._log_of(name).end
            if again is not None and name in again:
                first = again[name]
                at = int(first[0]) if first.size else (outlet.waiting.first() if outlet.waiting else end)
                entries[name] = [at, outlet.ring_id, outlet.ring.num_pushed()]
            else:
                entries[name] = outlet.cursor(end)
        for name, behind in self.behind.items():
            entries.setdefault(name, [behind.log.end, None, 0]).append(behind.details(self.log.end))
        return entries

    def _floor(self, entries: dict[str, list]) -> int:
        """The shared-log offset below which no name needs anything (a name far behind: its `through`)."""
        return min([self.log.end] + [e[3]["through"] if len(e) > 3 else e[0] for e in entries.values()])

    def _save_cursors(self, again: dict | None = None) -> None:
        # every offset an entry names is synced first: a cursor past what a power loss leaves would
        # skip the results that item runs again write there
        self.log.sync()
        for behind in self.behind.values():
            behind.log.sync()
        entries = self._entries(again)
        floor = self._floor(entries)
        if self.cursors.save(entries, floor):
            self.floor = floor
            self.log.trim(floor)
            for name, behind in self.behind.items():
                behind.through = self.log.end
                behind.log.trim(entries[name][0])
        for behind in self.dropped:  # no entry names their logs any more
            behind.remove()
        self.dropped.clear()
