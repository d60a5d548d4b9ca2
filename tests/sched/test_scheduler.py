"""The scheduler alone, in this process, between real rings in shared memory and a real backlog on disk.

Producers submit to a Registry; an Announcer (ingest's own callback) appends their records to the
backlog and announces them on the appended ring; the `Scheduler` takes the announcements and pushes
batch records; the test pops the batch rings as the GPU processes would and checks what each carries.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
from support.harness import ingest_side

from shmbroker.client.producer import Producer
from shmbroker.config import settings
from shmbroker.ingest.loop import Announcer, BacklogAppender, pump
from shmbroker.jobs import cancels
from shmbroker.ring.items import SEQ_BITS, Status
from shmbroker.ring.owned import create_ring
from shmbroker.ring.ring import CONSUMER, PRODUCER
from shmbroker.ring.wire import LOC_DTYPE
from shmbroker.sched import pending as P
from shmbroker.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)

DEADLINE_SECONDS = 30.0
APPENDED_RING_BYTES = 1 << 20


class Delivered(NamedTuple):
    """One batch record as a GPU process pops it."""

    consumer: int
    key: int
    run: np.ndarray  # LOC rows to run
    failed: np.ndarray  # LOC rows failed back, `aux` = status


def config(data_dir: Path, consumers: list[dict], **over):
    raw = {"segment_bytes": 1 << 20, "index_items": 1024, "consumers": consumers, **over}
    return settings.parse(raw, data_dir=str(data_dir))


def consumer(name: str, size: int, tokens: int, input_len: int, **more) -> dict:
    return {"name": name, "max_batch_size": size, "max_batch_tokens": tokens, "max_input_len": input_len, **more}


class Rig:
    """A scheduler between an ingest side (Registry, Announcer, Backlog) and one batch ring per consumer."""

    def __init__(self, stack: ExitStack, owner, cfg, *, batch_ring_bytes: int = 1 << 20):
        self.cfg = cfg
        self.modes = ["padded"] * len(cfg.consumers)
        self.registry, self.rings, self.backlog, self.writer = stack.enter_context(ingest_side(Path(cfg.data_dir)))
        self.bell = owner.doorbell("sched-d")
        self.appended = create_ring(owner, "ann0", APPENDED_RING_BYTES, data_bell=self.bell)
        self.batch = [create_ring(owner, f"batch{c}", batch_ring_bytes, space_bell=self.bell)
                      for c in range(len(cfg.consumers))]
        self.gpu = [stack.enter_context(b.attach(CONSUMER)) for b in self.batch]
        ann = stack.enter_context(self.appended.attach(PRODUCER))
        self.announcer = Announcer(BacklogAppender(self.writer, cfg.block_tokens), ann, lambda: 0)
        self.sched: Scheduler | None = None
        self.start()
        stack.callback(self.stop)
        self.delivered: list[Delivered] = []

    def start(self) -> Scheduler:
        """A scheduler incarnation on the rings (the last one stopped)."""
        assert self.sched is None
        self.sched = Scheduler(self.cfg, self.modes, [self.appended.attach(CONSUMER)],
                               [b.attach(PRODUCER) for b in self.batch], self.bell)
        return self.sched

    def stop(self) -> None:
        if self.sched is not None:
            self.sched.close()
            for ring in self.sched.appended + self.sched.batches:
                ring.close()
            self.sched = None

    def submit(self, p: Producer, lengths, *, model: str | None = None, seed: int = 0) -> list[int]:
        """Submit prompts of these lengths, each ingested (on disk, announced) before the next."""
        rng = np.random.default_rng(seed)
        ids = []
        for n in lengths:
            ids.append(p.submit(rng.integers(0, 30_000, int(n), dtype=np.uint32), max_new_tokens=1, model=model))
            self.ingest(1)
        return ids

    def ingest(self, more: int) -> None:
        """Pump until `more` more records are on disk and announced."""
        want = self.announcer.appender.num_items + more
        deadline = time.monotonic() + DEADLINE_SECONDS
        while self.announcer.appender.num_items < want:
            assert time.monotonic() < deadline, f"{self.announcer.appender.num_items} of {want} ingested"
            pump(self.rings, self.registry, self.announcer, wait_seconds=0.01)

    def take(self, count: int) -> None:
        """Take announcements until `count` items came."""
        got = 0
        deadline = time.monotonic() + DEADLINE_SECONDS
        while got < count:
            assert time.monotonic() < deadline, f"{got} of {count} announced items taken"
            got += self.sched.take_announcements()

    def pop(self) -> int:
        """Pop every batch ring as the GPU processes would; the records popped."""
        n = 0
        for c, ring in enumerate(self.gpu):
            while (rec := ring.pop()) is not None:
                rows = rec.tokens.view(LOC_DTYPE)
                n_run, n_failed = rec.meta[0], rec.meta[1]
                assert rows.size == n_run + n_failed
                self.delivered.append(Delivered(c, rec.key, rows[:n_run].copy(), rows[n_run:].copy()))
                n += 1
        return n

    def run_until(self, num_rows: int) -> None:
        """Take, dispatch and pop until `num_rows` rows (run or failed) came out of the batch rings."""
        deadline = time.monotonic() + DEADLINE_SECONDS
        while self.rows_out() < num_rows:
            assert time.monotonic() < deadline, f"{self.rows_out()} of {num_rows} rows dispatched"
            self.sched.take_announcements()
            self.sched.dispatch()
            if self.pop() == 0:
                time.sleep(0.001)

    def rows_out(self) -> int:
        return sum(d.run.size + d.failed.size for d in self.delivered)

    def run_ids(self) -> list[int]:
        return [int(i) for d in self.delivered for i in d.run["item_id"]]

    def failed_status(self) -> dict[int, int]:
        return {int(i): int(s) for d in self.delivered for i, s in zip(d.failed["item_id"], d.failed["aux"])}


@pytest.fixture
def rigs(owner, tmp_path):
    with ExitStack() as stack:
        yield lambda cfg, **kw: Rig(stack, owner, cfg, **kw)


def test_items_go_to_a_consumer_whose_contract_fits_in_batches_that_keep_it(rigs, tmp_path):
    short, long = (4, 1024, 256), (2, 4096, 2048)  # (max_batch_size, max_batch_tokens, max_input_len)
    rig = rigs(config(tmp_path / "data", [consumer("short", *short), consumer("long", *long)]))
    lengths = np.random.default_rng(5).integers(1, 2049, 60)
    with Producer("p", data_dir=rig.cfg.data_dir) as p:
        ids = rig.submit(p, lengths)
    rig.run_until(len(ids))
    run = rig.run_ids()
    assert sorted(run) == sorted(ids)  # each exactly once, none failed
    assert rig.failed_status() == {}
    by_id = dict(zip(ids, lengths.tolist()))
    for d in rig.delivered:
        size, tokens, input_len = (short, long)[d.consumer]
        lens = d.run["num_tokens"].astype(np.int64)
        assert d.run.size <= size
        assert (lens <= input_len).all()
        assert d.run.size * int(lens.max(initial=0)) <= tokens  # a padded engine's rectangle
        assert (d.run["model"] == 0).all()
        assert np.unique(d.run["prefix_key"]).size <= 1  # shape-pure: one family
        assert [by_id[int(i)] for i in d.run["item_id"]] == lens.tolist()
    assert sorted(d.key for d in rig.delivered) == list(range(len(rig.delivered)))  # batch numbers, each once
    v = rig.sched.values
    assert v[P.S_ITEMS] == len(ids) and v[P.S_INDEXED_ITEMS] == len(ids)
    assert v[P.S_PENDING_ITEMS] == 0 and v[P.S_PENDING_TOKENS] == 0


def test_items_no_consumer_can_take_come_back_as_failed_rows_with_their_status(rigs, tmp_path):
    rig = rigs(config(tmp_path / "data", [consumer("only", 4, 4096, 1024)]))
    sched = rig.sched
    with Producer("p", data_dir=rig.cfg.data_dir) as p, Producer("job", data_dir=rig.cfg.data_dir) as job:
        ok = rig.submit(p, [100] * 8)
        other = rig.submit(p, [100] * 3, model="other")  # no consumer serves it
        long = rig.submit(p, [1500] * 3)  # longer than every contract of its model
        cancelled = rig.submit(job, [100] * 6)
        rig.take(20)
        assert len(sched.packer) == 14  # the servable ones are indexed
        cancels.add(rig.cfg.data_dir, "job", [cancelled[0] >> SEQ_BITS])
        assert sched.cancel(sched.cancels.poll()) == 6  # taken back out of the index
        assert len(sched.packer) == 8
        later = rig.submit(job, [100] * 2)  # still to come: refused at admission
    rig.run_until(22)
    assert sorted(rig.run_ids()) == sorted(ok)
    want = {**{i: Status.INVALID for i in other}, **{i: Status.TOO_LONG for i in long},
            **{i: Status.CANCELLED for i in cancelled + later}}
    assert rig.failed_status() == want
    v = sched.values
    assert (v[P.S_NO_CONSUMER], v[P.S_TOO_LONG], v[P.S_CANCELLED], v[P.S_EMPTY]) == (3, 3, 8, 0)
    assert v[P.S_PENDING_ITEMS] == 0  # the refused never counted, the cancelled counted out
    assert all(d.failed.size <= 4096 for d in rig.delivered)


def test_a_full_batch_ring_holds_the_record_and_pushes_it_when_there_is_room(rigs, tmp_path):
    # 128 words of ring: two records of 3 rows (56 words each) fit, a third does not
    rig = rigs(config(tmp_path / "data", [consumer("tiny", 3, 3072, 1024)]), batch_ring_bytes=512)
    sched = rig.sched
    with Producer("p", data_dir=rig.cfg.data_dir) as p:
        ids = rig.submit(p, [50] * 12)
    rig.take(12)
    sched.dispatch()
    assert sched.feeds[0].held is not None  # packed, refused by the full ring, kept
    held = sched.feeds[0].held
    assert rig.gpu[0].num_queued() == 2 and len(sched.packer) == 12 - 3 * 3
    assert sched.dispatch() == 0  # still full: the same record stays held
    assert sched.feeds[0].held is held
    rig.pop()
    assert sched.dispatch() >= 1
    rig.pop()
    assert rig.delivered[2].key == 2 and rig.delivered[2].run["item_id"].tolist() == held.payload.view(LOC_DTYPE)["item_id"].tolist()
    rig.run_until(12)
    assert [d.key for d in rig.delivered] == list(range(len(rig.delivered)))  # every record once, in order
    assert sorted(rig.run_ids()) == sorted(ids)
    assert all(d.run.size == 3 for d in rig.delivered)


def test_a_start_indexes_what_is_pending_on_disk_and_skips_what_is_acked_or_seen(rigs, tmp_path):
    rig = rigs(config(tmp_path / "data", [consumer("only", 4, 4096, 1024)]))
    with Producer("p", data_dir=rig.cfg.data_dir) as p:
        ids = rig.submit(p, [30 + i for i in range(20)])
    rig.take(20)
    rig.run_until(20)  # a first incarnation dispatched them all; the results process acks 8
    done = set(ids[:8])
    rows = [r for d in rig.delivered for r in d.run if int(r["item_id"]) in done]
    for r in rows:
        rig.backlog.ack(int(r["writer"]), np.array([r["seq"]], np.uint64))
    rig.backlog.save_acks()
    with Producer("q", data_dir=rig.cfg.data_dir) as q:  # announced while no scheduler runs
        rig.stop()
        new = rig.submit(q, [40] * 5)
    sched = rig.start()
    report = sched.recover(rig.cfg.data_dir)
    assert report["items"] == 12 + 5 and report["corrupt"] == 0 and report["on_disk"]
    assert sched.values[P.S_PENDING_ITEMS] == 17
    rig.delivered.clear()
    rig.run_until(17)
    for _ in range(20):  # the five announced after the scan's records come again: skipped
        sched.take_announcements()
        sched.dispatch()
        rig.pop()
    assert sorted(rig.run_ids()) == sorted(ids[8:] + new)  # each once: acked skipped, seen not twice
    assert sched.values[P.S_PENDING_ITEMS] == 0


def test_items_beyond_a_full_index_wait_and_are_indexed_as_room_frees(rigs, tmp_path):
    cfg = dataclasses.replace(config(tmp_path / "data", [consumer("only", 4, 4096, 1024)]), index_items=32)
    rig = rigs(cfg)
    sched = rig.sched
    ids = []
    with Producer("p", data_dir=cfg.data_dir) as p:
        for k in range(5):  # five announcements of 20
            ids += [p.submit(np.full(60, k, np.uint32), max_new_tokens=1) for _ in range(20)]
            rig.ingest(20)
    rig.take(100)
    v = sched.values
    assert len(sched.packer) == 32 and sched.table.num_free == 0
    assert v[P.S_OVERFLOW] == 8  # what the index could not take of the second announcement, in memory
    assert v[P.S_WAITING] == 60  # the three after it, on disk
    waiting = Path(cfg.data_dir) / "sched" / "waiting"
    assert {f.stat().st_mode & 0o777 for f in waiting.glob("*.bin")} == {0o600}
    assert waiting.stat().st_mode & 0o777 == 0o700
    assert v[P.S_PENDING_ITEMS] == 100
    sched.refresh_gauges()
    assert v[P.S_OLDEST] > 0
    rig.run_until(100)
    run = rig.run_ids()
    assert sorted(run) == sorted(ids) and len(set(run)) == 100
    assert (v[P.S_OVERFLOW], v[P.S_WAITING], v[P.S_PENDING_ITEMS]) == (0, 0, 0)
    assert not list(waiting.glob("*.bin"))


def test_a_job_still_arriving_waits_beyond_the_index_while_the_cards_have_other_work(rigs, tmp_path):
    """A job whose file is still arriving (its producer id in `jobs/arriving.json`) has its items wait
    beyond the index, in their groups, while the index has other work; they enter once the job is
    all in. With nothing else in the index they enter at once: an idle card never waits for a job."""
    from shmbroker.jobs import arriving

    cfg = config(tmp_path / "data", [consumer("c", 4, 4096, 2048)], job_hold_seconds=30.0)
    rig = rigs(cfg)
    sched = rig.sched
    with Producer("other", data_dir=cfg.data_dir) as other, Producer("job", data_dir=cfg.data_dir) as job:
        arriving.add(cfg.data_dir, "job", job.producer_id)
        sched.watch_jobs()
        alone = rig.submit(job, [100] * 2, seed=3)
        rig.take(2)
        assert len(sched.packer) == 1 and sched.values[P.S_WAITING] == 1  # the first: nothing else to do
        rig.run_until(2)  # the index drained: the second is not held any more
        others = rig.submit(other, [100] * 20)
        rig.take(20)
        held = rig.submit(job, [100] * 4, seed=1)
        rig.take(4)
        assert len(sched.packer) == 20 and sched.values[P.S_WAITING] == 4
        sched.dispatch()
        indexed = len(sched.packer)
        assert 0 < indexed < 20 and sched.values[P.S_WAITING] == 4  # batches went, the job still waits
        arriving.done(cfg.data_dir, "job")
        sched.watch_jobs()
        sched.dispatch()  # the rings are full: only the refill moves
        assert len(sched.packer) == indexed + 4 and sched.values[P.S_WAITING] == 0
        rig.run_until(26)
    assert sorted(rig.run_ids()) == sorted(alone + others + held)  # each once
