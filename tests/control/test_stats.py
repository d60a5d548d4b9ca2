"""The statistics block: seqlock publication across processes, counters that carry on across restarts."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import numpy as np
import pytest

from shmbroker.control.segment import R_SEQ, R_VALUES, ROLE_WORDS, VALUE_WORDS, Control
from shmbroker.control.stats import GPU, STATS, StatsWriter, read_role, slot_of
from shmbroker.ring import seqlock
from shmbroker.ring.owner import Owner
from shmbroker.ring.shm import Segment, make_name

WORDS = ROLE_WORDS
RACE_SECONDS = 1.5


def _writer(name: str, seconds: float) -> None:
    """Publish rounds k = 1, 2, ...: every value word k (a consistent set is all-equal), as fast as it can."""
    seg = Segment.attach(name)
    words = seg.buf.view(np.int64)
    values = np.zeros(VALUE_WORDS, np.int64)
    end = time.monotonic() + seconds
    k = 0
    while time.monotonic() < end:
        k += 1
        values[:] = k
        seqlock.publish(words, R_SEQ, R_VALUES, values)
    seg.close()


def _race(read_once) -> tuple[int, int, int]:
    """Run a writer process for RACE_SECONDS; call read_once(words, out) -> bool in a loop.
    (reads, torn, went backwards) over the successful reads."""
    name = make_name(f"t{os.getpid()}", "seqlock")
    seg = Segment.create(name, WORDS * 8)
    try:
        words = seg.buf.view(np.int64)
        proc = mp.get_context("fork").Process(target=_writer, args=(name, RACE_SECONDS))
        proc.start()
        out = np.empty(VALUE_WORDS, np.int64)
        reads = torn = backwards = 0
        last = 0
        distinct = set()
        while proc.is_alive() or reads == 0:
            if not read_once(words, out):
                continue
            reads += 1
            if (out != out[0]).any():
                torn += 1
                continue
            if out[0] < last:
                backwards += 1
            last = int(out[0])
            distinct.add(last)
        proc.join(10)
        assert proc.exitcode == 0
        assert len(distinct) > 100, "the reader must have raced many publications"
        return reads, torn, backwards
    finally:
        seg.close()
        seg.unlink()


def test_seqlock_readers_never_see_a_torn_or_decreasing_set():
    reads, torn, backwards = _race(lambda words, out: seqlock.read(words, R_SEQ, R_VALUES, out, 1000))
    assert reads > 1000
    assert torn == 0
    assert backwards == 0


def test_the_race_is_real_a_plain_copy_does_tear():
    """The same race read without the sequence check: torn sets show up, so the test above has teeth."""
    def plain(words, out):
        out[:] = words[R_VALUES : R_VALUES + VALUE_WORDS]
        return True

    for _ in range(3):  # a torn copy needs the two processes to overlap: a few tries on a busy machine
        _reads, torn, _ = _race(plain)
        if torn:
            return
    pytest.fail("no torn plain copy in three races: the race test cannot tell a seqlock from none")


def test_read_refuses_a_slot_stuck_mid_publication():
    words = np.zeros(WORDS, np.int64)
    seqlock.publish(words, R_SEQ, R_VALUES, np.arange(4, dtype=np.int64))
    out = np.empty(4, np.int64)
    assert seqlock.read(words, R_SEQ, R_VALUES, out, 10) and out.tolist() == [0, 1, 2, 3]
    words[R_SEQ] += 1  # a writer killed between its two sequence stores
    assert not seqlock.read(words, R_SEQ, R_VALUES, out, 10)
    seqlock.publish(words, R_SEQ, R_VALUES, np.arange(4, dtype=np.int64) + 5)  # its successor
    assert words[R_SEQ] % 2 == 0
    assert seqlock.read(words, R_SEQ, R_VALUES, out, 10) and out.tolist() == [5, 6, 7, 8]


@pytest.fixture
def control(tmp_path):
    owner = Owner(str(tmp_path), f"st{os.getpid()}")
    ctl = Control.create(owner, ["ingest-0", "sched", "results", "gpu-a", "metrics"])
    try:
        yield ctl
    finally:
        owner.close()


def test_a_restarted_process_carries_its_counters_on(control):
    r = control.roles.index("gpu-a")
    first = StatsWriter(control, r)
    first.values[slot_of("gpu", "tokens")] = 1000
    first.values[slot_of("gpu", "batches")] = 3
    first.publish()
    second = StatsWriter(control, r)  # the restarted process
    assert second["tokens"] == 1000 and second["batches"] == 3
    second.values[slot_of("gpu", "tokens")] += 24
    second.publish()
    got = read_role(control, r)
    assert got["tokens"] == 1024 and got["batches"] == 3
    assert set(got) == {f.key for f in GPU}


def test_a_process_killed_mid_publication_is_resumed_from_its_words(control):
    r = control.roles.index("ingest-0")
    w = StatsWriter(control, r)
    w.values[0] = 7
    w.publish()
    control.role(r)[R_SEQ] += 1  # killed between the two sequence stores, after writing new words
    control.values(r)[0] = 8
    assert read_role(control, r) is None
    resumed = StatsWriter(control, r)
    assert resumed["items"] == 8  # each word is the old or the new value: both are counts it made
    resumed.publish()
    assert read_role(control, r)["items"] == 8


def test_readonly_view_reads_and_cannot_write(control):
    r = control.roles.index("sched")
    w = StatsWriter(control, r)
    w.values[slot_of("sched", "batches")] = 5
    w.publish()
    ro = Control.attach(control.segment.name, control.roles, readonly=True)
    try:
        assert read_role(ro, r)["batches"] == 5
        assert read_role(ro, control.roles.index("metrics")) == {}
        with pytest.raises(ValueError):
            ro.words[0] = 1
    finally:
        ro.close()


def test_every_kind_fits_its_slot_and_exports_counters_with_total():
    for kind, fields in STATS.items():
        assert len(fields) <= VALUE_WORDS, kind
        for f in fields:
            if f.metric is None:
                continue
            assert f.metric == f.metric.lower() and " " not in f.metric
            assert f.metric.endswith("_total") == (f.kind == "counter"), f.metric
