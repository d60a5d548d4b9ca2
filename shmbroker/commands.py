"""`shmbroker submit`, `shmbroker results`, `shmbroker status`: the user-facing commands around a running broker."""

from __future__ import annotations


def submit(args) -> int:
    raise NotImplementedError


def results(args) -> int:
    raise NotImplementedError


def status(args) -> int:
    raise NotImplementedError
