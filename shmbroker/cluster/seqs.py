"""A producer's sequence numbers, reserved in blocks by compare-and-set in the leases bucket.

Key `seq.<producer>` of the `SHMB_LEASES` bucket holds the first sequence number no incarnation
of that producer name has reserved (decimal ASCII). Taking a block moves it on by compare-and-set
on the entry's revision, so two producers of one name, or one restarted, never get the same
number: a repeated `<producer>:<seq>` inside the duplicate window would be dropped as a duplicate.
Runs on a `NatsLoop`'s loop.
"""

from __future__ import annotations

SEQ_BLOCK = 1 << 16
MAX_CAS_ATTEMPTS = 64


async def reserve(kv, key: str, num_seqs: int) -> int:
    """Reserve `num_seqs` consecutive sequence numbers (a whole number of blocks); returns the first."""
    from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

    span = -(-num_seqs // SEQ_BLOCK) * SEQ_BLOCK
    for _ in range(MAX_CAS_ATTEMPTS):
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            entry = None
        try:
            if entry is None or entry.value is None:
                await kv.create(key, str(span).encode())
                return 0
            first = int(entry.value.decode())
            await kv.update(key, str(first + span).encode(), last=entry.revision)
            return first
        except KeyWrongLastSequenceError:
            continue  # another incarnation took a block meanwhile: read again
    raise RuntimeError(f"could not reserve sequence numbers at {key!r}: {MAX_CAS_ATTEMPTS} compare-and-set races lost")


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

    async def take(self, num_seqs: int) -> int:
        if self.end - self.next < num_seqs:  # the rest of this block is left unused
            self.next = await reserve(self._kv, self._key, num_seqs)
            self.end = self.next + -(-num_seqs // SEQ_BLOCK) * SEQ_BLOCK
        first = self.next
        self.next += num_seqs
        return first
