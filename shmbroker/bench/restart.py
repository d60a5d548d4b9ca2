"""`shmbroker bench restart`: a broker restarting on a large backlog: how soon it serves, how much memory.

A backlog of `tokens` tokens is written to a fresh data directory as a broker left it (backlog
writer 0, the ingest path's record layout, family keys in the headers): items of log-normal
length (median ~1k tokens, 16..16384) behind 256 shared 512-token prefixes, half of them
declared. Then `shmbroker supervise` starts on it (zero-cost simulated engines: the broker is
what is measured) and the run reports:

- first_batch_seconds: from starting the supervisor process to a GPU process's first batch
  (the control segment's batch counters), through recovery, the scheduler's index rebuild (block
  hashes read only past each item's family root) and the first decision;
- drain_seconds: until every recovered item has a result;
- peak memory (VmHWM) of every broker process, and, from a second run on a backlog ten times
  smaller in the same invocation, each process's peak growth per backlog item, next to the
  packing index's own bytes per item at this sizing (`index_bytes_per_item`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..control import roles
from ..control.segment import R_PID
from ..control.stats import slot_of
from ..pack.index import PackIndex
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, shape_items
from ..ring.items import NO_PREFIX, SEQ_BITS
from ..spill.layout import ITEM_DTYPE
from ..spill.store import Backlog
from .broker import ZERO_COST_CONSUMERS, BenchBroker

CONFIG = """instance = "restart{pid}"
index_items = {capacity}
"""

CHUNK_ITEMS = 1024
GPU_BATCHES = slot_of(roles.Kind.GPU, "batches")  # its statistics word: > 0 once a batch ran
RESULTS_LOGGED = slot_of(roles.Kind.RESULTS, "results")  # results in the results log


def write_backlog(data_dir: str, tokens: int, seed: int = 0) -> dict:
    """Items totalling about `tokens` tokens, appended by backlog writer 0 as the ingest path does."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 32_000, size=(256, DEFAULT_BLOCK_TOKENS), dtype=np.uint32)
    backlog, _ = Backlog.open(data_dir)
    writer = backlog.writer(0, fsync="never")
    items = 0
    total = 0
    try:
        while total < tokens:
            lengths = np.clip(rng.lognormal(7.0, 1.0, CHUNK_ITEMS).astype(np.int64), 16, 16384)
            offsets = np.zeros(CHUNK_ITEMS + 1, np.int64)
            np.cumsum(lengths, out=offsets[1:])
            flat = rng.integers(0, 32_000, size=int(offsets[-1]), dtype=np.uint32)
            fam = rng.integers(0, 256, CHUNK_ITEMS)
            long_enough = lengths >= DEFAULT_BLOCK_TOKENS
            for i in np.flatnonzero(long_enough).tolist():
                flat[offsets[i] : offsets[i] + DEFAULT_BLOCK_TOKENS] = prefixes[fam[i]]
            declared = np.where(long_enough & (fam % 2 == 0), DEFAULT_BLOCK_TOKENS, 0)
            shapes = shape_items(flat, offsets, declared)
            meta = np.zeros(CHUNK_ITEMS, ITEM_DTYPE)
            meta["item_id"] = (np.uint64(1) << np.uint64(SEQ_BITS)) | np.arange(items, items + CHUNK_ITEMS,
                                                                                  dtype=np.uint64)
            meta["prefix_key"] = shapes.families
            meta["producer"] = 1
            meta["prefix_len"] = np.where(declared > 0, declared, NO_PREFIX)
            meta["max_new_tokens"] = 1
            writer.append_many(flat, offsets, meta)
            items += CHUNK_ITEMS
            total += int(offsets[-1])
    finally:
        writer.close()
        backlog.close()
    return {"items": items, "tokens": total}


def _rss_peak(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _serve(tmp: str, tokens: int, capacity: int) -> dict:
    from ..control.segment import Control

    made = write_backlog(os.path.join(tmp, "data"), tokens)
    broker = BenchBroker(tmp, CONFIG.format(pid=os.getpid(), capacity=capacity) + ZERO_COST_CONSUMERS)
    t0 = broker.started
    sup = broker.proc
    ctl = None
    try:
        info = broker.wait_ready(0.005)
        ctl = Control.attach(info["control"], info["roles"])
        gpus = [r for r, name in enumerate(info["roles"]) if roles.kind_of(name) is roles.Kind.GPU]
        res = info["roles"].index("results")
        first = None
        peaks: dict[str, int] = {}
        while True:
            now = time.perf_counter()
            if first is None and any(ctl.values(r)[GPU_BATCHES] > 0 for r in gpus):
                first = now - t0
            for r, name in enumerate(info["roles"]):
                pid = int(ctl.role(r)[R_PID])
                if pid:
                    peaks[name] = max(peaks.get(name, 0), _rss_peak(pid))
            peaks["supervisor"] = max(peaks.get("supervisor", 0), _rss_peak(sup.pid))
            if ctl.values(res)[RESULTS_LOGGED] >= made["items"]:
                drained = now - t0
                break
            if now - t0 > 600:
                raise TimeoutError("the backlog did not drain in 600 s")
            time.sleep(0.002 if first is None else 0.05)
        return {"items": made["items"], "tokens": made["tokens"], "first_batch_seconds": first,
                "drain_seconds": drained, "peak_rss_bytes": peaks}
    finally:
        if ctl is not None:
            ctl.close()
        broker.stop()


def run(tokens: int = 100_000_000, *, scale: float = 1.0) -> dict:
    tokens = int(tokens * scale)
    capacity = 1 << 20
    index = PackIndex([(0, 131072), (0, 16384)], items=capacity, num_consumers=2)
    index_bytes_per_item = round(index.nbytes() / capacity, 1)
    del index
    out = {"backlog_tokens": tokens}
    runs = {}
    for name, size in (("small", tokens // 10), ("full", tokens)):
        tmp = tempfile.mkdtemp(prefix="shmb-restart-")
        try:
            runs[name] = _serve(tmp, size, capacity)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    full, small = runs["full"], runs["small"]
    out.update(backlog_items=full["items"], first_batch_seconds=round(full["first_batch_seconds"], 3),
               drain_seconds=round(full["drain_seconds"], 3),
               small_backlog_first_batch_seconds=round(small["first_batch_seconds"], 3),
               peak_rss_bytes=full["peak_rss_bytes"], index_bytes_per_item=index_bytes_per_item)
    growth = {}
    d_items = full["items"] - small["items"]
    for role, peak in full["peak_rss_bytes"].items():
        if d_items > 0:
            growth[role] = round((peak - small["peak_rss_bytes"].get(role, 0)) / d_items, 1)
    out["peak_rss_growth_bytes_per_item"] = growth
    return out
