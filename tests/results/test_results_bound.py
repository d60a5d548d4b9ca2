"""a producer name that never reads no longer pins the shared results log. Past
`results_name_bytes` its results move to a log of its own (`behind.py`); the shared log is trimmed
past it; a replay after a crash gives the name each of its results exactly once, in order."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_results_log import _Cfg as _LogCfg
from test_results_log import _Control

from shmbroker.frontdoor.registry import ProducerBook
from shmbroker.results.behind import BEHIND_DIR
from shmbroker.results.log import FILE_BYTES_MIN
from shmbroker.results.router import Router
from shmbroker.ring.wire import encode_results, res_bytes

TOKENS = 60
RECORD = res_bytes(TOKENS)


class _Cfg(_LogCfg):
    results_name_bytes = 1 << 16  # files of FILE_BYTES_MIN


def _records(ids: np.ndarray) -> np.ndarray:
    count = ids.size
    offsets = np.arange(count + 1, dtype=np.int64) * TOKENS
    flat = (np.arange(TOKENS * count, dtype=np.uint32) * 7) & 0xFFFF
    out = np.zeros(count * RECORD, np.uint8)
    done, at = encode_results(out, 0, ids, ids, np.zeros(count, np.uint32), np.zeros(count, np.uint32), flat,
                              offsets, 0, count)
    assert done == count and at == out.size
    return out


def _feed(router: Router, ids: np.ndarray, per_batch: int = 64) -> None:
    """As `take` does with GPU batches: append each batch to the shared log and route it."""
    for k in range(0, ids.size, per_batch):
        data = _records(ids[k : k + per_batch])
        at = router.log.append(data)
        n = ids[k : k + per_batch].size
        pos = np.arange(n, dtype=np.int64) * RECORD
        router.route(data, pos, at, ack=True)


def _parked_ids(router: Router, name: str) -> list[int]:
    """The item ids of a name's parked results, in order (left parked)."""
    log = router.behind.log_of(name)
    queue = router.parked[name]
    parts = queue.take_all()
    for part in parts:
        queue.extend(part)
    return [int(log.read(int(at), 16)[8:16].view(np.uint64)[0]) for part in parts for at in part]


def _shared_bytes(tmp_path) -> int:
    return sum(p.stat().st_size for p in (tmp_path / "results").glob("*.log"))


def test_a_name_that_never_reads_moves_to_its_own_log_and_the_shared_log_is_trimmed(tmp_path):
    lazy = ProducerBook(str(tmp_path)).assign("lazy") << 40
    router = Router(str(tmp_path), _Cfg(), _Control())
    router.replay()
    ids = lazy + np.arange(40_000, dtype=np.uint64)  # ~10 MiB of results, none ever read
    _feed(router, ids[:20_000])
    router.checkpoint(force=True)
    assert "lazy" in router.behind  # moved: its cursor fell past results_name_bytes
    _feed(router, ids[20_000:])
    router.checkpoint(force=True)
    # the shared log holds at most its newest file (plus the one being filled): nothing pins it
    assert _shared_bytes(tmp_path) <= 2 * FILE_BYTES_MIN
    names, held = router.behind_now()
    assert names == 1 and held == ids.size * RECORD
    assert _parked_ids(router, "lazy") == ids.tolist()
    router.close()


def test_a_replay_gives_a_name_far_behind_each_result_once_in_order_even_after_a_crash(tmp_path):
    lazy = ProducerBook(str(tmp_path)).assign("lazy") << 40
    router = Router(str(tmp_path), _Cfg(), _Control())
    router.replay()
    ids = lazy + np.arange(12_000, dtype=np.uint64)
    _feed(router, ids[:8_000])
    router.checkpoint(force=True)
    assert "lazy" in router.behind
    _feed(router, ids[8_000:])  # copied to its log, but no checkpoint saved them: a crash now
    router.log.sync()  # (the shared log's records are on disk, as `take` leaves them for the GPUs' sake)
    # no close: the process dies here
    again = Router(str(tmp_path), _Cfg(), _Control())
    try:
        assert "lazy" in again.behind
        again.replay()
        assert _parked_ids(again, "lazy") == ids.tolist()  # the copies after the checkpoint are made again, once
    finally:
        again.close()
    third = Router(str(tmp_path), _Cfg(), _Control())  # a clean restart: the same
    try:
        third.replay()
        assert _parked_ids(third, "lazy") == ids.tolist()
    finally:
        third.close()


