"""The front door's wire protocol: what a producer and the broker's registry both speak.

A producer finds a broker by its data directory: the argument, else `$SHMBROKER_DATA_DIR`, else
`./shmbroker-data` (`data_dir`). The registry listens on `<data_dir>/broker.sock` (`socket_path`;
mode 0600 in a 0700 directory); one request per connection, one JSON line each way:

    -> {"op": "connect", "version": 1, "name": "my-app"}
    <- {"ok": true, "producer_id": 3,
        "ingest": {"segment": ..., "data_bell": ..., "space_bell": ...},
        "results": {...}}
    <- {"ok": false, "error": "..."}
    -> {"op": "payload", "version": 1, "data": "<base64>"}     (a request payload, stored once)
    <- {"ok": true, "digest": "<32 hex digits>"}

This module is all the client (`client/`) knows of the broker's side: it imports nothing else of
the package, so `from shmbroker import Producer` loads no server code.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

PROTOCOL_VERSION = 1
SOCKET_NAME = "broker.sock"
MAX_REQUEST_BYTES = 4096
DATA_DIR_ENV = "SHMBROKER_DATA_DIR"
DEFAULT_DATA_DIR = "shmbroker-data"


def data_dir(explicit: str | os.PathLike | None = None) -> str:
    """The data directory: the argument, else $SHMBROKER_DATA_DIR, else ./shmbroker-data."""
    if explicit is not None:
        return os.fspath(explicit)
    return os.environ.get(DATA_DIR_ENV, DEFAULT_DATA_DIR)


def socket_path(data_dir: str | os.PathLike) -> Path:
    return Path(data_dir) / SOCKET_NAME


def payload_request_bytes(max_payload_bytes: int) -> int:
    """The longest request line that carries a payload of `max_payload_bytes` (base64, and the rest)."""
    return max(MAX_REQUEST_BYTES, 4 * -(-max_payload_bytes // 3) + 1024)


def read_line(conn: socket.socket, limit: int = MAX_REQUEST_BYTES) -> dict:
    """One JSON object, one line, at most `limit` bytes; ValueError for anything else."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = conn.recv(min(1 << 16, limit + 1))
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError(f"request too long (over {limit} bytes)")
    try:
        message = json.loads(data)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed request: {exc}") from None
    if not isinstance(message, dict):
        raise ValueError("request must be a JSON object")
    return message


def request(data_dir: str | os.PathLike, message: dict, timeout_seconds: float) -> dict:
    """Client side: send one JSON request to the broker's socket and return its reply."""
    path = socket_path(data_dir)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_seconds)
        sock.connect(str(path))
        sock.sendall(json.dumps(message).encode() + b"\n")
        return read_line(sock)
