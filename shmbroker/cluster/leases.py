"""Partition leases and node liveness, in the cluster's key-value bucket (JetStream KV).

Keys of the bucket (`subjects.ClusterNames.leases_bucket`):

| key            | value                                         | written by                       |
|----------------|-----------------------------------------------|----------------------------------|
| node.<name>    | JSON {"loads": {partition: pending tokens}}   | the node, every beat (put)       |
| part.<p>       | the owner's name (utf-8)                      | the owner: taken by create or by |
|                |                                               | update at the revision it saw,   |
|                |                                               | renewed by update at its own     |
|                |                                               | last revision, released by a     |
|                |                                               | delete at that revision          |

Every write of a lease is a compare-and-set on the key's revision, so two nodes can never both
believe they hold one partition past the next renewal: the one whose update fails has lost it.

Liveness is judged by what this node observes, never by comparing clocks: a key whose revision
has not changed for `lease_seconds` of this node's monotonic time is expired (its writer is
dead or cut off), and may be taken. A node renews its leases and beats every `lease_seconds / 3`,
so a live node's keys never look expired to a peer that sees the bucket. A watcher task keeps
this node's picture of the bucket current (`Leases.start`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

log = logging.getLogger("shmbroker.bridge")

NODE_PREFIX = "node."
PART_PREFIX = "part."


@dataclass
class Seen:
    """One key as this node last saw it: its value, revision, and when (monotonic) it changed."""

    value: bytes
    revision: int
    changed_at: float


class Leases:
    """This node's side of the lease protocol (runs on the node's asyncio loop)."""

    def __init__(self, kv, node: str, num_partitions: int, lease_seconds: float, clock=time.monotonic):
        if lease_seconds <= 0:
            raise ValueError(f"lease_seconds must be > 0, got {lease_seconds}")
        self.kv = kv
        self.node = node
        self.num_partitions = num_partitions
        self.lease_seconds = float(lease_seconds)
        self.clock = clock
        self.seen: dict[str, Seen] = {}
        self.held: dict[int, int] = {}  # partition -> the revision of this node's own last write
        self.renewed_at: dict[int, float] = {}  # partition -> when (monotonic) its lease was last written
        self.num_taken = 0
        self.num_lost = 0
        self.num_released = 0
        self._watcher = None
        self._task: asyncio.Task | None = None
        self._ready = asyncio.Event()

    # -- the picture of the bucket ------------------------------------------------------

    async def start(self, timeout_seconds: float = 10.0) -> None:
        """Watch the bucket; returns once the initial values are in."""
        self._watcher = await self.kv.watchall()
        self._task = asyncio.ensure_future(self._watch())
        await asyncio.wait_for(self._ready.wait(), timeout_seconds)

    async def _watch(self) -> None:
        async for entry in self._watcher:
            if entry is None:  # the initial values are all in
                self._ready.set()
                continue
            self._apply(entry.key, entry.value, entry.revision, entry.operation)
            if not entry.delta:
                self._ready.set()

    def _apply(self, key: str, value, revision: int, operation) -> None:
        if operation in ("DEL", "PURGE"):
            self.seen.pop(key, None)
            return
        old = self.seen.get(key)
        if old is None or revision > old.revision:
            self.seen[key] = Seen(bytes(value or b""), int(revision), self.clock())

    async def close(self) -> None:
        if self._watcher is not None:
            try:
                await self._watcher.stop()
            except Exception:  # the connection is gone already
                pass
            self._watcher = None
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def _expired(self, s: Seen, now: float) -> bool:
        return now - s.changed_at > self.lease_seconds

    def live_nodes(self) -> list[str]:
        """The nodes whose heartbeat changed within the lease time (this node included), sorted."""
        now = self.clock()
        names = {k[len(NODE_PREFIX):] for k, s in self.seen.items()
                 if k.startswith(NODE_PREFIX) and not self._expired(s, now)}
        names.add(self.node)
        return sorted(names)

    def owners(self) -> dict[int, str]:
        """partition -> the node holding a lease on it that has not expired."""
        now = self.clock()
        out = {}
        for p in range(self.num_partitions):
            s = self.seen.get(f"{PART_PREFIX}{p}")
            if s is not None and not self._expired(s, now):
                out[p] = s.value.decode(errors="replace")
        for p in self.held:
            out[p] = self.node
        return out

    def loads(self) -> dict[int, float]:
        """partition -> pending tokens as its owner last reported them (live nodes only)."""
        out: dict[int, float] = {}
        live = set(self.live_nodes())
        for k, s in self.seen.items():
            if k.startswith(NODE_PREFIX) and k[len(NODE_PREFIX):] in live:
                try:
                    reported = json.loads(s.value or b"{}").get("loads", {})
                    out.update({int(p): float(v) for p, v in reported.items()})
                except (ValueError, TypeError, AttributeError):
                    continue  # a foreign or torn value: that node reports nothing
        return out

    # -- writes (each a compare-and-set) -------------------------------------------------

    async def beat(self, loads: dict[int, float]) -> None:
        """This node is alive; the pending tokens of the partitions it holds."""
        await self.kv.put(f"{NODE_PREFIX}{self.node}", json.dumps({"loads": {str(p): v for p, v in loads.items()}}).encode())

    async def leave(self) -> None:
        """Release every lease and remove this node's heartbeat (a graceful stop: peers take its
        partitions at once instead of after the lease time)."""
        from nats.js.errors import APIError

        for p in list(self.held):
            await self.release(p)
        try:
            await self.kv.delete(f"{NODE_PREFIX}{self.node}")
        except APIError:
            pass

    async def renew(self) -> list[int]:
        """Renew every lease held; the partitions lost (someone else's write came first)."""
        import nats.errors
        import nats.js.errors
        from nats.js.errors import KeyWrongLastSequenceError

        lost = []
        for p, rev in list(self.held.items()):
            now = self.clock()
            try:
                self.held[p] = await self.kv.update(f"{PART_PREFIX}{p}", self.node.encode(), last=rev)
                self.renewed_at[p] = now
            except KeyWrongLastSequenceError:
                del self.held[p]
                self.renewed_at.pop(p, None)
                lost.append(p)
            except (TimeoutError, nats.errors.Error, nats.js.errors.APIError) as exc:
                # no answer (a server going away): held still, not fresh once the lease time passes
                # without a renewal; tried again next round
                log.debug("partition %d: renewal: %s", p, exc)
        self.num_lost += len(lost)
        return lost

    def fresh(self, p: int) -> bool:
        """Whether this node holds p and wrote its lease within the lease time: only then may it
        publish p's results (a node paused past its lease learns it lost p at its next renewal,
        and until then it must not act on p: the fence)."""
        at = self.renewed_at.get(p)
        return p in self.held and at is not None and self.clock() - at < self.lease_seconds

    async def take(self, p: int) -> bool:
        """Take partition p if nobody holds it or its lease expired; whether this node holds it now."""
        from nats.js.errors import KeyWrongLastSequenceError

        if p in self.held:
            return True
        key = f"{PART_PREFIX}{p}"
        s = self.seen.get(key)
        now = self.clock()
        try:
            if s is None:
                rev = await self.kv.create(key, self.node.encode())
            elif self._expired(s, self.clock()) or s.value.decode(errors="replace") == self.node:
                rev = await self.kv.update(key, self.node.encode(), last=s.revision)
            else:
                return False
        except KeyWrongLastSequenceError:
            return False
        self.held[p] = rev
        self.renewed_at[p] = now
        self.num_taken += 1
        return True

    async def release(self, p: int) -> None:
        """Give partition p up (a delete at this node's own last revision: a lease someone else
        took meanwhile is left alone)."""
        from nats.js.errors import APIError

        rev = self.held.pop(p, None)
        self.renewed_at.pop(p, None)
        if rev is None:
            return
        try:
            await self.kv.delete(f"{PART_PREFIX}{p}", last=rev)
        except APIError:  # the wrong last revision: it is someone else's now
            pass
        self.num_released += 1
