"""Request options carried with their items through a real broker (`shmbroker supervise`, the
simulated engine): they reach the engine as submitted, survive a SIGKILL of the GPU process and of
the whole broker, a damaged option word makes its item `corrupt`, and an option the engine cannot
honour fails that item alone."""

from __future__ import annotations

import time

import numpy as np
import pytest
from support.brokerproc import BrokerProc, serve

from shmbroker.client.producer import Producer
from shmbroker.engines.sim import Sim
from shmbroker.engines.sim_requests import output_length, sample_key
from shmbroker.request.options import OptionsError, RequestOptions

pytestmark = pytest.mark.timeout(180)

PACKED = """
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "big"
max_batch_size = 32
max_batch_tokens = 65536
max_input_len = 8192
engine_settings = { mode = "packed", cache_tokens = 262144 }
"""
SLOW = PACKED.replace('cache_tokens = 262144 }', 'cache_tokens = 262144, pace_seconds = 0.2 }')


def expected(item_id: int, tokens, max_new: int, opts: RequestOptions | None) -> np.ndarray:
    """What the simulated engine generates for an item under its options (engines/sim_requests.py)."""
    digest = Sim.digest(tokens)
    key = sample_key(item_id, digest, opts)
    out = Sim.generated_many(np.array([item_id], np.uint64), np.array([max_new]), keys=np.array([key], np.uint64)).flat
    return out[: output_length(out, opts)]


def collect(p: Producer, ids, timeout: float = 60.0) -> dict:
    want, got = {int(i) for i in ids}, {}
    deadline = time.monotonic() + timeout
    while want - set(got) and time.monotonic() < deadline:
        for r in p.results(timeout_seconds=1.0):
            got[r.item_id] = r
    assert want <= set(got), f"{len(want - set(got))} results missing"
    return got


def test_options_reach_the_engine_and_an_unhonoured_one_fails_alone(tmp_path):
    rng = np.random.default_rng(3)
    prompt = rng.integers(1, 30_000, 300).astype(np.uint32)
    greedy = RequestOptions(temperature=0.0)
    seeded = RequestOptions(temperature=0.8, top_p=0.9, seed=1234)
    sim_stop = Sim.generated_many(np.array([0], np.uint64), np.array([64]),
                                  keys=np.array([sample_key(0, Sim.digest(prompt), greedy)], np.uint64)).flat
    stopping = RequestOptions(temperature=0.0, stop_token_ids=(int(sim_stop[9]),), min_tokens=3)
    with serve(tmp_path, "ro", PACKED) as broker, Producer("opts", data_dir=broker.data_dir) as p:
        plain = [p.submit(prompt, max_new_tokens=16) for _ in range(3)]
        greedy_ids = [p.submit(prompt, max_new_tokens=16, options=greedy) for _ in range(3)]
        seeded_ids = [p.submit(prompt, max_new_tokens=16, options={"temperature": 0.8, "top_p": 0.9, "seed": 1234})
                      for _ in range(2)]
        stop_id = p.submit(prompt, max_new_tokens=64, options=stopping)
        many = p.submit_many(np.tile(prompt, 4), np.arange(5) * prompt.size, max_new_tokens=16, options=seeded)
        n4 = p.submit(prompt, max_new_tokens=64, options={"n": 4, "temperature": 1.0, "seed": 5,
                                                          "stop_token_ids": list(stopping.stop_token_ids)})
        n_big = p.submit(prompt, max_new_tokens=8, options={"n": 33})  # more than the card's max_batch_size
        got = collect(p, [*plain, *greedy_ids, *seeded_ids, stop_id, *many.tolist(), n4, n_big])
    assert all(got[i].status == "ok" for i in got if i != n_big)
    outs = {i: got[i].tokens.tolist() for i in got}
    assert len({tuple(outs[i]) for i in plain}) == 3  # no options: each item its own tokens, as ever
    assert outs[plain[0]] == Sim.generated(plain[0], 16, prompt).tolist()
    assert len({tuple(outs[i]) for i in greedy_ids}) == 1  # greedy: the prompt's tokens, whatever the item
    assert outs[greedy_ids[0]] == expected(greedy_ids[0], prompt, 16, greedy).tolist()
    assert len({tuple(outs[i]) for i in [*seeded_ids, *many.tolist()]}) == 1  # one seed: one sample
    assert outs[seeded_ids[0]] == expected(seeded_ids[0], prompt, 16, seeded).tolist()
    assert outs[stop_id] == sim_stop[:10].tolist()  # ended at the stop id, which it keeps
    assert got[stop_id].finish_reasons == ("stop",) and got[greedy_ids[0]].finish_reasons == ("length",)
    assert got[plain[0]].samples[0].tolist() == outs[plain[0]] and got[plain[0]].finish_reasons == ("length",)
    assert all(got[i].cached_tokens is not None for i in got if i != n_big)  # the packed engine says what it cached
    samples = [s.tolist() for s in got[n4].samples]  # four samples, one after another, each its own
    assert len(samples) == 4 and len({tuple(s) for s in samples}) == 4 and sum(map(len, samples)) == len(outs[n4])
    assert samples[0] == expected(n4, prompt, 64, RequestOptions(temperature=1.0, seed=5,
                                                                  stop_token_ids=stopping.stop_token_ids)).tolist()
    assert got[n_big].status == "invalid" and "n = 33" in got[n_big].error