def test_a_full_disk_midway_through_a_move_leaves_the_name_as_it_was(tmp_path, monkeypatch):
    import errno

    from shmbroker.results import behind as behind_mod

    lazy = ProducerBook(str(tmp_path)).assign("lazy") << 40
    router = Router(str(tmp_path), _Cfg(), _Control())
    router.replay()
    ids = lazy + np.arange(20_000, dtype=np.uint64)
    real = behind_mod.NameLog.append
    calls = []

    def append(self, data, rows):
        calls.append(1)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data, rows)

    monkeypatch.setattr(behind_mod.NameLog, "append", append)
    _feed(router, ids)
    router.checkpoint(force=True)  # the move fails; the checkpoint goes on without it
    assert router.counters[6] == 1  # counted as a full disk
    assert "lazy" not in router.behind and not any((tmp_path / "results" / BEHIND_DIR).iterdir())
    assert _parked_ids(router, "lazy") == ids.tolist()  # still there, in the shared log
    monkeypatch.setattr(behind_mod.NameLog, "append", real)
    router.checkpoint(force=True)  # the disk has room again: moved
    assert "lazy" in router.behind
    assert _parked_ids(router, "lazy") == ids.tolist()
    router.close()


def test_a_log_no_cursor_names_is_deleted_at_start(tmp_path):
    stray = tmp_path / "results" / BEHIND_DIR / "0badc0de-0"
    stray.mkdir(parents=True)
    (stray / f"{0:020d}.log").write_bytes(b"x" * 100)
    router = Router(str(tmp_path), _Cfg(), _Control())
    try:
        assert not stray.exists()
    finally:
        router.close()


# -- a real broker -----------------------------------------------------------------------------

LAZY_ITEMS = 12_000


def _status(broker) -> dict:
    from shmbroker.observe.watch import BrokerView

    view = BrokerView.attach(broker.data_dir)
    try:
        return view.snapshot()
    finally:
        view.close()


def test_a_broker_keeps_a_name_that_never_reads_apart_and_gives_it_everything_after_a_kill(tmp_path):
    import time

    from support.brokerproc import SMALL_CONFIG, BrokerProc

    from shmbroker.client.producer import Producer

    flat = np.arange(LAZY_ITEMS, dtype=np.uint32) + np.uint32(1 << 16)
    offsets = np.arange(LAZY_ITEMS + 1, dtype=np.int64)
    with BrokerProc(tmp_path, config="results_name_bytes = 65536\n" + SMALL_CONFIG) as broker:
        lazy = Producer("lazy", data_dir=broker.data_dir)  # submits, never reads
        ids = set(lazy.submit_many(flat, offsets, max_new_tokens=64).tolist())
        with Producer("busy", data_dir=broker.data_dir) as busy:
            mine = set(busy.submit_many(flat + np.uint32(1 << 20), offsets, max_new_tokens=64).tolist())
            got: set[int] = set()
            deadline = time.monotonic() + 120
            while len(got) < len(mine):
                assert time.monotonic() < deadline, f"busy: {len(got)} of {len(mine)}"
                got.update(r.item_id for r in busy.results(timeout_seconds=1.0))
            assert got == mine
        deadline = time.monotonic() + 60
        while True:
            report = _status(broker)
            res = report["results"]
            if res["names_behind"] == 1 and res["results"] >= 2 * LAZY_ITEMS and res["behind"]:
                break
            assert time.monotonic() < deadline, res
            time.sleep(0.3)
        assert [b["name"] for b in res["behind"]] == ["lazy"]
        shared = _shared_bytes(Path(broker.data_dir))
        assert res["log_bytes"] > 6 * FILE_BYTES_MIN  # what the shared log would hold if lazy pinned it
        assert shared <= 3 * FILE_BYTES_MIN, shared
        lazy._auto_ack = False
        lazy.close()
        broker.kill()  # SIGKILL: the replay finds lazy in its own log
        broker.start()
        with Producer("lazy", data_dir=broker.data_dir) as again:
            seen: list[int] = []
            deadline = time.monotonic() + 120
            while len(seen) < len(ids):
                assert time.monotonic() < deadline, f"lazy: {len(seen)} of {len(ids)}"
                seen.extend(r.item_id for r in again.results(timeout_seconds=1.0))
            assert len(seen) == len(ids) and set(seen) == ids  # each once (the client drops duplicates)
        deadline = time.monotonic() + 30
        while _status(broker)["results"]["names_behind"]:  # all read: back on the shared log, its own deleted
            assert time.monotonic() < deadline
            time.sleep(0.3)
        behind = Path(broker.data_dir) / "results" / BEHIND_DIR
        deadline = time.monotonic() + 10
        while any(behind.iterdir()):
            assert time.monotonic() < deadline, list(behind.iterdir())
            time.sleep(0.2)
