"""Zero-copy views of backlog records for a GPU process: item tokens read from the segment files,
each record checked (`check`: whole, and the one its location names) before its tokens are used,
and the option words that follow an item's tokens (`option_words`, spill/layout.py)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..request.options import OptionsColumn
from ..spill.layout import OPTION_WORDS_MASK, R_FLAGS, RECORD_HEADER_BYTES, RECORD_HEADER_WORDS, segment_name, writer_dir_name
from ..spill.records import CHECK_GONE, check_records
from ..spill.segment import SegmentFile


class OptionWords(NamedTuple):
    """The distinct option word sets of some items, and each item's index into them (-1: none)."""

    sets: list  # uint32 arrays
    index: np.ndarray  # int64, one per item


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

    def check(self, locs: np.ndarray, words_out: np.ndarray | None = None) -> np.ndarray:
        """`records.CHECK_*` of each location (LOC rows): is the record there whole (its crc32c over
        header, tokens and option words) and the one the location names (sequence number, item id,
        token count)? `words_out` (int64, zeros) gets each whole record's option word count."""
        out = np.empty(locs.size, np.int64)
        words = np.zeros(locs.size, np.int64) if words_out is None else words_out
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
                          run["item_id"].astype(np.uint64), run["num_tokens"].astype(np.int64), out[i:j], words[i:j])
        return out

    def option_words(self, locs: np.ndarray) -> OptionWords | None:
        """The distinct option word sets of these locations and each one's index into them (-1: no
        options), or None when no item has any: one vector read of the flags words a segment, and
        for the items with options one gather and one `np.unique` per word count, no Python per
        item. The records must have passed `check` (their length, and so their words, are whole)."""
        index = None
        found: dict[bytes, int] = {}
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
            if index is None:
                index = np.full(locs.size, -1, np.int64)
            firsts = base + RECORD_HEADER_WORDS + locs["num_tokens"][i:j].astype(np.int64)
            for k in np.unique(counts[counts > 0]).tolist():
                rows = np.flatnonzero(counts == k)
                mat = words[firsts[rows, None] + np.arange(k)]
                if (mat == mat[0]).all():  # the common case, one set (np.unique by rows costs ~1 µs a row)
                    sets, inverse = mat[:1], np.zeros(rows.size, np.int64)
                else:
                    sets, inverse = np.unique(mat, axis=0, return_inverse=True)
                ids = [found.setdefault(row.tobytes(), len(found)) for row in sets]
                index[i + rows] = np.asarray(ids, np.int64)[inverse.ravel()]
        if index is None:
            return None
        return OptionWords([np.frombuffer(b, np.uint32) for b in found], index)

    def close(self) -> None:
        for seg in self.maps.values():
            seg.close()
        self.maps.clear()


class BatchTokens:
    """Item i's tokens as a zero-copy view into its segment file, made when first asked for;
    `check(rows)` checks those items' records first (`SegmentViews.check`); `options(reader)`
    their request options, decoded once for the record and kept for its parts (`part`)."""

    def __init__(self, views: SegmentViews, locs: np.ndarray, options: tuple | None = None):
        self.views, self.locs = views, locs
        self._options = options  # (OptionsColumn or None, {row: why}) once decoded
        self._samples = False  # each item's sample count once asked (None: one each)

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
        """`records.CHECK_*` of the records of items `rows` (their option word counts kept: an item
        without options then costs `options` nothing more)."""
        locs = self.locs if rows.size == self.locs.size else self.locs[rows]
        words = np.zeros(locs.size, np.int64)
        out = self.views.check(locs, words)
        if not words.any():
            self._options = (None, {})  # the whole record holds no options (rows not whole are failed)
        return out

    def options(self, reader, rows: np.ndarray | None = None):
        """(the items' options as an OptionsColumn, or None when none has any; {row: why} of those
        that must fail) by `reader` (`requests.RequestReader`), decoded once: `rows` (all: None) are
        the items whose records passed `check`, the only ones read."""
        if self._options is None:
            locs = self.locs if rows is None or rows.size == self.locs.size else self.locs[rows]
            column, why = reader.resolve(self.views.option_words(locs))
            if column is not None and locs is not self.locs:  # back to all rows (-1: not read)
                index = np.full(self.locs.size, -1, np.int64)
                index[rows] = column.index
                column = OptionsColumn(column.sets, index)
                why = {int(rows[k]): text for k, text in why.items()}
            self._options = (column, why)
        return self._options

    def samples(self) -> np.ndarray | None:
        """Each item's sample count, once its options are decoded (`options`); None: one each."""
        if self._options is None:
            return None
        if self._samples is False:
            column = self._options[0]
            self._samples = None if column is None else column.samples()
        return self._samples

    def part(self, rows: np.ndarray) -> BatchTokens:
        """Items `rows` (indices into this record's items), with their options if decoded."""
        if self._options is None:
            return BatchTokens(self.views, self.locs[rows])
        column = self._options[0]
        return BatchTokens(self.views, self.locs[rows],
                           (None if column is None else OptionsColumn(column.sets, column.index[rows]), {}))
