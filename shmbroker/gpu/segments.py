"""Zero-copy views of backlog records for a GPU process: item tokens read from the segment files,
each record checked (`check`: whole, and the one its location names) before its tokens are used."""

from __future__ import annotations

import numpy as np

from ..spill.layout import RECORD_HEADER_BYTES, segment_name, writer_dir_name
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
