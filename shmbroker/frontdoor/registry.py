"""The broker's front door: producers get their ring pair through a Unix socket.

The protocol (`protocol.py`): `<data_dir>/broker.sock` (mode 0600, in a 0700 directory), one
request per connection, one JSON line each way. Each connection is answered on its own
short-lived thread, MAX_HANDLERS at once, so a slow client delays nobody.

The registry learns the peer's pid and uid from SO_PEERCRED (it trusts no pid
the client claims) and refuses other users. A name held by a live process is
refused (held = its ingest ring's producer side belongs to a live process); a
name whose producer closed or died gets its old rings back, so a producer that
reconnects resumes its item sequence and its unread results. The accept loop
runs in one blocking thread that survives failed accepts (EMFILE: back-off and
retry); the broker's hot loop only reads `version` and `producers()`.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import re
import socket
import struct
import threading
import time
from dataclasses import dataclass

import numpy as np

from ..control.segment import MAX_PRODUCERS
from ..disk.payloads import PayloadError
from ..protocol import PROTOCOL_VERSION, payload_request_bytes, read_line, socket_path
from ..ring.items import MAX_PRODUCER_ID
from ..ring.layout import (
    H_CONSUMER_PID,
    H_CONSUMER_START,
    H_HEAD,
    H_NUM_ACKED,
    H_NUM_PUSHED,
    H_PRODUCER_PID,
    H_PRODUCER_START,
    H_SESSION,
    H_SESSION_READY,
    H_TAIL,
    HEADER_BYTES,
)
from ..ring.liveness import is_alive, start_ticks
from ..ring.owned import OwnedRing, create_ring
from ..ring.owner import Owner
from .producer_book import ProducerBook

REQUEST_TIMEOUT_SECONDS = 2.0
ACCEPT_POLL_SECONDS = 0.2
ACCEPT_BACKOFF_SECONDS = 0.01  # after a failed accept (no descriptors left), doubling up to
ACCEPT_BACKOFF_MAX_SECONDS = 0.5
MAX_HANDLERS = 16  # requests answered at once (each on its own short-lived thread)
RETIRE_CHECK_SECONDS = 0.5  # how often names are looked at for retiring (`retire_idle`)
NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass
class ProducerEntry:
    producer_id: int
    name: str
    pid: int
    pid_start: int
    ingest: OwnedRing
    results: OwnedRing
    slot: int = -1
    idle_since: float | None = None  # monotonic time it was first seen with nothing left to do


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix socket."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


class Registry:
    """Creates a ring pair per producer name and serves their names over the socket.

    With a `control` segment (a running broker) every producer is also published in its table
    (`control/segment.py`), ids come from the data directory's `ProducerBook`, and producer k's ingest ring
    rings ingest process k mod len(ingest_bells)'s doorbell.
    """

    def __init__(
        self,
        owner: Owner,
        data_dir: str | os.PathLike,
        *,
        ingest_ring_bytes: int,
        result_ring_bytes: int,
        control=None,
        ingest_bells: list | None = None,
        info: dict | None = None,
        retire_seconds: float,
        payloads=None,
    ):
        self.owner = owner
        self.control = control
        # the payload store (disk/payloads.py) producers put their request payloads in; None: no payloads
        self.payloads = payloads
        self.request_bytes = payload_request_bytes(payloads.max_bytes) if payloads is not None else None
        self.book = ProducerBook(data_dir) if control is not None else None
        for damaged in self.book.damaged if self.book is not None else ():
            logging.getLogger("shmbroker").warning("producer book: %s; its other copy used", damaged)
        self.info = dict(info or {})
        self.path = socket_path(data_dir)
        self.ingest_ring_bytes = ingest_ring_bytes
        self.result_ring_bytes = result_ring_bytes
        self.version = 0  # bumped whenever the producer table changes
        self._by_name: dict[str, ProducerEntry] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._handlers = threading.BoundedSemaphore(MAX_HANDLERS)
        self.accept_errors = 0
        self.last_accept_error: str | None = None
        self.refused_busy = 0
        self.retire_seconds = retire_seconds
        self.refused_full = 0  # connects refused because the producer table was full
        self.retired = 0  # names that left the table (their rings freed)
        self._free_slots: list[int] = []  # table slots of retired names, to reuse
        self._next_slot = 0
        self._next_check = 0.0
        # Every ingest ring of one ingest process rings one doorbell, so it sleeps on all of them.
        self.ingest_bells = ingest_bells or [owner.doorbell("ingest-d")]
        self.ingest_bell = self.ingest_bells[0]

    def start(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            self.path.unlink()  # a crashed broker's socket; the data-dir lock makes us its owner
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            old_umask = os.umask(0o177)
            try:
                sock.bind(str(self.path))
            finally:
                os.umask(old_umask)
            os.chmod(self.path, 0o600)
            sock.listen(64)
            sock.settimeout(ACCEPT_POLL_SECONDS)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="registry", daemon=True)
        self._thread.start()

    def producers(self) -> list[ProducerEntry]:
        with self._lock:
            return list(self._by_name.values())

    def close_in_child(self) -> None:
        """In a process forked from the registry's: close its copy of the listening socket (the
        registry's own stays open, and its path stays on disk)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def close(self) -> None:
        """Stop serving (idempotent). The rings stay with the owner, which unlinks them."""
        self._stop.set()
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)  # wakes a blocked accept() at once
            except OSError:
                pass
        if self._thread is not None:
            self._thread.join(timeout=5 * ACCEPT_POLL_SECONDS)
            self._thread = None
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass

    def __enter__(self) -> Registry:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the accept thread --------------------------------------------------------

    def _serve(self) -> None:
        """Accept connections and answer each on its own thread (at most MAX_HANDLERS at once, so
        a slow client delays nobody). An accept that fails (no file descriptors left: EMFILE,
        ENFILE, ENOBUFS, ENOMEM) is counted and retried after a back-off: the registry never
        stops serving while the broker runs."""
        assert self._sock is not None
        backoff = 0.0
        while not self._stop.is_set():
            if self.control is not None and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + RETIRE_CHECK_SECONDS
                self.retire_idle()
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    return
                self.accept_errors += 1
                self.last_accept_error = f"{type(exc).__name__}: {exc}"
                backoff = min(ACCEPT_BACKOFF_MAX_SECONDS, max(ACCEPT_BACKOFF_SECONDS, 2 * backoff))
                self._stop.wait(backoff)
                continue
            backoff = 0.0
            if not self._handlers.acquire(timeout=REQUEST_TIMEOUT_SECONDS):
                conn.close()  # every handler busy for a whole request timeout: the client retries
                self.refused_busy += 1
                continue
            try:
                threading.Thread(target=self._answer, args=(conn,), name="registry-conn", daemon=True).start()
            except RuntimeError:  # no thread could be started: answer here
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        try:
            with conn:
                conn.settimeout(REQUEST_TIMEOUT_SECONDS)
                try:
                    reply = self._handle(conn)
                except Exception as exc:  # one bad request never stops the registry
                    reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                try:
                    conn.sendall(json.dumps(reply).encode() + b"\n")
                except OSError:
                    pass  # the client went away; its rings (if any) wait for a reconnect
        finally:
            self._handlers.release()

    def _handle(self, conn: socket.socket) -> dict:
        pid, uid, _gid = peer_credentials(conn)
        if uid not in (os.geteuid(), 0):
            return {"ok": False, "error": f"uid {uid} may not use this broker"}
        request = read_line(conn, *([self.request_bytes] if self.request_bytes else []))
        if request.get("op") == "info":
            return {"ok": True, **self.info}
        if request.get("op") == "payload":
            return self._payload(request)
        if request.get("op") != "connect":
            return {"ok": False, "error": f"unknown op {request.get('op')!r}"}
        if request.get("version") != PROTOCOL_VERSION:
            return {"ok": False, "error": f"protocol version {request.get('version')!r}, broker speaks {PROTOCOL_VERSION}"}
        name = request.get("name")
        if not isinstance(name, str) or not NAME_RE.fullmatch(name):
            return {"ok": False, "error": f"producer name must match {NAME_RE.pattern}, got {name!r}"}
        entry = self._connect(name, pid)
        return {
            "ok": True,
            "broker_pid": self.info.get("pid"),
            "producer_id": entry.producer_id,
            "ingest": entry.ingest.names.to_dict(),
            "results": entry.results.names.to_dict(),
            "max_payload_bytes": self.payloads.max_bytes if self.payloads is not None else 0,
        }

    def _payload(self, request: dict) -> dict:
        """Store a producer's request payload durably, once (disk/payloads.py); its digest."""
        if self.payloads is None:
            return {"ok": False, "error": "this broker keeps no request payloads"}
        data = request.get("data")
        if not isinstance(data, str):
            return {"ok": False, "error": "'data' must be the payload in base64"}
        try:
            payload = base64.b64decode(data, validate=True)
        except ValueError:
            return {"ok": False, "error": "'data' is not base64"}
        try:
            return {"ok": True, "digest": self.payloads.put(payload).hex()}
        except PayloadError as exc:  # the payload's own fault (too large, empty): `refused`
            return {"ok": False, "error": str(exc), "refused": True}
        except OSError as exc:
            return {"ok": False, "error": f"the payload could not be stored ({exc.strerror or exc})"}

    def _connect(self, name: str, pid: int) -> ProducerEntry:
        ticks = start_ticks(pid)
        if ticks is None:
            raise ValueError(f"peer pid {pid} vanished during connect")
        with self._lock:
            entry = self._by_name.get(name)
            if entry is not None:
                header = entry.ingest.segment.buf[:HEADER_BYTES].view(np.int64)
                holder = int(header[H_PRODUCER_PID])
                if holder != 0 and is_alive(holder, int(header[H_PRODUCER_START])):
                    raise ValueError(f"producer name {name!r} is in use by live pid {holder}")
                entry.pid, entry.pid_start = pid, ticks
                self.version += 1
                return entry
            slot = self._free_slots.pop(0) if self._free_slots else self._next_slot
            if self.book is not None:
                if slot >= MAX_PRODUCERS:
                    self.refused_full += 1
                    raise ValueError(f"producer table is full: {MAX_PRODUCERS} names have a live producer or results "
                                     f"not yet read (a name leaves {self.retire_seconds:g} s after both are done)")
                producer_id = self.book.assign(name)
            else:
                producer_id = slot + 1
            if producer_id > MAX_PRODUCER_ID:
                raise ValueError("producer table is full")
            tag = f"p{producer_id}"
            k = slot % len(self.ingest_bells)
            ingest = create_ring(self.owner, tag + "i", self.ingest_ring_bytes, data_bell=self.ingest_bells[k])
            try:
                results = create_ring(self.owner, tag + "r", self.result_ring_bytes)
            except BaseException:
                self.owner.release(ingest.segment)
                self.owner.release(ingest.space_bell)
                raise
            entry = ProducerEntry(producer_id, name, pid, ticks, ingest, results, slot)
            self._next_slot = max(self._next_slot, slot + 1)
            if self.control is not None:
                self.control.write_producer(slot, producer_id, k, name, ingest.names, results.names)
            self._by_name[name] = entry
            self.version += 1
            return entry


    # -- names that are done --------------------------------------------------------

    def retire_idle(self, now: float | None = None) -> int:
        """Free the rings of names with nothing left to do for `retire_seconds` (config/broker.py: its
        rings are unlinked; it comes back with new ones, and a new producer id): their producer
        and reader are gone, their ingest ring is drained, every result pushed to them is
        acknowledged. Their slot is cleared in the control table (ingest and results processes
        then let go of the rings; results that come later wait in the results process for the
        name's next connect). Returns how many left."""
        now = time.monotonic() if now is None else now
        gone = 0
        with self._lock:
            for name, entry in list(self._by_name.items()):
                if not _idle(entry):
                    entry.idle_since = None
                    continue
                if entry.idle_since is None:
                    entry.idle_since = now
                if now - entry.idle_since < self.retire_seconds:
                    continue
                del self._by_name[name]
                self.control.clear_producer(entry.slot)
                self._free_slots.append(entry.slot)
                self._free_slots.sort()
                for obj in (entry.ingest.segment, entry.ingest.space_bell, entry.results.segment,
                            entry.results.data_bell, entry.results.space_bell):
                    self.owner.release(obj)
                self.retired += 1
                self.version += 1
                gone += 1
        return gone


def _idle(entry: ProducerEntry) -> bool:
    i = entry.ingest.segment.buf[:HEADER_BYTES].view(np.int64)
    r = entry.results.segment.buf[:HEADER_BYTES].view(np.int64)
    if int(i[H_PRODUCER_PID]) and is_alive(int(i[H_PRODUCER_PID]), int(i[H_PRODUCER_START])):
        return False
    if int(r[H_CONSUMER_PID]) and is_alive(int(r[H_CONSUMER_PID]), int(r[H_CONSUMER_START])):
        return False
    return (int(i[H_HEAD]) == int(i[H_TAIL]) and int(r[H_NUM_ACKED]) == int(r[H_NUM_PUSHED])
            and int(r[H_SESSION]) == int(r[H_SESSION_READY]))
