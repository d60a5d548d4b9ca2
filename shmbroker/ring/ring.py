"""One side's handle on an SPSC ring: attach, push/pop, and waits that never starve a core.

A ring is a shared-memory segment (`layout.py`, kernels in `spsc.py`) plus two
doorbells: `data` (the consumer sleeps on it when the ring is empty) and
`space` (the producer sleeps on it when the ring is full). Only the owner
(`owned.create_ring`) creates and unlinks them; each side attaches by name.

Waiting: spin briefly on the shared words (with a CPU pause), then announce
the sleep in the header, look once more, and sleep on the doorbell for at most
`SLEEP_SLICE_SECONDS`; the peer rings the doorbell only when it sees the
announcement. Between slices the waiter refreshes its heartbeat and, when the
peer's heartbeat is stale, checks the peer's liveness (pid + start time):
a dead peer raises `PeerDead`. Every wait has a deadline. A ring the broker
closed because its peer broke it (`closing.close_ring_for`, `closing.mark_closed`)
makes the next wait raise `RingClosed` with the reason.

Trust: the broker attaches a producer's rings `untrusted` (the producer maps
them read-write and may write any word). Then the geometry is the segment's
own size, as the registry created it (checked once, here; the kernels take it
from the array, `layout.py`), the header's words are never consulted, and the
broker takes its side even when the header names another holder. Everyone
else attaches trusted: the header is checked (magic, version, geometry) and
a side held by a live process is refused.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import numpy as np

from ..errors import Full, PeerDead, RingClosed, RingCorrupt
from . import layout as L
from . import spsc
from .liveness import is_alive, start_ticks
from .shm import Doorbell, Segment
from .untrusted import untrusted_capacity
from .waits import SLEEP_SLICE_SECONDS, SPIN_ROUNDS, STALE_SECONDS, yield_until

PRODUCER = "producer"
CONSUMER = "consumer"

_SIDE_FIELDS = {
    PRODUCER: (L.H_PRODUCER_PID, L.H_PRODUCER_START, L.H_PRODUCER_BEAT, L.H_PRODUCER_WAITING),
    CONSUMER: (L.H_CONSUMER_PID, L.H_CONSUMER_START, L.H_CONSUMER_BEAT, L.H_CONSUMER_WAITING),
}


@dataclass(frozen=True)
class RingNames:
    """What a peer needs to attach: the segment and the two doorbells."""

    segment: str
    data_bell: str
    space_bell: str

    def to_dict(self) -> dict:
        return {"segment": self.segment, "data_bell": self.data_bell, "space_bell": self.space_bell}

    @classmethod
    def from_dict(cls, d: dict) -> RingNames:
        return cls(str(d["segment"]), str(d["data_bell"]), str(d["space_bell"]))


@dataclass(frozen=True)
class Record:
    """One record, copied out of a ring."""

    key: int
    meta: tuple[int, int, int, int]
    tokens: np.ndarray


class Ring:
    """The producer's or the consumer's handle on one ring."""

    def __init__(self, segment: Segment, data_bell: Doorbell, space_bell: Doorbell, side: str, *, owns_handles: bool,
                 untrusted: bool = False):
        if side not in _SIDE_FIELDS:
            raise ValueError(f"ring side must be {PRODUCER!r} or {CONSUMER!r}, got {side!r}")
        self.segment = segment
        self.data_bell = data_bell
        self.space_bell = space_bell
        self.side = side
        self.untrusted = untrusted
        self._owns_handles = owns_handles
        cap = untrusted_capacity(segment, side == CONSUMER) if untrusted else L.check_header(segment.buf)
        self.capacity_words = cap
        self.max_tokens = L.max_tokens(cap)
        self.buf = segment.buf[: L.segment_bytes(cap)]  # the kernels' geometry: this array's length
        self.header = self.buf[: L.HEADER_BYTES].view(np.int64)
        self._pid_i, self._start_i, self._beat_i, self._wait_i = _SIDE_FIELDS[side]
        peer = CONSUMER if side == PRODUCER else PRODUCER
        self._peer_pid_i, self._peer_start_i, self._peer_beat_i, _ = _SIDE_FIELDS[peer]
        self._own_bell = data_bell if side == CONSUMER else space_bell
        self._peer_bell = space_bell if side == CONSUMER else data_bell
        self._closed = False
        self._pop_out: tuple | None = None
        self._claim_side()
        # untrusted, the consumer keeps its own tail: a tail word that moved under it was rewritten
        self._tail = int(self.header[L.H_TAIL]) if untrusted and side == CONSUMER else None

    @classmethod
    def attach(cls, names: RingNames, side: str, *, untrusted: bool = False) -> Ring:
        """Attach one side by name; `untrusted`: the peer may write anything (the module's docstring)."""
        segment = Segment.attach(names.segment)
        bells: list[Doorbell] = []
        try:
            bells.append(Doorbell.attach(names.data_bell))
            bells.append(Doorbell.attach(names.space_bell))
            return cls(segment, bells[0], bells[1], side, owns_handles=True, untrusted=untrusted)
        except BaseException:
            for bell in bells:
                bell.close()
            segment.close()
            raise

    # -- attachment and liveness -------------------------------------------------

    def _claim_side(self) -> None:
        """Take this side of the ring: one live process per side, claimed by CAS on the pid word.
        Untrusted, the broker takes it whatever the word says (the peer may have written it)."""
        pid = os.getpid()
        ticks = start_ticks(pid)
        assert ticks is not None
        for _ in range(8):
            old_pid = int(self.header[self._pid_i])
            if not self.untrusted and (old_pid == pid or (old_pid != 0 and self._holder_alive(old_pid))):
                raise RuntimeError(f"ring {self.segment.name} already has a live {self.side} (pid {old_pid})")
            if spsc.claim_word(self.buf, self._pid_i, old_pid, pid) == old_pid:
                break
        else:
            raise RuntimeError(f"ring {self.segment.name}: lost the race for the {self.side} side")
        self.header[self._start_i] = ticks
        self.heartbeat()
        if self.side == PRODUCER:
            spsc.recover_head(self.buf)

    def _holder_alive(self, pid: int) -> bool:
        """Is the process holding this side alive? A claimant may sit between its pid CAS
        and its start-time store for a moment, so a live pid whose start time does not
        match yet is looked at again before it is judged a reused pid."""
        for _ in range(3):
            if is_alive(pid, int(self.header[self._start_i])):
                return True
            if start_ticks(pid) is None:
                return False
            time.sleep(0.01)
        return False

    def heartbeat(self) -> None:
        self.header[self._beat_i] = time.monotonic_ns()

    def peer_pid(self) -> int | None:
        pid = int(self.header[self._peer_pid_i])
        return pid or None

    def peer_alive(self) -> bool:
        """True while a peer is attached and runs; False when none is attached or it died."""
        return is_alive(int(self.header[self._peer_pid_i]), int(self.header[self._peer_start_i]))

    def _check_peer(self) -> None:
        """Raise PeerDead when an attached peer's heartbeat is stale and its process is gone."""
        pid = int(self.header[self._peer_pid_i])
        if pid == 0:
            return  # nobody attached yet: absent, not dead
        age_seconds = (time.monotonic_ns() - int(self.header[self._peer_beat_i])) / 1e9
        if age_seconds > STALE_SECONDS and not self.peer_alive():
            peer = CONSUMER if self.side == PRODUCER else PRODUCER
            raise PeerDead(f"{peer} pid {pid} of ring {self.segment.name} is gone")

    # -- waiting -------------------------------------------------------------------

    def _wait(self, spin, ready, deadline: float) -> bool:
        """`spin()` briefly, then sleep on this side's doorbell until `ready()` or the deadline;
        RingClosed when the broker closed the ring for a reason (what is in it is read first)."""
        if spin():
            return True
        while True:
            self.heartbeat()
            spsc.set_waiting(self.buf, self._wait_i)
            if ready():
                spsc.clear_waiting(self.buf, self._wait_i)
                return True
            if self.closed_reason() is not None:
                spsc.clear_waiting(self.buf, self._wait_i)
                code = int(self.header[L.H_CLOSED_REASON])
                raise RingClosed(f"ring {self.segment.name} was closed by the broker: {self.closed_reason()}", code)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                spsc.clear_waiting(self.buf, self._wait_i)
                return False
            self._own_bell.sleep(min(remaining, SLEEP_SLICE_SECONDS))
            spsc.clear_waiting(self.buf, self._wait_i)
            if ready():
                return True
            self._check_peer()

    def wait_readable(self, timeout_seconds: float, yield_rounds: int = 0) -> bool:
        """Consumer: wait until a record is there; False at the deadline; PeerDead if the producer died.

        `yield_rounds`: first give the CPU to the others that many times (a consumer whose producer
        usually answers within a few of their time slices saves it a doorbell ring and itself a
        wake-up, without spinning on a core the producer needs), then spin and sleep as usual."""
        buf = self.buf
        return self._wait(
            lambda: yield_until(buf, yield_rounds) or spsc.spin_until_readable(buf, SPIN_ROUNDS),
            lambda: spsc.readable(buf),
            time.monotonic() + timeout_seconds,
        )

    def wait_writable(self, num_tokens: int, timeout_seconds: float) -> bool:
        """Producer: wait until a record of `num_tokens` fits; False at the deadline; PeerDead if the consumer died."""
        return self._wait_writable(num_tokens, time.monotonic() + timeout_seconds)

    def _wait_writable(self, num_tokens: int, deadline: float) -> bool:
        buf = self.buf
        return self._wait(
            lambda: spsc.spin_until_writable(buf, num_tokens, SPIN_ROUNDS),
            lambda: spsc.spin_until_writable(buf, num_tokens, 1),
            deadline,
        )

    # -- producer ------------------------------------------------------------------

    def push(self, tokens: np.ndarray, key: int, m0: int = 0, m1: int = 0, m2: int = 0, m3: int = 0) -> int:
        """Push one record without waiting: layout.OK, FULL or TOO_LARGE (rings the doorbell itself)."""
        rc = spsc.push(self.buf, tokens, key, m0, m1, m2, m3)
        if rc == L.OK_WAKE:
            self._peer_bell.ring()
            return L.OK
        return rc

    def push_wait(self, tokens: np.ndarray, key: int, m0: int, m1: int, m2: int, m3: int, timeout_seconds: float) -> None:
        """Push one record, waiting up to `timeout_seconds` for space; raises Full or PeerDead."""
        deadline = time.monotonic() + timeout_seconds
        while True:
            rc = self.push(tokens, key, m0, m1, m2, m3)
            if rc == L.OK:
                return
            if rc == L.TOO_LARGE:
                raise ValueError(f"record of {tokens.size} tokens exceeds the ring's {self.max_tokens}")
            if not self._wait_writable(tokens.size, deadline):
                raise Full(f"ring {self.segment.name} stayed full for {timeout_seconds} s")

    def push_many(self, flat: np.ndarray, offsets: np.ndarray, key0: int, meta: np.ndarray, timeout_seconds: float,
                  tail: np.ndarray | None = None) -> int:
        """Push every record, waiting for space up to `timeout_seconds` in all; `tail`: words every
        record carries after its tokens (None: none).

        Returns the count (all of them); raises Full (with `.submitted`) when the
        deadline passes first, ValueError when a record can never fit.
        """
        count = len(offsets) - 1
        deadline = time.monotonic() + timeout_seconds
        done = 0
        k = 0 if tail is None else tail.size
        while True:
            if tail is None:
                pushed, status, wake = spsc.push_many(self.buf, flat, offsets, key0, meta, done, count)
            else:
                pushed, status, wake = spsc.push_many_tail(self.buf, flat, offsets, tail, key0, meta, done, count)
            if wake:
                self._peer_bell.ring()
            done += pushed
            if status == L.OK:
                return done
            if status == L.TOO_LARGE:
                raise ValueError(f"record {done} exceeds the ring's {self.max_tokens} tokens")
            try:
                ready = self._wait_writable(int(offsets[done + 1] - offsets[done]) + k, deadline)
            except PeerDead as exc:
                exc.submitted = done
                raise
            if not ready:
                raise Full(f"ring {self.segment.name} stayed full for {timeout_seconds} s", submitted=done)

    @property
    def next_key(self) -> int:
        """The key the producer pushes next (kept in the header: a reattached producer resumes)."""
        return int(self.header[L.H_NEXT_KEY])

    # -- consumer ------------------------------------------------------------------

    def pop(self) -> Record | None:
        """Consume one record (a copy), or None when the ring is empty."""
        out = self._pop_out
        if out is None:
            out = self._pop_out = (
                np.empty(self.max_tokens, np.uint32),
                np.empty(2, np.int64),
                np.empty(1, np.uint64),
                np.empty((1, L.META_WORDS), np.uint32),
            )
        tokens, offsets, keys, meta = out
        if self.pop_many(tokens, offsets, keys, meta, 1) == 0:
            return None
        return Record(int(keys[0]), tuple(int(m) for m in meta[0]), tokens[: offsets[1]].copy())

    def pop_many(self, out_tokens, out_offsets, out_keys, out_meta, max_records: int) -> int:
        """Copy out and consume up to `max_records` records; returns how many (0 when empty)."""
        self._check_tail()
        n, status, wake = spsc.pop_many(self.buf, out_tokens, out_offsets, out_keys, out_meta, max_records)
        if self._tail is not None:
            self._tail = int(self.header[L.H_TAIL])
        if wake:
            self._peer_bell.ring()
        if status == L.CORRUPT and n == 0:
            raise RingCorrupt(f"ring {self.segment.name}: corrupt record at tail {int(self.header[L.H_TAIL])}")
        return n

    def peek_many(self, out_positions: np.ndarray, max_records: int) -> tuple[int, int]:
        """Zero-copy: (count, new_tail); record i starts at word out_positions[i] of `data_words`."""
        self._check_tail()
        n, new_tail, status = spsc.peek_many(self.buf, out_positions, max_records)
        if status == L.CORRUPT and n == 0:
            raise RingCorrupt(f"ring {self.segment.name}: corrupt record at tail {int(self.header[L.H_TAIL])}")
        return n, new_tail

    def release(self, new_tail: int, count: int) -> None:
        if self._tail is not None:
            self._tail = new_tail
        if spsc.release(self.buf, new_tail, count):
            self._peer_bell.ring()

    def count_done(self, rows: int) -> None:
        """Consumer of a batch ring: `rows` more rows of its held records have results (layout.py
        `rows_done`); wakes a sleeping producer."""
        if spsc.count_done(self.buf, rows):
            self._peer_bell.ring()

    def rows_done(self) -> int:
        """Rows of the unreleased records that have results (read after `num_queued`)."""
        return int(self.header[L.H_ROWS_DONE])

    def _check_tail(self) -> None:
        """Untrusted consumer: the tail word must be where this side left it (RingCorrupt if not)."""
        if self._tail is not None and int(self.header[L.H_TAIL]) != self._tail:
            raise RingCorrupt(f"ring {self.segment.name}: its tail word was rewritten "
                              f"({int(self.header[L.H_TAIL])}, the broker left {self._tail})")

    @property
    def data_words(self) -> np.ndarray:
        return self.buf[L.HEADER_BYTES :].view(np.uint32)

    # -- state ---------------------------------------------------------------------

    def closed_reason(self) -> str | None:
        """Why the broker closed this ring (`layout.CLOSE_REASONS`); None while open or closed by a stop."""
        if not int(self.header[L.H_CLOSED]):
            return None
        code = int(self.header[L.H_CLOSED_REASON])
        if code == L.CLOSE_STOP:
            return None
        return L.CLOSE_REASONS.get(code, f"reason {code}")

    def used_words(self) -> int:
        return int(self.header[L.H_HEAD]) - int(self.header[L.H_TAIL])

    def num_pushed(self) -> int:
        """Records pushed since the ring was made (its ring index of the next push)."""
        return int(self.header[L.H_NUM_PUSHED])

    def num_popped(self) -> int:
        """Records popped (or released after a peek) since the ring was made."""
        return int(self.header[L.H_NUM_POPPED])

    def num_queued(self) -> int:
        """Records pushed and not yet popped."""
        return self.num_pushed() - self.num_popped()

    def counters(self) -> dict[str, int]:
        h = self.header
        return {"head": int(h[L.H_HEAD]), "tail": int(h[L.H_TAIL]), "capacity_words": self.capacity_words,
                "num_pushed": self.num_pushed(), "num_popped": self.num_popped(), "num_full": int(h[L.H_NUM_FULL])}

    def close(self) -> None:
        """Detach this side (idempotent); closes the handles this side opened itself."""
        if self._closed:
            return
        self._closed = True
        if int(self.header[self._pid_i]) == os.getpid():
            self.header[self._pid_i] = 0
        self.header = None
        self.buf = None
        if self._owns_handles:
            self.data_bell.close()
            self.space_bell.close()
            self.segment.close()

    def __enter__(self) -> Ring:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
