"""The results process's log replay: every record from the cursor on, in pieces, a torn tail cut."""

from __future__ import annotations

import numpy as np

from shmbroker import results as results_mod
from shmbroker.results import Router
from shmbroker.results_log import ResultsLog
from shmbroker.ring.wire import encode_results, res_bytes


class _Control:
    table_version = 0

    def producers(self):
        return []


class _Cfg:
    fsync = "never"
    segment_bytes = 1 << 22


def _records(count: int, first_id: int) -> np.ndarray:
    ids = np.arange(first_id, first_id + count, dtype=np.uint64)
    offsets = np.arange(count + 1, dtype=np.int64) * 3
    flat = np.arange(3 * count, dtype=np.uint32)
    out = np.zeros(count * res_bytes(3), np.uint8)
    done, at = encode_results(out, 0, ids, ids, np.zeros(count, np.uint32), np.zeros(count, np.uint32), flat,
                              offsets, 0, count)
    assert done == count and at == out.size
    return out


def test_replay_routes_every_record_across_pieces_and_cuts_a_torn_tail(tmp_path, monkeypatch):
    monkeypatch.setattr(results_mod, "REPLAY_BYTES", 4096)  # many pieces, records cut by their edges
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

    from shmbroker import results_log

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
