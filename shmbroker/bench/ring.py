"""`shmbroker bench ring`: the producer data path against multiprocessing.Queue, in one run.

Two forked processes, a producer (the `Producer` client) and a broker side
(an `Owner`, the `Registry` and the ingest `RingSet`), run three phases:

- single: one `submit` per Python call, 16-token items;
- bulk:   `submit_many` of 512-token items, 256 per call;
- mpqueue: the single phase's items through a `multiprocessing.Queue`
  between the same two processes (the baseline).

The broker side checks every item it receives (count, in-order keys, and a
position-weighted checksum compared with the one computed from the seeded
workload), so the rates are of delivered, verified data. A rate is items over
the time from the producer's first submit to the broker's last check.
`memcpy_bytes_per_s` is a plain numpy copy of 256 MiB (the ceiling), and
`producer_attach_seconds` the wall time of a fresh interpreter that imports
shmbroker, connects and submits one item (numba cache warm).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from ..config.broker import BrokerConfig
from ..frontdoor.registry import Registry
from ..ingest.loop import RingSet
from ..ring.digest import DeliveryCheck, digest_tokens, expected_digest
from ..ring.owner import Owner

POOL_ITEMS = 1024
SINGLE_TOKENS = 16
BULK_TOKENS = 512
BULK_BATCH = 256
SEED = 20261129
WARMUP_ITEMS = 2  # one submit and one submit_many before the clock starts


def _pool(seed: int, rows: int, cols: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 17, size=(rows, cols), dtype=np.uint32)


def _plan(scale: float) -> dict:
    single = max(POOL_ITEMS, int(2_000_000 * scale) // POOL_ITEMS * POOL_ITEMS)
    bulk_calls = max(4, int(16_384 * scale))
    mpq = max(POOL_ITEMS, int(200_000 * scale) // POOL_ITEMS * POOL_ITEMS)
    return {"single": single, "bulk_calls": bulk_calls, "mpqueue": mpq}


def _broker_side(data_dir: str, conn, mpq, plan: dict) -> None:
    owner = Owner(data_dir, "bench")
    registry = Registry(owner, data_dir, ingest_ring_bytes=BrokerConfig.ingest_ring_bytes, result_ring_bytes=1 << 20,
                        retire_seconds=BrokerConfig.producer_retire_seconds)
    registry.start()
    rings = RingSet(registry.ingest_bell)
    try:
        conn.send("ready")
        while not rings.sources:
            rings.refresh(registry)
            time.sleep(0.001)
        check = DeliveryCheck(rings.sources[0].ring)
        acc = check.acc
        for phase, count in (("warmup", WARMUP_ITEMS), ("single", plan["single"]), ("bulk", plan["bulk_calls"] * BULK_BATCH)):
            acc[:] = 0
            target = check.next_key + count
            while check.next_key < target:
                # never fold the next phase's items into this phase's digest
                if rings.drain_once(lambda entry, ring, positions, n: check(positions, n), target - check.next_key) == 0:
                    rings.wait(1.0)
            if phase != "warmup":
                conn.send((phase, time.monotonic(), acc.copy()))
        acc[:] = 0
        for _ in range(plan["mpqueue"]):
            digest_tokens(mpq.get(timeout=60), acc)
        conn.send(("mpqueue", time.monotonic(), acc.copy()))
        conn.recv()  # the producer is done and detached
    finally:
        rings.close()
        registry.close()
        owner.close()


def _producer_side(data_dir: str, conn, mpq, plan: dict) -> None:
    from ..client.producer import Producer

    single = _pool(SEED, POOL_ITEMS, SINGLE_TOKENS)
    items = [single[i] for i in range(POOL_ITEMS)]
    bulk = _pool(SEED + 1, BULK_BATCH, BULK_TOKENS).reshape(-1)
    offsets = np.arange(0, bulk.size + 1, BULK_TOKENS, dtype=np.int64)
    with Producer("bench", data_dir=data_dir, timeout_seconds=30.0) as p:
        p.submit(items[0], max_new_tokens=1)  # load the kernel before the clock starts
        p.submit_many(bulk[:BULK_TOKENS], offsets[:2], max_new_tokens=1)
        conn.recv()  # go
        submit = p.submit
        start = time.monotonic()
        for _ in range(plan["single"] // POOL_ITEMS):
            for item in items:
                submit(item, max_new_tokens=16)
        conn.send(("single", start))
        start = time.monotonic()
        for _ in range(plan["bulk_calls"]):
            p.submit_many(bulk, offsets, max_new_tokens=16)
        conn.send(("bulk", start))
        start = time.monotonic()
        for _ in range(plan["mpqueue"] // POOL_ITEMS):
            for item in items:
                mpq.put(item)
        conn.send(("mpqueue", start))


def _memcpy_bytes_per_s(nbytes: int = 256 << 20, repeats: int = 3) -> float:
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


_ATTACH_SCRIPT = """
import time, numpy as np
t0 = time.monotonic()
from shmbroker import Producer
with Producer("attach", data_dir={data_dir!r}) as p:
    p.submit(np.arange(16, dtype=np.uint32), max_new_tokens=1)
