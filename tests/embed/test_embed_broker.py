"""Embedding items through a real broker (`shmbroker supervise`, the simulated engine with
`task = "embed"`): each result is its prompt's vector, bit-exact, carried as float32 words and marked
so by its extras; an item of the other task fails alone, naming why, on either kind of consumer;
`dimensions` is a Matryoshka cut where the engine declares it and refused by name where not."""

from __future__ import annotations

import numpy as np
import pytest
from support.brokerproc import serve

from shmbroker.client.producer import Producer
from shmbroker.engines.options import SimSettings
from shmbroker.engines.base import truncated
from shmbroker.engines.sim_embed import SimEmbedder
from shmbroker.request.options import EMBED, OptionsError, Task, parse_options

pytestmark = pytest.mark.timeout(180)

CONFIG = """
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "enc"
model = "enc"
max_batch_size = 32
max_batch_tokens = 16384
max_input_len = 512
engine_settings = {{ mode = "padded", task = "embed", embed_dimensions = {dims}, matryoshka = true, pace_seconds = 0 }}

[[consumers]]
name = "gen"
model = "gen"
max_batch_size = 16
max_batch_tokens = 16384
max_input_len = 512
engine_settings = {{ mode = "packed", pace_seconds = 0 }}

[[consumers]]
name = "flat"
model = "flat"
max_batch_size = 16
max_batch_tokens = 16384
max_input_len = 512
engine_settings = {{ mode = "padded", task = "embed", embed_dimensions = 8, pace_seconds = 0 }}
"""
DIMS = 1024


def results_of(p: Producer, n: int, timeout_seconds: float = 60.0) -> dict:
    out = {}
    for r in p.results(timeout_seconds):
        out[r.item_id] = r
        if len(out) == n:
            break
    return out


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    with serve(tmp_path_factory.mktemp("embed"), "emb", CONFIG.format(dims=DIMS)) as b:
        yield b


def test_each_embedding_is_its_prompts_vector_bit_exact(broker):
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 30000, int(n), dtype=np.uint32) for n in rng.integers(1, 500, 300)]
    model = SimEmbedder(SimSettings(task=Task.EMBED, embed_dimensions=DIMS))
    with Producer("embedder", data_dir=broker.data_dir) as p:
        ids = [p.embed(t, model="enc") for t in prompts]
        cut = p.embed(prompts[0], model="enc", dimensions=64)
        got = results_of(p, len(ids) + 1)
    assert set(got) == {*ids, cut}
    for i, t in zip(ids, prompts):
        r = got[i]
        assert r.status == "ok", r.error
        assert r.vector is not None and r.vector.dtype == np.float32 and r.vector.size == DIMS
        assert np.array_equal(r.vector.view(np.uint32), model.vector(t).view(np.uint32))  # bit-exact
        assert r.samples[0].size == DIMS  # one sample: the vector's words
    v = got[cut].vector
    assert v.size == 64 and np.array_equal(v, truncated(model.vector(prompts[0]), 64))
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-5


def test_an_item_of_the_other_task_fails_alone_naming_why(broker):
    t = np.arange(1, 40, dtype=np.uint32)
    with Producer("mixed", data_dir=broker.data_dir) as p:
        gen_on_enc = p.submit(t, max_new_tokens=8, model="enc")
        emb_on_gen = p.submit(t, max_new_tokens=0, model="gen", options=EMBED)
        fine = [p.embed(t, model="enc"), p.submit(t, max_new_tokens=4, model="gen")]
        dims_refused = p.embed(t, model="flat", dimensions=4)
        got = results_of(p, 5)
    assert got[gen_on_enc].status == "invalid" and "embeds" in got[gen_on_enc].error
    assert got[emb_on_gen].status == "invalid" and "a vector of its prompt" in got[emb_on_gen].error
    assert got[dims_refused].status == "invalid" and "'dimensions'" in got[dims_refused].error
    assert [got[i].status for i in fine] == ["ok", "ok"]
    assert got[fine[0]].vector.size == DIMS and got[fine[1]].vector is None and got[fine[1]].tokens.size == 4


def test_embedding_options_are_checked_at_the_producer():
    with pytest.raises(OptionsError, match="no generation option"):
        parse_options({"embed": True, "temperature": 0.5})
    with pytest.raises(OptionsError, match="needs 'embed'"):
        parse_options({"dimensions": 8})
    with pytest.raises(OptionsError, match="'dimensions' must be"):
        parse_options({"embed": True, "dimensions": 0})
    assert parse_options({"embed": True, "dimensions": 8}).task is Task.EMBED


def test_a_vector_wider_than_a_result_record_fails_alone(tmp_path):
    """A result ring of 64 KiB takes records of at most 32 KiB: a vector of 16,384 values (64 KiB)
    fails `engine_error` saying so, and its neighbours of 1,024 values come back."""
    config = CONFIG.format(dims=16384).replace("segment_bytes", "result_ring_bytes = 65536\nsegment_bytes")
    config = config.replace('embed_dimensions = 8,', 'embed_dimensions = 1024,')
    with serve(tmp_path, "ebig", config) as broker:
        with Producer("wide", data_dir=broker.data_dir) as p:
            t = np.arange(1, 30, dtype=np.uint32)
            wide, narrow = p.embed(t, model="enc"), p.embed(t, model="flat")
            got = results_of(p, 2)
    assert got[wide].status == "engine_error" and "larger than a result record may be" in got[wide].error
    assert got[narrow].status == "ok" and got[narrow].vector.size == 1024
