"""Constraints' payloads across the cluster: the key-value bucket `SHMB_PAYLOADS`.

A constraint's payload (request/structured.py: a JSON schema, a regex, a grammar, the choices) is
stored once in each broker's payload store (disk/payloads.py), and an item's option words carry only
its digest. A prompt message's options header carries those words, so the payload crosses hosts by
the bucket `ClusterNames.payloads_bucket`, keyed by the digest's 32 hex digits:

- **The remote producer** publishes each distinct payload once, before the first item that names it
  (`PayloadPublisher`): a create, that is a publish expecting no earlier value of its key, so a
  payload some producer published already is kept as it is; the producer remembers the digests it
  published. A payload over what one message can hold (the servers' `max_payload`, less room for
  headers) is refused there, `PayloadRefused` naming the limit.
- **A node's bridge** (`NodePayloads`), before it submits a run whose constraint names a digest its
  local store lacks, reads the payload from the bucket (from the stream's leader: the bucket takes no
  direct gets, which a lagging replica could answer), checks that it hashes to its digest, and stores
  it with its local Producer's `put_payload`. A payload the bucket lacks, or one that does not hash
  to its digest, is logged and its items are submitted as they are: the GPU process finds no payload
  and fails them `corrupt`, never unconstrained. A payload over the node's `max_payload_bytes` fails
  its items `invalid`, naming the limit. A failure that may pass (a server going away, the local
  broker restarting) leaves the run waiting for a later round.

Payloads are never deleted: a job's items share a handful, each a few kilobytes, and an item may be
delivered again long after its producer has gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ..client.checks import checked_options
from ..disk.payloads import PayloadError, PayloadStore
from ..errors import BrokerError, PayloadRefused
from ..request.options import encode
from ..request.structured import NO_DIGEST, digest_of
from .subjects import ClusterNames, words_header

log = logging.getLogger("shmbroker.bridge")

KEY_EXISTS = (10071, 10164)  # JetStream's "wrong last sequence": the key holds a value already
EXPECT_NO_VALUE = "Nats-Expected-Last-Subject-Sequence"  # "0": stored only while its key has no value
RETRY_SECONDS = 0.5  # a node tries a payload again this long after a failure that may pass


def options_and_payload(options, max_new_tokens) -> tuple[str | None, bytes | None]:
    """A submit's options header (None: none; checked as `Producer.submit` checks them) and the
    payload of its constraint when the options hold it (None: none, or only its digest)."""
    opts = checked_options(options, max_new_tokens)
    words = encode(opts) if opts is not None else None
    if words is None or not words.size:
        return None, None
    s = opts.structured
    return words_header(words), (None if s is None or s.payload is None else bytes(s.payload))


class PayloadPublisher:
    """The remote producer's side: each distinct payload published to the bucket once."""

    def __init__(self, names: ClusterNames, max_bytes: int):
        self.names = names
        self.max_bytes = int(max_bytes)  # what one message of the servers holds, less its headers
        self.published: set[bytes] = set()

    def check(self, payload) -> bytes:
        """The payload's digest; TypeError for what is not bytes, PayloadRefused for an empty one or
        one that no message can carry."""
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TypeError(f"a request payload is bytes, got {type(payload).__name__}")
        if not len(payload):
            raise PayloadRefused("a request payload is empty")
        if len(payload) > self.max_bytes:
            raise PayloadRefused(f"a request payload of {len(payload)} bytes is over the {self.max_bytes} bytes one "
                                 f"message of the cluster's servers can carry (their max_payload, less its headers)")
        return digest_of(bytes(payload))

    async def publish(self, js, payload: bytes, digest: bytes, timeout_seconds: float) -> None:
        """Create the payload's key in the bucket (kept as it is when it is there already); once
        JetStream stored it (or found it), its digest is remembered. BrokerError when it was not."""
        import nats.errors
        from nats.js.errors import APIError

        bucket = self.names.payloads_bucket
        try:
            await js.publish(self.names.payload_subject(digest), bytes(payload), timeout=timeout_seconds,
                             headers={EXPECT_NO_VALUE: "0"})
        except APIError as exc:
            if exc.err_code not in KEY_EXISTS:
                raise BrokerError(f"the payloads bucket {bucket} refused a request payload: {exc}") from None
        except (nats.errors.Error, TimeoutError) as exc:
            raise BrokerError(f"a request payload was not stored in the payloads bucket {bucket} "
                              f"({type(exc).__name__}: {exc}); does the bucket exist?") from None
        self.published.add(digest)


