"""`shmbroker demo`: a broker-side ring owner and two producer processes, a seeded workload, throughput.

The broker side (this process) owns the shared memory and the registry socket
in the data directory and drains every producer's ring zero-copy. Two forked
producers connect like any client would: `chat` submits short prompts one call
at a time, `batch` submits long prompts with shared prefixes in bulk. Every
item is checked on arrival (order, count, checksum against the producer's own
digest) and the throughput of each is printed. Later work turns this into the
full broker (backlog, scheduler, GPU consumers).
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from . import config
from .ingest import RingSet
from .registry import Registry
from .ring.digest import OUT_OF_ORDER, digest_records, expected_digest
from .ring.layout import HEADER_BYTES
from .ring.owner import Owner

SEED = 7


def chat_workload(num_items: int, seed: int = SEED) -> list[np.ndarray]:
    """Short prompts, 16-256 tokens, one per call."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 257, size=num_items)
    return [rng.integers(0, 128_000, size=int(n), dtype=np.uint32) for n in lengths]


def batch_workload(num_items: int, seed: int = SEED + 1) -> tuple[np.ndarray, np.ndarray]:
    """Long prompts (log-normal, 64-8192 tokens) behind one of 16 shared 512-token prefixes."""
    rng = np.random.default_rng(seed)
    prefixes = rng.integers(0, 128_000, size=(16, 512), dtype=np.uint32)
    suffix = np.clip(rng.lognormal(6.5, 1.0, size=num_items).astype(np.int64), 64, 7680)
    offsets = np.zeros(num_items + 1, np.int64)
    offsets[1:] = np.cumsum(suffix + 512)
    flat = np.empty(int(offsets[-1]), np.uint32)
    for i in range(num_items):
        lo = offsets[i]
        flat[lo : lo + 512] = prefixes[i % 16]
        flat[lo + 512 : offsets[i + 1]] = rng.integers(0, 128_000, size=int(suffix[i]), dtype=np.uint32)
    return flat, offsets


def _chat(data_dir: str, num_items: int, conn) -> None:
    from .client import Producer

    items = chat_workload(num_items)
    with Producer("chat", data_dir=data_dir) as p:
        start = time.monotonic()
        for item in items:
            p.submit(item, max_new_tokens=128)
        conn.send((start, time.monotonic(), expected_digest(items)))


def _batch(data_dir: str, num_items: int, conn) -> None:
    from .client import Producer

    flat, offsets = batch_workload(num_items)
    rows = [flat[offsets[i] : offsets[i + 1]] for i in range(num_items)]
    with Producer("batch", data_dir=data_dir) as p:
        start = time.monotonic()
        for lo in range(0, num_items, 256):
            hi = min(lo + 256, num_items)
            p.submit_many(flat[offsets[lo] : offsets[hi]], offsets[lo : hi + 1] - offsets[lo], max_new_tokens=256, prefix_len=512)
        conn.send((start, time.monotonic(), expected_digest(rows)))


def run(data_dir: str | None = None, chat_items: int = 200_000, batch_items: int = 20_000) -> dict:
    data_dir = config.data_dir(data_dir)
    owner = Owner(data_dir, "demo")
    registry = Registry(owner, data_dir)
    registry.start()
    rings = RingSet(registry.ingest_bell)
    ctx = mp.get_context("fork")
    procs, conns = {}, {}
    try:
        for name, target, n in (("chat", _chat, chat_items), ("batch", _batch, batch_items)):
            parent, child = ctx.Pipe()
            procs[name] = ctx.Process(target=target, args=(data_dir, n, child), name=f"demo-{name}")
            conns[name] = parent
            procs[name].start()
        expected = {"chat": chat_items, "batch": batch_items}
        got: dict[str, dict] = {}

        def on_records(entry, ring, positions, n):
            st = got.get(entry.name)
            if st is None:
                st = got[entry.name] = {
                    "words": ring.data_words,
                    "words64": ring.buf[HEADER_BYTES:].view(np.uint64),
                    "next_key": 0,
                    "acc": np.zeros(4, np.uint64),
                }
            nxt = digest_records(st["words"], st["words64"], positions, n, st["next_key"], st["acc"])
            if nxt == OUT_OF_ORDER:
                raise AssertionError(f"producer {entry.name}: items out of order")
            st["next_key"] = nxt
            if nxt == expected[entry.name]:
                st["end"] = time.monotonic()

        deadline = time.monotonic() + 600
        while not all(got.get(k, {}).get("next_key") == v for k, v in expected.items()):
            if time.monotonic() > deadline:
                raise TimeoutError("demo did not finish within 600 s")
            rings.refresh(registry)
            if rings.drain_once(on_records) == 0:
                if rings.sources:
                    rings.wait(0.05)
                else:
                    time.sleep(0.005)
                for name, proc in procs.items():
                    if proc.exitcode not in (None, 0):
                        raise RuntimeError(f"producer {name} exited with {proc.exitcode}")
        report = {}
        for name, conn in conns.items():
            start, _submitted, digest = conn.recv()
            st = got[name]
            if not np.array_equal(st["acc"], digest):
                raise AssertionError(f"producer {name}: checksum mismatch")
            seconds = st["end"] - start
            report[name] = {
                "items": int(st["acc"][0]),
                "tokens": int(st["acc"][1]),
                "seconds": seconds,
                "items_per_s": int(st["acc"][0]) / seconds,
                "tokens_per_s": int(st["acc"][1]) / seconds,
                "verified": True,
            }
        for proc in procs.values():
            proc.join(30)
        return report
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
        rings.close()
        registry.close()
        owner.close()


def main(data_dir: str | None = None) -> None:
    t0 = time.monotonic()
    report = run(data_dir)
    print("shmbroker demo: two producers -> shared-memory rings -> broker side (every item verified)")
    print(f"{'producer':<10}{'items':>10}{'tokens':>14}{'seconds':>9}{'items/s':>12}{'tokens/s':>14}")
    for name, r in report.items():
        print(f"{name:<10}{r['items']:>10,}{r['tokens']:>14,}{r['seconds']:>9.2f}{r['items_per_s']:>12,.0f}{r['tokens_per_s']:>14,.0f}")
    print(f"total wall time {time.monotonic() - t0:.2f} s")
