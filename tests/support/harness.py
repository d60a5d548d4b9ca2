"""What many tests share: the shm an instance left behind, an in-process broker side, a seeded workload.

    shm_leftovers(instance)        # its segments and doorbells still in /dev/shm
    sweep_shm(instance)            # the same, unlinked (a test asserts the list it returns is empty)
    BrokerSide(data_dir)           # Owner + Registry + the ingest RingSet, in this process
    ingest_side(data_dir)          # the same with a Backlog and its writer: what ingest-0 holds
    Workload(seed, name)           # seeded prompts of 1..3000 tokens, many sharing a prefix
    wait_for(check, seconds, what) # check()'s first truthy value, polled; AssertionError naming `what`

The fixtures built on them are in conftest.py (`owner`, `make_broker`, `broker`); a broker in its own
processes is brokerproc.py's.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import numpy as np

from shmbroker.config.broker import BrokerConfig
from shmbroker.frontdoor.registry import Registry
from shmbroker.ingest.loop import RingSet
from shmbroker.ring import layout as L
from shmbroker.ring.owner import Owner
from shmbroker.spill.store import Backlog

DEV_SHM = Path("/dev/shm")
DRAIN_SECONDS = 20.0  # bound on every wait for records that must arrive


def wait_for(check, timeout_seconds: float, what: str):
    deadline = time.monotonic() + timeout_seconds
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"{what}: not within {timeout_seconds} s")


def shm_leftovers(instance: str) -> list[Path]:
    """Segments and semaphores of `instance` still in /dev/shm."""
    return sorted(DEV_SHM.glob(f"shmb.{instance}.*")) + sorted(DEV_SHM.glob(f"sem.shmb.{instance}.*"))


def sweep_shm(instance: str) -> list[Path]:
    """Unlink what `instance` left in /dev/shm (so one failing test does not leak into the next);
    returns what was there."""
    left = shm_leftovers(instance)
    for path in left:
        path.unlink(missing_ok=True)
    return left


# -- a broker side in this process -----------------------------------------------------------


class Rec(NamedTuple):
    """One ingest record as the broker reads it."""

    key: int
    max_new_tokens: int
    prefix_len: int
    model: int
    flags: int
    tokens: np.ndarray


class BrokerSide:
    """Owner + Registry on one data directory, and a RingSet that drains every producer."""

    def __init__(self, data_dir: Path, instance: str | None = None, *, ingest_ring_bytes: int = 1 << 16,
                 result_ring_bytes: int = 1 << 14):
        self.data_dir = str(data_dir)
        self.instance = instance or "t" + secrets.token_hex(3)
        self.owner = Owner(self.data_dir, self.instance)
        try:
            self.reg = Registry(
                self.owner, self.data_dir, ingest_ring_bytes=ingest_ring_bytes, result_ring_bytes=result_ring_bytes,
                retire_seconds=BrokerConfig.producer_retire_seconds,
            )
            self.reg.start()
        except BaseException:
            self.owner.close()
            raise
        self.rings = RingSet(self.reg.ingest_bell)
        self.received: dict[str, list[Rec]] = {}

    def entry(self, name: str):
        matches = [e for e in self.reg.producers() if e.name == name]
        assert len(matches) == 1, f"producer {name!r}: {matches}"
        return matches[0]

    def header(self, name: str) -> dict[str, int]:
        """The ingest ring's counters, read straight from the shared header."""
        h = self.entry(name).ingest.segment.buf[: L.HEADER_BYTES].view(np.int64)
        return {
            "head": int(h[L.H_HEAD]),
            "tail": int(h[L.H_TAIL]),
            "num_pushed": int(h[L.H_NUM_PUSHED]),
            "num_full": int(h[L.H_NUM_FULL]),
            "next_key": int(h[L.H_NEXT_KEY]),
        }

    def _on_records(self, entry, ring, positions, n) -> None:
        words = ring.data_words
        words64 = ring.buf[L.HEADER_BYTES :].view(np.uint64)
        out = self.received.setdefault(entry.name, [])
        for i in range(n):
            pos = int(positions[i])
            ntok = int(words[pos + 1])
            meta = [int(x) for x in words[pos + 4 : pos + 8]]
            tokens = words[pos + L.RECORD_HEADER_WORDS : pos + L.RECORD_HEADER_WORDS + ntok].copy()
            out.append(Rec(int(words64[(pos >> 1) + 1]), *meta, tokens))

    def drain_once(self) -> int:
        self.rings.refresh(self.reg)
        return self.rings.drain_once(self._on_records)

    def collect(self, name: str, count: int, timeout_seconds: float = DRAIN_SECONDS) -> list[Rec]:
        """Drain until `name` has delivered `count` records in all; fail on a timeout or on extras."""
        deadline = time.monotonic() + timeout_seconds
        while len(self.received.get(name, [])) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{name}: {len(self.received.get(name, []))} of {count} records in {timeout_seconds} s")
            if self.drain_once() == 0:
                self.rings.refresh(self.reg)
                if self.rings.sources:
                    self.rings.wait(0.05)
                else:
                    time.sleep(0.005)
        self.drain_once()
        got = self.received.get(name, [])
        assert len(got) == count, f"{name}: {len(got)} records delivered, expected {count}"
        return got

    def close(self) -> None:
        try:
            self.rings.close()
            self.reg.close()
        finally:
            self.owner.close()


