"""The baseline pipeline of `bench e2e`, built on `multiprocessing.Queue`.

The same shape as the broker: producers -> one dispatcher -> two workers ->
results back to each producer. Each producer puts its items one at a time
(id, submit time, tokens) as a plain queue's user would; the dispatcher groups
what it has into batches of up to `batch_items` and hands them to the workers
in turn; a worker "runs" a zero-cost engine (one generated token per item) and
sends each result to its producer's result queue; a producer reads its
results while it submits. Every item must come back exactly once.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_mod
import time

import numpy as np

STOP = None


def _producer(index: int, items: int, tokens: int, inbox, results, report) -> None:
    rng = np.random.default_rng(index)
    pool = rng.integers(0, 32_000, size=(64, tokens), dtype=np.uint32)
    latencies = np.empty(items, np.int64)
    seen = np.zeros(items, bool)
    got = 0
    base = index << 40

    def take(result) -> None:
        nonlocal got
        item_id, sent, _ = result
        k = item_id - base
        assert 0 <= k < items and not seen[k], f"result for item {item_id:#x} is foreign or a duplicate"
        seen[k] = True
        latencies[got] = time.perf_counter_ns() - sent
        got += 1

    for i in range(items):
        inbox.put((base | i, time.perf_counter_ns(), pool[i & 63]))
        while True:  # take what has come back, without waiting
            try:
                take(results.get_nowait())
            except queue_mod.Empty:
                break
    inbox.put(STOP)
    while got < items:
        take(results.get(timeout=60))
    report.put((index, latencies))


def _dispatcher(inbox, workers: list, producers: int, batch_items: int) -> None:
    stopped = 0
    turn = 0
    while stopped < producers:
        batch = []
        item = inbox.get()
        while True:
            if item is STOP:
                stopped += 1
            else:
                batch.append(item)
            if len(batch) >= batch_items:
                break
            try:
                item = inbox.get_nowait()
            except queue_mod.Empty:
                break
        if batch:
            workers[turn % len(workers)].put(batch)
            turn += 1
    for w in workers:
        w.put(STOP)


def _worker(work, results: list) -> None:
    while True:
        batch = work.get()
        if batch is STOP:
            return
        for item_id, sent, _tokens in batch:
            results[item_id >> 40].put((item_id, sent, np.uint32(item_id & 0xFFFF)))


def run(items_per_producer: int = 20_000, *, producers: int = 2, workers: int = 2, tokens: int = 256,
        batch_items: int = 64) -> dict:
    """Items per second through the pipeline, and submit-to-result latency, all items checked back."""
    ctx = mp.get_context("fork")
    inbox = ctx.Queue()
    work = [ctx.Queue() for _ in range(workers)]
    results = [ctx.Queue() for _ in range(producers)]
    report = ctx.Queue()
    procs = [ctx.Process(target=_dispatcher, args=(inbox, work, producers, batch_items), daemon=True)]
    procs += [ctx.Process(target=_worker, args=(w, results), daemon=True) for w in work]
    for p in procs:
        p.start()
    t0 = time.perf_counter()
    prods = [ctx.Process(target=_producer, args=(i, items_per_producer, tokens, inbox, results[i], report),
                         daemon=True) for i in range(producers)]
    for p in prods:
        p.start()
    latencies = []
    deadline = time.monotonic() + 300
    while len(latencies) < producers:
        try:
            latencies.append(report.get(timeout=0.5)[1])
        except queue_mod.Empty:
            dead = [p.exitcode for p in prods + procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                for p in prods + procs:
                    p.kill()
                raise RuntimeError(f"the queue pipeline failed (exit codes {dead})") from None
    seconds = time.perf_counter() - t0
    for p in prods + procs:
        p.join(timeout=30)
    lat = np.concatenate(latencies) / 1000.0
    total = producers * items_per_producer
    assert lat.size == total, "every item comes back exactly once"
    return {"mpqueue_items_per_s": round(total / seconds, 1),
            "mpqueue_submit_to_result_us_p50": round(float(np.percentile(lat, 50)), 1),
            "mpqueue_submit_to_result_us_p99": round(float(np.percentile(lat, 99)), 1),
            "mpqueue_items": total}
