"""`shmbroker bench scale`: a backlog far larger than the packing index, ordered as one.

The workload is the spread family (`workloads/spread.py`, 10^6 x `--scale` items): prefix groups
(a system prompt and a document, then a question a member) whose members are spread evenly
through the file, as a script looping over its prompt templates writes a job. The same items go
through a live broker three times, one packed simulated consumer each (its prefix cache
`CACHE_TOKENS`, `block_tokens` 64, the engine paced as the simulation's default), all submitted at
once:

- `grouped`: written group by group, the index holding them all: the hit rate good order reaches;
- `full_index`: spread, `index_items` at least the backlog;
- `small_index`: spread, `index_items` a twentieth of the backlog: most of it waits beyond the
  index, where only the waiting groups (`pack/groups.py`) let a group meet.

Reported: each run's prefix-cache hit rate (the card's hit blocks over blocks looked up) and
seconds from the first submit to the last result, `small_index_vs_grouped` and
`full_index_vs_grouped` (hit rates over the grouped run's), `makespan_vs_grouped` (the small
index's seconds over the grouped run's), `sched_rss_mb` (the scheduler's peak resident memory in the small-index run) and
`bytes_per_waiting_item` (the waiting groups' memory for the whole backlog waiting, measured on
the workload's own keys; each waiting row's 72 bytes are on disk, not in memory).

Then the packing index alone at each size of `--indexed` (`scale_index.py`): its bytes per indexed
item, and the p99 of a decision from a full index of that size, padded and packed
(`decision_us_p99_padded`, `decision_us_p99_packed`, at the largest size; every size in
`index_runs`).
"""

from __future__ import annotations

import os
import shutil
import tempfile

from ..pack.shapes import shape_items
from ..workloads.spread import spread
from .broker import through_one_card

BLOCK_TOKENS = 64
CACHE_TOKENS = 262_144
SMALL_INDEX_FRACTION = 20
MIN_INDEX_ITEMS = 1024  # the configuration's least
TIMEOUT_SECONDS = 3600.0

CONFIG = """
index_items = {index_items}
block_tokens = {block_tokens}

[[consumers]]
name = "card"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 65536
engine_settings = {{ mode = "packed", cache_tokens = {cache_tokens} }}
"""


def through_broker(wl, index_items: int, tmp: str) -> dict:
    """The workload through a broker of one packed card, all submitted at once: its hit rate, its
    seconds from the first submit to the last result, the scheduler's peak memory."""
    config = CONFIG.format(index_items=index_items, block_tokens=BLOCK_TOKENS, cache_tokens=CACHE_TOKENS)
    try:
        run = through_one_card(tmp, config, "scale", wl.tokens, wl.offsets, wl.max_new_tokens, TIMEOUT_SECONDS,
                               prefix_len=wl.prefix_lens)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    hits = run.card["hit_blocks"] - run.card_before["hit_blocks"]
    queried = run.card["queried_blocks"] - run.card_before["queried_blocks"]
    return {"hit_rate": round(hits / queried, 4) if queried else None, "seconds": round(run.seconds, 2),
            "items": len(wl), "ok": int((run.status == 0).sum()), "index_items": index_items,
            "sched_rss_mb": round(run.sched_peak_rss_mb, 1)}


def waiting_bytes(wl) -> float:
    """The waiting groups' memory per item with the whole workload waiting (its own keys)."""
    from ..pack.groups import WaitingGroups, group_keys

    shapes = shape_items(wl.tokens, wl.offsets, wl.prefix_lens, block_tokens=BLOCK_TOKENS)
    groups = WaitingGroups()
    groups.append(*group_keys(shapes.families, shapes.hash_offsets, shapes.hashes))
    return groups.nbytes / len(wl)


def run(scale: float = 1.0, seed: int = 0, indexed: tuple[int, ...] = (1_000_000,), say=lambda line: None) -> dict:
    """The live runs, then the index alone at each size of `indexed` (none: left out)."""
    n = max(2000, int(1_000_000 * scale))
    spread_wl = spread(n, seed).workload
    grouped_wl = spread(n, seed, grouped=True).workload
    full = max(MIN_INDEX_ITEMS, 1 << (n - 1).bit_length())
    small = max(MIN_INDEX_ITEMS, n // SMALL_INDEX_FRACTION)
    out = {"items": n, "tokens": int(spread_wl.offsets[-1]), "block_tokens": BLOCK_TOKENS, "cache_tokens": CACHE_TOKENS,
           "bytes_per_waiting_item": round(waiting_bytes(spread_wl), 1)}
    root = tempfile.mkdtemp(prefix="shmbroker-bench-scale-")
    try:
        runs = {}
        for name, wl, index_items in (("grouped", grouped_wl, full), ("full_index", spread_wl, full),
                                      ("small_index", spread_wl, small)):
            say(f"bench scale: {name}, {n} items, index_items {index_items}")
            runs[name] = through_broker(wl, index_items, os.path.join(root, name))
            say(f"bench scale: {name}: {runs[name]}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    g = runs["grouped"]
    out.update({f"{k}_hit_rate": r["hit_rate"] for k, r in runs.items()})
    out.update({f"{k}_seconds": r["seconds"] for k, r in runs.items()})
    out["small_index_items"] = small
    out["small_index_vs_grouped"] = round(runs["small_index"]["hit_rate"] / g["hit_rate"], 4)
    out["full_index_vs_grouped"] = round(runs["full_index"]["hit_rate"] / g["hit_rate"], 4)
    out["makespan_vs_grouped"] = round(runs["small_index"]["seconds"] / g["seconds"], 4)
    out["full_index_makespan_vs_grouped"] = round(runs["full_index"]["seconds"] / g["seconds"], 4)
    out["sched_rss_mb"] = runs["small_index"]["sched_rss_mb"]
    out["all_ok"] = all(r["ok"] == r["items"] for r in runs.values())
    del spread_wl, grouped_wl
    if indexed:
        from .scale_index import run as index_run

        out.update(index_run(list(indexed), seed, say))
    return out


def from_command(args) -> dict:
    """`bench scale` from the command line's options (progress on stderr)."""
    import sys

    return run(scale=args.scale, seed=args.seed, indexed=tuple(int(x) for x in args.indexed.split(",") if int(x)),
               say=lambda line: print(line, file=sys.stderr))
