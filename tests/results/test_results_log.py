"""The results process's log replay: every record from the cursor on, a torn tail cut, a damaged
record in the middle skipped (resync) with its item told `corrupt`."""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.frontdoor.registry import ProducerBook
from shmbroker.results import router as results_mod
from shmbroker.results.log import ResultsLog
from shmbroker.results.replay import C_BAD_RECORDS
from shmbroker.results.router import Router
from shmbroker.ring.wire import encode_results, res_bytes


class _Control:
    table_version = 0

    def producers(self):
        return []


class _Cfg:
    fsync = "never"
    segment_bytes = 1 << 22
    results_name_bytes = 1 << 30


def _records(count: int, first_id: int) -> np.ndarray:
    ids = np.arange(first_id, first_id + count, dtype=np.uint64)
    offsets = np.arange(count + 1, dtype=np.int64) * 3
    flat = np.arange(3 * count, dtype=np.uint32)
    out = np.zeros(count * res_bytes(3), np.uint8)
    done, at = encode_results(out, 0, ids, ids, np.zeros(count, np.uint32), np.zeros(count, np.uint32), flat,
                              offsets, 0, count)
    assert done == count and at == out.size
    return out


def test_replay_routes_every_record_and_cuts_a_torn_tail(tmp_path):
    log = ResultsLog(tmp_path / "results", fsync="never")
    log.append(_records(1000, 1 << 40))
    log.append(_records(10, (1 << 40) + 1000)[: res_bytes(3) * 9 + 20])  # the last record torn
    good_end = log.end - 20
    log.close()
    router = Router(str(tmp_path), _Cfg(), _Control())
    try:
        report = router.replay()
        assert report["results"] == 1009
        assert router.log.end == good_end  # the torn record cut
        assert len(router.parked["#1"]) == 1009  # no producer of id 1 is known: parked, by offset
    finally:
        router.close()


