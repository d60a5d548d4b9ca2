"""A process's deaths in its role slot of the control segment: what the supervisor writes when a
child dies and what watchers (`shmbroker status --json`, `top`, the metrics) read back.

The words are the role slot's (`segment.py`'s table): a child on its way out writes the last line
of its exception (`note_exception`, word R_EXCEPTION); the supervisor's watchdog writes the death
(R_LAST_STATUS, R_LAST_EXIT_NS, R_LAST_ERROR, R_CRASH_LOOP, R_WATCHDOG_KILLS, R_RESTART_AT);
`death_report` reads them all. Both sides import them from here, so a watcher never imports the
supervisor.
"""

from __future__ import annotations

import os
import signal

import numpy as np

from .segment import (
    R_CRASH_LOOP,
    R_EXCEPTION,
    R_LAST_ERROR,
    R_LAST_EXIT_NS,
    R_LAST_STATUS,
    R_PID,
    R_RESTART_AT,
    R_WATCHDOG_KILLS,
    get_text,
    put_text,
)


def death_report(slot: np.ndarray, now_ns: int) -> dict:
    """What the supervisor's words in a role slot say of its deaths (`shmbroker status --json`, top,
    the metrics): crash_loop, last_exit (its last wait status in words, None: it never died),
    last_error (that death in words), last_exit_unix, watchdog_kills, restart_in_seconds (None: no
    restart pending)."""
    died = int(slot[R_LAST_EXIT_NS])
    restart = int(slot[R_RESTART_AT])
    return {"crash_loop": bool(slot[R_CRASH_LOOP]),
            "last_exit": describe_status(int(slot[R_LAST_STATUS])) if died else None,
            "last_error": get_text(slot, R_LAST_ERROR) if died else None,
            "last_exit_unix": died / 1e9 if died else None,
            "watchdog_kills": int(slot[R_WATCHDOG_KILLS]),
            "restart_in_seconds": max(0.0, (restart - now_ns) / 1e9) if restart and not int(slot[R_PID]) else None}


def describe_status(status: int) -> str:
    """An os.waitpid status in words: "killed by SIGSEGV", "exited with status 1"."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exited with status {os.waitstatus_to_exitcode(status)}"


def note_exception(slot: np.ndarray, exc: BaseException) -> None:
    """In a child on its way out: the last line of what it dies of, for the supervisor's report."""
    text = str(exc).splitlines()
    put_text(slot, R_EXCEPTION, f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__)
