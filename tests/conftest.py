"""Shared test fixtures."""

from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from shmbroker.ring.owner import Owner

DEV_SHM = Path("/dev/shm")


def shm_leftovers(instance: str) -> list[Path]:
    """Segments and semaphores of `instance` still in /dev/shm."""
    return sorted(DEV_SHM.glob(f"shmb.{instance}.*")) + sorted(DEV_SHM.glob(f"sem.shmb.{instance}.*"))


@pytest.fixture
def owner(tmp_path):
    """An Owner for a fresh instance; after the test nothing of that instance is left in /dev/shm."""
    instance = "t" + secrets.token_hex(3)
    own = Owner(tmp_path, instance)
    try:
        yield own
    finally:
        own.close()
        left = shm_leftovers(instance)
        for path in left:
            path.unlink(missing_ok=True)
        assert left == [], f"test left {left}"
