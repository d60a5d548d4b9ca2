"""A producer's sequence numbers, reserved in blocks by compare-and-set in the leases bucket.

Key `seq.<producer>` of the `SHMB_LEASES` bucket holds the first sequence number no incarnation
of that producer name has reserved (decimal ASCII). Taking a block moves it on by compare-and-set
on the entry's revision, so two producers of one name, or one restarted, never get the same
number: a repeated `<producer>:<seq>` inside the duplicate window would be dropped as a duplicate.
Runs on a `NatsLoop`'s loop.
"""

from __future__ import annotations

import asyncio
import time

SEQ_BLOCK = 1 << 16
MAX_CAS_ATTEMPTS = 64
KV_OP_SECONDS = 2.0  # one read or compare-and-set; past it (a bucket leader being elected) it is tried again
RETRY_SECONDS = 0.1


async def reserve(kv, key: str, num_seqs: int, deadline: float) -> int:
    """Reserve `num_seqs` consecutive sequence numbers (a whole number of blocks); returns the first.
    Timeouts and unavailable servers are retried until `deadline` (time.monotonic), then TimeoutError."""
    from nats.errors import Error as NatsError
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    span = -(-num_seqs // SEQ_BLOCK) * SEQ_BLOCK
    races = 0
    while True:
        try:
            try:
                entry = await asyncio.wait_for(kv.get(key), KV_OP_SECONDS)
            except KeyNotFoundError:
                entry = None
            if entry is None or entry.value is None:
                await asyncio.wait_for(kv.create(key, str(span).encode()), KV_OP_SECONDS)
                return 0
            first = int(entry.value.decode())
            await asyncio.wait_for(kv.update(key, str(first + span).encode(), last=entry.revision), KV_OP_SECONDS)
            return first
        except KeyWrongLastSequenceError:
            races += 1  # another incarnation took a block meanwhile (or our own retried write landed): read again
            if races >= MAX_CAS_ATTEMPTS:
                raise RuntimeError(f"could not reserve sequence numbers at {key!r}: {races} compare-and-set races lost") from None
        except (TimeoutError, NatsError) as exc:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"could not reserve sequence numbers at {key!r} in time: {type(exc).__name__}: {exc}") from None
            await asyncio.sleep(RETRY_SECONDS)


class SeqBlocks:
    """The block a producer draws from; `take(n)` gives n consecutive fresh sequence numbers."""

    def __init__(self, kv, key: str):
        self._kv = kv
        self._key = key
        self.next = 0
        self.end = 0  # nothing reserved yet

    def take_reserved(self, num_seqs: int) -> int | None:
        """n consecutive numbers from the block already reserved, or None when it has too few (then `take`)."""
        if self.end - self.next < num_seqs:
            return None
        first = self.next
        self.next += num_seqs
        return first

    async def take(self, num_seqs: int, deadline: float) -> int:
        if self.end - self.next < num_seqs:  # the rest of this block is left unused
            self.next = await reserve(self._kv, self._key, num_seqs, deadline)
            self.end = self.next + -(-num_seqs // SEQ_BLOCK) * SEQ_BLOCK
        first = self.next
        self.next += num_seqs
        return first