@contextmanager
def ingest_side(data_dir: Path) -> Iterator[tuple]:
    """(registry, rings, backlog, writer): what ingest-0 holds (an Owner + Registry with 64 KiB ingest
    rings, the RingSet over them, a Backlog of 1 MiB segments and its writer, no fsync) on `data_dir`."""
    owner = Owner(data_dir, "t" + secrets.token_hex(3))
    registry = Registry(owner, data_dir, ingest_ring_bytes=64 << 10, result_ring_bytes=4096,
                        retire_seconds=BrokerConfig.producer_retire_seconds)
    registry.start()
    rings = RingSet(registry.ingest_bell)
    backlog, _ = Backlog.open(data_dir, segment_bytes=1 << 20)
    writer = backlog.writer(0, fsync="never")
    try:
        yield registry, rings, backlog, writer
    finally:
        writer.close()
        backlog.close()
        rings.close()
        registry.close()
        owner.close()


# -- the workload (seeded) -------------------------------------------------------------------

PROMPT_TOKENS_MAX = 3000
TOKEN_END = 1 << 32  # token ids: any uint32


class Workload:
    """Seeded prompts of 1..PROMPT_TOKENS_MAX tokens (mostly short, some long, some at the edges:
    1, 2, the 512-token block boundary, the maximum), half of them starting with one of a few
    prefixes: three shared by every workload of one seed (several producers of one test), four of
    this `name`'s own. `rng` (numpy) is the stream; tests may draw from it too."""

    def __init__(self, seed: int, name: str = ""):
        self.rng = np.random.default_rng(list(f"{seed}/{name}".encode()))
        common = np.random.default_rng([seed])
        self.prefixes = [common.integers(0, TOKEN_END, n, dtype=np.uint32) for n in (512, 1500, 2900)]
        self.prefixes += [self.rng.integers(0, TOKEN_END, n, dtype=np.uint32) for n in (8, 300, 700, 2048)]

    def length(self) -> int:
        rng = self.rng
        u = rng.random()
        if u < 0.05:
            edges = [1, 2, 511, 512, 513, PROMPT_TOKENS_MAX - 1, PROMPT_TOKENS_MAX]
            return edges[int(rng.integers(len(edges)))]
        if u < 0.75:
            return int(rng.integers(1, 601))
        return int(rng.integers(600, PROMPT_TOKENS_MAX + 1))

    def item(self) -> tuple[np.ndarray, int]:
        """One prompt and the length of the prefix it shares (0: none); a prefix never covers the
        whole prompt."""
        rng = self.rng
        n = self.length()
        if n > 1 and rng.random() < 0.5:
            prefix = self.prefixes[int(rng.integers(len(self.prefixes)))]
            shared = min(prefix.size, n - int(rng.integers(1, max(1, n // 4) + 1)))
            tail = rng.integers(0, TOKEN_END, n - shared, dtype=np.uint32)
            return np.concatenate([prefix[:shared], tail]), shared
        return rng.integers(0, TOKEN_END, n, dtype=np.uint32), 0

    def max_new(self) -> int:
        return int(self.rng.integers(1, 17))

    def submit_some(self, producer, expect, budget: int) -> int:
        """Submit up to `budget` items in one way picked at random (submit or submit_many, with
        or without prefix_len, one max_new_tokens or one per item) and tell `expect`
        (`.add(ids, max_new, prompts)`) what was accepted; returns how many."""
        rng = self.rng
        how = rng.random()
        if how < 0.4:
            tokens, shared = self.item()
            m = self.max_new()
            form = int(rng.integers(3))
            data = tokens if form == 0 else tokens.tolist() if form == 1 else tokens.astype(np.int64)
            prefix = shared if shared and rng.random() < 0.5 else None
            expect.add(producer.submit(data, max_new_tokens=m, prefix_len=prefix), m, tokens)
            return 1
        count = int(min(budget, rng.integers(1, 97)))
        items = [self.item() for _ in range(count)]
        lengths = np.array([t.size for t, _ in items], np.int64)
        offsets = np.zeros(count + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate([t for t, _ in items])
        if how < 0.7:
            m = self.max_new()
            prefix = None
        else:
            m = rng.integers(1, 17, size=count).astype(np.int64)
            prefix = np.array([s for _, s in items], np.int64)
        ids = producer.submit_many(flat, offsets, max_new_tokens=m, prefix_len=prefix)
        assert ids.dtype == np.uint64 and ids.size == count
        expect.add(ids, m, (flat, offsets))
        return count
