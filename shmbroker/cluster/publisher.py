"""Pipelined JetStream publishing: many messages in flight, each one's PubAck (or error) on a future.

nats-py 2.16's `js.publish_async` never resolves a future whose publish the server refused (its
error parser raises inside the reply callback: nats-io/nats.py#985), and a full stream is exactly
such a refusal here. So this publisher sends each message with a reply subject under one inbox
of its own, and resolves the future from the reply: a `PubAck`, or `PublishRefused` with the
server's codes. At most `max_pending` messages are in flight. Runs on a `NatsLoop`'s loop.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

FULL_ERR_CODES = (10077,)  # JSStreamStoreFailedF: "maximum bytes/messages exceeded" (discard new)
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
