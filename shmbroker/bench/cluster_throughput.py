"""`shmbroker bench cluster`'s throughput: RemoteProducer.submit_many against a plain nats-py loop.

One local NATS server (started here, stopped in a finally), the cluster's streams, and the same
items (the Mooncake conversation trace's first `num_items`, or the seeded generator's) published
both ways, interleaved (raw, client, raw, client, ...), the prompts stream purged between repeats.

The raw side is nats-py's own pipelined JetStream publish: `js.publish_async` (one future per
message, PubAck awaited; nats-py bounds the futures in flight) with the same subjects, payloads
(`encode_prompt`, built inside the timing) and headers (`prompt_headers`). It does what the
client must do on the wire and nothing else: no checks, no sequence block, no per-item partition.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time

import numpy as np

from ..cluster.subjects import ClusterNames, StreamSettings, encode_prompt, prompt_headers

RAW_PRODUCER = "bench-raw"
DEADLINE_SECONDS = 120.0


async def _raw(url: str, names: ClusterNames, settings: StreamSettings, items: list, subjects: list,
               first_seq: int) -> tuple[float, int]:
    """Seconds the raw loop took, and the stream's messages after it (then purged)."""
    import nats

    from ..cluster import streams

    nc = await nats.connect(url, connect_timeout=5)
    try:
        js = nc.jetstream()
        await streams.ensure_streams(js, names, settings, update=False)
        t0 = time.perf_counter()
        futures = [await js.publish_async(subject, encode_prompt(tokens, first_seq + i, 1, None),
                                          headers=prompt_headers(RAW_PRODUCER, first_seq + i, None))
                   for i, (subject, tokens) in enumerate(zip(subjects, items))]
        await asyncio.wait_for(asyncio.gather(*futures), DEADLINE_SECONDS)
        seconds = time.perf_counter() - t0
        stored = (await js.stream_info(names.prompts_stream)).state.messages
        await js.purge_stream(names.prompts_stream)
        return seconds, stored
    finally:
        await nc.close()


async def _count_and_purge(url: str, names: ClusterNames) -> int:
    import nats

    nc = await nats.connect(url, connect_timeout=5)
    try:
        js = nc.jetstream()
        stored = (await js.stream_info(names.prompts_stream)).state.messages
        await js.purge_stream(names.prompts_stream)
        return stored
    finally:
        await nc.close()


def _workload(num_items: int, seed: int, trace: str | None):
    from .affinity import TRACE
    from .pack import workload_for

    if trace is None and TRACE.exists():
        trace = str(TRACE)
    wl = workload_for(trace, 1.0 if trace else max(num_items / 20000, 0.001), seed)  # then the first num_items
    count = min(num_items, len(wl))
    offsets = np.asarray(wl.offsets[:count + 1], np.int64)
    flat = np.ascontiguousarray(wl.tokens[offsets[0]:offsets[-1]], np.uint32)
    return wl.name, flat, offsets - offsets[0]


def run(num_items: int = 20000, seed: int = 0, num_repeats: int = 3, trace: str | None = None) -> dict:
    from ..cluster.partition import partitions_of
    from ..cluster.remote import RemoteProducer
    from ..cluster.servers import NatsServers

    name, flat, offsets = _workload(num_items, seed, trace)
    count = offsets.size - 1
    names, settings = ClusterNames(), StreamSettings()
    parts = partitions_of(flat, offsets, None, None, names.num_partitions)
    subjects = [names.prompt_subject(int(p)) for p in parts]
    items = [flat[a:b] for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())]
    repeats = []
    tmp = tempfile.TemporaryDirectory(prefix="shmb-tput-")
    servers = NatsServers.start(1, base_dir=tmp.name)
    try:
        url = servers.urls[0]
        with RemoteProducer("bench-client", servers=url) as producer:
            for r in range(num_repeats):
                raw_seconds, raw_stored = asyncio.run(_raw(url, names, settings, items, subjects, 1 + r * count))
                t0 = time.perf_counter()
                producer.submit_many(flat, offsets, max_new_tokens=1, timeout_seconds=DEADLINE_SECONDS)
                many_seconds = time.perf_counter() - t0
                many_stored = asyncio.run(_count_and_purge(url, names))
                t0 = time.perf_counter()
                for tokens in items:
                    producer.submit(tokens, max_new_tokens=1, timeout_seconds=DEADLINE_SECONDS)
                one_seconds = time.perf_counter() - t0
                one_stored = asyncio.run(_count_and_purge(url, names))
                repeats.append({"raw_publish_items_per_s": round(count / raw_seconds, 1),
                                "remote_submit_items_per_s": round(count / many_seconds, 1),
                                "remote_submit_one_items_per_s": round(count / one_seconds, 1),
                                "client_vs_raw": round(raw_seconds / many_seconds, 4),  # this pair's
                                "stored": {"raw": raw_stored, "submit_many": many_stored, "submit": one_stored}})
    finally:
        servers.stop()
        tmp.cleanup()
    median = {k: round(statistics.median(r[k] for r in repeats), 1)
              for k in ("raw_publish_items_per_s", "remote_submit_items_per_s", "remote_submit_one_items_per_s")}
    return {**median,
            "client_vs_raw": round(median["remote_submit_items_per_s"] / median["raw_publish_items_per_s"], 4),
            "throughput": {"workload": name, "items": count, "tokens_per_item": round(flat.size / max(count, 1), 1),
                           "num_repeats": num_repeats, "servers": 1, "raw": "js.publish_async, PubAcks awaited",
                           "repeats": repeats}}
