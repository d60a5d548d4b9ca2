"""The supervisor's children: they never compile a numba kernel (first start and restart alike)."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.brokerproc import BrokerProc

from shmbroker.client.producer import Producer
from shmbroker.control.segment import R_COMPILES, R_RESTARTS, Control
from shmbroker.control.stats import read_role


def _slots(broker) -> dict[str, tuple[int, int]]:
    info = broker.info()
    ctl = Control.attach(info["control"], info["roles"])
    try:
        return {role: (int(ctl.role(r)[R_COMPILES]), int(ctl.role(r)[R_RESTARTS])) for r, role in enumerate(info["roles"])}
    finally:
        ctl.close()


def _traffic(p: Producer, rng, count: int) -> None:
    ids = {p.submit(rng.integers(0, 100, int(n), dtype=np.uint32), max_new_tokens=2,
                    prefix_len=5 if n > 10 else None) for n in rng.integers(1, 3000, count)}
    ids |= set(p.submit_many(np.arange(1000, dtype=np.uint32), [0, 500, 1000], max_new_tokens=1).tolist())
    ids.add(p.submit(np.arange(9000, dtype=np.uint32), max_new_tokens=1))  # too long: a failed row
    got = set()
    deadline = time.monotonic() + 30
    while got != ids and time.monotonic() < deadline:
        got |= {r.item_id for r in p.results(0.2)}
    assert got == ids


@pytest.mark.timeout(120)
def test_children_never_compile_also_after_a_restart(tmp_path):
    rng = np.random.default_rng(3)
    with BrokerProc(tmp_path) as broker, Producer("compiles", data_dir=broker.data_dir) as p:
        _traffic(p, rng, 200)
        assert all(c == 0 for c, _ in _slots(broker).values()), _slots(broker)
        for role in ("sched", "gpu-small", "results", "ingest-0"):
            old = broker.kill_role(role)
            deadline = time.monotonic() + 20
            while broker.role_pids()[role] in (0, old):
                assert time.monotonic() < deadline, broker.log()
                time.sleep(0.05)
        _traffic(p, rng, 200)
        slots = _slots(broker)
        assert all(c == 0 for c, _ in slots.values()), slots
        assert all(slots[r][1] == 1 for r in ("sched", "gpu-small", "results", "ingest-0")), slots


@pytest.mark.timeout(120)
def test_two_ingest_processes_share_the_producers(tmp_path):
    from support.brokerproc import SMALL_CONFIG

    with BrokerProc(tmp_path, config="ingest_processes = 2\n" + SMALL_CONFIG) as broker:
        assert {"ingest-0", "ingest-1"} <= set(broker.role_pids())
        rng = np.random.default_rng(5)
        with Producer("one", data_dir=broker.data_dir) as a, Producer("two", data_dir=broker.data_dir) as b:
            _traffic(a, rng, 150)
            _traffic(b, rng, 150)
        info = broker.info()
        ctl = Control.attach(info["control"], info["roles"], readonly=True)
        try:
            ingested = [read_role(ctl, info["roles"].index(f"ingest-{k}"))["items"] for k in (0, 1)]
        finally:
            ctl.close()
        assert all(n > 0 for n in ingested), ingested  # each drained one producer's ring
        assert (tmp_path / "data" / "backlog" / "w001").is_dir()
