"""The multiprocessing.Queue baseline of `bench e2e` runs, and every item comes back exactly once."""

from __future__ import annotations

from shmbroker.bench import mpqueue


def test_small_run_returns_every_item_once():
    out = mpqueue.run(500, producers=2, workers=2, tokens=16, batch_items=8)
    assert out["mpqueue_items"] == 1000
    assert out["mpqueue_items_per_s"] > 0
    assert 0 < out["mpqueue_submit_to_result_us_p50"] <= out["mpqueue_submit_to_result_us_p99"]
