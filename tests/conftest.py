"""Shared test fixtures (the helpers they are built on are in harness.py)."""

from __future__ import annotations

import secrets

import pytest
from support.harness import BrokerSide, sweep_shm

from shmbroker.frontdoor import registry as registry_module
from shmbroker.ring.owner import Owner


@pytest.fixture
def owner(tmp_path):
    """An Owner for a fresh instance; after the test nothing of that instance is left in /dev/shm."""
    instance = "t" + secrets.token_hex(3)
    own = Owner(tmp_path, instance)
    try:
        yield own
    finally:
        own.close()
        left = sweep_shm(instance)
        assert left == [], f"test left {left}"


@pytest.fixture
def make_broker(tmp_path, monkeypatch):
    """make(instance=None, data_dir=None, **ring_bytes) -> a BrokerSide (Owner + Registry + RingSet) on its
    own data directory; after the test each is closed and nothing of its instance is left in /dev/shm."""
    # The accept thread polls its stop flag every ACCEPT_POLL_SECONDS (0.2 s), which is what
    # Registry.close() waits for; a shorter poll keeps ~100 broker teardowns within the time budget.
    monkeypatch.setattr(registry_module, "ACCEPT_POLL_SECONDS", 0.01)
    made: list[BrokerSide] = []

    def make(instance: str | None = None, data_dir=None, **ring_bytes) -> BrokerSide:
        side = BrokerSide(data_dir or tmp_path / f"data{len(made)}", instance, **ring_bytes)
        made.append(side)
        return side

    yield make
    for side in made:
        side.close()
    for side in made:
        left = sweep_shm(side.instance)
        assert left == [], f"test left shared memory behind: {left}"


@pytest.fixture
def broker(make_broker) -> BrokerSide:
    """One BrokerSide (modules that run a broker in its own processes bind brokerproc.serve instead)."""
    return make_broker()