class NodePayloads:
    """A node's side: the payload a run's constraint names, made local before the run is submitted."""

    def __init__(self, js, names: ClusterNames, local, *, clock=time.monotonic):
        self.js = js
        self.names = names
        self.local = local  # the local broker's Producer: its data_dir and put_payload
        self.clock = clock
        self.have: set[bytes] = set()  # digests in the local store
        self.refused: dict[bytes, str] = {}  # digests the local broker refused, and why
        self.counts = dict.fromkeys(("fetched", "missing", "refused", "errors"), 0)
        self._kv = None
        self._retry_at = 0.0

    async def prepare(self, options) -> bool:
        """True once a run with these options may go to `check` and its submit: its constraint names
        no payload, or the payload is in the local store, or the bucket lacks it (logged: its items
        fail `corrupt` at the GPU), or the local broker refused it. False: not yet (a failure that may
        pass, tried again after RETRY_SECONDS)."""
        import nats.errors

        s = None if options is None else options.structured
        if s is None or s.digest == NO_DIGEST or s.digest in self.have or s.digest in self.refused:
            return True
        digest = s.digest
        if self.clock() < self._retry_at:
            return False
        if self._stored_locally(digest):
            self.have.add(digest)
            return True
        try:
            payload = await self._fetch(digest)
            if payload is None:
                return True
            await asyncio.to_thread(self.local.put_payload, payload)
        except PayloadRefused as exc:  # over this node's max_payload_bytes
            self.counts["refused"] += 1
            self.refused[digest] = str(exc)
            log.warning("payload %s refused by this broker (%s): its items fail invalid", digest.hex(), exc)
            return True
        except (BrokerError, OSError, TimeoutError, nats.errors.Error) as exc:
            self.counts["errors"] += 1
            self._retry_at = self.clock() + RETRY_SECONDS
            log.debug("payload %s: %s: %s", digest.hex(), type(exc).__name__, exc)
            return False
        self.counts["fetched"] += 1
        self.have.add(digest)
        return True

    def check(self, options) -> None:
        """PayloadRefused (a ValueError: its run is answered `invalid`) when these options' payload is
        one the local broker refused, naming why."""
        s = None if options is None else options.structured
        if s is not None and s.digest in self.refused:
            raise PayloadRefused(self.refused[s.digest])

    def _stored_locally(self, digest: bytes) -> bool:
        try:
            PayloadStore(self.local.data_dir, 0).get(digest)
        except PayloadError:
            return False
        return True

    async def _fetch(self, digest: bytes) -> bytes | None:
        """The payload from the bucket, or None (logged) when the bucket lacks it or it does not hash
        to its digest; the errors that may pass are raised."""
        from nats.js.errors import KeyNotFoundError, NotFoundError

        bucket = self.names.payloads_bucket
        try:
            if self._kv is None:
                self._kv = await self.js.key_value(bucket)
            payload = (await self._kv.get(digest.hex())).value or b""
        except (KeyNotFoundError, NotFoundError):  # no such key, or no bucket
            self.counts["missing"] += 1
            log.warning("payload %s is not in the payloads bucket %s: its items fail corrupt", digest.hex(), bucket)
            return None
        if digest_of(payload) != digest:
            self.counts["missing"] += 1
            log.warning("payload %s in the payloads bucket %s does not hash to its digest: its items fail corrupt",
                        digest.hex(), bucket)
            return None
        return payload
