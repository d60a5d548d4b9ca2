"""A producer's connection to a broker: the connect handshake and the two rings it hands out.

The producer asks the broker's front door (`protocol.request`, op "connect") under its name; the
reply names its producer id, the broker's pid and the shared memory of its ingest ring (the
producer pushes) and its result ring (the producer pops). `same_broker` tells whether that broker
still runs: a ring whose peer died is then being taken over by a restarting process of the same
broker, else the broker itself restarted and the producer connects again.
"""

from __future__ import annotations

import base64
import os
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import BrokerError, NotRunning, PayloadRefused
from ..protocol import PROTOCOL_VERSION, request
from ..ring.ring import CONSUMER, PRODUCER, Ring, RingNames

INFO_TIMEOUT_SECONDS = 1.0  # how long `same_broker` waits for the supervisor's answer

# Called by a side of the producer whose ring's peer died: False while the broker it connected to
# still runs (a restarting process of it takes the ring over: wait on), else the producer has
# connected again (new rings, a new producer id) and it returns True (start over on those).
Recover = Callable[[], bool]


@dataclass(frozen=True)
class Connection:
    """What the broker handed a producer on connect."""

    producer_id: int
    broker_pid: int | None  # the supervisor's pid, to tell a restarted broker (`same_broker`)
    ingest: Ring  # the producer's side of its ingest ring
    results: Ring  # the consumer's side of its result ring
    max_payload_bytes: int = 0  # the largest request payload the broker stores (0: none)

    def close(self) -> None:
        """Detach from both rings (idempotent: Ring.close is)."""
        try:
            self.ingest.close()
        finally:
            self.results.close()


def connect(data_dir: str | os.PathLike, name: str, timeout_seconds: float) -> Connection:
    """Connect producer `name` to the broker on `data_dir`: NotRunning when none listens there,
    BrokerError when it refuses or gives no valid reply."""
    try:
        reply = request(data_dir, {"op": "connect", "version": PROTOCOL_VERSION, "name": name}, timeout_seconds)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise NotRunning(f"no broker is running on data directory {data_dir!r} ({exc.strerror})") from None
    except ValueError as exc:  # no reply, or half of one: the broker died answering
        raise BrokerError(f"the broker on {data_dir!r} gave no valid reply to connect ({exc}); try again") from None
    if not reply.get("ok"):
        raise BrokerError(f"broker refused producer {name!r}: {reply.get('error')}")
    ingest = Ring.attach(RingNames.from_dict(reply["ingest"]), PRODUCER)
    try:
        results = Ring.attach(RingNames.from_dict(reply["results"]), CONSUMER)
    except BaseException:
        ingest.close()
        raise
    return Connection(int(reply["producer_id"]), reply.get("broker_pid"), ingest, results,
                      int(reply.get("max_payload_bytes") or 0))


def store_payload(data_dir: str | os.PathLike, payload: bytes, timeout_seconds: float) -> bytes:
    """Hand a request payload to the broker's payload store (disk/payloads.py): its digest, once it
    is on disk. BrokerError says why the broker refused it (too large, a full disk)."""
    message = {"op": "payload", "version": PROTOCOL_VERSION, "data": base64.b64encode(payload).decode()}
    try:
        reply = request(data_dir, message, timeout_seconds)
    except (FileNotFoundError, ConnectionRefusedError) as exc:
        raise NotRunning(f"no broker is running on data directory {data_dir!r} ({exc.strerror})") from None
    except ValueError as exc:
        raise BrokerError(f"the broker on {data_dir!r} gave no valid reply to a payload ({exc}); try again") from None
    if not reply.get("ok"):
        error = str(reply.get("error"))
        refused = PayloadRefused if reply.get("refused") else BrokerError
        raise refused(f"broker refused a request payload: {error}")
    return bytes.fromhex(reply["digest"])


def same_broker(data_dir: str | os.PathLike, broker_pid: int | None) -> bool:
    """Does the broker a producer connected to (its supervisor's pid) still run and answer?"""
    try:
        reply = request(data_dir, {"op": "info"}, INFO_TIMEOUT_SECONDS)
    except (OSError, ValueError):
        return False
    return broker_pid is not None and reply.get("pid") == broker_pid
