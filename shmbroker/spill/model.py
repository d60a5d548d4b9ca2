"""`BacklogModel`: a plain-Python model of what the durable backlog must show.

It is what the property tests (`tests/spill/test_spill_model.py`) run beside a real
`Backlog` in a temporary directory, step for step, to say what the real one
must show at every point, with none of its mechanism: no mmap, no numba, no
files. It tracks

- each writer's records in write order with their sequence numbers (0, 1, 2,
  ... per writer). `append_many` writes a batch in input order, or with
  `cluster=True` in shape order: a stable sort on (model, prefix_key,
  shape_band), which is `np.lexsort((shape_band, prefix_key, model))`;
- where each record lands: segment (first_seq of its file) and byte offset.
  A segment holds records from byte 64 until the next one does not fit in
  `segment_bytes`; then a new segment starts at the next sequence number;
- the done sets: `acked` (in memory, what reclaim goes by) and `saved` (what
  the last `save_acks` made durable);
- which segments exist. Reclaim deletes every segment but a writer's newest
  whose sequence range [first, next segment's first) is all acked, and
  nothing else.

A reopen (`reopen`) forgets unsaved acks except for records whose segment is
gone (they cannot come back), then reclaims as `Backlog.open` does; after it,
`pending()` is every appended record not acked: what `Backlog.pending()` must
return, record for record.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SEGMENT_HEADER_BYTES = 64
RECORD_HEADER_BYTES = 64

# metadata fields of an appended item, as `layout.ITEM_DTYPE` and `layout.PENDING_DTYPE` name them
META_FIELDS = ("item_id", "prefix_key", "producer", "model", "prefix_len", "max_new_tokens", "shape_band")


def record_bytes(num_tokens: int) -> int:
    """Bytes a record takes in a segment: header, tokens, zero padding to a multiple of 8."""
    assert num_tokens >= 0
    return -(-(RECORD_HEADER_BYTES + 4 * num_tokens) // 8) * 8


def shape_order(items: list[dict]) -> list[int]:
    """Input indices in shape order: stable by (model, prefix_key, shape_band)."""
    return sorted(range(len(items)), key=lambda i: (items[i]["model"], items[i]["prefix_key"], items[i]["shape_band"]))


@dataclass(frozen=True)
class ModelRecord:
    writer: int
    seq: int
    segment: int  # first_seq of the segment file that holds it
    offset: int  # byte offset of the record in that file
    meta: dict  # META_FIELDS
    tokens: tuple[int, ...]


@dataclass
class _Writer:
    records: list[ModelRecord] = field(default_factory=list)  # index = seq
    segments: list[int] = field(default_factory=list)  # first_seq of every segment ever created, ascending
    active_end: int = SEGMENT_HEADER_BYTES  # byte offset where the newest segment's next record goes


class BacklogModel:
    """The observable state of one data directory's backlog."""

    def __init__(self, segment_bytes: int):
        assert segment_bytes > SEGMENT_HEADER_BYTES + RECORD_HEADER_BYTES
        self.segment_bytes = segment_bytes
        self.writers: dict[int, _Writer] = {}
        self.acked: set[tuple[int, int]] = set()  # (writer, seq) done in memory
        self.saved: set[tuple[int, int]] = set()  # (writer, seq) done in the ack file
        self.deleted: set[tuple[int, int]] = set()  # (writer, first_seq) of reclaimed segments

    # -- appending -----------------------------------------------------------------

    def next_seq(self, writer: int) -> int:
        return len(self.writers.get(writer, _Writer()).records)

    def append_many(self, writer: int, tokens: list[tuple[int, ...]], items: list[dict], *, cluster: bool = True) -> list[ModelRecord]:
        """Append items (tokens[i], metadata items[i]); returns their records in input order."""
        assert len(tokens) == len(items)
        w = self.writers.setdefault(writer, _Writer())
        order = shape_order(items) if cluster else list(range(len(items)))
        out: list[ModelRecord | None] = [None] * len(items)
        for i in order:
            size = record_bytes(len(tokens[i]))
            assert SEGMENT_HEADER_BYTES + size <= self.segment_bytes, "a record larger than a segment is refused"
            if not w.segments or w.active_end + size > self.segment_bytes:
                w.segments.append(len(w.records))
                w.active_end = SEGMENT_HEADER_BYTES
            rec = ModelRecord(
                writer, len(w.records), w.segments[-1], w.active_end, {k: int(items[i][k]) for k in META_FIELDS}, tuple(tokens[i])
            )
            w.records.append(rec)
            w.active_end += size
            out[i] = rec
        return out

    # -- acks and reclaim ----------------------------------------------------------

    def ack(self, writer: int, seqs) -> None:
        for seq in seqs:
            assert 0 <= seq < self.next_seq(writer), "only appended records are acked"
            self.acked.add((writer, int(seq)))

    def save_acks(self) -> None:
        self.saved = set(self.acked)

    def segment_range(self, writer: int, first: int) -> range:
        """Sequence numbers of the segment starting at `first`."""
        w = self.writers[writer]
        k = w.segments.index(first)
        return range(first, w.segments[k + 1] if k + 1 < len(w.segments) else len(w.records))

    def live_segments(self, writer: int) -> list[int]:
        w = self.writers.get(writer, _Writer())
        return [s for s in w.segments if (writer, s) not in self.deleted]

    def reclaimable(self) -> set[tuple[int, int]]:
        """(writer, first_seq) of every live segment reclaim must delete."""
        out = set()
        for writer in self.writers:
            live = self.live_segments(writer)
            for first in live[:-1]:
                if all((writer, s) in self.acked for s in self.segment_range(writer, first)):
                    out.add((writer, first))
        return out

    def reclaim(self) -> set[tuple[int, int]]:
        gone = self.reclaimable()
        self.deleted |= gone
        return gone

    # -- reopen ----------------------------------------------------------------------

    def reopen(self) -> set[tuple[int, int]]:
        """A close and `Backlog.open`: unsaved acks are lost unless their segment is gone; open reclaims."""
        self.acked = set(self.saved)
        for writer, first in self.deleted:
            self.acked.update((writer, s) for s in self.segment_range(writer, first))
        return self.reclaim()

    # -- what the real one must show -------------------------------------------------

    def live_records(self) -> dict[tuple[int, int], ModelRecord]:
        """Every record in a segment that still exists, acked or not."""
        return {
            (rec.writer, rec.seq): rec
            for writer, w in self.writers.items()
            for rec in w.records
            if (writer, rec.segment) not in self.deleted
        }

    def pending(self) -> dict[tuple[int, int], ModelRecord]:
        """(writer, seq) -> record for every appended record not acked (`Backlog.pending()` after a reopen)."""
        out = {}
        for writer, w in self.writers.items():
            for rec in w.records:
                if (writer, rec.seq) not in self.acked:
                    assert (writer, rec.segment) not in self.deleted, "a deleted segment held a pending record"
                    out[(writer, rec.seq)] = rec
        return out

    def all_acked(self) -> bool:
        return all((writer, rec.seq) in self.acked for writer, w in self.writers.items() for rec in w.records)
