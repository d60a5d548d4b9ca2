"""A full disk midway through taking a GPU's ring record: the results process takes the record
again once the disk has room, and every result is then in the shared log once, in its name's own
log once (a name read far behind), delivered once, and counted once (results, acks, log bytes);
no other GPU's record is taken before it, so every name's results stay in log order.
The fault is a real ENOSPC from the durable-I/O seam (`disk/durable.py`) on the write of the
record's copy to the name's own log, with a checkpoint in between as the results process makes."""

from __future__ import annotations

import errno
import os
import secrets
from pathlib import Path

import numpy as np
import pytest
from test_results_bound import RECORD, _Cfg, _feed, _parked_ids, _records
from test_results_log import _Control

from shmbroker.disk import durable
from shmbroker.frontdoor.registry import ProducerBook
from shmbroker.results.behind import BEHIND_DIR
from shmbroker.results.router import Router
from shmbroker.results.slots import C_ACKED, C_DISK_FULL, C_LOG_BYTES, C_RESULTS
from shmbroker.ring.owned import create_ring
from shmbroker.ring.owner import Owner
from shmbroker.ring.ring import CONSUMER, PRODUCER

LAZY_BEFORE = 20_000  # results of `lazy` that move it to a log of its own
BATCH = 8  # results of each name in the GPU batch a full disk stops


class FullDisk:
    """An observer of the durable calls (`durable.observe`) that fails every write to the file
    descriptor `fd` with ENOSPC while `full`, and runs every other call."""

    def __init__(self, fd: int):
        self.fd = fd
        self.full = True
        self.refused = 0
        self.boot = durable.boot_id()

    def boot_id(self) -> bytes:
        return self.boot

    def run(self, op: str, fn, args: tuple):
        if self.full and op == "write" and args[0] == self.fd:
            self.refused += 1
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fn(*args)


@pytest.fixture
def owner(tmp_path):
    own = Owner(tmp_path / "shm", "fd" + secrets.token_hex(3))
    try:
        yield own
    finally:
        own.close()


def _log_ids(directory: Path) -> list[int]:
    """The item id of every record in the log files of `directory`, in log order (every record of
    this test is RECORD bytes, and files start at a record)."""
    out = []
    for path in sorted(directory.glob("*.log")):
        data = np.frombuffer(path.read_bytes(), np.uint8)
        out += [int(data[at + 8 : at + 16].view(np.uint64)[0]) for at in range(0, data.size, RECORD)]
    return out


def test_a_take_a_full_disk_stops_midway_writes_and_counts_each_record_once(tmp_path, owner):
    book = ProducerBook(str(tmp_path))
    busy = book.assign("busy") << 40  # routed first (the smaller producer id), parked
    lazy = book.assign("lazy") << 40  # read far behind: its results are copied to its own log
    router = Router(str(tmp_path), _Cfg(), _Control())
    owned = [create_ring(owner, f"res{k}", 1 << 20) for k in range(2)]
    (ring_in, other_in), (ring_out, other_out) = ([o.attach(side) for o in owned] for side in (PRODUCER, CONSUMER))
    try:
        router.replay()
        earlier = lazy + np.arange(LAZY_BEFORE, dtype=np.uint64)
        _feed(router, earlier)
        router.checkpoint(force=True)
        assert "lazy" in router.behind
        ids = np.concatenate([busy + np.arange(BATCH, dtype=np.uint64),
                              lazy + np.arange(LAZY_BEFORE, LAZY_BEFORE + BATCH, dtype=np.uint64)])
        data = _records(ids)
        assert ring_in.push(data.view(np.uint32), 0, data.size) == 0
        later = _records(lazy + np.arange(LAZY_BEFORE + BATCH, LAZY_BEFORE + 2 * BATCH, dtype=np.uint64))
        assert other_in.push(later.view(np.uint32), 0, later.size) == 0  # another GPU's, logged after
        before = router.counters.copy()

        disk = FullDisk(router.behind.get("lazy").log.fd)
        durable.observe(disk)
        try:
            with pytest.raises(OSError) as failed:
                router.take(ring_out)
            assert failed.value.errno == errno.ENOSPC and disk.refused == 1
            router.counters[C_DISK_FULL] += 1  # as the results process does: count, checkpoint, try again
            router.checkpoint(force=True)
            disk.full = False
            assert router.take(other_out) == 0  # not before the record half taken: log order holds
            assert router.take(ring_out) == 1
            assert router.take(other_out) == 1
        finally:
            durable.observe(None)
        router.checkpoint(force=True)
        ids = np.concatenate([ids, lazy + np.arange(LAZY_BEFORE + BATCH, LAZY_BEFORE + 2 * BATCH, dtype=np.uint64)])

        shared = _log_ids(tmp_path / "results")
        assert [shared.count(int(i)) for i in ids] == [1] * ids.size  # each record once in the shared log
        (own_dir,) = (tmp_path / "results" / BEHIND_DIR).iterdir()
        assert _log_ids(own_dir) == earlier.tolist() + ids[BATCH:].tolist()  # once, in log order
        assert _parked_ids(router, "busy") == ids[:BATCH].tolist()
        assert _parked_ids(router, "lazy") == earlier.tolist() + ids[BATCH:].tolist()
        grew = router.counters - before
        assert grew[C_RESULTS] == ids.size and grew[C_ACKED] == ids.size
        assert grew[C_LOG_BYTES] == data.size + later.size
        assert router.backlog.acks.done_mask(0, ids).all()
    finally:
        router.close()
        for r in (ring_in, ring_out, other_in, other_out):
            r.close()
        for ring in owned:
            for obj in (ring.segment, ring.data_bell, ring.space_bell):
                owner.release(obj)
