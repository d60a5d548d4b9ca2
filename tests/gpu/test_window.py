"""The GPU process's in-flight window (gpu/consumer.Window) over a real batch ring: the engine is
kept full within the contract, results are written as items finish, in any order, and a record is
released only when every item of it has a result."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbroker.config.broker import BrokerConfig
from shmbroker.engines.base import EngineOutcome, ItemResult
from shmbroker.gpu.backoff import WindowLimits
from shmbroker.gpu.core import ConsumerCore
from shmbroker.gpu.window import Window
from shmbroker.pack.contract import Contract
from shmbroker.pack.feeding import window_items
from shmbroker.ring import layout as L
from shmbroker.ring.owned import create_ring
from shmbroker.ring.ring import CONSUMER, PRODUCER
from shmbroker.ring.wire import LOC_DTYPE


class ScriptedEngine:
    """Test double of a streaming engine: each poll finishes up to `per_poll` items in flight, in the
    order `pick` chooses (out of order by default: the newest first); it records how many items it
    ever held at once."""

    def __init__(self, mode="packed", per_poll=3, pick=None):
        self.mode = mode
        self.per_poll = per_poll
        self.pick = pick or (lambda held: held[::-1])
        self.held: list[tuple[int, int]] = []
        self.max_held = 0
        self.adds: list[int] = []

    def add(self, batch):
        self.adds.append(len(batch))
        self.held.extend((int(i), int(m)) for i, m in zip(batch.item_ids, batch.max_new_tokens))
        self.max_held = max(self.max_held, len(self.held))

    def pending(self):
        return len(self.held)

    def poll(self, timeout_seconds):
        done = self.pick(list(self.held))[: self.per_poll]
        for d in done:
            self.held.remove(d)
        return EngineOutcome([ItemResult(i, "ok", np.full(m, i % 1000, np.uint32)) for i, m in done])

    def close(self):
        pass


class Writes:
    """Stands in for the results ring's writer: every write, in order."""

    def __init__(self):
        self.calls: list[list[int]] = []

    def write(self, res, seqs, writers):
        assert np.array_equal(seqs, res.item_ids + 1000)  # each result goes with its own item's location
        self.calls.append(res.item_ids.tolist())


class Views:
    def tokens(self, writer, segment, offset, length):
        return np.arange(length, dtype=np.uint32)

    def check(self, locs, words_out=None):
        return np.zeros(locs.size, np.int64)  # every record whole (records.CHECK_OK), no options

    def option_words(self, locs):
        return None  # no item carries request options


def push_records(ring, sizes, *, first_id=1, length=10, failed_every=0):
    """Batch records as the scheduler pushes them: item locations, n_run, n_failed, packed time."""
    next_id = first_id
    for k, n in enumerate(sizes):
        locs = np.zeros(n, LOC_DTYPE)
        locs["item_id"] = np.arange(next_id, next_id + n)
        locs["seq"] = locs["item_id"] + 1000
        locs["num_tokens"] = length
        locs["max_new_tokens"] = 1 + locs["item_id"] % 5
        locs["prefix_key"] = 7
        n_failed = 1 if failed_every and k % failed_every == 0 and n > 1 else 0
        if n_failed:
            locs["aux"][n - 1] = 1  # too_long, as the scheduler marks it
        assert ring.push(locs.view(np.uint32).reshape(-1), k, n - n_failed, n_failed, 0, 0) == L.OK
        next_id += n
    return next_id - first_id


def drain(window, rounds=100_000):
    for _ in range(rounds):
        window.take_more()
        if window.empty:
            return
        window.poll(0)
        window.admit()
        window.release_done()
    raise AssertionError("the window did not drain")


def make(owner, contract, engine, role="b"):
    owned = create_ring(owner, role, 1 << 20)
    prod, cons = owned.attach(PRODUCER), owned.attach(CONSUMER)
    writes = Writes()
    core = ConsumerCore(contract, engine)
    window = Window(core, cons, writes, Views(), 0, window_items(contract.max_batch_size, engine.mode),
                    limits=WindowLimits.of(BrokerConfig(data_dir="unused")))
    return prod, cons, writes, window


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bs=st.integers(1, 48), sizes=st.lists(st.integers(1, 60), min_size=1, max_size=12),
       per_poll=st.integers(1, 9), mode=st.sampled_from(["packed", "padded"]))
