"""`shmbroker bench scale --indexed N,...`: the packing index itself at 10^6 and 10^7 items.

For each size N a Packer of capacity N is filled with N items of the spread family's shape, made
from hashes alone (no tokens: at 10^7 items they would be 14 G): documents in groups of 2 to 16
under six system prompts, half declared, each member its document's blocks then a few of its own
(`block_tokens` 64). Reported per size and engine mode (one consumer, `padded` or `packed`): the
index's bytes per item (its arrays, allocated at capacity), the seconds to allocate and to fill it
(`add_many`, what a scheduler's rebuild does after its scan), this process's peak memory so far,
and the p50 and p99 of DECISIONS decisions taken from the full index (each one compiled call; a
decision's cost must not grow with the index).
"""

from __future__ import annotations

import gc
import os
import time

import numpy as np

from ..pack.contract import Contract, Mode
from ..pack.packer import ConsumerSpec, Packer
from ..pack.shapes import ItemShapes
from .broker import peak_rss_mb

BLOCK_TOKENS = 64
DECISIONS = 2000
CONTRACT = Contract(64, 65536, 65536)


def mixed(x: np.ndarray) -> np.ndarray:
    """A 64-bit finaliser (splitmix64) over an array: distinct inputs, hash-like outputs."""
    x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def synthetic_shapes(n: int, seed: int = 0) -> ItemShapes:
    """n items in document groups (sizes 2..16) under 6 system prompts: hashes, no tokens."""
    rng = np.random.default_rng(seed)
    sizes = np.exp(rng.uniform(np.log(2), np.log(17), n // 2 + 16)).astype(np.int64)
    group = np.repeat(np.arange(sizes.size), sizes)[:n]
    g = int(group.max()) + 1
    system = rng.integers(0, 6, g)
    declared = system % 2 == 0
    doc_blocks = np.exp(rng.uniform(np.log(2), np.log(31), g)).astype(np.int64)
    own = rng.integers(1, 4, n)
    nb = doc_blocks[group] + own  # blocks past the family root
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(nb, out=offsets[1:])
    depth = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], nb)
    item = np.repeat(np.arange(n, dtype=np.int64), nb)
    shared = depth < np.repeat(doc_blocks[group], nb)
    # a shared block's hash is its document's and depth's; an item's own block is its own
    ident = np.where(shared, np.repeat(group, nb) * 64 + depth, -(item * 4 + depth - np.repeat(doc_blocks[group], nb)) - 1)
    hashes = mixed(ident.astype(np.uint64) ^ np.uint64(seed + 0x5EED))
    families = mixed(system[group].astype(np.uint64) + np.uint64(1 << 40))
    bases = np.where(declared[group], 300, BLOCK_TOKENS).astype(np.int64)
    lengths = bases + nb * BLOCK_TOKENS - rng.integers(0, BLOCK_TOKENS, n)
    return ItemShapes(families, offsets, hashes, lengths, np.zeros(n, np.int64), bases, BLOCK_TOKENS,
                      np.zeros(n, bool))


def one_size(n: int, mode: Mode, seed: int = 0) -> dict:
    shapes = synthetic_shapes(n, seed)
    gc.collect()
    t0 = time.perf_counter()
    packer = Packer([ConsumerSpec("card", CONTRACT, mode)], capacity=n)
    made = time.perf_counter() - t0
    t0 = time.perf_counter()
    added = packer.add_many(np.arange(n, dtype=np.uint64), 0.0, shapes, 16)
    fill = time.perf_counter() - t0
    assert added == n, f"{added} of {n} indexed"
    del shapes
    clock = time.perf_counter_ns
    packer.next_batch(0, 1.0)  # the first call pays numba's dispatch set-up
    passes = []
    for _ in range(2):  # the first pass touches the index's pages for the first time (allocated lazily)
        ns, items = [], 0
        for _ in range(DECISIONS):
            t0 = clock()
            batch = packer.next_batch(0, 1.0)
            ns.append(clock() - t0)
            items += len(batch) if batch is not None else 0
        passes.append(np.array(ns, np.float64) / 1000)
    first, us = passes
    out = {"items": n, "mode": str(mode), "bytes_per_indexed_item": round(packer.index.nbytes() / n, 1),
           "alloc_seconds": round(made, 2), "fill_seconds": round(fill, 2),
           "decision_us_p50": round(float(np.percentile(us, 50)), 1),
           "decision_us_p99": round(float(np.percentile(us, 99)), 1),
           "decision_us_p99_first_pass": round(float(np.percentile(first, 99)), 1),
           "decision_items_mean": round(items / DECISIONS, 1), "process_peak_rss_mb": round(peak_rss_mb(os.getpid()), 1)}
    del packer
    gc.collect()
    return out


def run(sizes: list[int], seed: int = 0, say=lambda line: None) -> dict:
    """Each size in each mode; the figures of the largest size at the top level as well."""
    runs = []
    for n in sizes:
        for mode in (Mode.PADDED, Mode.PACKED):
            say(f"bench scale: the index at {n} items, {mode}")
            runs.append(one_size(n, mode, seed))
            say(f"bench scale: {runs[-1]}")
    top = max(sizes)
    of = {r["mode"]: r for r in runs if r["items"] == top}
    return {"indexed_items": top, "bytes_per_indexed_item": of[str(Mode.PACKED)]["bytes_per_indexed_item"],
            "decision_us_p99_padded": of[str(Mode.PADDED)]["decision_us_p99"],
            "decision_us_p99_packed": of[str(Mode.PACKED)]["decision_us_p99"],
            "index_fill_seconds": of[str(Mode.PACKED)]["fill_seconds"], "index_runs": runs}
