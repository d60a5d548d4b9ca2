"""The client's duplicate window: which sequence numbers of one producer id it has handed out."""

from __future__ import annotations

import numpy as np


class SeenSet:
    """The sequence numbers seen of one producer id, in chunks of CHUNK: a chunk with some seen
    is a bitmap, a chunk with all seen is one number (`full_below`, or `full` when out of order),
    a chunk with none is nothing. So memory follows the chunks partly answered (the spread of
    results in flight), not the first sequence number a new reader sees, and a sequence number
    that never comes back holds one chunk, not a window that can no longer slide."""

    CHUNK_BITS = 16
    CHUNK = 1 << CHUNK_BITS

    def __init__(self):
        self.full_below = 0  # every chunk below this one is all seen
        self.full: set[int] = set()  # other chunks all seen
        self.partial: dict[int, np.ndarray] = {}  # chunk -> bool flags

    def add(self, seqs: np.ndarray) -> np.ndarray:
        """Mark seqs seen; True for each not seen before (the first of two equal ones in seqs)."""
        seqs = np.asarray(seqs, np.int64)
        fresh = np.zeros(seqs.size, bool)
        if seqs.size == 0:
            return fresh
        chunks = seqs >> self.CHUNK_BITS
        lo, hi = int(chunks.min()), int(chunks.max())
        for c in ([lo] if lo == hi else np.unique(chunks).tolist()):
            if c < self.full_below or c in self.full:
                continue
            mine = slice(None) if lo == hi else np.flatnonzero(chunks == c)
            rel = seqs[mine] & (self.CHUNK - 1)
            flags = self.partial.get(c)
            if flags is None:
                flags = self.partial[c] = np.zeros(self.CHUNK, bool)
            new = ~flags[rel]
            if rel.size > 1:  # two copies within one call: keep the first
                order = np.argsort(rel, kind="stable")
                again = np.zeros(rel.size, bool)
                again[order[1:]] = rel[order[1:]] == rel[order[:-1]]
                new &= ~again
            fresh[mine] = new
            flags[rel] = True
            if new.any() and flags.all():
                del self.partial[c]
                self.full.add(c)
        while self.full_below in self.full:
            self.full.discard(self.full_below)
            self.full_below += 1
        return fresh

    def nbytes(self) -> int:
        return self.CHUNK * len(self.partial) + 64 * len(self.full)

    def contains(self, seqs: np.ndarray) -> np.ndarray:
        """True for each of seqs already seen (nothing is marked)."""
        seqs = np.asarray(seqs, np.int64)
        chunks = seqs >> self.CHUNK_BITS
        out = (chunks < self.full_below) | np.isin(chunks, list(self.full))
        for c, flags in self.partial.items():
            mine = chunks == c
            out[mine] = flags[seqs[mine] & (self.CHUNK - 1)]
        return out

    def state(self) -> dict:
        """A JSON-able copy (`from_state` reads it back): partial chunks as packed bits in hex."""
        return {"full_below": self.full_below, "full": sorted(self.full),
                "partial": {str(c): np.packbits(f).tobytes().hex() for c, f in self.partial.items()}}

    @classmethod
    def from_state(cls, state: dict) -> SeenSet:
        """ValueError (or KeyError, TypeError) when `state` is not what `state()` writes."""
        s = cls()
        s.full_below = int(state["full_below"])
        s.full = {int(c) for c in state["full"]}
        for c, bits in state["partial"].items():
            flags = np.unpackbits(np.frombuffer(bytes.fromhex(bits), np.uint8)).astype(bool)
            if flags.size != cls.CHUNK:
                raise ValueError(f"a seen chunk of {flags.size} flags, not {cls.CHUNK}")
            s.partial[int(c)] = flags
        return s