def test_wrong_options_are_refused_before_anything_is_written(tmp_path):
    with serve(tmp_path, "rw", PACKED) as broker, Producer("wrong", data_dir=broker.data_dir) as p:
        first = p.next_item_id
        for bad, says in [({"temperature": 9}, "'temperature'"), ({"min_tokens": 20}, "'min_tokens'"),
                          ({"stop": [""]}, "'stop'"), ({"logprobs": True, "top_logprobs": 30}, "'top_logprobs'")]:
            with pytest.raises(OptionsError, match=says):
                p.submit([1, 2, 3], max_new_tokens=8, options=bad)
        with pytest.raises(TypeError, match="options must be"):
            p.submit([1, 2, 3], max_new_tokens=8, options=["temperature", 0])
        assert p.next_item_id == first  # nothing written
        ok = p.submit([1, 2, 3], max_new_tokens=8, options={"temperature": 0})
        assert collect(p, [ok])[ok].status == "ok"


@pytest.mark.parametrize("kill", ["gpu", "broker"])
def test_options_survive_a_sigkill(tmp_path, kill):
    """Items with options in flight and queued when the GPU process (or the whole broker) is killed
    run after the restart with their own options: each result is its options' output."""
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 30_000, 200).astype(np.uint32) for _ in range(40)]
    sets = [RequestOptions(temperature=0.0), RequestOptions(seed=0, temperature=1.0),
            RequestOptions(seed=1, temperature=1.0), None]
    broker = BrokerProc(tmp_path, config=SLOW, instance="rk" + str(time.monotonic_ns() % 100000))
    broker.start()
    try:
        with Producer("killed", data_dir=broker.data_dir) as p:
            ids = {p.submit(t, max_new_tokens=12, options=sets[k % 4]): (t, sets[k % 4]) for k, t in enumerate(prompts)}
        time.sleep(1.0)  # some in the engine, most queued
        if kill == "gpu":
            broker.kill_role("gpu-big")
        else:
            broker.kill()
            broker.start()
        with Producer("killed", data_dir=broker.data_dir) as p:
            got = collect(p, ids, timeout=120)
    finally:
        broker.stop()
    for i, (tokens, opts) in ids.items():
        assert got[i].status == "ok", got[i].error
        assert got[i].tokens.tolist() == expected(i, tokens, 12, opts).tolist()


def test_a_hostile_producer_cannot_give_another_producers_items_its_options(tmp_path):
    """A producer writes raw ingest records with option word counts and words of its own making:
    garbage words fail its own item `invalid`, a count that leaves no token is refused at ingest,
    and another producer's items run with their own options (or none), exactly."""
    from shmbroker.ring import spsc
    from shmbroker.ring.items import NO_PREFIX

    rng = np.random.default_rng(9)
    prompt = rng.integers(1, 30_000, 100).astype(np.uint32)
    mine = RequestOptions(temperature=0.0, seed=3)
    with serve(tmp_path, "rh", PACKED) as broker, Producer("good", data_dir=broker.data_dir) as good, \
            Producer("hostile", data_dir=broker.data_dir) as bad:
        sub = bad._submitter
        garbage = np.concatenate([prompt, rng.integers(0, 1 << 32, 12, dtype=np.uint64).astype(np.uint32)])
        assert spsc.push(sub.buf, garbage, sub.seq, 8, NO_PREFIX, 0, 12) in (0, 1)
        bad_id = sub.id_base | sub.seq
        sub.seq += 1
        assert spsc.push(sub.buf, prompt[:4], sub.seq, 8, NO_PREFIX, 0, 4) in (0, 1)  # no token left: refused
        sub.seq += 1
        sub.ring.data_bell.ring()
        ids = {good.submit(prompt, max_new_tokens=8, options=mine): mine, good.submit(prompt, max_new_tokens=8): None}
        got = collect(good, ids)
        theirs = collect(bad, [bad_id])
    for i, opts in ids.items():
        assert got[i].status == "ok" and got[i].tokens.tolist() == expected(i, prompt, 8, opts).tolist()
    assert theirs[bad_id].status == "invalid" and "not readable" in theirs[bad_id].error
