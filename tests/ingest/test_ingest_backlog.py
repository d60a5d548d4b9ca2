"""Ingest into the backlog: records leave a ring only once committed on disk; a full disk is back-pressure."""

from __future__ import annotations

import numpy as np
import pytest
from support.harness import ingest_side

from shmbroker.client.producer import Producer
from shmbroker.errors import DiskFull, Full
from shmbroker.ingest.loop import BacklogAppender, pump
from shmbroker.pack.shapes import shape_items
from shmbroker.ring.items import NO_PREFIX, model_id
from shmbroker.spill.store import Backlog

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def broker(tmp_path):
    with ingest_side(tmp_path) as side:
        yield side


def drain_all(registry, rings, appender, expect: int) -> None:
    for _ in range(1000):
        pump(rings, registry, appender, wait_seconds=0.01)
        if appender.num_items >= expect:
            return
    raise AssertionError(f"only {appender.num_items} of {expect} items reached the backlog")


def test_items_reach_the_backlog_with_their_metadata(broker, tmp_path):
    registry, rings, backlog, writer = broker
    appender = BacklogAppender(writer)
    rng = np.random.default_rng(3)
    sent = {}
    with Producer("p", data_dir=tmp_path) as p:
        for i in range(300):
            tokens = rng.integers(0, 1 << 20, size=int(rng.integers(1, 700)), dtype=np.uint32)
            prefix = int(rng.integers(0, tokens.size + 1)) if i % 3 == 0 else None
            item = p.submit(tokens, max_new_tokens=i, prefix_len=prefix, model="m" if i % 2 else None)
            sent[item] = (tokens, i, NO_PREFIX if prefix is None else prefix, model_id("m") if i % 2 else 0)
            pump(rings, registry, appender, wait_seconds=0.0)  # one thread plays both sides
        drain_all(registry, rings, appender, len(sent))
    writer.close()
    backlog.close()
    reopened, report = Backlog.open(tmp_path, segment_bytes=1 << 20)
    try:
        rows = reopened.pending()
        assert report.pending_records == len(sent) and not report.quarantined
        assert sorted(int(r["item_id"]) for r in rows) == sorted(sent)
        for row in rows:
            tokens, max_new, prefix, model = sent[int(row["item_id"])]
            assert np.array_equal(reopened.tokens(row), tokens)
            assert (int(row["max_new_tokens"]), int(row["prefix_len"]), int(row["model"])) == (max_new, prefix, model)
            assert int(row["shape_band"]) == tokens.size.bit_length() - 1
            declared = 0 if prefix == NO_PREFIX else prefix
            family = shape_items(tokens, np.array([0, tokens.size]), [declared], [model], block_tokens=512).families[0]
            assert int(row["prefix_key"]) == int(family)  # the packer's family key, on disk
    finally:
        reopened.close()


def test_a_full_disk_keeps_records_in_the_ring_and_producers_feel_it(broker, tmp_path, monkeypatch):
    registry, rings, backlog, writer = broker
    appender = BacklogAppender(writer)
    tokens = np.arange(500, dtype=np.uint32)
    real_append = writer.append_many

    def disk_full(*args, **kwargs):
        raise DiskFull("injected: no space for a segment")

    with Producer("p", data_dir=tmp_path) as p:
        monkeypatch.setattr(writer, "append_many", disk_full)
        submitted = []
        with pytest.raises(Full):
            for _ in range(10_000):  # the 64 KiB ring fills: nothing leaves it while the disk is full
                submitted.append(p.submit(tokens, max_new_tokens=1, block=False))
                pump(rings, registry, appender, wait_seconds=0.0)
        assert submitted and appender.num_items == 0 and appender.num_disk_full > 0
        monkeypatch.setattr(writer, "append_many", real_append)  # space returns
        drain_all(registry, rings, appender, len(submitted))
        submitted.append(p.submit(tokens, max_new_tokens=1, block=False))  # the ring takes items again
        drain_all(registry, rings, appender, len(submitted))
    assert appender.num_items == len(submitted)
    writer.close()
    backlog.close()
    reopened, _ = Backlog.open(tmp_path, segment_bytes=1 << 20)
    try:
        assert sorted(int(i) for i in reopened.pending()["item_id"]) == submitted
    finally:
        reopened.close()
