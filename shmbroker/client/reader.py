"""A producer's reading side: its results off the result ring, each once, acknowledged as handled.

`Producer` (client.py) is a `ResultReader`: it owns the rings (`_results`, `_buf`) and the state
this class reads (`_pending`, `_seen`, `_auto_ack`, `_session`, `_ready`, `_result_out`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import PeerDead
from ..protocol import request
from ..ring import layout as L
from ..ring.items import SEQ_BITS, SEQ_MASK, STATUS_NAMES
from .seen import SeenSet

RESULT_BATCH = 256
SESSION_POLL_SECONDS = 0.002  # how often a new reader looks whether the results process set its ring up


@dataclass(frozen=True)
class Result:
    item_id: int
    status: str  # ok | too_long | invalid | engine_error | corrupt
    tokens: np.ndarray
    error: str | None = None  # what went wrong, for a status other than ok


@dataclass(frozen=True)
class ResultBatch:
    """Results in columns (`Producer.take_results`): item ids, status codes, generated token counts."""

    item_ids: np.ndarray
    status: np.ndarray  # ring.items.STATUS_CODES
    num_tokens: np.ndarray

    def __len__(self) -> int:
        return int(self.item_ids.size)

    @classmethod
    def of(cls, results: list) -> ResultBatch:
        from ..ring.items import STATUS_CODES

        return cls(np.array([r.item_id for r in results], np.uint64),
                   np.array([STATUS_CODES[r.status] for r in results], np.uint32),
                   np.array([r.tokens.size for r in results], np.uint32))


class ResultReader:
    """The result methods of `Producer`."""

    def results(self, timeout_seconds: float = 0.0, *, auto_ack: bool = True) -> Iterator[Result]:
        """Yield results as they arrive; stops once none has come for `timeout_seconds`.

        Each item's result is yielded once by this Producer (the broker delivers at least once;
        duplicates are dropped here by item id). A result stays the broker's until it is
        acknowledged: with `auto_ack` a result counts as handled when the caller asks for the next
        one (or closes the Producer); with `auto_ack=False` only `ack()` acknowledges, so a caller
        that writes results somewhere calls it after its own write is durable. What a reader that
        dies had not acknowledged comes again to the next reader under this name.
        """
        pending = self._pending
        while True:
            while pending:
                yield self._hand_out(auto_ack)
                if auto_ack:
                    self.ack()
            # one record at a time: a result leaves the ring only when it is about to be yielded
            if self._fetch_results(1) == 0 and not self._wait_results(timeout_seconds):
                return

    def pop_results(self, max_results: int = RESULT_BATCH) -> list[Result]:
        """The results that arrived (up to `max_results`, at once, not waiting), without duplicates,
        not acknowledged: call `ack()` once they are handled (for a caller that forwards results
        in bulk, like a cluster node's bridge)."""
        if len(self._pending) < max_results:
            self._fetch_results(min(RESULT_BATCH, max_results - len(self._pending)))
        return [self._hand_out(False) for _ in range(min(max_results, len(self._pending)))]

    def take_results(self, timeout_seconds: float = 0.0, *, auto_ack: bool = True) -> ResultBatch:
        """The results that arrived (up to RESULT_BATCH, waiting up to `timeout_seconds` for the
        first), in columns and without duplicates: for producers that handle many at once. With
        `auto_ack` the results of the previous call count as handled (acknowledged) when this one
        is made; otherwise call `ack()`."""
        if auto_ack:
            self.ack()
        self._auto_ack = auto_ack
        if self._pending:
            rs = [self._hand_out(auto_ack) for _ in range(min(len(self._pending), RESULT_BATCH))]
            return ResultBatch.of(rs)
        n = self._pop_results()
        if n == 0 and timeout_seconds > 0 and self._wait_results(timeout_seconds):
            n = self._pop_results()
        tokens, offsets, keys, meta = self._result_out
        keep = self._fresh(keys[:n])
        return ResultBatch(keys[:n][keep].copy(), meta[:n, 0][keep].copy(), meta[:n, 1][keep].copy())

    def ack(self) -> None:
        """Acknowledge every result handed out so far (and the duplicates dropped meanwhile): the
        broker forgets them, and a later reader under this name does not get them again."""
        if self._buf is None or not self._session_ready():
            return
        h = self._results.header
        upto = self._pending[0][0] if self._pending else int(h[L.H_NUM_POPPED])
        if upto > int(h[L.H_NUM_ACKED]):
            h[L.H_NUM_ACKED] = upto

    def _hand_out(self, auto_ack: bool) -> Result:
        self._auto_ack = auto_ack
        return self._pending.popleft()[1]

    def _begin_session(self) -> None:
        """Announce a new reader of the result ring. The results process sets the ring up for it
        (what an earlier reader popped but never acknowledged is pushed again); until then nothing
        is popped (`_session_ready`, `_wait_results`)."""
        h = self._results.header
        self._session = int(h[L.H_SESSION]) + 1
        h[L.H_SESSION] = self._session
        self._ready = False

    def _session_ready(self) -> bool:
        if not self._ready:
            self._ready = int(self._results.header[L.H_SESSION_READY]) == self._session
        return self._ready

    def _wait_results(self, timeout_seconds: float) -> bool:
        if not self._session_ready():
            deadline = time.monotonic() + timeout_seconds
            while not self._session_ready():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(SESSION_POLL_SECONDS)
        try:
            return self._results.wait_readable(timeout_seconds)
        except PeerDead:
            # the results process is gone: a restarting one takes the ring over (same broker), or
            # the broker restarted and our results come on new rings
            if self._same_broker():
                time.sleep(min(timeout_seconds, 0.05))
                return False
            self.reconnect()
            return False

    def _same_broker(self) -> bool:
        """Does the broker this producer connected to still run (its supervisor answers)?"""
        try:
            reply = request(self.data_dir, {"op": "info"}, 1.0)
        except (OSError, ValueError):
            return False
        return self._broker_pid is not None and reply.get("pid") == self._broker_pid

    def _pop_results(self, max_records: int = RESULT_BATCH) -> int:
        if self._result_out is None:
            self._result_out = (
                np.empty(self._results.max_tokens, np.uint32),
                np.empty(RESULT_BATCH + 1, np.int64),
                np.empty(RESULT_BATCH, np.uint64),
                np.empty((RESULT_BATCH, L.META_WORDS), np.uint32),
            )
        if not self._session_ready():
            return 0
        tokens, offsets, keys, meta = self._result_out
        return self._results.pop_many(tokens, offsets, keys, meta, max_records)

    def _fresh(self, keys: np.ndarray) -> np.ndarray:
        """Mark these item ids seen; True for those not seen before."""
        keep = np.ones(keys.size, bool)
        if keys.size == 0:
            return keep
        producers = keys >> np.uint64(SEQ_BITS)
        seqs = (keys & np.uint64(SEQ_MASK)).astype(np.int64)
        unique = np.unique(producers).tolist()
        for p in unique:
            mine = producers == p if len(unique) > 1 else slice(None)
            seen = self._seen.get(p)
            if seen is None:
                seen = self._seen[p] = SeenSet()
            keep[mine] = seen.add(seqs[mine])
        return keep

    def _fetch_results(self, max_records: int = RESULT_BATCH) -> int:
        """Move what the result ring holds (up to max_records) into the pending queue."""
        n = self._pop_results(max_records)
        if n == 0:
            return 0
        tokens, offsets, keys, meta = self._result_out
        keep = self._fresh(keys[:n])
        first = self._results.num_popped() - n  # ring index of the first record popped
        for i in np.flatnonzero(keep).tolist():
            ntok = int(meta[i, 1])
            body = tokens[offsets[i] : offsets[i + 1]]
            error = None
            if meta[i, 3]:
                error = body[ntok:].tobytes()[: int(meta[i, 3])].decode("utf-8", "replace")
            self._pending.append((first + i, Result(int(keys[i]), STATUS_NAMES.get(int(meta[i, 0]), "invalid"),
                                                    body[:ntok].copy(), error)))
        return n

