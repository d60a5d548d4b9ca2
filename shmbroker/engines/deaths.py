"""A dead engine told apart from a bad item (engines/base.py "Failures").

An exception from a real engine is the engine's fault until proven otherwise. It is death when:
- the adapter's library says so by type (vLLM's `EngineDeadError`: `fatal_types`);
- its words are those of an error every later call repeats (`death_of`: a CUDA context that is
  lost after an illegal memory access or a device-side assert, an NCCL failure, the engine core or
  a worker process gone);
- ENGINE_FAILURES_MAX failures come in a row with no success between them (`Streak`).

A lone item that fails is charged with its failure only once the engine has answered other work
after it (`Streak.charge`): the next item's success, or else a probe, a one-token request the
adapter runs (`probe`). So a dead engine fails no item: every failure in its last streak is
handed back with `EngineDead`, and the GPU process exits and is started afresh.
"""

from __future__ import annotations

import numpy as np

from .base import ENGINE_FAILURES_MAX, EngineDead, EngineDown, ItemResult, engine_error

# Errors after which no later call succeeds (CUDA's sticky errors, collective failures, a process
# gone), matched in lower case in the exception's text and in what caused it.
DEATH_WORDS = (
    "illegal memory access",  # cudaErrorIllegalAddress
    "device-side assert",  # cudaErrorAssert
    "misaligned address",
    "illegal instruction",
    "unspecified launch failure",
    "uncorrectable ecc error",
    "cuda error: unknown error",
    "cudaerrorlaunchfailure",
    "cublas_status_execution_failed",
    "cudnn_status_execution_failed",
    "nccl error",
    "ncclunhandledcudaerror",
    "ncclsystemerror",
    "ncclremoteerror",
    "communicator was aborted",
    "collective operation timeout",
    "engine core",  # vLLM: "Engine core proc ... died unexpectedly", "EngineCore encountered an issue"
    "worker died",
    "process is dead",
)
# an out-of-memory error is the batch's size, not a lost context: isolation runs smaller work
NOT_DEATH_WORDS = ("out of memory",)
PROBE_ITEM_ID = (1 << 64) - 1  # an item id no producer can have (producer ids are < 2**24)
PROBE_TOKENS = np.zeros(1, np.uint32)  # token id 0: in every vocabulary


def causes(exc: BaseException):
    """exc and the exceptions that caused it, each once, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def death_of(exc: BaseException, fatal_types: tuple = ()) -> str | None:
    """Why exc means the engine is dead, or None when it may be the item's (module docstring)."""
    for e in causes(exc):
        if isinstance(e, EngineDead) or (fatal_types and isinstance(e, fatal_types)):
            return f"{type(e).__name__}: {e}"
        text = f"{type(e).__name__}: {e}".lower()
        if any(w in text for w in NOT_DEATH_WORDS):
            continue
        if any(w in text for w in DEATH_WORDS):
            return f"{type(e).__name__}: {e}"
    return None


class Streak:
    """An engine's failures in a row, and the judgement of each (module docstring). `name`: the
    engine's, for the messages; `fatal_types`: its library's exception types that mean death."""

    def __init__(self, name: str, fatal_types: tuple = ()):
        self.name = name
        self.fatal_types = fatal_types
        self.count = 0  # failures since the last success

    def failed(self, exc: BaseException) -> None:
        """The engine raised exc: EngineDead when it means death or ends a streak of
        ENGINE_FAILURES_MAX; otherwise it is one more failure in a row."""
        if isinstance(exc, (EngineDead, EngineDown)):
            raise exc
        why = death_of(exc, self.fatal_types)
        if why is not None:
            raise EngineDead(f"engine '{self.name}' is dead: {why}") from exc
        self.count += 1
        if self.count >= ENGINE_FAILURES_MAX:
            raise EngineDead(f"engine '{self.name}' failed {self.count} times in a row with no success between; "
                             f"the last: {type(exc).__name__}: {exc}") from exc

    def answered(self) -> None:
        """The engine completed work: the streak is over."""
        self.count = 0

    def charge(self, item_id: int, exc: BaseException, probe) -> ItemResult:
        """A lone item failed with exc: its engine_error once `probe()` (a one-token request) shows
        the engine answers other work; EngineDead when the engine fails that too, in a streak."""
        self.failed(exc)
        while True:
            try:
                probe()
            except Exception as again:  # noqa: BLE001 - judged: death, or one more in the streak
                self.failed(again)
                continue
            self.answered()
            return engine_error(item_id, exc)
