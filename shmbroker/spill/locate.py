"""Item locations (`ring.wire.LOC_DTYPE` rows, built by `fill_locations` only) and block hashes of backlog records read back from disk, for a scheduler (re)filling its index.

The family key is in every record's header (`prefix_key`); the block hashes below it are chained
from it over the tokens past the family root (the declared prefix, else the first block), so an
item within one block reads no payload, and a longer one reads only its tokens past the root.
"""

from __future__ import annotations

import numpy as np

from ..pack.shapes import chain_items, count_blocks
from ..ring.items import NO_PREFIX
from ..ring.wire import LOC_DTYPE
from .layout import RECORD_HEADER_BYTES


def fill_locations(locs: np.ndarray, items: np.ndarray, *, writer, segment, offset, seq, length) -> np.ndarray:
    """Fill LOC_DTYPE rows (aux 0) of backlog records: `items` holds their metadata
    (spill.layout.ITEM_DTYPE or PENDING_DTYPE rows), the keywords where each record lies. The one
    place a location row is built: ingest announcing what it appended, recovery what it found."""
    locs["writer"] = writer
    locs["num_tokens"] = length
    locs["segment"] = segment
    locs["offset"] = offset
    locs["seq"] = seq
    locs["item_id"] = items["item_id"]
    locs["prefix_key"] = items["prefix_key"]
    locs["max_new_tokens"] = items["max_new_tokens"]
    locs["model"] = items["model"]
    locs["prefix_len"] = items["prefix_len"]
    locs["aux"] = 0
    return locs


def record_locations(records: np.ndarray) -> np.ndarray:
    """LOC_DTYPE rows (aux 0) of backlog records (spill.layout.PENDING_DTYPE), read from their headers only."""
    return fill_locations(np.zeros(records.size, LOC_DTYPE), records, writer=records["writer"],
                          segment=records["segment"], offset=records["offset"], seq=records["seq"],
                          length=records["num_tokens"])


def recovered_locations(backlog, pending: np.ndarray, block_tokens: int):
    """(LOC_DTYPE rows, hash_offsets, hashes) of pending records (spill.layout.PENDING_DTYPE)."""
    locs = record_locations(pending)
    return (locs, *block_hashes(backlog, locs, block_tokens))


def block_hashes(backlog, locs: np.ndarray, block_tokens: int):
    """(hash_offsets, hashes) of backlog records at LOC_DTYPE rows, their `aux` set to each one's
    count; `backlog` maps their segments (`segment()`/`forget_segment()`), one at a time."""
    n = locs.size
    hash_offsets = np.zeros(n + 1, np.int64)
    if n == 0:
        return hash_offsets, np.zeros(0, np.uint64)
    lengths = locs["num_tokens"].astype(np.int64)
    declared = locs["prefix_len"]
    prefixes = np.where(declared == NO_PREFIX, 0, declared).astype(np.int64)
    ends = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=ends[1:])
    total = count_blocks(ends, prefixes, block_tokens, hash_offsets)
    locs["aux"] = np.diff(hash_offsets)
    hashes = np.zeros(total, np.uint64)
    if total:
        need = np.diff(hash_offsets) > 0
        writers, segments = locs["writer"], locs["segment"]
        idx = np.flatnonzero(need)
        seg_ids = writers[idx].astype(np.uint64) << np.uint64(48) | segments[idx]
        starts = np.flatnonzero(np.r_[True, seg_ids[1:] != seg_ids[:-1]])
        ends = np.r_[starts[1:], idx.size]
        for a, b in zip(starts.tolist(), ends.tolist()):
            sel = idx[a:b]
            where = (int(writers[sel[0]]), int(segments[sel[0]]))
            seg = backlog.segment(*where)
            starts = (locs["offset"][sel].astype(np.int64) + RECORD_HEADER_BYTES) // 4  # tokens, in words
            chain_items(seg.buf.view(np.uint32), starts, lengths[sel], prefixes[sel], locs["prefix_key"][sel],
                        block_tokens, hash_offsets[sel], hashes)
            backlog.forget_segment(*where)  # unmapped at once: memory stays one segment, not the backlog
    return hash_offsets, hashes
