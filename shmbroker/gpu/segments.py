"""Zero-copy views of backlog records for a GPU process: item tokens read from the segment files."""

from __future__ import annotations

import numpy as np

from ..spill.layout import RECORD_HEADER_BYTES, writer_dir_name
from ..spill.segment import SegmentFile


class SegmentViews:
    """Read-only mappings of backlog segment files, kept while batches use them."""

    MAX_OPEN = 64

    def __init__(self, root):
        self.root = root
        self.maps: dict[tuple[int, int], SegmentFile] = {}

    def tokens(self, writer: int, segment: int, offset: int, length: int) -> np.ndarray:
        key = (writer, segment)
        seg = self.maps.get(key)
        if seg is None:
            if len(self.maps) >= self.MAX_OPEN:
                old = next(iter(self.maps))
                self.maps.pop(old).close()
            seg = SegmentFile.open(self.root / writer_dir_name(writer) / f"{segment:020d}.seg")
            self.maps[key] = seg
        start = offset + RECORD_HEADER_BYTES
        return seg.buf[start : start + 4 * length].view(np.uint32)

    def close(self) -> None:
        for seg in self.maps.values():
            seg.close()
        self.maps.clear()


class BatchTokens:
    """Item i's tokens as a zero-copy view into its segment file, made when first asked for."""

    def __init__(self, views: SegmentViews, locs: np.ndarray):
        self.views, self.locs = views, locs

    def __len__(self):
        return self.locs.size

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        r = self.locs[i]
        return self.views.tokens(int(r["writer"]), int(r["segment"]), int(r["offset"]), int(r["length"]))

    def __iter__(self):
        return (self[i] for i in range(len(self)))
