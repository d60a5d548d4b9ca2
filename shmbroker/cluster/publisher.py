"""Pipelined JetStream publishing: many messages in flight, each one's PubAck (or error) on a future.

nats-py 2.16's `js.publish_async` never resolves a future whose publish the server refused (its
error parser raises inside the reply callback: nats-io/nats.py#985), and a full stream is exactly
such a refusal here. So this publisher sends each message with a reply subject under one inbox
of its own, and resolves the future from the reply: a `PubAck`, or `PublishRefused` with the
server's codes. At most `max_pending` messages are in flight. `publish_all` publishes a batch
with back-pressure: a refused message is retried (same message id) with a growing back-off
until a deadline. Runs on a `NatsLoop`'s loop.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

FULL_ERR_CODES = (10077,)  # JSStreamStoreFailedF: "maximum bytes/messages exceeded" (discard new)
PUBACK_GRACE_SECONDS = 2.0  # a PubAck is awaited at least this long, even past the deadline
BACKOFF_MIN_SECONDS = 0.005  # retries of a refused message back off from this ...
BACKOFF_MAX_SECONDS = 0.2  # ... doubling up to this
RETRYABLE_CODES = (503,)  # no responders (a stream leader being elected), a full stream, JetStream unavailable


@dataclass(frozen=True)
class PubAck:
    stream: str
    seq: int
    duplicate: bool


class PublishRefused(Exception):
    """The server refused a publish: `code` (HTTP-like), `err_code` (JetStream's), `description`."""

    def __init__(self, code: int, err_code: int, description: str):
        super().__init__(f"{description} (code {code}, err_code {err_code})")
        self.code = code
        self.err_code = err_code
        self.description = description

    @property
    def full(self) -> bool:
        """The stream reached its limit (discard new): back-pressure, not a failure."""
        return self.err_code in FULL_ERR_CODES or "maximum" in self.description

    @property
    def retryable(self) -> bool:
        return self.full or self.code in RETRYABLE_CODES


class AckedPublisher:
    """Publish with PubAcks, pipelined. `await publish(...)` returns once the message is sent
    (waiting for a free slot) and gives the future of its PubAck."""

    def __init__(self, nc, max_pending: int = 1024):
        assert max_pending >= 1
        self._nc = nc
        self._slots = asyncio.Semaphore(max_pending)
        self._futures: dict[str, asyncio.Future] = {}
        self._next = 0
        self._inbox: str | None = None
        self._sub = None

    async def _start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox + ".*", cb=self._on_reply)

    async def publish(self, subject: str, payload: bytes, headers: dict | None = None) -> asyncio.Future:
        if self._sub is None:
            await self._start()
        await self._slots.acquire()
        token = str(self._next)
        self._next += 1
        future = asyncio.get_running_loop().create_future()
        self._futures[token] = future
        future.add_done_callback(lambda _f, token=token: self._done(token))
        try:
            await self._nc.publish(subject, payload, reply=f"{self._inbox}.{token}", headers=headers)
        except BaseException as exc:
            if not future.done():
                future.set_exception(exc)
            raise
        return future

    def _done(self, token: str) -> None:
        if self._futures.pop(token, None) is not None:
            self._slots.release()

    async def _on_reply(self, msg) -> None:
        future = self._futures.get(msg.subject[len(self._inbox) + 1:])
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == "503":
            future.set_exception(PublishRefused(503, 0, "no responders: no stream (or no stream leader) for the subject"))
            return
        try:
            reply = json.loads(msg.data)
            error = reply.get("error")
            if error is not None:
                future.set_exception(PublishRefused(int(error.get("code", 0)), int(error.get("err_code", 0)),
                                                    str(error.get("description", ""))))
            else:
                future.set_result(PubAck(str(reply["stream"]), int(reply["seq"]), bool(reply.get("duplicate"))))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            future.set_exception(PublishRefused(0, 0, f"unreadable PubAck {msg.data[:80]!r}: {exc}"))

    @property
    def has_slot(self) -> bool:
        """A publish now would not wait for a PubAck to free a slot."""
        return not self._slots.locked()

    @property
    def num_pending(self) -> int:
        return len(self._futures)

    async def close(self) -> None:
        for future in list(self._futures.values()):
            future.cancel()
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None


async def publish_all(pub: AckedPublisher, msgs: list, stored: np.ndarray, deadline: float):
    """Publish every (subject, payload, headers) of `msgs` not yet `stored`, pipelined; after a
    refusal, retry the first one left alone with a growing back-off until it goes in (then
    pipeline again) or the deadline passes. Returns None when all are stored, else the last error."""
    start, backoff = 0, BACKOFF_MIN_SECONDS
    while True:
        error = await _pipeline(pub, msgs, stored, start, deadline)
        left = np.flatnonzero(~stored)
        if left.size == 0:
            return None
        if isinstance(error, PublishRefused) and not error.retryable:
            return error
        start = int(left[0])
        while True:  # one at a time until it goes in: no window of refusals
            if time.monotonic() >= deadline:
                return error
            await asyncio.sleep(min(backoff, max(0.0, deadline - time.monotonic())))
            backoff = min(2 * backoff, BACKOFF_MAX_SECONDS)
            error = await _pipeline(pub, msgs, stored, start, deadline, only=1)
            if stored[start]:
                backoff = BACKOFF_MIN_SECONDS
                start += 1
                break
            if isinstance(error, PublishRefused) and not error.retryable:
                return error


async def _pipeline(pub: AckedPublisher, msgs, stored, start: int, deadline: float, only: int | None = None):
    """Send the unstored messages from `start` on (`only` of them at most) until one is refused,
    then await the PubAcks in flight; marks `stored`, returns the first error seen or None."""
    inflight: deque = deque()
    error = None
    i, end = start, len(msgs) if only is None else min(len(msgs), start + only)
    while i < end and error is None:
        if stored[i]:
            i += 1
            continue
        subject, payload, headers = msgs[i]
        try:
            if pub.has_slot:
                future = await pub.publish(subject, payload, headers)
            else:  # the window is full: wait for a PubAck, bounded (asyncio.wait_for costs a task)
                future = await asyncio.wait_for(pub.publish(subject, payload, headers),
                                                max(PUBACK_GRACE_SECONDS, deadline - time.monotonic()))
        except Exception as exc:  # no slot in time, or the connection is reconnecting or closed
            error = exc
            break
        inflight.append((i, future))
        i += 1
        while inflight and inflight[0][1].done():
            error = _settle(*inflight.popleft(), stored) or error
    if inflight:
        _, late = await asyncio.wait([f for _, f in inflight], timeout=max(PUBACK_GRACE_SECONDS, deadline - time.monotonic()))
        for future in late:
            future.cancel()  # no PubAck in time: retried under the same message id
    for j, future in inflight:
        error = _settle(j, future, stored) or error
    return error


def _settle(index: int, future, stored: np.ndarray):
    """Mark a finished publish; its error, or None when JetStream stored it (a duplicate was stored before)."""
    if future.cancelled():
        return TimeoutError("no PubAck in time")
    error = future.exception()
    if error is None:
        stored[index] = True
    return error
