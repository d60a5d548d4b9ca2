"""Producer names that are done leave the table and free their rings."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
from support.brokerproc import SMALL_CONFIG, serve

from shmbroker.client.producer import Producer

RETIRE = 0.5


def _shm(instance: str) -> list[Path]:
    """The instance's producer rings (segments and doorbells: `shmb.<instance>.<token>.p<id>i|r...`)."""
    return sorted(p for p in Path("/dev/shm").glob(f"*shmb.{instance}.*") if re.search(r"\.p\d+[ir]", p.name))


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    config = f"producer_retire_seconds = {RETIRE}\n" + SMALL_CONFIG
    with serve(tmp_path_factory.mktemp("names"), "nm", config) as b:
        yield b


def _one(broker, name: str, read: bool = True) -> int:
    with Producer(name, data_dir=broker.data_dir) as p:
        item = p.submit(np.array([1, 2, 3], np.uint32), max_new_tokens=1)
        if read:
            got = []
            deadline = time.monotonic() + 30
            while not got:
                assert time.monotonic() < deadline
                got = [r.item_id for r in p.results(timeout_seconds=1.0)]
            assert got == [item]
        return item


def test_short_lived_names_free_their_rings(broker):
    """Before: every name ever connected kept its two rings (24 MiB of /dev/shm by default) and its
    table slot for the broker's life, and the 1,025th name was refused."""
    for k in range(30):
        _one(broker, f"short-{k}")
    assert _shm(broker.instance)  # the latest name's rings, until it retires: the glob finds rings
    deadline = time.monotonic() + 10 * RETIRE + 10
    while _shm(broker.instance) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _shm(broker.instance) == []  # every ring of a finished name is gone


def test_a_name_with_unread_results_keeps_them_and_a_retired_name_comes_back(broker):
    late = _one(broker, "late", read=False)  # its result may come after the name retired: it waits
    with Producer("unacked", data_dir=broker.data_dir) as p:
        unacked = p.submit(np.array([4, 5], np.uint32), max_new_tokens=1)
        seen = []
        while not seen:
            seen = [r.item_id for r in p.results(timeout_seconds=1.0, auto_ack=False)]
        p._auto_ack = False  # popped, never acknowledged: it stays the name's
    first = _one(broker, "again")
    time.sleep(4 * RETIRE + 2)
    assert any(f".p{unacked >> 40}r" in path.name for path in _shm(broker.instance))  # kept: a result unread
    for name, item in (("unacked", unacked), ("late", late)):
        with Producer(name, data_dir=broker.data_dir) as p:
            assert [r.item_id for r in p.results(timeout_seconds=5.0)] == [item]
    second = _one(broker, "again")  # a retired name connects again: new rings, a new producer id
    assert second >> 40 != first >> 40