def test_a_failed_append_leaves_no_part_of_its_records_behind(tmp_path, monkeypatch):
    import errno
    import os as os_mod

    import pytest

    from shmbroker.results import log as results_log

    log = ResultsLog(tmp_path / "results", fsync="never")
    first = _records(5, 1 << 40)
    log.append(first)
    real_write = os_mod.write
    calls = []

    def failing_write(fd, view):
        calls.append(len(view))
        if len(calls) == 1:
            return real_write(fd, view[: len(view) // 2])  # half lands, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_log.os, "write", failing_write)
    with pytest.raises(OSError):
        log.append(_records(5, (1 << 40) + 5))
    monkeypatch.setattr(results_log.os, "write", real_write)
    assert log.end == first.size
    assert os_mod.fstat(log.fd).st_size == first.size
    log.append(_records(2, (1 << 40) + 10))  # the next append goes on where the last good one ended
    log.close()
    router = Router(str(tmp_path), _Cfg(), _Control())
    try:
        assert router.replay()["results"] == 7
    finally:
        router.close()


def _damage(path, at: int) -> None:
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("where", ["older file", "newest file"])
@pytest.mark.parametrize("field", ["payload", "length"])
def test_a_damaged_record_mid_log_is_skipped_counted_and_its_item_told_corrupt(tmp_path, monkeypatch, where, field):
    """replay used to stop at the first bad record (the newest file was cut there, the rest
    of an older file was dropped), losing every later result although their items were acked."""
    producer_id = ProducerBook(str(tmp_path)).assign("alice")
    base = producer_id << 40
    if where == "older file":
        monkeypatch.setattr(results_mod.ResultsLog, "append", _rolling_append(4 * res_bytes(3)))
    log = ResultsLog(tmp_path / "results", fsync="never")
    for k in range(6):
        log.append(_records(4, base + 4 * k))
    files = list(log.files)
    log.close()
    size = res_bytes(3)
    victim = 5  # the 6th record: in the 2nd file when files roll every 4 records
    start = files[victim * size // (4 * size)] if where == "older file" else files[-1]
    path = tmp_path / "results" / f"{start:020d}.log"
    if where == "older file":
        assert len(files) == 6
    _damage(path, victim * size - start + (0 if field == "length" else 44))
    router = Router(str(tmp_path), _Cfg(), _Control())
    # every item's backlog record is done (acked when its result was logged): a damaged result is
    # then all that is left of it
    router.backlog.acks.ack(0, np.arange(base, base + 24, dtype=np.uint64))
    try:
        report = router.replay()
        parked = router.parked["alice"]
        offsets = [int(x) for part in parked.take_all() for x in part]
        assert report["results"] == 23  # every record but the damaged one
        assert router.counters[C_BAD_RECORDS] == 1
        ids = set()
        statuses = {}
        for at in offsets:
            rec = router.log.read(at, size)
            item = int(rec[8:16].view(np.uint64)[0])
            ids.add(item)
            statuses[item] = int(rec[24:28].view(np.uint32)[0])
        if field == "payload":  # the frame is whole: the item it names is told, once
            assert report["corrupt_notices"] == 1
            assert ids == {base + i for i in range(24)}
            assert statuses[base + victim] == 4  # corrupt
        else:  # its length is damaged: nothing can be trusted in it, so it is only counted
            assert report["corrupt_notices"] == 0
            assert ids == {base + i for i in range(24)} - {base + victim}
    finally:
        router.close()


def _rolling_append(file_bytes: int):
    real = ResultsLog.append

    def append(self, data):
        self.file_bytes = file_bytes
        return real(self, data)

    return append


def test_a_damaged_result_of_an_item_not_done_tells_nothing_the_item_runs_again(tmp_path):
    """A damaged record whose item's backlog record is not acked (its ack was not saved before a
    crash) is only counted: the item runs again and gets its real result, not `corrupt`."""
    producer_id = ProducerBook(str(tmp_path)).assign("bob")
    base = producer_id << 40
    log = ResultsLog(tmp_path / "results", fsync="never")
    log.append(_records(4, base))
    log.close()
    _damage(tmp_path / "results" / f"{0:020d}.log", res_bytes(3) + 44)
    router = Router(str(tmp_path), _Cfg(), _Control())
    try:
        report = router.replay()
        assert report["results"] == 3 and report["corrupt_notices"] == 0
        assert router.counters[C_BAD_RECORDS] == 1
    finally:
        router.close()


def test_a_damaged_last_record_with_a_whole_frame_is_told_not_cut_silently(tmp_path):
    producer_id = ProducerBook(str(tmp_path)).assign("carol")
    base = producer_id << 40
    log = ResultsLog(tmp_path / "results", fsync="never")
    log.append(_records(4, base))
    log.close()
    _damage(tmp_path / "results" / f"{0:020d}.log", 3 * res_bytes(3) + 44)  # the last record's tokens
    router = Router(str(tmp_path), _Cfg(), _Control())
    router.backlog.acks.ack(0, np.arange(base, base + 4, dtype=np.uint64))
    try:
        report = router.replay()
        assert report["results"] == 3 and report["corrupt_notices"] == 1
        offsets = [int(x) for part in router.parked["carol"].take_all() for x in part]
        last = router.log.read(offsets[-1], 40)
        assert int(last[8:16].view(np.uint64)[0]) == base + 3 and int(last[24:28].view(np.uint32)[0]) == 4
    finally:
        router.close()


def test_blocks_are_allocated_ahead_and_a_full_disk_refuses_before_any_byte(tmp_path, monkeypatch):
    """The results log allocates its blocks ahead of its writes (the file size unchanged: a replay
    sees only what was written); a disk that cannot allocate refuses the append before any byte."""
    import errno
    import os as os_mod

    from shmbroker.results import log as results_log

    log = ResultsLog(tmp_path / "results", fsync="never", file_bytes=8 << 20)
    first = _records(5, 1 << 40)
    log.append(first)
    st = os_mod.stat(log.path(0))
    assert st.st_size == first.size
    assert st.st_blocks * 512 >= results_log.PREALLOCATE_BYTES  # allocated ahead, beyond the size
    log.allocated = log.end  # as if the allocation were used up

    def full(fd, size):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(results_log, "preallocate", full)
    with pytest.raises(OSError):
        log.append(_records(5, (1 << 40) + 5))
    assert log.end == first.size and os_mod.fstat(log.fd).st_size == first.size
    log.close()