print(time.monotonic() - t0)
"""


def _attach_seconds(data_dir: str) -> float:
    """Wall time of a fresh interpreter: import, connect, first submit (cache warm)."""
    owner = Owner(data_dir, "attach")
    registry = Registry(owner, data_dir, ingest_ring_bytes=1 << 20, result_ring_bytes=1 << 16,
                        retire_seconds=BrokerConfig.producer_retire_seconds)
    registry.start()
    try:
        t0 = time.monotonic()
        out = subprocess.run(
            [sys.executable, "-c", _ATTACH_SCRIPT.format(data_dir=data_dir)],
            check=True, capture_output=True, text=True, timeout=120,
        )
        total = time.monotonic() - t0
        float(out.stdout.strip().splitlines()[-1])
        return total
    finally:
        registry.close()
        owner.close()


def run(scale: float = 1.0) -> dict:
    plan = _plan(scale)
    ctx = mp.get_context("fork")
    mpq = ctx.Queue(maxsize=65536)
    # A fixed data directory: a run killed half-way leaves its shared memory
    # listed in the manifest there, and the next run's Owner sweeps it.
    data_dir = os.path.join(tempfile.gettempdir(), f"shmbroker-bench-{os.getuid()}")
    b_conn, b_child = ctx.Pipe()
    p_conn, p_child = ctx.Pipe()
    broker = ctx.Process(target=_broker_side, args=(data_dir, b_child, mpq, plan), name="bench-broker")
    producer = ctx.Process(target=_producer_side, args=(data_dir, p_child, mpq, plan), name="bench-producer")
    broker.start()
    try:
        _recv(b_conn, broker, 60.0)  # "ready"
        producer.start()
        p_conn.send("go")
        starts, ends = {}, {}
        for _ in range(3):
            phase, start = _recv(p_conn, producer)
            starts[phase] = start
            phase, end, acc = _recv(b_conn, broker)
            ends[phase] = (end, acc)
        b_conn.send("done")
        producer.join(60)
        broker.join(60)
    finally:
        for proc in (producer, broker):
            if proc.pid is not None and proc.is_alive():
                proc.kill()
                proc.join()
    attach = _attach_seconds(data_dir)
    single_pool = _pool(SEED, POOL_ITEMS, SINGLE_TOKENS)
    bulk_rows = _pool(SEED + 1, BULK_BATCH, BULK_TOKENS)
    expect = {
        "single": expected_digest(single_pool, plan["single"] // POOL_ITEMS),
        "bulk": expected_digest(bulk_rows, plan["bulk_calls"]),
        "mpqueue": expected_digest(single_pool, plan["mpqueue"] // POOL_ITEMS),
    }
    secs = {}
    for phase in expect:
        end, acc = ends[phase]
        if not np.array_equal(acc, expect[phase]):
            raise AssertionError(f"{phase}: delivered digest {acc.tolist()} != expected {expect[phase].tolist()}")
        secs[phase] = end - starts[phase]
    bulk_items = plan["bulk_calls"] * BULK_BATCH
    memcpy = _memcpy_bytes_per_s()
    result = {
        "single_items_per_s": plan["single"] / secs["single"],
        "bulk_items_per_s": bulk_items / secs["bulk"],
        "bulk_tokens_per_s": bulk_items * BULK_TOKENS / secs["bulk"],
        "mpqueue_items_per_s": plan["mpqueue"] / secs["mpqueue"],
        "memcpy_bytes_per_s": memcpy,
        "producer_attach_seconds": attach,
        "single_items": plan["single"],
        "bulk_items": bulk_items,
        "mpqueue_items": plan["mpqueue"],
        "verified": True,
        "cpus": os.cpu_count(),
    }
    result["single_vs_mpqueue"] = result["single_items_per_s"] / result["mpqueue_items_per_s"]
    result["bulk_bytes_vs_memcpy"] = result["bulk_tokens_per_s"] * 4 / memcpy
    return result


def _recv(conn, proc, timeout_seconds: float = 120.0):
    deadline = time.monotonic() + timeout_seconds
    while not conn.poll(0.2):
        if not proc.is_alive():
            raise RuntimeError(f"{proc.name} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{proc.name} did not report within {timeout_seconds} s")
    return conn.recv()
