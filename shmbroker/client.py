"""The producer client: submit token-id prompts into shared memory, never blocking on a GPU.

    from shmbroker import Producer
    with Producer("my-app") as p:
        item = p.submit(np.array([1, 2, 3], np.uint32), max_new_tokens=64)
        ids = p.submit_many(flat, offsets, max_new_tokens=64)
        for result in p.results(timeout_seconds=1.0):
            ...

`submit` returns once the item is committed to the producer's ingest ring
(shared memory). A full ring makes it wait up to its timeout and then raise
`Full`, or raise at once with `block=False`. Bad input raises TypeError or
ValueError before anything is written, so nothing already submitted is
affected. The fast path is one numba call: a C-contiguous uint32 array and
plain ints pass numba's own type check; anything else takes a slower path
that converts it or says what is wrong.
"""

from __future__ import annotations

import operator
import os
import secrets
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from . import config
from .errors import BrokerError, Full, NotRunning, PeerDead
from .registry import PROTOCOL_VERSION, request
from .ring import layout as L
from .ring.items import (
    ITEM_BAD_MAX_NEW,
    ITEM_EMPTY,
    NO_PREFIX,
    SEQ_BITS,
    SEQ_MASK,
    STATUS_NAMES,
    U32_MAX,
    as_tokens,
    item_id,
    model_id,
    push_item,
    push_item_readonly,
)
from .ring.ring import CONSUMER, PRODUCER, Ring, RingNames
from .ring.spsc import BATCH_BAD_BOUNDS, BATCH_EMPTY_ITEM, BATCH_TOO_LARGE, check_batch

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
        from .ring.items import STATUS_CODES

        return cls(np.array([r.item_id for r in results], np.uint64),
                   np.array([STATUS_CODES[r.status] for r in results], np.uint32),
                   np.array([r.tokens.size for r in results], np.uint32))


class SeenSet:
    """The sequence numbers seen of one producer id, in chunks of CHUNK: a chunk with some seen
    is a bitmap, a chunk with all seen is one number (`full_below`, or `full` when out of order),
    a chunk with none is nothing. So memory follows the chunks partly answered (the spread of
    results in flight), not the first sequence number a new reader sees, and a sequence number
    that never comes back holds one chunk, not a window that can no longer slide."""

    CHUNK_BITS = 16
    CHUNK = 1 << CHUNK_BITS

    def __init__(self):
        self.full_below = 0  # every chunk below this one is all seen
        self.full: set[int] = set()  # other chunks all seen
        self.partial: dict[int, np.ndarray] = {}  # chunk -> bool flags

    def add(self, seqs: np.ndarray) -> np.ndarray:
        """Mark seqs seen; True for each not seen before (the first of two equal ones in seqs)."""
        seqs = np.asarray(seqs, np.int64)
        fresh = np.zeros(seqs.size, bool)
        if seqs.size == 0:
            return fresh
        chunks = seqs >> self.CHUNK_BITS
        lo, hi = int(chunks.min()), int(chunks.max())
        for c in ([lo] if lo == hi else np.unique(chunks).tolist()):
            if c < self.full_below or c in self.full:
                continue
            mine = slice(None) if lo == hi else np.flatnonzero(chunks == c)
            rel = seqs[mine] & (self.CHUNK - 1)
            flags = self.partial.get(c)
            if flags is None:
                flags = self.partial[c] = np.zeros(self.CHUNK, bool)
            new = ~flags[rel]
            if rel.size > 1:  # two copies within one call: keep the first
                order = np.argsort(rel, kind="stable")
                again = np.zeros(rel.size, bool)
                again[order[1:]] = rel[order[1:]] == rel[order[:-1]]
                new &= ~again
            fresh[mine] = new
            flags[rel] = True
            if new.any() and flags.all():
                del self.partial[c]
                self.full.add(c)
        while self.full_below in self.full:
            self.full.discard(self.full_below)
            self.full_below += 1
        return fresh

    def nbytes(self) -> int:
        return self.CHUNK * len(self.partial) + 64 * len(self.full)


class _Retry(Exception):
    """Internal: the broker restarted under a submit; submit again on the new rings."""


