"""The producer client's parts: what `from shmbroker import Producer` loads, the Producer's sides
(its submitter and its result reader) attached again on reconnect, and a dropped Producer closed.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from shmbroker.client.checks import BatchFields, batch_fields
from shmbroker.client.producer import Producer
from shmbroker.ring import layout as L
from shmbroker.ring.items import SEQ_MASK, STATUS_CODES
from shmbroker.ring.ring import PRODUCER

pytestmark = pytest.mark.timeout(60)

# what a producer process may load of the package: the client and what it stands on
CLIENT_MODULES = ("shmbroker.client", "shmbroker.protocol", "shmbroker.request", "shmbroker.ring", "shmbroker.errors",
                  "shmbroker.jit")

LOADED = """
import json, sys
import shmbroker
shmbroker.Producer
print(json.dumps(sorted(m for m in sys.modules if m.startswith("shmbroker"))))
"""


def test_the_producer_loads_only_the_client_and_what_it_stands_on():
    out = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, timeout=50,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout)
    assert "shmbroker.client.producer" in loaded
    outside = [m for m in loaded if m != "shmbroker" and not any(m == c or m.startswith(c + ".") for c in CLIENT_MODULES)]
    assert outside == []


def test_reconnect_attaches_the_submitter_and_the_reader_again(broker):
    with Producer("back", data_dir=broker.data_dir) as p:
        first = p.submit([1], max_new_tokens=0)
        out = broker.entry("back").results.attach(PRODUCER)
        try:
            session = int(out.header[L.H_SESSION])
            p.reconnect()
            assert p.reconnects == 1
            assert int(out.header[L.H_SESSION]) == session + 1  # the reader announced itself again
            assert p.submit([2], max_new_tokens=0) == first + 1  # the sequence goes on
            out.header[L.H_SESSION_READY] = out.header[L.H_SESSION]  # the results process's answer
            assert out.push(np.array([7], np.uint32), first, STATUS_CODES["ok"], 1, 0, 0) == L.OK
            got = list(p.results(timeout_seconds=0.5))
            assert [r.item_id for r in got] == [first]
            assert got[0].tokens.tolist() == [7]
        finally:
            out.close()
    assert [int(r.tokens[0]) for r in broker.collect("back", 2)] == [1, 2]


def test_a_dropped_producer_closes_its_rings_at_once(broker):
    """Its sides hold the producer weakly: dropping the last reference closes it then, not at the
    garbage collector's next round."""
    gc.disable()
    try:
        p = Producer("dropped", data_dir=broker.data_dir)
        p.submit([1], max_new_tokens=0)
        ingest, results = p._submitter.ring, p._reader.ring
        del p
        assert ingest.buf is None
        assert results.buf is None
    finally:
        gc.enable()
    with Producer("dropped", data_dir=broker.data_dir) as again:  # the name is free again
        assert again.submit([2], max_new_tokens=0) & SEQ_MASK == 1


def test_results_keep_a_producer_nobody_else_holds_open(broker):
    p = Producer("held", data_dir=broker.data_dir)
    first = p.submit([1], max_new_tokens=0)
    out = broker.entry("held").results.attach(PRODUCER)
    try:
        out.header[L.H_SESSION_READY] = out.header[L.H_SESSION]
        assert out.push(np.array([5], np.uint32), first, STATUS_CODES["ok"], 1, 0, 0) == L.OK
        results = p.results(timeout_seconds=0.2)
        del p
        assert [r.item_id for r in results] == [first]
    finally:
        out.close()


def test_batch_fields_are_named():
    offs = np.array([0, 2, 5], np.int64)
    fields = batch_fields(3, [1, 2], offs)
    assert isinstance(fields, BatchFields)
    assert fields.shared is False
    assert fields.max_new.tolist() == [3, 3]
    assert fields.prefixes.tolist() == [1, 2]
    shared = batch_fields(4, None, offs)
    assert shared.shared is True and shared.prefixes is None and shared.max_new.tolist() == [4]


def test_reading_from_a_closed_producer_is_a_clear_error_and_loses_nothing(broker):
    from shmbroker.errors import BrokerError

    p = Producer("closed-reader", data_dir=broker.data_dir)
    p.close()
    for read in (lambda: list(p.results(0.01)), lambda: p.pop_results(), lambda: p.take_results(0.01)):
        with pytest.raises(BrokerError, match="is closed"):
            read()
    p.ack()  # acknowledging after close does nothing (close settled what was handed out)
    with Producer("closed-reader", data_dir=broker.data_dir) as again:  # the name is free, its rings whole
        assert again.take_results(0.01).item_ids.size == 0
