"""`shmbroker bench e2e`: the whole broker, in processes, against a `multiprocessing.Queue` pipeline.

The broker runs as `shmbroker supervise` does (a subprocess: supervisor, ingest, scheduler,
results, one GPU process per consumer of the default configuration) on a fresh data directory,
with the default fsync policy and the simulated engine in zero-cost mode (it returns at once, so
the broker is what is measured). Two producer processes each submit `items` 256-token items
(`submit_many` in chunks of CHUNK) while they read their results (`take_results`); every item
must come back exactly once with an ok status. With `--options` every item carries SHARED_OPTIONS
(one set of request options, as a job's items do): what carrying them costs. With `--schema` the
runs that would be observed instead carry, besides, a reference to one JSON schema (SHARED_SCHEMA,
stored once as a payload and read once by the GPU process): `schema_items_per_s` and
`schema_vs_plain` against the plain runs, alternated in the same run. With `--embed DIMS` those
runs are embeddings instead: the consumers embed (`task = "embed"`, zero-cost vectors of DIMS
float32 values), the items ask for vectors (max_new_tokens 0), and each result carries DIMS words
through the results ring, the results log and the producer's ring: `embed_items_per_s` and
`embed_vs_plain`. Figures:

- items_per_s, tokens_per_s: items over the time from the first submit to the last result;
- submit_to_result_us_p50/p99: from the submit call that sent an item to its result's arrival;
- disk_write_bytes_per_s: the disk's sequential write bandwidth, measured in the same run
  (DISK_PROBE_BYTES written in 4 MiB pieces, fdatasync every 16 MiB, as the backlog does);
  disk_bound_items_per_s: that over the bytes one item costs on disk (its backlog record and its
  result record), so a reader sees which limit holds;
- mpqueue_items_per_s: the same pipeline shape (producers -> one dispatcher -> two workers ->
  results) on `multiprocessing.Queue` (`mpqueue.py`), in the same run;
- observed_items_per_s, observed_vs_plain: the cost of watching. After one uncounted warm-up run
  the broker runs `2 × pairs` times on fresh data directories, in the order plain, observed,
  observed, plain, ... (so a drift of the machine falls on both alike); an observed run has its
  Prometheus exporter scraped every second (`Observer`) and `shmbroker top` attached in a
  pseudo-terminal the whole time (both started before the clock).
  items_per_s and the latencies are the median plain run's; observed_items_per_s the median
  observed run's; observed_vs_plain their ratio (the target: at least 0.95);
- exported_tokens, exported_tokens_match: the consumers' input tokens on the exporter's last
  scrape of the last observed run, against what the producers sent (items × tokens_per_item).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from ..request.options import encode, parse_options
from ..ring.wire import res_bytes
from ..spill.layout import record_bytes
from . import mpqueue
from .broker import ZERO_COST_CONSUMERS, BenchBroker
from .observer import Observer

TOKENS = 256
CHUNK = 1024
MAX_NEW_TOKENS = 1
# `--options`: what every item carries (a job's usual set; the zero-cost engine honours and ignores it)
SHARED_OPTIONS = {"temperature": 0.7, "top_p": 0.95, "seed": 1234, "stop_token_ids": [2]}
# `--schema`: every item references one JSON schema (a payload stored once; the engine reads it once)
SHARED_SCHEMA = {"response_format": {"type": "json_schema", "json_schema": {"name": "record", "strict": True, "schema": {
    "type": "object", "additionalProperties": False, "required": [f"field{k}" for k in range(24)],
    "properties": {f"field{k}": {"type": "string", "description": f"the record's field number {k}"} for k in range(24)}}}}}
DISK_PROBE_BYTES = 256 << 20
# what an observed run adds (`Observer.finish`); reported from the last observed run
OBSERVER_FIELDS = ("scrapes", "scrape_seconds_max", "top_bytes", "exported_tokens", "exported_tokens_match",
                   "watch_cpu_seconds", "watch_cpu_share")

def embedding_consumers(dims: int) -> str:
    """The zero-cost consumers, embedding: each result a vector of `dims` float32 values."""
    return ZERO_COST_CONSUMERS.replace("zero_cost = true }", f'zero_cost = true, task = "embed", embed_dimensions = {dims} }}')


def _producer(index: int, data_dir: str, items: int, conn, options: dict | None = None,
              max_new: int = MAX_NEW_TOKENS) -> None:
    from ..client.producer import Producer
    from ..ring.items import SEQ_MASK

    rng = np.random.default_rng(index)
    prefixes = rng.integers(0, 32_000, size=(64, 64), dtype=np.uint32)
    flat = np.empty(CHUNK * TOKENS, np.uint32)
    rows = flat.reshape(CHUNK, TOKENS)
    rows[:, 64:] = rng.integers(0, 32_000, size=(CHUNK, TOKENS - 64), dtype=np.uint32)
    offsets = np.arange(CHUNK + 1, dtype=np.int64) * TOKENS
    sent_ns = np.zeros(items, np.int64)
    latency_ns = np.zeros(items, np.int64)
    got = 0
    from ..supervisor.warmup import warm_rings

    warm_rings()  # the client's kernels in memory before the clock starts, as the broker's are
    with Producer(f"bench{index}", data_dir=data_dir) as p:
        conn.send("ready")
        conn.recv()
        base = p.next_item_id & ~SEQ_MASK
        t0 = time.perf_counter_ns()
        done = 0
        while done < items or got < items:
            if done < items:
                n = min(CHUNK, items - done)
                rows[:n, :64] = prefixes[(done // CHUNK + np.arange(n)) % 64]
                now = time.perf_counter_ns()
                p.submit_many(flat[: n * TOKENS], offsets[: n + 1], max_new_tokens=max_new, options=options)
                sent_ns[done : done + n] = now
                done += n
            while True:
                batch = p.take_results(0.0 if done < items else 0.05)
                if len(batch) == 0:
                    break
                k = (batch.item_ids - np.uint64(base)).astype(np.int64)
                if (k < 0).any() or (k >= items).any() or (batch.status != 0).any():
                    raise AssertionError("a foreign or failed result")
                latency_ns[k] = time.perf_counter_ns() - sent_ns[k]
                got += len(batch)
            if done >= items and time.perf_counter_ns() - t0 > 600e9:
                raise TimeoutError(f"producer {index}: {got} of {items} results after 600 s")
        t1 = time.perf_counter_ns()
    conn.send((t0, t1, latency_ns))


def disk_write_bandwidth(directory: str, total: int = DISK_PROBE_BYTES) -> float:
    """Bytes per second of sequential writes with an fdatasync every 16 MiB."""
    path = Path(directory) / "disk-probe"
    chunk = np.random.default_rng(0).integers(0, 255, size=4 << 20, dtype=np.uint8)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        written = 0
        while written < total:
            written += os.write(fd, chunk)
            if written % (16 << 20) == 0:
                os.fdatasync(fd)
        os.fdatasync(fd)
        seconds = time.perf_counter() - t0
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    return written / seconds


def run(items_per_producer: int = 500_000, *, mpqueue_items: int = 40_000, scale: float = 1.0,
        data_dir: str | None = None, pairs: int = 4, options: bool = False, schema: bool = False,
        embed: int = 0) -> dict:
    items = max(CHUNK, int(items_per_producer * scale))
    shared = SHARED_OPTIONS if options else None
    if embed and (options or schema):
        raise ValueError("--embed runs embeddings, which take no generation option: not with --options or --schema")
    # the runs of the second kind: observed, or with `schema` the same items referencing SHARED_SCHEMA, or
    # with `embed` embeddings
    second = {**(shared or {}), **SHARED_SCHEMA} if schema else {"embed": True} if embed else shared
    variant = {"config": embedding_consumers(embed), "max_new": 0} if embed else {}
    tmp = tempfile.mkdtemp(prefix="shmb-e2e-", dir=data_dir)
    try:
        disk_bw = disk_write_bandwidth(tmp, int(DISK_PROBE_BYTES * min(1.0, max(scale, 0.125))))
        runs: dict[bool, list] = {False: [], True: []}
        warm = os.path.join(tmp, "warm")
        os.mkdir(warm, 0o700)
        _run_broker(warm, max(CHUNK, items // 4), options=shared)  # not counted: a first run in a fresh process is slower
        shutil.rmtree(warm, ignore_errors=True)
        for k in range(2 * pairs):
            observed = k % 4 in (1, 2)  # plain, observed, observed, plain, ...
            run_dir = os.path.join(tmp, f"run{k}")
            os.mkdir(run_dir, 0o700)
            runs[observed].append(_run_broker(run_dir, items, observe=observed and not (schema or embed),
                                              options=second if observed else shared, **(variant if observed else {})))
            shutil.rmtree(run_dir, ignore_errors=True)
        out = _median_run(runs[False])
        watched = _median_run(runs[True])
        out["plain_runs_items_per_s"] = [r["items_per_s"] for r in runs[False]]
        out["observed_runs_items_per_s"] = [r["items_per_s"] for r in runs[True]]
        if schema:  # the second kind's runs were the schema's, not observed
            out["schema_runs_items_per_s"] = out.pop("observed_runs_items_per_s")
            out["schema_items_per_s"] = watched["items_per_s"]
            out["schema_vs_plain"] = round(watched["items_per_s"] / out["items_per_s"], 3)
            out["schema_option_words"] = int(encode(parse_options(second)).size)
        elif embed:
            out["embed_runs_items_per_s"] = out.pop("observed_runs_items_per_s")
            out["embed_items_per_s"] = watched["items_per_s"]
            out["embed_vs_plain"] = round(watched["items_per_s"] / out["items_per_s"], 3)
            out["embed_dimensions"] = embed
            out["embed_result_bytes_per_item"] = res_bytes(embed, 0, 2)
        else:
            out["observed_items_per_s"] = watched["items_per_s"]
            out["observed_vs_plain"] = round(watched["items_per_s"] / out["items_per_s"], 3)
            last = runs[True][-1]
            out.update({key: last[key] for key in OBSERVER_FIELDS})
        out["options"] = shared
        out["disk_write_bytes_per_s"] = round(disk_bw, 1)
        option_words = encode(parse_options(shared)).size if shared else 0
        per_item = record_bytes(TOKENS + option_words) + res_bytes(MAX_NEW_TOKENS)
        out["disk_bytes_per_item"] = per_item
        out["disk_bound_items_per_s"] = round(disk_bw / per_item, 1)
        base = mpqueue.run(max(1000, int(mpqueue_items * scale)) // 2)
        out.update(base)
        out["vs_mpqueue"] = round(out["items_per_s"] / base["mpqueue_items_per_s"], 2)
        return out
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _median_run(runs: list[dict]) -> dict:
    by_speed = sorted(runs, key=lambda r: r["items_per_s"])
    out = dict(by_speed[(len(by_speed) - 1) // 2])
    out["items_per_s"] = round(statistics.median(r["items_per_s"] for r in runs), 1)
    out["tokens_per_s"] = round(out["items_per_s"] * TOKENS, 1)
    for key in OBSERVER_FIELDS:
        out.pop(key, None)
    return out


def _run_broker(tmp: str, items: int, *, observe: bool = False, options: dict | None = None,
                config: str = ZERO_COST_CONSUMERS, max_new: int = MAX_NEW_TOKENS) -> dict:
    broker = BenchBroker(tmp, f'instance = "e2e{os.getpid()}"\n' + config)
    data = broker.data_dir
    ctx = mp.get_context("fork")
    procs, conns = [], []
    observer = None
    try:
        broker.wait_ready()
        for i in range(2):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_producer, args=(i, data, items, child, options, max_new), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(parent)
        for c in conns:
            if not c.poll(60):
                raise RuntimeError("a producer did not connect")
            c.recv()
        if observe:  # after the producers forked: they inherit neither its threads nor its terminal
            observer = Observer(data)
            observer.wait_attached()  # top started, drew, and the exporter answered: then the clock
        for c in conns:
            c.send("go")
        reports = []
        for c, proc in zip(conns, procs):
            while not c.poll(1.0):
                if proc.exitcode not in (None, 0):
                    raise RuntimeError(f"producer exited with {proc.exitcode}")
            reports.append(c.recv())
        t0 = min(r[0] for r in reports)
        t1 = max(r[1] for r in reports)
        seconds = (t1 - t0) / 1e9
        lat = np.concatenate([r[2] for r in reports]) / 1000.0
        total = 2 * items
        watched = observer.finish(total * TOKENS) if observer is not None else {}
        return {
            **watched,
            "items_per_s": round(total / seconds, 1),
            "tokens_per_s": round(total * TOKENS / seconds, 1),
            "submit_to_result_us_p50": round(float(np.percentile(lat, 50)), 1),
            "submit_to_result_us_p99": round(float(np.percentile(lat, 99)), 1),
            "items": total,
            "seconds": round(seconds, 3),
            "tokens_per_item": TOKENS,
        }
    finally:
        if observer is not None:
            observer.close()
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        broker.stop()
