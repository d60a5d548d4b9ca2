"""A backlog twenty times the index, spread template-major, still meets in its prefix groups across a
SIGKILL of the scheduler and of the whole broker: every item's result comes once, and the card's
hit rate stays near what the same items written group by group reach."""

from __future__ import annotations

import time

import numpy as np
from support.brokerproc import serve

from shmbroker.client.producer import Producer
from shmbroker.observe.watch import BrokerView
from shmbroker.workloads.spread import spread

ITEMS = 3000
CONFIG = """
index_items = {index}
block_tokens = 64
ingest_ring_bytes = 8388608
segment_bytes = 16777216

[[consumers]]
name = "card"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 65536
engine_settings = {{ mode = "packed", cache_tokens = 262144, pace_seconds = 0.1 }}
"""


def _card(broker) -> dict:
    view = BrokerView.attach(broker.data_dir)
    try:
        return view.snapshot()["consumers"]["card"]
    finally:
        view.close()


def _run(tmp_path, wl, index: int, kills: dict) -> tuple[float, list[int], set[int]]:
    """The workload through a one-card broker, all submitted at once; at the fractions of results in
    `kills` ("sched" or "broker"), that is SIGKILLed (and comes back). Hit rate, results, ids."""
    hits = queried = 0
    got: list[int] = []
    tmp_path.mkdir()
    with serve(tmp_path, "g", CONFIG.format(index=index)) as broker:
        with Producer("spread", data_dir=broker.data_dir, connect_timeout_seconds=60.0) as p:
            ids = set(p.submit_many(wl.tokens, wl.offsets, max_new_tokens=wl.max_new_tokens,
                                    prefix_len=wl.prefix_lens).tolist())
            todo = sorted(kills.items())
            deadline = time.monotonic() + 300
            while len(set(got)) < ITEMS:
                assert time.monotonic() < deadline, f"{len(set(got))} of {ITEMS} results"
                for r in p.results(0.2):
                    assert r.status == "ok", r.error
                    got.append(r.item_id)
                if todo and len(got) >= todo[0][0] * ITEMS:
                    _, victim = todo.pop(0)
                    if victim == "sched":
                        broker.kill_role("sched")
                    else:  # the counters of this broker's life, then a new supervisor on the same data
                        card = _card(broker)
                        hits, queried = hits + card["hit_blocks"], queried + card["queried_blocks"]
                        broker.kill()
                        broker.start()
            card = _card(broker)
    return (hits + card["hit_blocks"]) / (queried + card["queried_blocks"]), got, ids


def test_spread_groups_meet_across_a_scheduler_and_a_broker_kill(tmp_path):
    grouped_hit, got, ids = _run(tmp_path / "grouped", spread(ITEMS, 7, grouped=True).workload, 4096, {})
    assert len(got) == ITEMS and set(got) == ids
    hit, got, ids = _run(tmp_path / "spread", spread(ITEMS, 7).workload, 1024, {0.25: "sched", 0.55: "broker"})
    assert set(got) == ids and len(got) == len(ids)  # each result once, through both kills
    print(f"\nhit rate {hit:.3f} through the kills, {grouped_hit:.3f} written group by group")
    assert hit >= 0.85 * grouped_hit, (hit, grouped_hit)
