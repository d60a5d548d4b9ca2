"""Zero-copy views of backlog records for a GPU process: item tokens read from the segment files,
each record checked (`check`: whole, and the one its location names) before its tokens are used,
and the option words that follow an item's tokens (`option_words`, spill/layout.py)."""

from __future__ import annotations

import numpy as np

from ..spill.layout import OPTION_WORDS_MASK, R_FLAGS, RECORD_HEADER_BYTES, RECORD_HEADER_WORDS, segment_name, writer_dir_name
from ..spill.records import CHECK_GONE, check_records
from ..spill.segment import SegmentFile


class SegmentViews:
    """Read-only mappings of backlog segment files, kept while batches use them."""

    MAX_OPEN = 64

    def __init__(self, root):
        self.root = root
        self.maps: dict[tuple[int, int], SegmentFile] = {}

    def segment(self, writer: int, segment: int) -> SegmentFile | None:
        """The mapping of a segment file (cached); None when it cannot be mapped (gone, or its header
        fails its checks)."""
        where = (writer, segment)
        seg = self.maps.get(where)
        if seg is None:
            if len(self.maps) >= self.MAX_OPEN:
                old = next(iter(self.maps))
                self.maps.pop(old).close()
            try:
                seg = SegmentFile.open(self.root / writer_dir_name(writer) / segment_name(segment))
            except (OSError, ValueError):
                return None
            self.maps[where] = seg
        return seg

    def tokens(self, writer: int, segment: int, offset: int, length: int) -> np.ndarray:
        seg = self.segment(writer, segment)
        if seg is None:
            raise ValueError(f"backlog segment w{writer:03d}/{segment:020d} cannot be read")
        start = offset + RECORD_HEADER_BYTES
        return seg.buf[start : start + 4 * length].view(np.uint32)

    def check(self, locs: np.ndarray) -> np.ndarray:
        """`records.CHECK_*` of each location (LOC rows): is the record there whole (its crc32c over
        header and tokens) and the one the location names (sequence number, item id, token count)?"""
        out = np.empty(locs.size, np.int64)
        if not locs.size:
            return out
        writers, segments = locs["writer"], locs["segment"]
        starts = np.flatnonzero(np.r_[True, (writers[1:] != writers[:-1]) | (segments[1:] != segments[:-1])])
        ends = np.r_[starts[1:], locs.size]
        for i, j in zip(starts.tolist(), ends.tolist()):  # runs of one segment: one kernel call each
            seg = self.segment(int(writers[i]), int(segments[i]))
            if seg is None:
                out[i:j] = CHECK_GONE
                continue
            run = locs[i:j]
            check_records(seg.buf, run["offset"].astype(np.int64), run["seq"].astype(np.uint64),
                          run["item_id"].astype(np.uint64), run["num_tokens"].astype(np.int64), out[i:j])
        return out

    def option_words(self, locs: np.ndarray) -> list | None:
        """Each location's option words (a zero-copy view, None for an item without options), or None
        when no item has any: the common case costs one vector read of the flags words a segment.
        The records must have passed `check` (their length, and so their option words, are whole)."""
        out = None
        writers, segments = locs["writer"], locs["segment"]
        starts = np.flatnonzero(np.r_[True, (writers[1:] != writers[:-1]) | (segments[1:] != segments[:-1])])
        ends = np.r_[starts[1:], locs.size]
        for i, j in zip(starts.tolist(), ends.tolist()):
            seg = self.segment(int(writers[i]), int(segments[i])) if locs.size else None
            if seg is None:
                continue
            words = seg.buf[: seg.buf.size & ~3].view(np.uint32)
            base = locs["offset"][i:j].astype(np.int64) >> 2
            counts = words[base + R_FLAGS] & OPTION_WORDS_MASK
            if not counts.any():
                continue
            if out is None:
                out = [None] * locs.size
            firsts = base + RECORD_HEADER_WORDS + locs["num_tokens"][i:j].astype(np.int64)
            for k in np.flatnonzero(counts).tolist():
                out[i + k] = words[firsts[k] : firsts[k] + counts[k]]
        return out

    def close(self) -> None:
        for seg in self.maps.values():
            seg.close()
        self.maps.clear()


class BatchTokens:
    """Item i's tokens as a zero-copy view into its segment file, made when first asked for;
    `check(rows)` checks those items' records first (`SegmentViews.check`)."""

    def __init__(self, views: SegmentViews, locs: np.ndarray):
        self.views, self.locs = views, locs

    def __len__(self):
        return self.locs.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        r = self.locs[i]
        return self.views.tokens(int(r["writer"]), int(r["segment"]), int(r["offset"]), int(r["num_tokens"]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def check(self, rows: np.ndarray) -> np.ndarray:
        """`records.CHECK_*` of the records of items `rows`."""
        locs = self.locs if rows.size == self.locs.size else self.locs[rows]
        return self.views.check(locs)

    def option_words(self, rows: np.ndarray | None = None) -> list | None:
        """The option words of items `rows` (all: None), checked records only (`SegmentViews`)."""
        locs = self.locs if rows is None or rows.size == self.locs.size else self.locs[rows]
        return self.views.option_words(locs)
