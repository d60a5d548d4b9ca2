"""A GPU process's deliveries: how often a process died holding a batch, kept where its death
cannot take it (poison items).

A batch record that kills the engine process (a segfault, the OOM killer, an abort, or a hang the
supervisor's watchdog kills) would be redelivered forever: a restarted process takes its ring's
records again, from the tail. So each GPU process counts, in its role slot's own words
(`control.Control.own`, shared memory the supervisor created: they outlive the process, and a
broker restart, which makes new rings, clears them), which records it holds and how many
processes died holding them. A record is known by its ring position (the tail word count when it
is first in line; only a release moves the tail, so a successor sees the same positions).

| own word | field           | meaning                                                         |
|----------|-----------------|-----------------------------------------------------------------|
| 0        | taken_end       | ring position past the newest record taken into the window      |
| 1        | deliveries      | processes that took the records [tail, taken_end) (this one too) |
| 2        | solo_at         | ring position of the record whose item runs alone               |
| 3        | solo_row        | that item's row in its record                                   |
| 4        | solo_deliveries | processes that ran that item alone (this one too); 0: none      |
| 5        | died_ns         | CLOCK_MONOTONIC of the last engine death not yet followed by a result (0: none) |

At its start the process compares its ring's tail with taken_end: the records between were held
by a predecessor that died (a clean stop releases everything first). Its mode, with N =
`poison_attempts`:

- `NORMAL`: nothing held; taken_end follows the window, deliveries is 1;
- `AGAIN` (deliveries <= N): the held records are taken again as they were, and nothing past
  them until they are released, so that a death now is theirs alone;
- `SPLIT` (deliveries > N): the held records' items run alone, one at a time, in order (the
  window, `window.py`); an item on which N processes died alone fails, engine_error "the engine
  process died on this item N times", without running again.

Then NORMAL again. A process that dies before its engine is loaded has taken nothing: it counts
no delivery (so an engine that cannot start fails no item).

An engine that dies (`engine_watch.py`: EngineDead, a call past its deadline, its processes gone)
is not its items' fault when the process got work done: a process in NORMAL mode that released a
record before its engine died hands its records back uncounted (`engine_died`), and its successor
starts NORMAL. One that released nothing, or that was running a dead predecessor's records again,
counts the delivery as any death does: an item that kills every engine it meets still ends failed
after poison_attempts deaths alone, instead of restarting the card forever.
"""

from __future__ import annotations

import numpy as np

from ..control.segment import OWN_WORDS

NORMAL, AGAIN, SPLIT = "normal", "again", "split"
# the own words' layout (the table above), declared here only
O_TAKEN_END, O_DELIVERIES, O_SOLO_AT, O_SOLO_ROW, O_SOLO_DELIVERIES, O_DIED_NS = range(6)
assert O_DIED_NS < OWN_WORDS, "the deliveries fit a role slot's own words"


def poison_message(attempts: int) -> str:
    return f"the engine process died on this item {attempts} time{'' if attempts == 1 else 's'}"


class Deliveries:
    """The delivery words of one GPU process (module docstring); `tail`: its batch ring's tail at start."""

    def __init__(self, own: np.ndarray, tail: int, attempts: int):
        assert attempts >= 1, "poison_attempts is at least 1"
        self.own = own
        self.attempts = attempts
        self.held_end = int(own[O_TAKEN_END])
        self.start_tail = self.tail = tail  # the ring's tail at this process's start, and now
        self.prev_solo: tuple[int, int, int] | None = None
        if tail < self.held_end:
            deliveries = max(1, int(own[O_DELIVERIES])) + 1
            own[O_DELIVERIES] = deliveries
            self._mode(AGAIN if deliveries <= attempts else SPLIT)
            self.deliveries = deliveries
            if int(own[O_SOLO_DELIVERIES]) and int(own[O_SOLO_AT]) >= tail:
                self.prev_solo = (int(own[O_SOLO_AT]), int(own[O_SOLO_ROW]), int(own[O_SOLO_DELIVERIES]))
        else:
            self._normal(tail)

    def _normal(self, tail: int) -> None:
        own = self.own
        own[O_SOLO_DELIVERIES] = 0
        own[O_DELIVERIES] = 1  # before taken_end moves on: new records are this process's first delivery
        own[O_TAKEN_END] = max(tail, int(own[O_TAKEN_END]))
        self._mode(NORMAL)
        self.deliveries = 1
        self.prev_solo = None

    def _mode(self, mode: str) -> None:
        self.mode = mode
        self.holding = mode != NORMAL  # records a dead predecessor held are still to be released
        self.split = mode == SPLIT  # ... and their items run alone

    @property
    def first_split(self) -> bool:
        """This process is the first to split the held records (a statistic counts it once)."""
        return self.mode == SPLIT and self.deliveries == self.attempts + 1

    def may_take(self, start: int) -> bool:
        """Whether the window may take the record starting at ring position `start`."""
        return self.mode == NORMAL or start < self.held_end

    def redelivered(self, start: int) -> bool:
        """Whether the record starting at `start` was held by a predecessor that died."""
        return self.holding and start < self.held_end

    def taken(self, end: int) -> None:
        """A record up to ring position `end` was taken into the window (before its engine sees it)."""
        if not self.holding:
            self.own[O_TAKEN_END] = end

    def released(self, tail: int) -> None:
        """Records were released up to ring position `tail`: the held ones all, and it is NORMAL again."""
        self.tail = tail
        if self.mode != NORMAL and tail >= self.held_end:
            self._normal(tail)

    def engine_died(self, now_ns: int) -> bool:
        """The engine died at now_ns (module docstring): True when the records held count a delivery
        (this process released none, or was not in NORMAL mode); the moment is kept for the
        successor's restart time."""
        own = self.own
        own[O_DIED_NS] = now_ns
        if self.mode != NORMAL or self.tail == self.start_tail:
            return True
        own[O_SOLO_DELIVERIES] = 0
        own[O_DELIVERIES] = 1
        own[O_TAKEN_END] = self.tail  # nothing held: the successor starts NORMAL from the tail
        return False

    def restart_seconds(self, now_ns: int) -> float | None:
        """Seconds from the last engine death to now, once (a first result); None: none pending."""
        died = int(self.own[O_DIED_NS])
        if not died:
            return None
        self.own[O_DIED_NS] = 0
        return (now_ns - died) / 1e9

    def solo_done(self) -> None:
        """The item running alone has its result: a death now is not its (what a predecessor died on
        is still remembered, `prev_solo`: the items before it in its record run again first)."""
        if self.own[O_SOLO_DELIVERIES]:
            self.own[O_SOLO_DELIVERIES] = 0

    def solo(self, at: int, row: int) -> bool:
        """The item at row `row` of the record at `at` is to run alone: True, and the words say so
        (before the engine sees it); False when N processes died on it alone already (fail it)."""
        prev = self.prev_solo
        count = prev[2] + 1 if prev is not None and prev[:2] == (at, row) else 1
        if count > self.attempts:
            return False
        own = self.own
        own[O_SOLO_DELIVERIES] = 0  # a death between these stores counts no solo delivery
        own[O_SOLO_AT] = at
        own[O_SOLO_ROW] = row
        own[O_SOLO_DELIVERIES] = count
        return True


def private(tail: int = 0, attempts: int = 3) -> Deliveries:
    """Deliveries kept in private memory (a window without a role slot: tests, benchmarks)."""
    return Deliveries(np.zeros(8, np.int64), tail, attempts)
