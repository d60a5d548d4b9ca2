"""The scheduler's collaborators alone: admission, the announcement form, the failed rows, the index
slots, what waits beyond the index."""

from __future__ import annotations

import numpy as np

from shmbroker.control.stats import SCHED
from shmbroker.ring.items import SEQ_BITS, Status
from shmbroker.ring.wire import LOC_DTYPE, Announcement
from shmbroker.sched import pending as P
from shmbroker.sched.admission import Admission
from shmbroker.sched.beyond import Arrived, BeyondIndex
from shmbroker.sched.records import FailedRows, batch_record
from shmbroker.sched.slots import NO_ITEM_NS, SlotTable


def announcement(lengths, *, models=None, producer: int = 1, blocks=None) -> Announcement:
    """Items of these lengths (model 0 unless `models`), item i with `blocks[i]` block hashes valued
    1000 * i + j."""
    n = len(lengths)
    locs = np.zeros(n, LOC_DTYPE)
    locs["num_tokens"] = lengths
    locs["model"] = 0 if models is None else models
    locs["item_id"] = (np.uint64(producer) << np.uint64(SEQ_BITS)) | np.arange(n, dtype=np.uint64)
    blocks = [1] * n if blocks is None else blocks
    locs["aux"] = blocks
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum(blocks, out=offsets[1:])
    hashes = np.array([1000 * i + j for i in range(n) for j in range(blocks[i])], np.uint64)
    return Announcement(locs, offsets, hashes)


def test_a_subset_keeps_each_items_block_hashes():
    ann = announcement([5, 6, 7, 8], blocks=[2, 0, 3, 1])
    sub = ann.subset(np.array([False, True, True, True]))
    assert sub.locs["num_tokens"].tolist() == [6, 7, 8]
    assert sub.hash_offsets.tolist() == [0, 0, 3, 4]
    assert sub.hashes.tolist() == [2000, 2001, 2002, 3000]


def test_admission_refuses_by_reason_and_counts_each():
    values = np.zeros(len(SCHED), np.int64)
    admission = Admission({0: 100, 7: 50}, {9}, values)
    ann = announcement([10, 0, 101, 60, 40, 20], models=[0, 0, 0, 7, 3, 0], blocks=[1, 0, 1, 2, 1, 1])
    servable, refused = admission.split(ann)
    assert servable.locs["num_tokens"].tolist() == [10, 20]
    assert servable.hashes.tolist() == [0, 5000]
    assert refused["num_tokens"].tolist() == [0, 101, 60, 40]
    assert refused["aux"].tolist() == [Status.INVALID, Status.TOO_LONG, Status.TOO_LONG, Status.INVALID]
    assert (values[P.S_EMPTY], values[P.S_TOO_LONG], values[P.S_NO_CONSUMER], values[P.S_CANCELLED]) == (1, 2, 1, 0)


def test_admission_hands_back_the_announcement_itself_when_all_are_servable_and_refuses_cancelled_jobs():
    values = np.zeros(len(SCHED), np.int64)
    admission = Admission({0: 100}, (), values)
    ann = announcement([10, 20])
    servable, refused = admission.split(ann)
    assert servable is ann and refused.size == 0
    admission.cancel({1})
    servable, refused = admission.split(ann)
    assert servable.locs.size == 0
    assert (refused["aux"] == Status.CANCELLED).all() and refused.size == 2
    assert values[P.S_CANCELLED] == 2
    assert admission.split(announcement([10], producer=2)).refused.size == 0


def test_failed_rows_ride_records_of_at_most_rows_max_in_order():
    failed = FailedRows(rows_max=5)
    parts = [announcement([1] * n, producer=p).locs for p, n in ((1, 3), (2, 4), (3, 2))]
    for part in parts:
        failed.append(part)
    failed.append(parts[0][:0])  # nothing: no part
    assert len(failed) == 9
    sizes = []
    while (record := batch_record(None, failed)) is not None:
        rows = record.payload.view(LOC_DTYPE)
        assert (record.n_run, record.n_failed) == (0, rows.size)
        sizes.append(rows.size)
    assert sizes == [5, 4] and len(failed) == 0
    run = announcement([4, 4]).locs
    record = batch_record(run, failed)
    assert (record.n_run, record.n_failed) == (2, 0)


def test_index_slots_are_taken_from_the_free_stack_and_given_back():
    table = SlotTable(8)
    slots = table.free_slots(3)
    assert slots.tolist() == [0, 1, 2] and table.num_free == 8
    locs = announcement([5, 6, 7]).locs
    table.fill(slots[:2], locs[:2], arrival_ns=100)
    assert table.num_free == 6 and table.rows["num_tokens"][:2].tolist() == [5, 6]
    assert table.free_slots(1).tolist() == [2]  # the one not filled is next
    table.fill(table.free_slots(1), locs[2:], arrival_ns=200)
    assert table.oldest_ns() == 100
    rows = table.release(np.array([0, 1]))
    assert rows["num_tokens"].tolist() == [5, 6] and table.num_free == 7
    assert table.oldest_ns() == 200
    table.release(np.array([2]))
    assert table.oldest_ns() == NO_ITEM_NS and table.num_free == 8


