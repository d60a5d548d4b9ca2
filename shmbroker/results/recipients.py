"""Who each result goes to, and what waits for whom: the results process's view of the producers.

A result's producer is found by the producer id in its item id. A producer of this broker's
lifetime is in the control segment's producer table, with its result ring: connected, it has an
`Outlet` (`delivery.py`). An id of an earlier lifetime is named by `producers.json` (the
registry's `ProducerBook`): a producer that reconnects under that name gets its results.

A result for a name not connected is parked by name (its log offset, in an `OffsetQueue`) and
handed to the name's outlet when it connects. A name whose ring waits for its new reader's set-up
is held: nothing is pushed on its ring until the results process has answered the reader.
"""

from __future__ import annotations

import sys

import numpy as np

from ..control.segment import Control
from ..frontdoor.registry import ProducerBook
from ..ring.ring import PRODUCER, Ring
from .delivery import Outlet
from .log import OffsetQueue


class Recipients:
    """The connected producers' outlets, the queues parked by name, the names held for a new reader."""

    def __init__(self, data_dir: str):
        self.data_dir = data_dir
        self.parked: dict[str, OffsetQueue] = {}  # name -> results for a name not connected
        self._outlets: dict[int, Outlet] = {}  # producer id -> outlet (ids of this lifetime)
        self._by_name: dict[str, Outlet] = {}
        self._names: dict[int, str] = {}  # producer id -> name, every id ever given
        self._held: set[str] = set()  # names whose ring waits for its new reader's set-up
        self._unattachable: dict[int, str] = {}  # producer id -> why its result ring could not be attached
        self._seen_version = -1

    # -- the producer table --------------------------------------------------------------

    def refresh(self, control: Control) -> bool:
        """Follow the control segment's producer table: attach the result rings of new producers,
        let go of retired ones. True when the table changed since the last call."""
        if control.table_version == self._seen_version:
            return False
        self._seen_version = control.table_version
        table = control.producers()
        live = {p.producer_id for p in table}
        for producer_id in [i for i in self._outlets if i not in live]:
            self._retire(producer_id)
        for p in table:
            if p.producer_id not in self._outlets:
                self._attach(p)
        return True

    def _attach(self, p) -> None:
        """Connect producer `p` (a control-table entry): its outlet gets what was parked under its name."""
        try:
            ring = Ring.attach(p.result_names, PRODUCER, untrusted=True)
        except (OSError, ValueError, RuntimeError) as exc:  # resized or unlinked by a hostile producer
            if p.producer_id not in self._unattachable:
                self._unattachable[p.producer_id] = str(exc)
                sys.stderr.write(f"shmbroker results: cannot attach the result ring of {p.name!r}: {exc}\n")
            return
        outlet = Outlet(p.name, p.slot, ring)
        self._outlets[p.producer_id] = outlet
        self._by_name[p.name] = outlet
        self._names[p.producer_id] = p.name
        queue = self.parked.pop(p.name, None)
        if queue is not None:
            for part in queue.take_all():
                outlet.waiting.extend(part)

    def _retire(self, producer_id: int) -> None:
        """The registry retired this name (nothing was left to do for it): let go of its ring. A
        result pushed meanwhile and not acknowledged, and any waiting, waits by name for its next
        connect, first."""
        outlet = self._outlets.pop(producer_id)
        if self._by_name.get(outlet.name) is outlet:
            del self._by_name[outlet.name]
        queue = OffsetQueue()
        queue.extend(outlet.unacked_offsets())
        for part in outlet.waiting.take_all():
            queue.extend(part)
        old = self.parked.pop(outlet.name, None)
        if old is not None:
            for part in old.take_all():
                queue.extend(part)
        if queue:
            self.parked[outlet.name] = queue
        outlet.ring.close()

    # -- finding a result's recipient ------------------------------------------------------

    def name_of(self, producer_id: int) -> str | None:
        """The name producer id `producer_id` was given (this lifetime or an earlier one); None: unknown."""
        name = self._names.get(producer_id)
        if name is None:
            self._names.update(ProducerBook(self.data_dir).name_of())
            name = self._names.get(producer_id)
        return name

    def find(self, producer_id: int) -> tuple[Outlet | None, str | None]:
        """(the outlet, the name) a result of `producer_id` goes to: the outlet of that id, else that
        of a later connect under its name; None where not connected (or the name is unknown)."""
        outlet = self._outlets.get(producer_id)
        if outlet is not None:
            return outlet, outlet.name
        name = self.name_of(producer_id)
        return (self._by_name.get(name) if name is not None else None), name

    def outlet_named(self, name: str) -> Outlet | None:
        return self._by_name.get(name)

    def connected(self) -> list[Outlet]:
        """The outlet of each connected name."""
        return list(self._by_name.values())

    def park(self, name: str, offsets: np.ndarray) -> None:
        """Keep `offsets` for `name`, not connected, until it connects."""
        queue = self.parked.get(name)
        if queue is None:
            queue = self.parked[name] = OffsetQueue()
        queue.extend(offsets)

    def parked_now(self) -> int:
        """Results waiting for a producer: parked by name, or for a full ring."""
        return sum(len(q) for q in self.parked.values()) + sum(len(o.waiting) for o in self._outlets.values())

    # -- new readers -------------------------------------------------------------------------

    def hold_new_readers(self) -> frozenset[str]:
        """Hold every name whose ring waits for a new reader's set-up (before a replay); returns them."""
        self._held = {o.name for o in self._by_name.values() if o.session_pending()}
        return frozenset(self._held)

    def is_held(self, name: str | None) -> bool:
        return name in self._held

    def new_readers(self) -> list[Outlet]:
        """The outlets whose new reader announced itself and waits for its set-up."""
        return [o for o in self._by_name.values() if o.session_pending()]

    def release(self, name: str) -> None:
        """The name's new reader is set up: push to its ring again."""
        self._held.discard(name)

    def close(self) -> None:
        for outlet in self._by_name.values():
            outlet.ring.close()
