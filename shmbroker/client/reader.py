"""A producer's reading side: its results off the result ring, each once, acknowledged as handled.

`ResultReader` owns the result ring's consumer side, the results popped but not handed out yet,
the item ids already handed out (`SeenIds`: the broker delivers at least once, the reader drops
what it has handed out before) and the session handshake with the results process. `Result`,
`ResultBatch` and `RESULT_BATCH` are the client's result types, shared with
`cluster.remote.RemoteProducer`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import PeerDead
from ..request.extras import Extras, ExtrasError, decode_extras, samples_of
from ..ring import layout as L
from ..ring.items import SEQ_BITS, SEQ_MASK, STATUS_CODES, STATUS_NAMES
from ..ring.ring import Ring
from .connection import Recover
from .seen import SeenSet

RESULT_BATCH = 256
SESSION_POLL_SECONDS = 0.002  # how often a new reader looks whether the results process set its ring up
RESTART_WAIT_SECONDS = 0.05  # how long a read waits on while the broker restarts its results process


@dataclass(frozen=True)
class Result:
    item_id: int
    status: str  # ok | too_long | invalid | engine_error | corrupt
    tokens: np.ndarray  # every sample's tokens, one after another (`samples` splits them)
    error: str | None = None  # what went wrong, for a status other than ok
    extras: Extras | None = None  # samples, finish reasons, cached prompt tokens, when the engine said

    @property
    def samples(self) -> list[np.ndarray]:
        """Each sample's tokens (one sample, all the tokens, when the engine said nothing of samples)."""
        return samples_of(self.tokens, self.extras)

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the engine served from its prefix cache (None: it did not say)."""
        return None if self.extras is None else self.extras.cached_tokens

    @property
    def finish_reasons(self) -> tuple[str, ...] | None:
        """Each sample's finish reason, "stop" or "length" (None: the engine did not say)."""
        return None if self.extras is None else self.extras.finish_reasons

    @property
    def vector(self) -> np.ndarray | None:
        """An embedding item's vector (float32, a view of the result's words), else None."""
        return self.tokens.view(np.float32) if self.extras is not None and self.extras.vector else None

    @property
    def logprobs(self):
        """Each sample's `request.extras.Logprobs` (each token's logprob, its top tokens' ids and
        logprobs), when the item asked for logprobs and its engine gave them; else None."""
        return None if self.extras is None else self.extras.logprobs


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
        return cls(np.array([r.item_id for r in results], np.uint64),
                   np.array([STATUS_CODES[r.status] for r in results], np.uint32),
                   np.array([r.tokens.size for r in results], np.uint32))


@dataclass(frozen=True)
class ResultBuffers:
    """Where `Ring.pop_many` copies result records to: record i's tokens are
    tokens[offsets[i]:offsets[i+1]], its key item_ids[i], its meta words meta[i]."""

    tokens: np.ndarray  # uint32, the ring's max_tokens
    offsets: np.ndarray  # int64, RESULT_BATCH + 1
    item_ids: np.ndarray  # uint64, RESULT_BATCH
    meta: np.ndarray  # uint32, RESULT_BATCH x META_WORDS

    @classmethod
    def for_ring(cls, ring: Ring) -> ResultBuffers:
        return cls(np.empty(ring.max_tokens, np.uint32), np.empty(RESULT_BATCH + 1, np.int64),
                   np.empty(RESULT_BATCH, np.uint64), np.empty((RESULT_BATCH, L.META_WORDS), np.uint32))


class SeenIds:
    """The item ids handed out, one `SeenSet` per producer id: after a broker restart one batch of
    results mixes a name's old and new producer ids."""

    def __init__(self):
        self.by_producer: dict[int, SeenSet] = {}

    def fresh(self, item_ids: np.ndarray) -> np.ndarray:
        """Mark these item ids (uint64) seen; True for each not seen before (the first of two equal
        ones in item_ids)."""
        keep = np.ones(item_ids.size, bool)
        if item_ids.size == 0:
            return keep
        producers = item_ids >> np.uint64(SEQ_BITS)
        seqs = (item_ids & np.uint64(SEQ_MASK)).astype(np.int64)
        unique = np.unique(producers).tolist()
        for p in unique:
            mine = producers == p if len(unique) > 1 else slice(None)
            seen = self.by_producer.get(p)
            if seen is None:
                seen = self.by_producer[p] = SeenSet()
            keep[mine] = seen.add(seqs[mine])
        return keep


