"""`Recipients`: who a result goes to and what waits for whom, against a real control segment,
real result rings and a real producer book."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from shmbroker.control.segment import Control
from shmbroker.frontdoor.registry import ProducerBook
from shmbroker.results.recipients import Recipients
from shmbroker.ring import layout as L
from shmbroker.ring.owned import create_ring
from shmbroker.ring.owner import Owner


@pytest.fixture
def shm(tmp_path):
    owner = Owner(tmp_path / "shm", "rc" + secrets.token_hex(3))
    try:
        yield owner, Control.create(owner, ["results"])
    finally:
        owner.close()


def _offsets(queue) -> list[int]:
    return [int(x) for part in queue.peek_all() for x in part]


def test_a_result_for_a_name_not_connected_is_parked_and_handed_to_its_outlet_at_connect(tmp_path, shm):
    owner, control = shm
    book = ProducerBook(str(tmp_path))
    earlier = book.assign("alice")  # an id of an earlier lifetime: known from producers.json only
    now = book.assign("alice")
    recipients = Recipients(str(tmp_path))
    try:
        assert recipients.find(earlier) == (None, "alice")
        assert recipients.find(12345) == (None, None)  # never given out
        recipients.park("alice", np.array([10, 20], np.int64))
        recipients.park("alice", np.array([30], np.int64))
        assert _offsets(recipients.parked["alice"]) == [10, 20, 30]
        assert recipients.parked_now() == 3
        assert recipients.refresh(control)  # the first look at the (empty) table
        assert not recipients.refresh(control)  # nothing changed since
        ring = create_ring(owner, "res-alice", 1 << 16)
        control.write_producer(0, now, 0, "alice", ring.names, ring.names)
        assert recipients.refresh(control)
        outlet, name = recipients.find(now)
        assert name == "alice" and outlet is not None and outlet.name == "alice"
        assert recipients.find(earlier) == (outlet, "alice")  # the earlier id's results go to the new connect
        assert "alice" not in recipients.parked
        assert _offsets(outlet.waiting) == [10, 20, 30]  # what was parked waits on the outlet, in order
        assert recipients.parked_now() == 3
        assert recipients.connected() == [outlet] and recipients.outlet_named("alice") is outlet
    finally:
        recipients.close()


def test_a_retired_name_keeps_what_it_was_not_acknowledged_first_then_what_waited(tmp_path, shm):
    owner, control = shm
    pid = ProducerBook(str(tmp_path)).assign("bob")
    ring = create_ring(owner, "res-bob", 1 << 16)
    control.write_producer(0, pid, 0, "bob", ring.names, ring.names)
    recipients = Recipients(str(tmp_path))
    try:
        recipients.refresh(control)
        outlet = recipients.outlet_named("bob")
        outlet.pushed(np.array([100, 200], np.int64))  # on its ring, not acknowledged
        outlet.waiting.extend(np.array([300], np.int64))  # waiting for room
        control.clear_producer(0)
        assert recipients.refresh(control)
        assert recipients.connected() == [] and recipients.find(pid) == (None, "bob")
        assert _offsets(recipients.parked["bob"]) == [100, 200, 300]
    finally:
        recipients.close()


def test_a_name_whose_new_reader_waits_is_held_until_released(tmp_path, shm):
    owner, control = shm
    pid = ProducerBook(str(tmp_path)).assign("carol")
    ring = create_ring(owner, "res-carol", 1 << 16)
    control.write_producer(0, pid, 0, "carol", ring.names, ring.names)
    recipients = Recipients(str(tmp_path))
    try:
        recipients.refresh(control)
        assert recipients.hold_new_readers() == frozenset() and recipients.new_readers() == []
        ring.segment.buf[: L.HEADER_BYTES].view(np.int64)[L.H_SESSION] += 1  # a new reader announces itself
        assert recipients.hold_new_readers() == {"carol"}
        assert recipients.is_held("carol") and not recipients.is_held(None)
        assert [o.name for o in recipients.new_readers()] == ["carol"]
        recipients.release("carol")
        assert not recipients.is_held("carol")
    finally:
        recipients.close()
