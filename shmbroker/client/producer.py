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

import os
import secrets
import time
from collections import deque

import numpy as np

from .. import protocol
from ..errors import BrokerError, Full, NotRunning, PeerDead
from ..protocol import PROTOCOL_VERSION, request
from ..ring import layout as L
from ..ring.items import (
    ITEM_BAD_MAX_NEW,
    ITEM_EMPTY,
    NO_PREFIX,
    U32_MAX,
    as_tokens,
    item_id,
    model_id,
    push_item,
    push_item_readonly,
)
from ..ring.ring import CONSUMER, PRODUCER, Ring, RingNames
from .checks import as_int, as_offsets, batch_fields, check_prefix_len, check_u32
from .reader import Result, ResultReader
from .seen import SeenSet

SUBMIT_TIMEOUT_SECONDS = 10.0  # how long a submit waits on a full ring before it raises Full
CONNECT_TIMEOUT_SECONDS = 5.0  # how long connecting (or reconnecting) waits for a broker


class _Retry(Exception):
    """Internal: the broker restarted under a submit; submit again on the new rings."""


class Producer(ResultReader):
    """A producer's connection to a running broker: one ingest ring and one result ring.

    The rings are single-producer: use one Producer per thread (or a lock).
    """

    def __init__(
        self,
        name: str | None = None,
        *,
        data_dir: str | os.PathLike | None = None,
        timeout_seconds: float = SUBMIT_TIMEOUT_SECONDS,
        connect_timeout_seconds: float = CONNECT_TIMEOUT_SECONDS,
    ):
        self.name = name if name is not None else f"p{os.getpid()}-{secrets.token_hex(3)}"
        self.data_dir = protocol.data_dir(data_dir)
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
        except ValueError as exc:  # no reply, or half of one: the broker died answering
            raise BrokerError(f"the broker on {self.data_dir!r} gave no valid reply to connect ({exc}); try again") from None
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
            max_new_tokens = as_int(max_new_tokens, "max_new_tokens")
        try:
            rc = push_item(self._buf, tokens, seq, max_new_tokens, prefix, mid)
        except TypeError:
            if self._buf is None:
                raise BrokerError("producer is closed") from None
            tokens = as_tokens(tokens)
            prefix = NO_PREFIX if prefix_len is None else self._prefix(prefix_len, tokens)
            push = push_item if tokens.flags.writeable else push_item_readonly
            rc = push(self._buf, tokens, seq, check_u32(max_new_tokens, "max_new_tokens"), prefix, mid)
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
        offs = as_offsets(offsets, flat.size, self.max_tokens)
        count = offs.size - 1
        mid = self._models.get(model)
        if mid is None:
            mid = self._models.setdefault(model, model_id(model))
        max_new, prefixes, shared = batch_fields(max_new_tokens, prefix_len, offs)
        meta = np.zeros((1 if shared else count, L.META_WORDS), np.uint32)
        meta[:, 0] = max_new
        meta[:, 1] = NO_PREFIX if prefixes is None else prefixes
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
        return check_prefix_len(prefix_len, tokens)

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