class ResultReader:
    """The result ring's reader (`Producer.results`, `take_results`, `pop_results`, `ack`).

    Not attached until `attach`; the producer calls it again with the new ring after it connected
    again, and `detach` before the ring closes. A read that finds the results process dead asks the
    producer to recover (`connection.Recover`) and then finds nothing this time.
    """

    def __init__(self, recover: Recover):
        self.recover = recover
        self.ring: Ring | None = None
        self.pending: deque[tuple[int, Result]] = deque()  # (ring index, result) popped, not handed out
        self.seen = SeenIds()
        self.auto_ack = True  # were the results handed out last handed out with auto_ack (close acks them)
        self.session = 0  # this reader's session number on its ring
        self.ready = False  # has the results process set the ring up for this session
        self.out: ResultBuffers | None = None

    def attach(self, ring: Ring) -> None:
        """Read `ring` from now on: announce a new reader of it. The results process sets the ring
        up for it (what an earlier reader popped but never acknowledged is pushed again); until
        then nothing is popped (`session_ready`)."""
        self.ring = ring
        if self.out is not None and self.out.tokens.size != ring.max_tokens:
            self.out = None
        h = ring.header
        self.session = int(h[L.H_SESSION]) + 1
        h[L.H_SESSION] = self.session
        self.ready = False

    def detach(self) -> None:
        self.ring = None

    @property
    def attached(self) -> bool:
        return self.ring is not None

    def results(self, timeout_seconds: float, auto_ack: bool) -> Iterator[Result]:
        """`Producer.results`: each new result once, until none has come for `timeout_seconds`."""
        pending = self.pending
        while True:
            while pending:
                yield self._hand_out(auto_ack)
                if auto_ack:
                    self.ack()
            # one record at a time: a result leaves the ring only when it is about to be yielded
            if self._fetch(1) == 0 and not self._wait(timeout_seconds):
                return

    def pop_results(self, max_results: int) -> list[Result]:
        """`Producer.pop_results`: what arrived (up to `max_results`), not waiting, not acknowledged."""
        if len(self.pending) < max_results:
            self._fetch(min(RESULT_BATCH, max_results - len(self.pending)))
        return [self._hand_out(False) for _ in range(min(max_results, len(self.pending)))]

    def take_results(self, timeout_seconds: float, auto_ack: bool) -> ResultBatch:
        """`Producer.take_results`: what arrived (up to RESULT_BATCH), in columns."""
        if auto_ack:
            self.ack()
        self.auto_ack = auto_ack
        if self.pending:
            rs = [self._hand_out(auto_ack) for _ in range(min(len(self.pending), RESULT_BATCH))]
            return ResultBatch.of(rs)
        n = self._pop(RESULT_BATCH)
        if n == 0 and timeout_seconds > 0 and self._wait(timeout_seconds):
            n = self._pop(RESULT_BATCH)
        out = self.out
        keep = self.seen.fresh(out.item_ids[:n])
        return ResultBatch(out.item_ids[:n][keep].copy(), out.meta[:n, 0][keep].copy(), out.meta[:n, 1][keep].copy())

    def ack(self) -> None:
        """`Producer.ack`: every result handed out so far (and the duplicates dropped meanwhile)."""
        if self.ring is None or not self.session_ready():
            return
        h = self.ring.header
        upto = self.pending[0][0] if self.pending else int(h[L.H_NUM_POPPED])
        if upto > int(h[L.H_NUM_ACKED]):
            h[L.H_NUM_ACKED] = upto

    def session_ready(self) -> bool:
        if not self.ready:
            self.ready = int(self.ring.header[L.H_SESSION_READY]) == self.session
        return self.ready

    def _hand_out(self, auto_ack: bool) -> Result:
        self.auto_ack = auto_ack
        return self.pending.popleft()[1]

    def _wait(self, timeout_seconds: float) -> bool:
        """Wait up to `timeout_seconds` for the session and then for a record; True when one came."""
        if not self.session_ready():
            deadline = time.monotonic() + timeout_seconds
            while not self.session_ready():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(SESSION_POLL_SECONDS)
        try:
            return self.ring.wait_readable(timeout_seconds)
        except PeerDead:
            # the results process is gone: a restarting one takes the ring over (same broker), or
            # the broker restarted and our results come on new rings (the producer attaches us there)
            if not self.recover():
                time.sleep(min(timeout_seconds, RESTART_WAIT_SECONDS))
            return False

    def _pop(self, max_records: int) -> int:
        """Pop up to `max_records` records into `out` (none before the session is ready)."""
        if self.out is None:
            self.out = ResultBuffers.for_ring(self.ring)
        if not self.session_ready():
            return 0
        out = self.out
        return self.ring.pop_many(out.tokens, out.offsets, out.item_ids, out.meta, max_records)

    def _fetch(self, max_records: int) -> int:
        """Move what the result ring holds (up to max_records) into the pending queue."""
        n = self._pop(max_records)
        if n == 0:
            return 0
        out = self.out
        tokens, offsets, item_ids, meta = out.tokens, out.offsets, out.item_ids, out.meta
        keep = self.seen.fresh(item_ids[:n])
        first = self.ring.num_popped() - n  # ring index of the first record popped
        for i in np.flatnonzero(keep).tolist():
            ntok, nx = int(meta[i, 1]), int(meta[i, 2])
            body = tokens[offsets[i] : offsets[i + 1]]
            error = None
            if meta[i, 3]:
                error = body[ntok + nx :].tobytes()[: int(meta[i, 3])].decode("utf-8", "replace")
            extras = None
            if nx:
                try:
                    extras = decode_extras(body[ntok : ntok + nx], ntok)
                except ExtrasError as exc:  # not the broker's words: say so, keep the tokens
                    error = f"its extras are not readable: {exc}"
            self.pending.append((first + i, Result(int(item_ids[i]), STATUS_NAMES.get(int(meta[i, 0]), "invalid"),
                                                   body[:ntok].copy(), error, extras)))
        return n
