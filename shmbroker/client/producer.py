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

A Producer is its connection to the broker (`connection.Connection`) and two
collaborators it delegates to: a `Submitter` (the ingest ring, sequence numbers,
model ids) and a `ResultReader` (the result ring, dedupe, acknowledgements). When
a ring's peer dies, either side asks the Producer to recover: it waits while the
same broker restarts that process, else connects again and attaches both sides
to the new rings.
"""

from __future__ import annotations

import os
import secrets
import time
import weakref
from collections.abc import Iterator

import numpy as np

from .. import protocol
from ..errors import BrokerError, NotRunning, PayloadRefused
from ..request.options import RequestOptions, embedding, encode
from ..request.structured import digest_of
from .checks import checked_options
from .connection import Connection, connect, same_broker, store_payload
from .reader import RESULT_BATCH, Result, ResultBatch, ResultReader
from .submitter import Resubmit, Submitter

SUBMIT_TIMEOUT_SECONDS = 10.0  # how long a submit waits on a full ring before it raises Full
CONNECT_TIMEOUT_SECONDS = 5.0  # how long connecting (or reconnecting) waits for a broker
RECONNECT_POLL_SECONDS = 0.05  # how often reconnecting tries again while no broker answers

__all__ = ["CONNECT_TIMEOUT_SECONDS", "SUBMIT_TIMEOUT_SECONDS", "Producer", "Result", "ResultBatch"]


class Producer:
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
        self.connect_timeout_seconds = float(connect_timeout_seconds)
        self.reconnects = 0
        self.producer_id = 0  # the broker's id for this producer (`connection.Connection`); set on connect
        self._broker_pid: int | None = None  # the broker this producer connected to last
        self._conn: Connection | None = None  # None while not attached
        self._stored: set[bytes] = set()  # digests of the payloads the broker has stored (put_payload)
        # the sides hold the recovery weakly: a Producer nobody holds closes when it is dropped
        # (`__del__`), not at the garbage collector's next round through a reference cycle
        recover = weakref.WeakMethod(self._recover)
        self._submitter = Submitter(float(timeout_seconds), lambda: recover()())
        self._reader = ResultReader(lambda: recover()())
        self._connect(self.connect_timeout_seconds)

    def _connect(self, timeout_seconds: float) -> None:
        conn = connect(self.data_dir, self.name, timeout_seconds)
        self._conn = conn
        self.producer_id = conn.producer_id
        self._broker_pid = conn.broker_pid
        self._reader.attach(conn.results)
        self._submitter.attach(conn.ingest, conn.producer_id)

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
                time.sleep(RECONNECT_POLL_SECONDS)

    def _recover(self) -> bool:
        """A ring's peer died (`connection.Recover`): False while the broker this producer connected
        to still runs (it restarts that process, the rings stay); else connect again, True."""
        if same_broker(self.data_dir, self._broker_pid):
            return False
        self.reconnect()
        return True

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
        options: RequestOptions | dict | None = None,
    ) -> int:
        """Submit one prompt; returns its item id once it is in shared memory. When the broker
        restarts meanwhile, the producer reconnects under its name and submits it there.

        `options`: its request options (`shmbroker.request.options.RequestOptions`, or a dict of
        request-body fields checked by `parse_options`): they ride with the item, durably, to the
        engine that runs it; an engine that cannot honour one fails the item alone (`invalid`)."""
        words = self._option_words(options, max_new_tokens)
        while True:
            try:
                if words is None:
                    return self._submitter.submit(tokens, max_new_tokens, prefix_len, model, block, timeout_seconds)
                return self._submitter.submit_with_options(tokens, max_new_tokens, prefix_len, model, words, block,
                                                           timeout_seconds)
            except Resubmit:
                continue

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
        options: RequestOptions | dict | None = None,
    ) -> np.ndarray:
        """Submit many prompts: item i is flat_tokens[offsets[i]:offsets[i+1]].

        `max_new_tokens` and `prefix_len` are one value for all or one per item; `options`, one set
        of request options for all (`submit`). Every item is checked before any is written. Returns
        the item ids (uint64). A full ring past the deadline raises Full whose `submitted` and `ids`
        say which items went in.
        """
        return self._submitter.submit_many(flat_tokens, offsets, max_new_tokens, prefix_len, model, block,
                                           timeout_seconds, self._option_words(options, max_new_tokens))

    def embed(self, tokens, *, model: str | None = None, dimensions: int | None = None, **kw) -> int:
        """Submit one prompt for its vector (an embedding: `Result.vector`), to a consumer of `model`
        that embeds (`task = "embed"`); `dimensions` cuts it (Matryoshka models only). As `submit`."""
        return self.submit(tokens, max_new_tokens=0, model=model, options=embedding(dimensions), **kw)

    def embed_many(self, flat_tokens, offsets, *, model: str | None = None, dimensions: int | None = None,
                   **kw) -> np.ndarray:
        """`embed` for many prompts, as `submit_many`: item i is flat_tokens[offsets[i]:offsets[i+1]]."""
        return self.submit_many(flat_tokens, offsets, max_new_tokens=0, model=model, options=embedding(dimensions),
                                **kw)

    def put_payload(self, payload: bytes) -> bytes:
        """Store a request payload (a constraint's schema, regex, grammar or choices) in the broker,
        durably and once however many items reference it; its digest. `submit` does this itself for
        a constraint it is given with its payload."""
        digest = digest_of(payload)
        limit = self._conn.max_payload_bytes if self._conn is not None else 0
        if digest not in self._stored and len(payload) > limit:
            raise PayloadRefused(f"a request payload of {len(payload)} bytes is over the broker's max_payload_bytes = "
                                 f"{limit}" if limit else "this broker stores no request payloads")
        if digest not in self._stored:
            if store_payload(self.data_dir, payload, self.connect_timeout_seconds) != digest:
                raise BrokerError("the broker stored a payload under another digest")
            self._stored.add(digest)
        return digest

    def _option_words(self, options, max_new_tokens) -> np.ndarray | None:
        opts = checked_options(options, max_new_tokens)
        if opts is None or not opts:
            return None
        s = opts.structured
        if s is not None and s.payload is not None and s.digest not in self._stored:
            self.put_payload(s.payload)
        return encode(opts)

    @property
    def next_item_id(self) -> int:
        return self._submitter.next_item_id

    @property
    def max_tokens(self) -> int:
        """The longest item (in tokens) the ingest ring takes."""
        return self._submitter.max_tokens

    @property
    def timeout_seconds(self) -> float:
        """How long a submit waits on a full ring by default before it raises Full."""
        return self._submitter.timeout_seconds

    @timeout_seconds.setter
    def timeout_seconds(self, value: float) -> None:
        self._submitter.timeout_seconds = float(value)

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
        # a generator of its own: it holds this Producer (whose rings the reader reads) while it runs
        self._check_open()
        yield from self._reader.results(timeout_seconds, auto_ack)

    def pop_results(self, max_results: int = RESULT_BATCH) -> list[Result]:
        """The results that arrived (up to `max_results`, at once, not waiting), without duplicates,
        not acknowledged: call `ack()` once they are handled (for a caller that forwards results
        in bulk, like a cluster node's bridge)."""
        self._check_open()
        return self._reader.pop_results(max_results)

    def take_results(self, timeout_seconds: float = 0.0, *, auto_ack: bool = True) -> ResultBatch:
        """The results that arrived (up to RESULT_BATCH, waiting up to `timeout_seconds` for the
        first), in columns and without duplicates: for producers that handle many at once. With
        `auto_ack` the results of the previous call count as handled (acknowledged) when this one
        is made; otherwise call `ack()`."""
        self._check_open()
        return self._reader.take_results(timeout_seconds, auto_ack)

    def ack(self) -> None:
        """Acknowledge every result handed out so far (and the duplicates dropped meanwhile): the
        broker forgets them, and a later reader under this name does not get them again. On a closed
        producer it does nothing: what it handed out was settled when it closed."""
        if self._conn is not None:
            self._reader.ack()

    @property
    def _auto_ack(self) -> bool:
        """Does `close` acknowledge the results handed out (they were handed out with auto_ack)?
        Tests set it False to leave as a reader that dies before acknowledging does."""
        return self._reader.auto_ack

    @_auto_ack.setter
    def _auto_ack(self, value: bool) -> None:
        self._reader.auto_ack = value

    def _check_open(self) -> None:
        if self._conn is None:
            raise BrokerError(f"producer {self.name!r} is closed: its results stay with the broker for the "
                              "next Producer under its name")

    # -- lifetime --------------------------------------------------------------------

    def close(self) -> None:
        """Detach from the rings (idempotent). Items already submitted stay with the broker, and so
        do results not acknowledged (with auto_ack, those handed out are acknowledged here)."""
        try:
            if self._conn is not None and self._reader.auto_ack:
                self._reader.ack()
        finally:
            self._detach()

    def _detach(self) -> None:
        conn, self._conn = self._conn, None
        if conn is None:
            return
        self._submitter.detach()
        self._reader.detach()
        conn.close()

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
