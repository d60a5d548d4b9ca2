"""The payload store: request payloads of any length (a constraint's JSON schema, its regex, its
grammar), stored once under their digest and referenced by every item that uses them.

`payloads/<digest, 32 hex digits>.bin`, written once by atomic replace (`durable.atomic_write`: a
temporary file, fsync, rename, fsync of the directory), 0600 in a 0700 directory, so a payload is
on disk before any item naming it is pushed, and survives a SIGKILL of any process and a power loss.
Storing a payload that is there already only checks it. The registry (one process) is the only writer. The digest is the first 16 bytes of the
payload's SHA-256 (`request/structured.py` `digest_of`); a read hashes the payload again, so a file
whose bytes rotted, or one cut short, is refused (`PayloadCorrupt`) and its items fail `corrupt`.

| byte | size | field   | meaning                                 |
|------|------|---------|-----------------------------------------|
| 0    | 8    | magic   | `SHMBPLD1`                              |
| 8    | 8    | length  | the payload's bytes                     |
| 16   | 32   | sha256  | of the payload                          |
| 48   | n    | payload |                                         |

Payloads are not reclaimed: a job's items share a handful, each a few kilobytes.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from pathlib import Path

from ..request.structured import DIGEST_BYTES, digest_of
from . import durable

DIR_NAME = "payloads"
MAGIC = b"SHMBPLD1"
HEADER = struct.Struct("<8sQ32s")
assert HEADER.size == 48


class PayloadError(Exception):
    """A payload that cannot be stored or read: too large, missing, or damaged."""


class PayloadTooLarge(PayloadError):
    pass


class PayloadMissing(PayloadError):
    pass


class PayloadCorrupt(PayloadError):
    pass


class PayloadStore:
    """The data directory's payloads; `max_bytes` bounds one payload (the configuration's
    `max_payload_bytes`)."""

    def __init__(self, data_dir: str | os.PathLike, max_bytes: int):
        self.dir = Path(data_dir) / DIR_NAME
        self.max_bytes = int(max_bytes)
        # the registry answers producers on threads of its own: two storing one payload at once would
        # replace the same file through the same temporary name
        self._lock = threading.Lock()

    def path(self, digest: bytes) -> Path:
        assert len(digest) == DIGEST_BYTES
        return self.dir / f"{digest.hex()}.bin"

    def put(self, payload: bytes) -> bytes:
        """Store `payload` durably (once: a sound copy there already is kept); its digest."""
        if len(payload) > self.max_bytes:
            raise PayloadTooLarge(f"a payload of {len(payload)} bytes is over max_payload_bytes = {self.max_bytes}")
        if not payload:
            raise PayloadError("an empty payload")
        digest = digest_of(payload)
        with self._lock:
            return self._put(payload, digest)

    def _put(self, payload: bytes, digest: bytes) -> bytes:
        try:
            if self.get(digest) == payload:
                return digest
        except PayloadMissing:
            pass
        except PayloadCorrupt:
            pass  # a damaged copy is replaced by this sound one
        if not self.dir.is_dir():
            durable.mkdir(self.dir)
        full = hashlib.sha256(payload).digest()
        durable.atomic_write(self.path(digest), HEADER.pack(MAGIC, len(payload), full) + payload)
        return digest

    def get(self, digest: bytes) -> bytes:
        """The payload stored under `digest`; PayloadMissing or PayloadCorrupt."""
        path = self.path(digest)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise PayloadMissing(f"payload {digest.hex()} is not in {self.dir}") from None
        except OSError as exc:
            raise PayloadCorrupt(f"payload {digest.hex()} is not readable ({exc})") from None
        if len(raw) < HEADER.size:
            raise PayloadCorrupt(f"payload {digest.hex()} is cut short ({len(raw)} bytes)")
        magic, length, full = HEADER.unpack_from(raw)
        payload = raw[HEADER.size :]
        if magic != MAGIC or length != len(payload):
            raise PayloadCorrupt(f"payload {digest.hex()}: its header is damaged or its bytes cut short")
        if hashlib.sha256(payload).digest() != full or full[:DIGEST_BYTES] != digest:
            raise PayloadCorrupt(f"payload {digest.hex()}: its bytes do not hash to its digest")
        return payload
