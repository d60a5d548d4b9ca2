"""Is a process alive? pid plus its start time, so a reused pid is not mistaken for it.

A ring header stores each side's pid and start time (field 22 of
/proc/<pid>/stat, clock ticks since boot). A peer is alive when a process with
that pid exists, started at that time, and is not a zombie. Waiters call this
only after a timeout (a stale heartbeat), never decide on the timeout alone.
"""

from __future__ import annotations


def start_ticks(pid: int) -> int | None:
    """Start time of `pid` in clock ticks since boot, or None when there is no such process."""
    fields = _stat_fields(pid)
    return None if fields is None else int(fields[19])


def is_alive(pid: int, ticks: int) -> bool:
    """True when the process `pid` that started at `ticks` still runs (zombies count as dead)."""
    if pid <= 0:
        return False
    fields = _stat_fields(pid)
    if fields is None:
        return False
    return fields[0] not in ("Z", "X") and int(fields[19]) == ticks


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name: [state, ppid, ...]."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()