def test_beyond_the_index_the_front_goes_first_and_a_cancel_takes_from_it(tmp_path):
    values = np.zeros(len(SCHED), np.int64)
    beyond = BeyondIndex(str(tmp_path), 1 << 20, values, wait_limit=8)
    try:
        assert not beyond and beyond.oldest_ns() is None
        beyond.append(announcement([3] * 4, producer=2), 50)
        beyond.put_front(Arrived(announcement([5, 6, 7], blocks=[1, 2, 1]), 40))
        assert beyond and not beyond.on_disk()
        assert (values[P.S_OVERFLOW], values[P.S_WAITING]) == (3, 4)
        assert beyond.oldest_ns() == 40
        gone = beyond.drop_front(lambda locs: locs["num_tokens"] == 6)
        assert [g["num_tokens"].tolist() for g in gone] == [[6]]
        front = beyond.pop_front()
        assert front.items.locs["num_tokens"].tolist() == [5, 7] and front.items.hashes.tolist() == [0, 2000]
        assert front.arrival_ns == 40 and beyond.pop_front() is None
        assert beyond.on_disk() and values[P.S_OVERFLOW] == 0 and beyond.oldest_ns() == 50
    finally:
        beyond.close()
    assert not (tmp_path / "sched" / "waiting").exists()


def test_a_feed_wants_more_once_the_items_of_held_records_are_done(owner):
    """The consumer's ring holds AHEAD records whose items are all but one done (a long item keeps
    the oldest, and so every later one, from being released): the feed counts the done rows out and
    wants another record, where counting released records alone would starve the engine."""
    from shmbroker.pack.feeding import AHEAD
    from shmbroker.ring.owned import create_ring
    from shmbroker.ring.ring import CONSUMER, PRODUCER
    from shmbroker.sched.records import Feed

    owned = create_ring(owner, "feed", 1 << 20)
    prod, cons = owned.attach(PRODUCER), owned.attach(CONSUMER)
    try:
        feed = Feed(prod, queued_items=64)
        failed = FailedRows(rows_max=1 << 12)
        for key in range(AHEAD):
            run = np.zeros(32, LOC_DTYPE)
            assert feed.push(batch_record(run, failed), key)
        assert not feed.wants()  # 3 records, 96 items to do: enough queued
        cons.count_done(95)  # the consumer finished every item but one, released nothing
        assert cons.num_queued() == AHEAD
        assert feed.wants()  # one item to do: the window needs more
    finally:
        prod.close()
        cons.close()


def test_recovered_rows_join_their_groups_a_slice_at_a_time_announced_ones_behind_them(tmp_path):
    """A start's backlog goes on disk at once and into its prefix groups a slice at a time (their
    block hashes read from the backlog); rows announced meanwhile wait behind them; read back, the
    oldest row brings every member of its group, however far apart they were written."""
    from shmbroker.pack.groups import group_keys
    from shmbroker.pack.shapes import shape_items
    from shmbroker.ring.items import NO_PREFIX
    from shmbroker.spill.layout import ITEM_DTYPE
    from shmbroker.spill.locate import record_locations
    from shmbroker.spill.store import Backlog
    from shmbroker.workloads.spread import spread

    wl = spread(300, 3).workload
    shapes = shape_items(wl.tokens, wl.offsets, wl.prefix_lens, block_tokens=64)
    backlog, _ = Backlog.open(str(tmp_path))
    writer = backlog.writer(0, fsync="never")
    meta = np.zeros(len(wl), ITEM_DTYPE)
    meta["item_id"] = (np.uint64(1) << np.uint64(SEQ_BITS)) | np.arange(len(wl), dtype=np.uint64)
    meta["prefix_key"] = shapes.families
    meta["producer"] = 1
    meta["prefix_len"] = np.where(wl.prefix_lens > 0, wl.prefix_lens, NO_PREFIX)
    meta["max_new_tokens"] = 1
    writer.append_many(wl.tokens, wl.offsets, meta, cluster=False)
    writer.close()
    backlog.close()
    backlog, _ = Backlog.open(str(tmp_path), readonly=True)  # as a start finds it
    pending = backlog.pending()
    backlog.close()
    values = np.zeros(len(SCHED), np.int64)
    beyond = BeyondIndex(str(tmp_path), 1 << 26, values, wait_limit=64)
    try:
        locs = record_locations(pending)
        beyond.append_recovered(locs, 5)
        beyond.append(announcement([70, 80], producer=2, blocks=[2, 2]), 6)
        assert values[P.S_WAITING] == 302 and not beyond.on_disk() and beyond.oldest_ns() == 5
        assert beyond.key_some(100, 64) == 100 and len(beyond.groups) == 100 and beyond.on_disk()
        assert beyond.key_some(10**6, 64) == 202 and len(beyond.groups) == 302 and not beyond.unkeyed
        round_of = {}
        for r in range(1000):
            back = beyond.read_back(64, 64)
            if back is None:
                break
            ids = back.arrived.items.locs["item_id"]
            mine = ids >> np.uint64(SEQ_BITS) == 1  # the backlog's items (the announced two are producer 2's)
            round_of.update((int(i), r) for i in (ids[mine] & np.uint64((1 << SEQ_BITS) - 1)).tolist())
        assert len(round_of) == len(wl) and round_of[0] == 0 and not beyond
        _, deep = group_keys(shapes.families, shapes.hash_offsets, shapes.hashes)
        spans = []
        for key in np.unique(deep).tolist():
            same = np.flatnonzero(deep == key)
            assert len({round_of[int(i)] for i in same}) == 1, same  # a group comes in together
            spans.append(int(same.max() - same.min()))
        assert max(spans) > 64  # members written far apart came in together
    finally:
        beyond.close()