class Producer:
    """A producer's connection to a running broker: one ingest ring and one result ring.

    The rings are single-producer: use one Producer per thread (or a lock).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        data_dir: str | os.PathLike | None = None,
        timeout_seconds: float = config.DEFAULT_SUBMIT_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = config.DEFAULT_CONNECT_TIMEOUT_SECONDS,
    ):
        self.name = name if name is not None else f"p{os.getpid()}-{secrets.token_hex(3)}"
        self.data_dir = config.data_dir(data_dir)
        self.timeout_seconds = float(timeout_seconds)
        self.connect_timeout_seconds = float(connect_timeout_seconds)
        self._buf = None
        self._result_out = None
        self._pending: deque[tuple[int, Result]] = deque()  # (ring index, result) popped, not handed out
        self._auto_ack = True
        self._seen: dict[int, SeenSet] = {}  # producer id -> the seqs whose results were yielded (dedupe)
        self._models: dict[str | None, int] = {None: 0}
        self.reconnects = 0
        self._connect(self.connect_timeout_seconds)

    def _connect(self, timeout_seconds: float) -> None:
        try:
            reply = request(
                self.data_dir,
                {"op": "connect", "version": PROTOCOL_VERSION, "name": self.name},
                timeout_seconds,
            )
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            raise NotRunning(f"no broker is running on data directory {self.data_dir!r} ({exc.strerror})") from None
        if not reply.get("ok"):
            raise BrokerError(f"broker refused producer {self.name!r}: {reply.get('error')}")
        self.producer_id = int(reply["producer_id"])
        self._broker_pid = reply.get("broker_pid")
        self._ingest = Ring.attach(RingNames.from_dict(reply["ingest"]), PRODUCER)
        try:
            self._results = Ring.attach(RingNames.from_dict(reply["results"]), CONSUMER)
        except BaseException:
            self._ingest.close()
            raise
        self._begin_session()
        self._buf = self._ingest.buf
        self._seq = self._ingest.next_key  # resumes after a reconnect
        self._id_base = item_id(self.producer_id, 0)
        self.max_tokens = self._ingest.max_tokens

    def reconnect(self, timeout_seconds: float | None = None) -> None:
        """Attach again under the same name: to the same rings while the broker runs, to new ones
        (and a new producer id) after it restarted. Waits up to `timeout_seconds` for a broker."""
        deadline = time.monotonic() + (self.connect_timeout_seconds if timeout_seconds is None else timeout_seconds)
        self._detach()
        while True:
            try:
                self._connect(max(0.1, deadline - time.monotonic()))
                self.reconnects += 1
                return
            except (NotRunning, BrokerError, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    # -- submit ----------------------------------------------------------------------

    def submit(
        self,
        tokens,
        *,
        max_new_tokens: int,
        prefix_len: int | None = None,
        model: str | None = None,
        block: bool = True,
        timeout_seconds: float | None = None,
    ) -> int:
        """Submit one prompt; returns its item id once it is in shared memory. When the broker
        restarts meanwhile, the producer reconnects under its name and submits it there."""
        while True:
            try:
                return self._submit(tokens, max_new_tokens, prefix_len, model, block, timeout_seconds)
            except _Retry:
                continue

    def _submit(self, tokens, max_new_tokens, prefix_len, model, block, timeout_seconds) -> int:
        seq = self._seq
        if prefix_len is None and model is None and type(max_new_tokens) is int:
            # the common case in one numba call; numba's own type check refuses anything but
            # a C-contiguous uint32 array, and those go the general way below
            try:
                rc = push_item(self._buf, tokens, seq, max_new_tokens, NO_PREFIX, 0)
            except (TypeError, OverflowError):
                pass
            else:
                if rc != L.OK:
                    self._submit_slow(rc, tokens, seq, max_new_tokens, NO_PREFIX, 0, block, timeout_seconds)
                self._seq = seq + 1
                return self._id_base | seq
        prefix = NO_PREFIX if prefix_len is None else self._prefix(prefix_len, tokens)
        mid = self._models.get(model)
        if mid is None:
            mid = self._models.setdefault(model, model_id(model))
        if type(max_new_tokens) is not int:
            max_new_tokens = _as_int(max_new_tokens, "max_new_tokens")
        try:
            rc = push_item(self._buf, tokens, seq, max_new_tokens, prefix, mid)
        except TypeError:
            if self._buf is None:
                raise BrokerError("producer is closed") from None
            tokens = as_tokens(tokens)
            prefix = NO_PREFIX if prefix_len is None else self._prefix(prefix_len, tokens)
            push = push_item if tokens.flags.writeable else push_item_readonly
            rc = push(self._buf, tokens, seq, _check_u32(max_new_tokens, "max_new_tokens"), prefix, mid)
        except OverflowError:
            raise ValueError(f"max_new_tokens must be in 0..{U32_MAX}, got {max_new_tokens}") from None
        if rc != L.OK:
            self._submit_slow(rc, tokens, seq, max_new_tokens, prefix, mid, block, timeout_seconds)
        self._seq = seq + 1
        return self._id_base | seq

    def _submit_slow(self, rc, tokens, seq, max_new_tokens, prefix, mid, block, timeout_seconds) -> None:
        if rc == L.OK_WAKE:
            self._ingest.data_bell.ring()
            return
        if rc == ITEM_EMPTY:
            raise ValueError("tokens is empty: an item needs at least one token")
        if rc == ITEM_BAD_MAX_NEW:
            raise ValueError(f"max_new_tokens must be in 0..{U32_MAX}, got {max_new_tokens}")
        if rc == L.TOO_LARGE:
            raise ValueError(f"item of {tokens.size} tokens exceeds the ingest ring's limit of {self.max_tokens}")
        assert rc == L.FULL
        if not block:
            raise Full("ingest ring is full")
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + timeout
        while True:
            try:
                self._ingest.push_wait(tokens, seq, max_new_tokens, prefix, mid, 0,
                                       max(0.0, deadline - time.monotonic()))
                return
            except PeerDead:
                if not self._same_broker():
                    # the broker went away: its next incarnation salvaged what the ring held;
                    # start over on new rings (a new producer id) and push this item there
                    self.reconnect()
                    raise _Retry() from None
                # the same broker restarts its ingest process: the ring stays, wait on
                if time.monotonic() >= deadline:
                    raise Full(f"ingest ring stayed full for {timeout} s (its ingest process is restarting)") from None
                time.sleep(0.01)

    def submit_many(
        self,
        flat_tokens,
        offsets,
        *,
        max_new_tokens,
        prefix_len=None,
        model: str | None = None,
        block: bool = True,
        timeout_seconds: float | None = None,
    ) -> np.ndarray:
        """Submit many prompts: item i is flat_tokens[offsets[i]:offsets[i+1]].

        `max_new_tokens` and `prefix_len` are one value for all or one per item.
        Every item is checked before any is written. Returns the item ids
        (uint64). A full ring past the deadline raises Full whose `submitted`
        and `ids` say which items went in.
        """
        flat = as_tokens(flat_tokens, "flat_tokens")
        offs = _as_offsets(offsets, flat.size, self.max_tokens)
        count = offs.size - 1
        mid = self._models.get(model)
        if mid is None:
            mid = self._models.setdefault(model, model_id(model))
        shared = _is_one(max_new_tokens) and _is_one(prefix_len)
        meta = np.zeros((1 if shared else count, L.META_WORDS), np.uint32)
        meta[:, 0] = _per_item(max_new_tokens, count, "max_new_tokens", shared)
        if prefix_len is None:
            meta[:, 1] = NO_PREFIX
        else:
            prefixes = _per_item(prefix_len, count, "prefix_len", shared)
            if np.any(prefixes > np.diff(offs)):
                raise ValueError("prefix_len exceeds its item's length")
            meta[:, 1] = prefixes
        meta[:, 2] = mid
        timeout = self.timeout_seconds if timeout_seconds is None else timeout_seconds
        deadline = time.monotonic() + (timeout if block else 0.0)
        out = np.empty(count, np.uint64)
        done = 0
        while True:
            seq0 = self._seq
            ids = np.arange(self._id_base | seq0, (self._id_base | seq0) + count - done, dtype=np.uint64)
            part = offs[done:] - offs[done]
            sub = flat[offs[done] : offs[-1]]
            m = meta if meta.shape[0] == 1 else meta[done:]
            try:
                self._ingest.push_many(sub, part, seq0, m, max(0.0, deadline - time.monotonic()))
            except Full as exc:
                self._seq = seq0 + exc.submitted
                out[done : done + exc.submitted] = ids[: exc.submitted]
                done += exc.submitted
                raise Full(str(exc), submitted=done, ids=out[:done]) from None
            except PeerDead as exc:
                pushed = getattr(exc, "submitted", 0)
                self._seq = seq0 + pushed
                out[done : done + pushed] = ids[:pushed]
                done += pushed
                if not self._same_broker():
                    self.reconnect()  # the broker restarted: the rest goes to the new one
                elif time.monotonic() >= deadline:
                    raise Full("ingest ring stayed full (its ingest process is restarting)", submitted=done,
                               ids=out[:done]) from None
                else:
                    time.sleep(0.01)  # the same broker restarts its ingest process: wait on
                continue
            self._seq = seq0 + count - done
            out[done:] = ids
            return out

    def _prefix(self, prefix_len, tokens) -> int:
        value = _as_int(prefix_len, "prefix_len")
        try:
            size = len(tokens)
        except TypeError:
            raise TypeError(f"tokens must be 1-D integer data, got {type(tokens).__name__}") from None
        if not 0 <= value <= size:
            raise ValueError(f"prefix_len must be in 0..{size} (the item's length), got {value}")
        return value

    # -- results ---------------------------------------------------------------------

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
        first = int(self._results.header[L.H_NUM_POPPED]) - n  # ring index of the first record popped
        for i in np.flatnonzero(keep).tolist():
            ntok = int(meta[i, 1])
            body = tokens[offsets[i] : offsets[i + 1]]
            error = None
            if meta[i, 3]:
                error = body[ntok:].tobytes()[: int(meta[i, 3])].decode("utf-8", "replace")
            self._pending.append((first + i, Result(int(keys[i]), STATUS_NAMES.get(int(meta[i, 0]), "invalid"),
                                                    body[:ntok].copy(), error)))
        return n

    # -- lifetime --------------------------------------------------------------------

    @property
    def next_item_id(self) -> int:
        return self._id_base | self._seq

    def close(self) -> None:
        """Detach from the rings (idempotent). Items already submitted stay with the broker, and so
        do results not acknowledged (with auto_ack, those handed out are acknowledged here)."""
        try:
            if self._buf is not None and self._auto_ack:
                self.ack()
        finally:
            self._detach()

    def _detach(self) -> None:
        if self._buf is None:
            return
        self._buf = None
        self._ingest.close()
        self._results.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None


def _check_u32(value, what: str) -> int:
    value = _as_int(value, what)
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{what} must be in 0..{U32_MAX}, got {value}")
    return value


def _is_one(value) -> bool:
    return value is None or isinstance(value, (int, np.integer))


def _per_item(value, count: int, what: str, shared: bool) -> np.ndarray:
    """One value (shared) or `count` values per item as int64, range-checked."""
    if shared:
        arr = np.array([_check_u32(value, what)], np.int64)
    else:
        raw = np.asarray(value)
        if raw.ndim == 0:
            raw = np.full(count, _check_u32(value, what), np.int64)
        if raw.ndim != 1 or raw.size != count:
            raise ValueError(f"{what} must be one integer or {count} of them, got shape {raw.shape}")
        if raw.dtype.kind not in "iu":
            raise TypeError(f"{what} must be integers, got dtype {raw.dtype}")
        arr = raw.astype(np.int64)
    if arr.min() < 0 or arr.max() > U32_MAX:
        raise ValueError(f"{what} must be in 0..{U32_MAX}")
    return arr


def _as_offsets(offsets, flat_size: int, max_tokens: int) -> np.ndarray:
    raw = offsets if isinstance(offsets, np.ndarray) else np.asarray(offsets)
    if raw.ndim != 1 or raw.size < 2:
        raise ValueError("offsets must be 1-D with at least two entries (item i is flat[offsets[i]:offsets[i+1]])")
    if raw.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers, got dtype {raw.dtype}")
    offs = raw if raw.dtype == np.int64 and raw.flags.c_contiguous else np.ascontiguousarray(raw, dtype=np.int64)
    status, index = check_batch(offs, flat_size, max_tokens)
    if status == BATCH_BAD_BOUNDS:
        raise ValueError(f"offsets must start at 0 and end at len(flat_tokens) = {flat_size}")
    if status == BATCH_EMPTY_ITEM:
        raise ValueError(f"item {index} is empty or offsets decrease")
    if status == BATCH_TOO_LARGE:
        raise ValueError(f"item {index} exceeds the ingest ring's limit of {max_tokens} tokens")
    return offs
