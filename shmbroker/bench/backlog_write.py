"""The workload of `bench backlog` and its write phases: seeded records of log-normal length with their
checksums, the disk baseline (`os.write` + `fdatasync`), the timed appends through `SegmentWriter`,
and the memory priming before each (backlog.py's docstring says why).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import numpy as np

from ..ingest.loop import BATCH_RECORDS
from ..ring.items import SEQ_BITS
from ..spill import layout as L
from ..spill.store import Backlog

SEED = 20261130
FAMILIES = 64
MODELS = 2
TOKENS_MIN, TOKENS_MAX, TOKENS_MEDIAN, TOKENS_SIGMA = 64, 4096, 512, 0.8
APPEND_BATCH = BATCH_RECORDS  # what one ingest pass hands the writer at most
DISK_CHUNK_BYTES = 8 << 20
SUM_CHUNK_TOKENS = 1 << 23
PRIME_EXTRA_BYTES = 256 << 20
PRODUCER_MAIN = 1


def workload(volume_bytes: int, seed: int = SEED):
    """(flat uint32 tokens, offsets, ITEM_DTYPE items) of about volume_bytes of tokens."""
    rng = np.random.default_rng(seed)
    want = volume_bytes // 4
    guess = int(want / (TOKENS_MEDIAN * np.exp(TOKENS_SIGMA**2 / 2)) * 1.2) + 16
    lens = np.clip(rng.lognormal(np.log(TOKENS_MEDIAN), TOKENS_SIGMA, guess), TOKENS_MIN, TOKENS_MAX).astype(np.int64)
    offsets = np.zeros(lens.size + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    count = int(np.searchsorted(offsets, want, side="right")) - 1
    assert 0 < count < lens.size, "lognormal guess too small"
    offsets = offsets[: count + 1]
    flat = rng.integers(0, 1 << 17, size=int(offsets[-1]), dtype=np.uint32)
    family = rng.integers(0, FAMILIES, count).astype(np.uint64)
    items = np.zeros(count, L.ITEM_DTYPE)
    items["item_id"] = (PRODUCER_MAIN << SEQ_BITS) | np.arange(count, dtype=np.uint64)
    items["producer"] = PRODUCER_MAIN
    items["prefix_key"] = (family + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)  # wraps: a spread 64-bit key
    items["model"] = family % np.uint64(MODELS)
    items["shape_band"] = np.floor(np.log2(lens[:count])).astype(np.uint32)  # as spill/collect.py
    items["max_new_tokens"] = 128
    return flat, offsets, items


def record_sums(flat: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per record (Σt, Σt·(i+1)) in wrapping uint32, i the index inside the record (ring.digest's checksum)."""
    n = offsets.size - 1
    assert n == 0 or int(np.diff(offsets).min()) > 0, "reduceat needs non-empty records"
    s1 = np.empty(n, np.uint32)
    s2 = np.empty(n, np.uint32)
    i = 0
    while i < n:
        j = min(n, max(i + 1, int(np.searchsorted(offsets, offsets[i] + SUM_CHUNK_TOKENS, side="right")) - 1))
        lo, hi = int(offsets[i]), int(offsets[j])
        t = flat[lo:hi]
        starts = offsets[i:j] - lo
        a = np.add.reduceat(t, starts, dtype=np.uint32)
        b = np.add.reduceat(t * np.arange(1, hi - lo + 1, dtype=np.uint32), starts, dtype=np.uint32)
        s1[i:j] = a
        s2[i:j] = b - starts.astype(np.uint32) * a  # Σ t·(start+k+1) − start·Σt = Σ t·(k+1)
        i = j
    return s1, s2


# -- writing ----------------------------------------------------------------------------


def prime_memory(nbytes: int) -> None:
    """Touch and free nbytes of memory, so that the next phase's page cache meets host-backed pages.

    On this VM (virtio-balloon free page reporting) memory freed for a few
    seconds goes back to the host, and faulting it in again runs at ~0.5 GiB/s:
    slower than the device. Every timed write phase starts right after this,
    so that the baseline and the appends meet the same memory.
    """
    np.ones(nbytes, np.uint8)


def disk_write_seconds(path: Path, flat: np.ndarray) -> float:
    view = memoryview(flat).cast("B")
    prime_memory(flat.nbytes + PRIME_EXTRA_BYTES)
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for lo in range(0, len(view), DISK_CHUNK_BYTES):
            chunk = view[lo : lo + DISK_CHUNK_BYTES]
            while chunk:
                chunk = chunk[os.write(fd, chunk) :]
        os.fdatasync(fd)
    finally:
        os.close(fd)
    seconds = time.perf_counter() - t0
    path.unlink()
    return seconds


def append_seconds(data_dir: Path, segment_bytes: int, flat, offsets, items, *, fsync: str, cluster: bool = True) -> float:
    """Append the workload with one writer in calls of APPEND_BATCH records; seconds including a final sync().

    The clock starts after the writer exists (its directory made, its sync
    thread started) and after memory is primed; the first segment's creation is on it.
    """
    backlog, _ = Backlog.open(data_dir, segment_bytes=segment_bytes)
    writer = backlog.writer(0, fsync=fsync)
    try:
        count = items.size
        prime_memory(int(offsets[-1]) * 4 + PRIME_EXTRA_BYTES)
        t0 = time.perf_counter()
        for lo in range(0, count, APPEND_BATCH):
            hi = min(count, lo + APPEND_BATCH)
            writer.append_many(flat, offsets[lo : hi + 1], items[lo:hi], cluster=cluster)
        writer.sync()
        seconds = time.perf_counter() - t0
    finally:
        writer.close()
        backlog.close()
    return seconds


def warm_kernels(data_dir: Path, flat, offsets, items, segment_bytes: int) -> None:
    """Load every kernel the timed phases call (numba's cache) outside the clocks."""
    append_seconds(data_dir, segment_bytes, flat, offsets[:9], items[:8], fsync="never")
    backlog, _ = Backlog.open(data_dir, segment_bytes=segment_bytes)
    recs = backlog.pending()
    out = np.empty(int(offsets[8]), np.uint32)
    backlog.gather(recs, out, np.empty(recs.size + 1, np.int64))
    backlog.close()
    shutil.rmtree(data_dir)
