"""The simulated engine's faults (`SimSettings`: poison_token, hang_token, block_token, fail_token,
fail_after): what a real engine does on a bad day, on demand, for the tests of what the broker does
about it (tests/gpu/test_poison.py).

- a poison item kills the process the moment it is added (`poison_kill`: SIGABRT as from a failed
  CUDA assert, a real SIGSEGV, or exit status 137 as after the OOM killer);
- a hung item never finishes: the engine runs every other item (its batch misses its deadline);
- a blocking item makes the next poll never return (the process stops beating);
- a refused item makes `add` raise ValueError (an engine refusing one prompt);
- `fail_after`: a dead engine, once that many items were added every poll raises RuntimeError.

`SimFaults.of(settings)` is None when no fault is set, so a healthy sim pays nothing.
"""

from __future__ import annotations

import ctypes
import os
import time

import numpy as np

BLOCK_SLICE_SECONDS = 3600.0


class SimFaults:
    def __init__(self, settings):
        self.poison = settings.poison_token
        self.kill = settings.poison_kill
        self.hang = settings.hang_token
        self.block = settings.block_token
        self.fail = settings.fail_token
        self.fail_after = settings.fail_after
        self.added = 0
        self.blocked = False

    @classmethod
    def of(cls, settings) -> SimFaults | None:
        keys = ("poison_token", "hang_token", "block_token", "fail_token", "fail_after")
        if all(getattr(settings, k, None) is None for k in keys):
            return None
        return cls(settings)

    def added_batch(self, batch):
        """The part of `batch` the engine runs (hung items held back); may kill the process or raise."""
        keep = np.ones(len(batch), bool)
        for tokens in batch.tokens:
            if self.fail is not None and (tokens == self.fail).any():
                raise ValueError(f"sim: refused, the prompt holds fail_token {self.fail}")
        for k, tokens in enumerate(batch.tokens):
            if self.poison is not None and (tokens == self.poison).any():
                self._die()
            if self.block is not None and (tokens == self.block).any():
                self.blocked = True
            if self.hang is not None and (tokens == self.hang).any():
                keep[k] = False
        self.added += len(batch)
        if keep.all():
            return batch
        return batch.rows(np.flatnonzero(keep))

    def polled(self) -> None:
        """Before a poll: a blocked engine never returns; a dead one raises."""
        while self.blocked:
            time.sleep(BLOCK_SLICE_SECONDS)
        if self.fail_after is not None and self.added > self.fail_after:
            raise RuntimeError(f"sim: the engine died (fail_after {self.fail_after} items)")

    def _die(self) -> None:
        if self.kill == "segfault":
            ctypes.string_at(0)  # a real SIGSEGV: a read of address 0
        if self.kill == "exit":
            os._exit(137)
        os.abort()
