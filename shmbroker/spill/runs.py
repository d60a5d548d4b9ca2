"""Landing a backlog writer's staged runs: two staging buffers, one write thread.

The writer stages a run of records in one buffer while the thread writes the
previous run from the other: one `pwrite` of the run with its first length
word still 0, then that 4-byte word (`layout.py`: the store that commits the
run). Runs land in the order they were submitted.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from ..disk import durable


class RunLander:
    """Double-buffered staging and the one thread that writes the runs (`SegmentWriter`'s)."""

    def __init__(self, writer: int, dirty: bool):
        self.dirty = dirty  # a run landed since the writer last synced
        self._staging = [np.empty(0, np.uint8), np.empty(0, np.uint8)]  # double buffer: stage one, write the other
        self._in_flight: list[Future | None] = [None, None]
        self._next_slot = 0
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"pwrite-w{writer}")

    def buffer(self, want: int) -> tuple[int, np.ndarray]:
        """(slot, a staging buffer of at least `want` bytes) whose previous run has landed."""
        slot = self._next_slot
        self._next_slot ^= 1
        pending = self._in_flight[slot]
        if pending is not None:
            pending.result()  # this staging buffer's previous run has landed
        if self._staging[slot].size < want:
            self._staging[slot] = np.empty(want, np.uint8)
        return slot, self._staging[slot]

    def submit(self, slot: int, fd: int, data: np.ndarray, offset: int) -> None:
        """Write the staged run `data` (a view of slot's buffer) at `offset`: all but its first
        length word, then that word."""
        commit = data[:4].copy()
        data[:4] = 0
        # one writer thread, runs in order: this run's data and then its commit word land
        # while the next run is staged
        self._in_flight[slot] = self._io.submit(self._land, fd, data, commit, offset)

    def _land(self, fd: int, data: np.ndarray, commit: np.ndarray, offset: int) -> None:
        _pwrite_all(fd, data, offset)
        _pwrite_all(fd, commit, offset)  # the run's commit word, last
        self.dirty = True

    def wait(self) -> None:
        """Wait for the runs in flight; raises the OSError a failed write raised."""
        for slot, pending in enumerate(self._in_flight):
            if pending is not None:
                self._in_flight[slot] = None
                pending.result()

    def close(self) -> None:
        self.wait()
        self._io.shutdown(wait=True)


def _pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        done = durable.pwrite(fd, view, offset)
        view = view[done:]
        offset += done
