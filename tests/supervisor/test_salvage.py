"""Salvage: a dead broker's ingest rings are closed and what they hold goes to the backlog."""

from __future__ import annotations

import numpy as np

from shmbroker.config import settings
from shmbroker.ring import layout as L
from shmbroker.ring.items import SEQ_BITS, item_id
from shmbroker.ring.owned import create_ring
from shmbroker.ring.owner import Owner
from shmbroker.ring.ring import PRODUCER
from shmbroker.spill.store import Backlog
from shmbroker.supervisor.salvage import salvage


def result_ids(p, count: int, timeout_seconds: float = 60.0) -> set[int]:
    """The item ids of a producer's results until `count` came (within the time)."""
    import time

    got: set[int] = set()
    deadline = time.monotonic() + timeout_seconds
    while len(got) < count:
        assert time.monotonic() < deadline, f"{len(got)} of {count}"
        got.update(r.item_id for r in p.results(timeout_seconds=1.0))
    return got


def test_salvage_appends_what_a_dead_brokers_ring_holds_and_closes_it(tmp_path):
    data = str(tmp_path / "data")
    cfg = settings.load(None, data_dir=data)
    owner = Owner(data, "salv", sweep=False)  # the dead broker's objects, left in /dev/shm
    try:
        ring = create_ring(owner, "p7i", 1 << 16)
        producer = ring.attach(PRODUCER)
        items = [np.arange(n, dtype=np.uint32) + n for n in (5, 600, 1)]
        for seq, tokens in enumerate(items):
            assert producer.push(tokens, seq, 3, 0xFFFFFFFF, 0, 0) == L.OK
        backlog, _ = Backlog.open(data)
        try:
            assert salvage(backlog, cfg) == 3
        finally:
            backlog.close()
        # the ring is closed: its producer finds it full from now on
        assert producer.push(items[0], 3, 3, 0xFFFFFFFF, 0, 0) == L.FULL
        producer.close()
        recovered, _ = Backlog.open(data)
        try:
            rows = np.sort(recovered.pending(), order="item_id")
            assert rows["item_id"].tolist() == [item_id(7, s) for s in range(3)]
            assert (rows["item_id"] >> np.uint64(SEQ_BITS)).tolist() == [7, 7, 7]
            for row, tokens in zip(rows, items):
                np.testing.assert_array_equal(recovered.tokens(row), tokens)
            assert rows["max_new_tokens"].tolist() == [3, 3, 3]
        finally:
            recovered.close()
        backlog, _ = Backlog.open(data)
        try:
            assert salvage(backlog, cfg) == 0  # a second look finds nothing more
        finally:
            backlog.close()
    finally:
        owner.close()


def test_items_an_ingest_process_left_at_a_stop_are_salvaged_not_unlinked(tmp_path):
    """Before: an ingest process that died during the stop (or could not drain on a full disk) left
    its producers' rings full, and the supervisor unlinked them with the rest of the shared memory:
    every item in them, accepted by `submit`, was lost."""
    import os
    import signal
    import time

    from support.brokerproc import BrokerProc

    from shmbroker.client.producer import Producer

    count = 500
    broker = BrokerProc(tmp_path)
    broker.start()
    try:
        ingest = broker.role_pids()["ingest-0"]
        os.kill(ingest, signal.SIGSTOP)  # it drains nothing from here on
        with Producer("stuck", data_dir=broker.data_dir) as p:
            flat = np.arange(count * 4, dtype=np.uint32)
            ids = set(p.submit_many(flat, np.arange(count + 1, dtype=np.int64) * 4, max_new_tokens=1).tolist())
            p._auto_ack = False
        broker.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        os.kill(ingest, signal.SIGKILL)  # dies during the stop
        assert broker.proc.wait(60) == 0
        assert "salvaged to the backlog" in broker.log()
        broker.start()
        with Producer("stuck", data_dir=broker.data_dir) as p:
            assert result_ids(p, count) == ids
    finally:
        broker.stop()


def test_a_start_on_a_disk_too_full_to_salvage_comes_up_and_appends_the_rings_once_there_is_room(tmp_path):
    """Before: a start whose salvage found no room waited for room forever (only a running broker
    frees any), so a broker on a disk its backlog had filled never came back. Now it starts, keeps
    the dead broker's ring (its items in shared memory), and ingest-0 appends them once room is back."""
    import os
    import secrets
    import signal
    import time

    from support.brokerproc import BrokerProc
    from support.harness import shm_leftovers
    from support.smallfs import fill, mounted_tmpfs

    from shmbroker.client.producer import Producer

    count = 300
    instance = "ls" + secrets.token_hex(3)
    broker = BrokerProc(tmp_path, instance=instance)
    with mounted_tmpfs(tmp_path / "fs", mib=40) as mnt:
        broker.data_dir = str(mnt / "data")
        broker.start()
        try:
            os.kill(broker.role_pids()["ingest-0"], signal.SIGSTOP)  # it drains nothing from here on
            with Producer("stuck", data_dir=broker.data_dir) as p:
                ids = set(p.submit_many(np.arange(count * 4, dtype=np.uint32), np.arange(count + 1, dtype=np.int64) * 4,
                                        max_new_tokens=1).tolist())
                p._auto_ack = False
            broker.kill()  # the whole broker dies; its ingest ring, with every item, stays in /dev/shm
            for reserve in mnt.rglob(".reserve"):  # spent by the full disk that came before
                reserve.unlink()
            filler = fill(mnt, leave_bytes=32 << 10)  # no room for even a small salvage segment
            broker.start(ready_timeout_seconds=60)
            assert "no room on the disk for what 1 ingest rings" in broker.log()
            time.sleep(1.5)
            with Producer("stuck", data_dir=broker.data_dir) as p:
                assert not list(p.results(timeout_seconds=0.5))  # nowhere to go yet
                filler.unlink()  # room again
                assert result_ids(p, count) == ids
            assert broker.stop() == 0
            assert shm_leftovers(instance) == []  # the dead broker's ring too, once salvaged
        finally:
            if broker.proc is not None and broker.proc.poll() is None:
                broker.kill()
