"""The demo's load: the generator's workload (default model only) and the two forked producers that
submit it and check every result (`chat` one item at a time, `batch` with `submit_many`).
"""

from __future__ import annotations

import time

import numpy as np

CHUNK = 256  # items per submit_many call of the `batch` producer
DRAIN_EVERY = 64  # `chat` reads its results every this many submits
RESULTS_SECONDS = 600.0


def workload(items: int, seed: int, max_new_tokens: int | None = None):
    """The generator's workload, default model only: a consumer without a model name serves model id 0.
    `max_new_tokens`: every item's (None: the generator's own output lengths, per item)."""
    from ..workloads.synthetic import Workload, generate

    wl = generate(items, seed=seed)
    if max_new_tokens is not None:
        wl.max_new_tokens = np.full(len(wl), max_new_tokens, np.int64)
    keep = np.flatnonzero(wl.models == 0)
    if keep.size == len(wl):
        return wl
    lengths = wl.lengths[keep]
    offsets = np.zeros(keep.size + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    tokens = np.concatenate([wl.item(int(i)) for i in keep])
    return Workload(tokens, offsets, wl.arrivals[keep], wl.max_new_tokens[keep], wl.prefix_lens[keep],
                    wl.models[keep], f"{wl.name}, default model")


# -- the producers (forked) ---------------------------------------------------------------


def producer(name: str, data_dir: str, wl, rows: np.ndarray, bulk: bool, conn) -> None:
    from ..client.producer import Producer

    max_new = wl.max_new_tokens[rows]
    prefixes = wl.prefix_lens[rows]
    got_ids: list[int] = []
    got_tokens: list[np.ndarray] = []
    not_ok = 0

    seen: set[int] = set()

    def drain(timeout_seconds: float) -> None:
        nonlocal not_ok
        for r in p.results(timeout_seconds):
            seen.add(r.item_id)
            got_ids.append(r.item_id)
            got_tokens.append(r.tokens)
            not_ok += r.status != "ok"

    n = rows.size
    ids = np.empty(n, np.uint64)
    with Producer(name, data_dir=data_dir) as p:
        conn.send("ready")
        conn.recv()
        t0 = time.monotonic()
        if bulk:
            for lo in range(0, n, CHUNK):
                hi = min(lo + CHUNK, n)
                part = [wl.item(int(i)) for i in rows[lo:hi]]
                offsets = np.zeros(hi - lo + 1, np.int64)
                np.cumsum([t.size for t in part], out=offsets[1:])
                ids[lo:hi] = p.submit_many(np.concatenate(part), offsets, max_new_tokens=max_new[lo:hi],
                                           prefix_len=prefixes[lo:hi])
                drain(0.0)
        else:
            for k, i in enumerate(rows.tolist()):
                ids[k] = p.submit(wl.item(i), max_new_tokens=int(max_new[k]), prefix_len=int(prefixes[k]) or None)
                if k % DRAIN_EVERY == DRAIN_EVERY - 1:
                    drain(0.0)
        submitted = time.monotonic()
        deadline = submitted + RESULTS_SECONDS
        while len(seen) < n and time.monotonic() < deadline:
            drain(0.2)
        t1 = time.monotonic()
    from ..engines.sim import Sim

    digests = np.array([Sim.digest(wl.item(int(i))) for i in rows.tolist()], np.uint32)  # after the clock stops
    conn.send({"start": t0, "submitted": submitted, "end": t1,
               **check(ids, max_new, digests, np.array(got_ids, np.uint64), got_tokens, not_ok),
               "tokens": int(wl.lengths[rows].sum()), "output_tokens": int(sum(t.size for t in got_tokens))})


def check(ids: np.ndarray, max_new: np.ndarray, digests: np.ndarray, got: np.ndarray, tokens: list[np.ndarray],
           not_ok: int) -> dict:
    """Every submitted id exactly once, ok, with the simulated engine's tokens for it (`digests`: each submitted
    prompt's `Sim.digest`)."""
    from ..engines.sim import Sim

    order = np.argsort(ids)
    sorted_ids = ids[order]
    pos = np.minimum(np.searchsorted(sorted_ids, got), max(0, ids.size - 1))
    mine = sorted_ids[pos] == got if ids.size else np.zeros(got.size, bool)
    unique, counts = np.unique(got[mine], return_counts=True)
    expected = Sim.generated_many(got[mine], max_new[order][pos[mine]], digests[order][pos[mine]])
    mismatched = 0
    k = 0
    for j in np.flatnonzero(mine).tolist():
        want = expected.flat[expected.offsets[k] : expected.offsets[k + 1]]
        mismatched += not np.array_equal(tokens[j], want)
        k += 1
    out = {
        "items": int(ids.size), "results": int(got.size), "missing": int(ids.size - unique.size),
        "duplicates": int((counts - 1).sum()), "foreign": int((~mine).sum()), "not_ok": int(not_ok),
        "token_mismatches": int(mismatched),
    }
    out["verified"] = out["missing"] == out["duplicates"] == out["foreign"] == out["not_ok"] == mismatched == 0
    return out


def recv(conn, proc, timeout_seconds: float):
    deadline = time.monotonic() + timeout_seconds
    while not conn.poll(0.2):
        if proc.exitcode is not None:
            raise RuntimeError(f"producer {proc.name} exited with {proc.exitcode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"producer {proc.name}: nothing for {timeout_seconds:.0f} s")
    return conn.recv()