def test_the_window_never_exceeds_the_contract_and_every_item_comes_back_once(owner, bs, sizes, per_poll, mode):
    sizes = [min(s, bs) for s in sizes]  # a record holds at most max_batch_size items
    contract = Contract(bs, 1 << 20, 4096)
    engine = ScriptedEngine(mode, per_poll)
    prod, cons, writes, window = make(owner, contract, engine, role=f"w{np.random.randint(1 << 30)}")
    try:
        total = push_records(prod, sizes, failed_every=3)
        drain(window)
        got = [i for call in writes.calls for i in call]
        assert sorted(got) == list(range(1, total + 1))  # each item once, the failed rows too
        limit = window_items(bs, mode)
        assert engine.max_held <= limit
        if mode == "packed":
            assert engine.max_held <= bs + max(1, bs // 8)
        else:
            assert all(a <= bs for a in engine.adds)  # whole rectangles, each within the contract
        assert cons.used_words() == 0  # every record released
    finally:
        prod.close()
        cons.close()


def test_out_of_order_results_are_written_as_items_finish_and_records_release_in_order(owner):
    contract = Contract(8, 1 << 16, 4096)
    engine = ScriptedEngine("packed", per_poll=1, pick=lambda held: sorted(held, key=lambda x: -x[0]))
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        push_records(prod, [4, 4, 4])  # ids 1-4, 5-8, 9-12
        window.take_more()
        # the window took records until it held max_batch_size + 1 items: all of the first two, one of the third
        assert engine.max_held == 9 and len(window.taken) == 3
        window.poll(0)  # the engine finishes the newest item first (id 9, of the third record)
        assert writes.calls == [[9]]  # written at once, not when its record is done
        assert window.release_done() == 0  # the oldest record is still open: nothing is released
        drain(window)
        order = [i for call in writes.calls for i in call]
        assert sorted(order) == list(range(1, 13)) and order != sorted(order)
        assert cons.used_words() == 0
    finally:
        prod.close()
        cons.close()


def test_a_finished_slot_is_refilled_from_the_ring_before_the_next_poll(owner):
    contract = Contract(4, 1 << 16, 4096)
    engine = ScriptedEngine("packed", per_poll=2, pick=lambda held: held)  # oldest first
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        push_records(prod, [4, 4, 4])
        window.take_more()
        assert engine.max_held == 5  # 4 + 1 of headroom
        window.poll(0)
        window.take_more()  # two finished: two more go in before the engine steps again
        assert len(engine.held) == 5
    finally:
        prod.close()
        cons.close()


# -- through a running broker --------------------------------------------------------------------

PACED_ONE_CONSUMER = """
ingest_ring_bytes = 1048576
result_ring_bytes = 1048576
segment_bytes = 4194304
index_items = 65536

[[consumers]]
name = "big"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 2048
engine_settings = { mode = "packed", cache_tokens = 65536, pace_seconds = 1.0 }
"""


def test_kill_9_of_the_gpu_process_with_items_in_flight_loses_none_and_duplicates_none(tmp_path):
    import time

    from support.brokerproc import BrokerProc

    from shmbroker.client.producer import Producer
    from shmbroker.engines.sim import Sim

    rng = np.random.default_rng(5)
    with BrokerProc(tmp_path, PACED_ONE_CONSUMER) as broker, Producer("k9", data_dir=broker.data_dir) as p:
        want = {}
        for _ in range(120):
            m = int(rng.integers(20, 200))
            prompt = rng.integers(0, 500, int(rng.integers(20, 400)), dtype=np.uint32)
            want[p.submit(prompt, max_new_tokens=m)] = (m, prompt)
        seen: list[int] = []
        deadline = time.monotonic() + 30
        while len(seen) < 10:
            assert time.monotonic() < deadline, broker.log()
            seen += [r.item_id for r in p.results(0.05)]
        old = broker.kill_role("gpu-big")  # with a window of items in flight, none of them answered
        assert len(seen) < len(want)
        deadline = time.monotonic() + 90
        results = {}
        while len(seen) < len(want):
            assert time.monotonic() < deadline, (len(seen), broker.log())
            for r in p.results(0.2):
                seen.append(r.item_id)
                results[r.item_id] = r
        assert broker.role_pids()["gpu-big"] not in (0, old)
        assert sorted(seen) == sorted(want)  # every item once: none lost, none yielded twice
        for i, r in results.items():
            assert r.status == "ok" and np.array_equal(r.tokens, Sim.generated(i, *want[i]))


def test_an_item_dispatched_again_while_in_flight_runs_once_and_both_rows_get_its_result(owner):
    """A restarted scheduler re-dispatches what it had not seen acked; the first copy may still be in
    the engine (an engine such as vLLM refuses a request id it already runs)."""
    contract = Contract(8, 1 << 16, 4096)
    engine = ScriptedEngine("packed", per_poll=1, pick=lambda held: held)
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        push_records(prod, [3])  # ids 1, 2, 3
        window.take_more()
        push_records(prod, [3], first_id=2)  # ids 2, 3, 4: 2 and 3 are in flight
        drain(window)
        assert engine.adds == [3, 1]  # only 4 was added again
        got = sorted(i for call in writes.calls for i in call)
        assert got == [1, 2, 2, 3, 3, 4]  # a result for every row (the client keeps the first)
        assert cons.used_words() == 0
    finally:
        prod.close()
        cons.close()


def test_results_that_interleave_records_go_to_their_own_records(owner):
    """One poll's results may come from several records in any order (a b a b b a: the first and the
    last from one record): each row to its own."""
    contract = Contract(6, 1 << 16, 4096)
    order = {1: 0, 4: 1, 2: 2, 5: 3, 6: 4, 3: 5}  # ids 1-3 in the first record, 4-6 in the second
    engine = ScriptedEngine("packed", per_poll=6, pick=lambda held: sorted(held, key=lambda x: order.get(x[0], 9)))
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        push_records(prod, [3, 3])
        window.take_more()
        window.poll(0)
        assert writes.calls == [[1, 4, 2, 5, 6, 3]]  # one write, each row with its own location
        assert [t.open for t in window.taken] == [0, 0]
        assert window.release_done() == 2 and cons.used_words() == 0
    finally:
        prod.close()
        cons.close()


def test_an_item_twice_in_one_record_runs_once(owner):
    """After a restart a record may hold the same item twice (recovered from the backlog and salvaged
    from a ring): the engine sees it once, both rows get its result."""
    contract = Contract(8, 1 << 16, 4096)
    engine = ScriptedEngine("packed", per_poll=2, pick=lambda held: held)
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        locs = np.zeros(4, LOC_DTYPE)
        locs["item_id"] = [7, 8, 7, 9]
        locs["seq"] = locs["item_id"] + 1000
        locs["num_tokens"] = 10
        locs["max_new_tokens"] = 2
        locs["prefix_key"] = 7
        assert prod.push(locs.view(np.uint32).reshape(-1), 0, 4, 0, 0, 0) == L.OK
        drain(window)
        assert engine.adds == [3]  # 7, 8, 9
        assert sorted(i for call in writes.calls for i in call) == [7, 7, 8, 9]
        assert cons.used_words() == 0
    finally:
        prod.close()
        cons.close()


def test_done_rows_of_held_records_are_published_for_the_scheduler(owner):
    """One long item holds its record, and every record behind it; the rows done behind it are
    counted in the ring's `rows_done` word (the scheduler feeds by the items still to do), and a
    record's rows leave the count as it is released."""
    contract = Contract(8, 1 << 16, 4096)
    # the engine finishes everything but item 1 (the straggler) first
    engine = ScriptedEngine("packed", per_poll=3, pick=lambda held: sorted(held, key=lambda x: (x[0] == 1, x[0])))
    prod, cons, writes, window = make(owner, contract, engine)
    try:
        push_records(prod, [4, 4], failed_every=2)  # ids 1-4 (id 4 failed back), 5-8
        window.take_more()
        assert prod.rows_done() == 1  # the failed row has its result at once
        for _ in range(2):
            window.poll(0)
            window.admit()
        assert window.release_done() == 0  # item 1 holds the first record, and so the second
        assert prod.rows_done() == 7  # every row but the straggler's
        assert prod.num_queued() == 2
        drain(window)
        assert prod.rows_done() == 0 and prod.num_queued() == 0
    finally:
        prod.close()
        cons.close()


def test_a_restarted_gpu_process_counts_the_records_it_takes_over_from_zero(owner):
    contract = Contract(8, 1 << 16, 4096)
    prod, cons, writes, window = make(owner, contract, ScriptedEngine("packed", per_poll=3, pick=lambda h: h[1:]))
    try:
        push_records(prod, [4])
        window.take_more()
        window.poll(0)
        assert window.release_done() == 0 and prod.rows_done() == 3
        # the process dies; its successor takes the unreleased record over and runs it again
        again = Window(ConsumerCore(contract, ScriptedEngine("packed")), cons, Writes(), Views(), 0,
                       window_items(8, "packed"), limits=WindowLimits.of(BrokerConfig(data_dir="unused")))
        assert prod.rows_done() == 0
        drain(again)
        assert prod.rows_done() == 0 and prod.num_queued() == 0
    finally:
        prod.close()
        cons.close()


class SampledEngine(ScriptedEngine):
    """ScriptedEngine that honours n: it counts the sequences it holds (each item's samples)."""

    honours = frozenset({"n", "temperature", "seed"})

    def __init__(self, **kw):
        super().__init__(**kw)
        self.n_of: dict[int, int] = {}
        self.max_sequences = 0

    def add(self, batch):
        for k, i in enumerate(batch.item_ids.tolist()):
            opts = batch.options_of(k)
            self.n_of[int(i)] = (opts.n or 1) if opts is not None else 1
        super().add(batch)
        self.max_sequences = max(self.max_sequences, sum(self.n_of[i] for i, _ in self.held))


class SampledViews(Views):
    """Every third item asks for n = 5 samples, every other for none."""

    @staticmethod
    def words():
        from shmbroker.request.options import encode, parse_options

        return encode(parse_options({"n": 5, "temperature": 1.0, "seed": 1}))

    def check(self, locs, words_out=None):
        if words_out is not None:
            words_out[:] = np.where(locs["item_id"] % 3 == 0, self.words().size, 0)
        return np.zeros(locs.size, np.int64)

    def option_words(self, locs):
        from shmbroker.gpu.segments import OptionWords

        return OptionWords([self.words()], np.where(locs["item_id"] % 3 == 0, 0, -1).astype(np.int64))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bs=st.integers(5, 40), sizes=st.lists(st.integers(1, 40), min_size=1, max_size=10), per_poll=st.integers(1, 9))
def test_each_sample_is_a_unit_of_the_window(owner, bs, sizes, per_poll):
    """An item asking for n samples takes n of the window's sequences: the engine never holds more
    sequences than the window allows (one item alone may fill it), and every item comes back once."""
    sizes = [min(s, bs) for s in sizes]
    contract = Contract(bs, 1 << 20, 4096)
    engine = SampledEngine(per_poll=per_poll)
    owned = create_ring(owner, f"s{np.random.randint(1 << 30)}", 1 << 20)
    prod, cons = owned.attach(PRODUCER), owned.attach(CONSUMER)
    writes = Writes()
    limit = window_items(bs, "packed")
    window = Window(ConsumerCore(contract, engine), cons, writes, SampledViews(), 0, limit,
                    limits=WindowLimits.of(BrokerConfig(data_dir="unused")))
    try:
        total = push_records(prod, sizes)
        drain(window)
        assert sorted(i for call in writes.calls for i in call) == list(range(1, total + 1))
        assert engine.max_sequences <= limit
        if total >= 3:  # a sampled item was in the engine: the window counted its samples
            assert max(engine.n_of.values()) == 5 and window.num_admitted == 0 and not window.extra
    finally:
        prod.close()
        cons.close()
