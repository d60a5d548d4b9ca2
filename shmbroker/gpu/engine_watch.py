"""A GPU process's watch over its engine: a dead engine ends the process in seconds, with nothing
it held failed (engines/base.py "Failures", engines/deaths.py).

`EngineWatch` is a thread of the GPU process. While the loop is inside a call into the engine
(`with watch.calling("poll", seconds)`), the thread beats the role slot for it, so one call that
blocks does not stop the heartbeat; and a call still running past its deadline (the call's own
timeout, plus `engine_call_seconds`, plus `batch_deadline_token_seconds` for each token one engine
step may compute: the contract's `max_batch_tokens`) means the engine is dead. It also asks the
engine, four times a second, whether its own processes are gone (an adapter's `gone()`: vLLM's
engine core). Either way the death is the same as an `EngineDead` the loop catches: `end`.

`end(why)`: the process exits (EXIT_ENGINE_DEAD) without releasing any batch record, so its
successor, started at once by the supervisor with a fresh engine, takes them all again. The
death is logged with what was in flight, counted (`engine_deaths`), noted in the role slot for
`status` and `top`, and its moment kept in the own words (`deliveries.O_DIED_NS`), from which the
successor measures its restart: death to its next result (`engine_restart_ns`). Whether the
records it held count as a delivery for the poison rule is `Deliveries.engine_died`'s.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager

from ..control.segment import R_DEADLINE, R_EXCEPTION, beat, put_text
from ..engines.base import EngineDead

log = logging.getLogger("shmbroker.gpu")

EXIT_ENGINE_DEAD = 75  # a GPU process's exit status when its engine died (the supervisor restarts it)
WATCH_PERIOD_SECONDS = 0.25
CLOSE_SECONDS = 5.0  # a dead engine's close is waited for this long before the exit


class EngineWatch:
    """The watch thread and the one way a GPU process ends for a dead engine (module docstring).
    `report()`: what was in flight, in words, read at the death; `counted()` publishes the death's
    statistics."""

    def __init__(self, consumer: str, slot, engine, deliveries, *, report, counted, exit=os._exit):
        self.consumer = consumer
        self.slot = slot
        self.engine = engine
        self.deliveries = deliveries
        self.report = report
        self.counted = counted
        self.exit = exit
        self.gone = getattr(engine, "gone", None)
        self.lock = threading.Lock()
        self.call: tuple[str, int] | None = None  # (what, deadline in CLOCK_MONOTONIC ns) of the call running
        self.dead: str | None = None  # why the engine is gone, seen while no call ran (the loop ends it)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="engine-watch", daemon=True)

    def start(self) -> EngineWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopping.set()

    @contextmanager
    def calling(self, what: str, deadline_seconds: float):
        """The loop is inside a call into the engine for at most deadline_seconds."""
        with self.lock:
            self.call = (what, time.monotonic_ns() + int(deadline_seconds * 1e9))
        try:
            yield
        finally:
            with self.lock:  # held by `end` while the process ends: the loop waits here for its exit
                self.call = None

    def check(self) -> str | None:
        """Why the engine is gone, when the thread saw it between calls (None: alive)."""
        return self.dead

    def _run(self) -> None:
        while not self.stopping.wait(WATCH_PERIOD_SECONDS):
            why = self._gone()
            with self.lock:
                call = self.call
                if call is None:
                    if why is not None:
                        self.dead = why  # the loop ends it at its next round (it is not inside the engine)
                    continue
                beat(self.slot)
                now = time.monotonic_ns()
                if why is None and now > call[1]:
                    why = f"its {call[0]} call did not return by its deadline"
                if why is not None:
                    self.end(why, locked=True)

    def _close_engine(self) -> None:
        """Close the engine for at most CLOSE_SECONDS, so its processes and its card's memory are freed
        for the successor's (a hung engine that does not close is left to the process's exit)."""
        closing = threading.Thread(target=self._close_quietly, name="engine-close", daemon=True)
        closing.start()
        closing.join(CLOSE_SECONDS)

    def _close_quietly(self) -> None:
        try:
            self.engine.close()
        except Exception as exc:  # noqa: BLE001 - a dead engine may not close cleanly; the exit follows
            log.warning("consumer %s: closing the dead engine failed: %s", self.consumer, exc)

    def _gone(self) -> str | None:
        if self.gone is None:
            return None
        try:
            return self.gone()
        except Exception as exc:  # noqa: BLE001 - an adapter that cannot tell: asked again next time
            log.debug("consumer %s: the engine's liveness check failed: %s", self.consumer, exc)
            return None

    def end(self, why: str, *, locked: bool = False) -> None:
        """The engine is dead: log, count and note it, then exit (module docstring)."""
        if not locked:
            self.lock.acquire()  # the watch thread does not end it meanwhile; held until the exit
        delivery = self.deliveries.engine_died(time.monotonic_ns())
        log.error("consumer %s: the engine is dead (%s); in flight: %s; the process exits and a fresh engine "
                  "takes them again (%s)", self.consumer, why, self.report(),
                  "a delivery of its records: it released none" if delivery else "not a delivery of its records")
        self.counted()
        put_text(self.slot, R_EXCEPTION, f"engine dead: {why}")
        self.slot[R_DEADLINE] = 0
        self._close_engine()
        logging.shutdown()
        self.exit(EXIT_ENGINE_DEAD)


class WatchedEngine:
    """The engine, each call the loop makes into it inside `watch.calling` (its deadline: the call's
    own timeout plus `call_seconds`), and one whose processes the watch saw gone raising EngineDead
    at the next call; the rest of its interface as it is."""

    def __init__(self, engine, watch: EngineWatch, call_seconds: float):
        self.engine = engine
        self.watch = watch
        self.call_seconds = call_seconds

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def add(self, batch) -> None:
        self._alive()
        with self.watch.calling("add", self.call_seconds):
            self.engine.add(batch)

    def poll(self, timeout_seconds: float):
        self._alive()
        with self.watch.calling("poll", timeout_seconds + self.call_seconds):
            return self.engine.poll(timeout_seconds)

    def _alive(self) -> None:
        why = self.watch.check()
        if why is not None:
            raise EngineDead(why)
