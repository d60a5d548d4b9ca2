"""Exceptions that cross module boundaries."""

from __future__ import annotations


class BrokerError(Exception):
    """Base of shmbroker's own errors."""


class Full(BrokerError):
    """The ring stayed full past the deadline (or at once, with block=False).

    `submitted` counts the items of the call that did go in before it filled
    (always 0 for a single submit); their ids are `ids`.
    """

    def __init__(self, message: str, submitted: int = 0, ids=None):
        super().__init__(message)
        self.submitted = submitted
        self.ids = ids if ids is not None else []


class PeerDead(BrokerError):
    """The process on the other side of a ring is gone (liveness-checked, not guessed)."""


class RingCorrupt(BrokerError):
    """A record read from a ring failed its checks; the ring stops at it."""


class RingClosed(BrokerError):
    """The broker closed this ring because what its peer wrote broke it (`reason`: a
    `ring.layout.CLOSE_*` code, named in the message); it reads or writes no more of it."""

    def __init__(self, message: str, reason: int = 0):
        super().__init__(message)
        self.reason = reason


class NotRunning(BrokerError):
    """No broker answers on the data directory's socket."""


class DiskFull(BrokerError):
    """The backlog could not get disk space for a new segment.

    Nothing committed is lost, and nothing of the failed call was written
    (`appended` is 0: the writer reserves a batch's space before writing it).
    Appending works again once space returns.
    """

    def __init__(self, message: str, appended: int = 0):
        super().__init__(message)
        self.appended = appended


class ConfigError(BrokerError, ValueError):
    """The configuration names an unknown key or an impossible value; the message names the key."""


class PayloadRefused(BrokerError, ValueError):
    """The broker would not store a request payload (too large, empty): the request's own fault, so a
    submit refuses that request alone."""
