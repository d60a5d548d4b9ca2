"""`shmbroker demo`: a broker-side ring owner and two producer processes, a seeded workload, throughput.

The broker side (this process) owns the shared memory and the registry socket
in the data directory, drains every producer's ring zero-copy and appends
each batch to the durable backlog on disk (fsync=interval) before releasing
it from the ring. Two forked producers connect like any client would: `chat`
submits short prompts one call at a time, `batch` submits long prompts with
shared prefixes in bulk. Every item is checked on arrival (order, count,
checksum against the producer's own digest). Then the backlog is reopened as
after a restart (recovery from segment headers), every recovered item's
tokens are checked against the producers' digests, and the backlog is
drained (acked, reclaimed). Later work adds the scheduler and GPU consumers.
"""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np

from . import config
from .ingest import BacklogAppender, RingSet, pump
from .registry import Registry
from .ring.digest import DeliveryCheck, digest_tokens, expected_digest
from .ring.owner import Owner
from .spill.store import Backlog

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
    backlog, _ = Backlog.open(data_dir)
    leftover = {int(i) for i in backlog.pending()["item_id"]}  # an earlier run's undrained items
    writer = backlog.writer(0, fsync="interval")
    appender = BacklogAppender(writer)
    ctx = mp.get_context("fork")
    procs, conns = {}, {}
    try:
        for name, target, n in (("chat", _chat, chat_items), ("batch", _batch, batch_items)):
            parent, child = ctx.Pipe()
            procs[name] = ctx.Process(target=target, args=(data_dir, n, child), name=f"demo-{name}")
            conns[name] = parent
            procs[name].start()
        expected = {"chat": chat_items, "batch": batch_items}
        got: dict[str, DeliveryCheck] = {}
        ends: dict[str, float] = {}

        def on_records(entry, ring, positions, n):
            check = got.get(entry.name) or got.setdefault(entry.name, DeliveryCheck(ring))
            check(positions, n)
            appender(entry, ring, positions, n)  # durable before drain_once releases the ring
            if check.next_key == expected[entry.name]:
                ends[entry.name] = time.monotonic()

        deadline = time.monotonic() + 600
        while len(ends) < len(expected):
            if time.monotonic() > deadline:
                raise TimeoutError("demo did not finish within 600 s")
            if pump(rings, registry, on_records) == 0:
                for name, proc in procs.items():
                    if proc.exitcode not in (None, 0):
                        raise RuntimeError(f"producer {name} exited with {proc.exitcode}")
        report = {}
        for name, conn in conns.items():
            start, _submitted, digest = conn.recv()
            acc = got[name].acc
            if not np.array_equal(acc, digest):
                raise AssertionError(f"producer {name}: checksum mismatch")
            seconds = ends[name] - start
            report[name] = {
                "items": int(acc[0]),
                "tokens": int(acc[1]),
                "seconds": seconds,
                "items_per_s": int(acc[0]) / seconds,
                "tokens_per_s": int(acc[1]) / seconds,
                "verified": True,
            }
        for proc in procs.values():
            proc.join(30)
        writer.close()
        backlog.close()
        report["backlog"] = _reopen_and_drain(data_dir, sum(check.acc for check in got.values()), leftover)
        return report
    finally:
        writer.close()
        backlog.close()
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
                proc.join()
        rings.close()
        registry.close()
        owner.close()


def _reopen_and_drain(data_dir: str, expected: np.ndarray, leftover: set[int]) -> dict:
    """Recover the backlog as after a restart, check every item's tokens, then ack and reclaim it all."""
    backlog, rep = Backlog.open(data_dir)
    try:
        pending = backlog.pending()
        mine = pending[~np.isin(pending["item_id"], np.fromiter(leftover, np.uint64, len(leftover)))]
        acc = np.zeros(4, np.uint64)
        for row in mine:
            digest_tokens(backlog.tokens(row), acc)
        if not np.array_equal(acc, expected):
            raise AssertionError(f"recovered backlog digest {acc.tolist()} != producers' {expected.tolist()}")
        disk_before = backlog.disk_bytes()
        for writer in np.unique(pending["writer"]):
            backlog.ack(int(writer), pending["seq"][pending["writer"] == writer])
        backlog.save_acks()
        backlog.reclaim()
        return {
            "recovered_items": int(mine.size),
            "recovered_tokens": int(acc[1]),
            "recovery_seconds": rep.seconds,
            "disk_bytes_before_drain": disk_before,
            "disk_bytes_after_drain": backlog.disk_bytes(),
            "verified": True,
        }
    finally:
        backlog.close()


def main(data_dir: str | None = None) -> None:
    t0 = time.monotonic()
    report = run(data_dir)
    print("shmbroker demo: two producers -> shared-memory rings -> broker side (every item verified)")
    print(f"{'producer':<10}{'items':>10}{'tokens':>14}{'seconds':>9}{'items/s':>12}{'tokens/s':>14}")
    b = report.pop("backlog")
    for name, r in report.items():
        print(f"{name:<10}{r['items']:>10,}{r['tokens']:>14,}{r['seconds']:>9.2f}{r['items_per_s']:>12,.0f}{r['tokens_per_s']:>14,.0f}")
    print(
        f"backlog: reopened as after a restart in {b['recovery_seconds'] * 1e3:.1f} ms: {b['recovered_items']:,} items, "
        f"{b['recovered_tokens']:,} tokens, every token verified; drained: {b['disk_bytes_before_drain'] / 2**20:.1f} MiB "
        f"-> {b['disk_bytes_after_drain'] / 2**20:.1f} MiB on disk"
    )
    print(f"total wall time {time.monotonic() - t0:.2f} s")
