"""The window's deadlines and retries (`WindowLimits`), and an engine that is down (engines/base.py "Failures"), as the GPU process's window sees it: the
items it handed back, when they are added again, the back-off (engine_retry_min_seconds, doubling
per wave to engine_retry_max_seconds while it stays down), and the polls that failed in a row
(ENGINE_FAILURES_MAX of them: EngineDead, the process exits and is started afresh).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from ..engines.base import ENGINE_FAILURES_MAX, EngineDead, EngineDown

log = logging.getLogger("shmbroker.gpu")


class Backoff:
    """Consumer c's engine outage: what waits for a retry and when."""

    def __init__(self, c: int, min_seconds: float, max_seconds: float):
        self.c = c
        self.min_seconds, self.max_seconds = min_seconds, max_seconds
        self.ids = np.zeros(0, np.uint64)  # handed back by an engine that is down, to add again
        self.at = 0.0  # when (monotonic)
        self.seconds = min_seconds  # the next back-off
        self.failures = 0  # polls in a row that raised
        self.down = False  # the engine is down: items wait for a retry

    @property
    def waiting(self) -> bool:
        return bool(self.ids.size)

    def hand_back(self, ids: np.ndarray, why: Exception) -> None:
        """The engine handed ids back for why: they wait for the back-off. A failure that is not
        EngineDown counts towards EngineDead."""
        if not isinstance(why, EngineDown):
            self.failures += 1
            if self.failures >= ENGINE_FAILURES_MAX:
                raise EngineDead(f"the engine failed {self.failures} polls in a row: {type(why).__name__}: {why}") \
                    from why
        wave = not self.ids.size  # a new wave: the back-off doubles per wave, not per request
        self.ids = np.concatenate([self.ids, ids])
        if wave:
            self.at = time.monotonic() + self.seconds
            log.warning("consumer %d: the engine is down (%s: %s): %d items retried in %.2f s", self.c,
                        type(why).__name__, why, self.ids.size, self.seconds)
            self.seconds = min(self.max_seconds, self.seconds * 2)
        self.down = True

    def due_in(self) -> float:
        """Seconds until the handed-back items are added again (<= 0: now)."""
        return self.at - time.monotonic()

    def take(self) -> np.ndarray:
        """The handed-back items, to add again now."""
        ids, self.ids = self.ids, np.zeros(0, np.uint64)
        return ids

    def answered(self) -> bool:
        """The engine answered a poll without handing anything back; True when that ends an outage."""
        self.failures = 0
        self.seconds = self.min_seconds
        if self.down and not self.ids.size:
            self.down = False
            log.info("consumer %d: the engine is up again", self.c)
            return True
        return False


@dataclass(frozen=True)
class WindowLimits:
    """The window's deadline and retry settings, taken from the broker's configuration
    (`WindowLimits.of(cfg)`; config/broker.py has each one's default and what it means)."""

    deadline_seconds: float
    deadline_token_seconds: float
    retry_min_seconds: float
    retry_max_seconds: float

    @classmethod
    def of(cls, cfg) -> WindowLimits:
        return cls(cfg.batch_deadline_seconds, cfg.batch_deadline_token_seconds, cfg.engine_retry_min_seconds,
                   cfg.engine_retry_max_seconds)
