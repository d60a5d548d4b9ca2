"""The `vllm` engine embedding (`task = "embed"`: vLLM's pooling runner, engines/vllm_pooling.py).

1. Over a test double (`FakePoolingVLLM`, a pooling `LLMEngine` stand-in built on test_engines_packed's
   `FakeVLLM`, under its stub `vllm` package, since vLLM is not installed in the project's
   environment): the engine's arguments, one `PoolingParams(task="embed")` per item with its
   `dimensions`, each vector back as the item's float32 words with its cached tokens, `dimensions`
   refused by name for a model without Matryoshka dimensions, a step that raises isolating the item
   that makes it fail (the probe a pooling request), a dead engine failing no item.
2. The real thing (`tests/support/vllm_embed_check.py` under `.venv-vllm`; skipped, saying why,
   without it): a broker with a real vLLM pooling consumer; every vector equals vLLM's own `LLM.embed`
   of the same input (cosine >= 0.9999, the Matryoshka cuts included); the items that must fail do,
   alone; the consumer reports prefix-cache hits. The same items through the `openai` engine in front of
   `vllm serve --runner pooling` equal it too.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest
from support.vllm_venv import check_report
from test_engines_packed import FakeVLLM, batch_of, forget_engine, vllm_engine  # noqa: F401 - a fixture

from shmbroker.engines.base import ENGINE_ERROR, INVALID, OK, EngineDead
from shmbroker.engines.catalogue import load_engine
from shmbroker.engines.options import VLLMSettings
from shmbroker.engines.packed_args import vllm_llm_kwargs
from shmbroker.pack.contract import Contract
from shmbroker.request.options import Task, embedding

CONTRACT = Contract(8, 4096, 512)
DIMS = 16


class StubPoolingParams:
    """Stands in for `vllm.PoolingParams`: keeps its task and dimensions."""

    def __init__(self, task=None, dimensions=None):
        self.task, self.dimensions = task, dimensions


def vector_for(prompt, dimensions=None) -> np.ndarray:
    """The test double's vector of a prompt: a unit vector seeded by its tokens, cut and renormalised."""
    v = np.random.default_rng(abs(hash(tuple(prompt))) % (1 << 32)).standard_normal(DIMS)[:dimensions]
    return (v / np.linalg.norm(v)).astype(np.float32)


class FakePoolingVLLM(FakeVLLM):
    """Test double for vLLM's `LLMEngine` on the pooling runner: a request finishes at the step that
    admits it (one prefill), as a `PoolingRequestOutput` whose `outputs.data` is `vector_for` its
    prompt (a torch tensor in vLLM: anything numpy reads here), with the prefix-cache model's cached
    tokens; a prompt holding `poison` makes every step it runs in raise."""

    def __init__(self, *, matryoshka: bool = True, **kw):
        super().__init__(**kw)
        self.model_config = SimpleNamespace(get_vocab_size=lambda: 50_000, is_matryoshka=matryoshka)

    def step(self):
        self.steps += 1
        while self.waiting and len(self.running) < self.max_running:
            rid, ids, params = self.waiting.pop(0)
            self.running[rid] = [ids, params, 0, self.cache.query(ids)]
        if self.poison is not None and any(self.poison in r[0] for r in self.running.values()):
            raise RuntimeError("index out of bounds in the pooler")
        done = [SimpleNamespace(request_id=rid, finished=True, num_cached_tokens=r[3], error=None,
                                outputs=SimpleNamespace(data=vector_for(r[0], r[1].dimensions)))
                for rid, r in self.running.items()]
        self.running.clear()
        return done


@pytest.fixture
def pooling(vllm_engine, monkeypatch):  # noqa: F811 - the fixture imported above
    """make(fake) -> a `vllm` engine that embeds over the test double, loaded by the registry."""
    monkeypatch.setattr(sys.modules["vllm"], "PoolingParams", StubPoolingParams, raising=False)
    monkeypatch.delitem(sys.modules, "shmbroker.engines.vllm_pooling", raising=False)
    made = []

    def make(fake):
        made.append(load_engine("vllm", VLLMSettings(model="m", task=Task.EMBED), block_tokens=16,
                                contract=CONTRACT, engine=fake))
        return made[-1]

    yield make
    for engine in made:
        engine.close()
    if "shmbroker.engines.vllm_pooling" in sys.modules:
        forget_engine(sys.modules["shmbroker.engines.vllm_pooling"])


def drain(engine) -> dict:
    got = {}
    while engine.pending():
        got.update((r.item_id, r) for r in engine.poll(1.0).results)
    return got


def test_embedding_engine_arguments_are_the_pooling_runners():
    kwargs = vllm_llm_kwargs(VLLMSettings(model="m", task=Task.EMBED, max_new_tokens=64), CONTRACT)
    assert (kwargs["runner"], kwargs["convert"]) == ("pooling", "auto")
    assert kwargs["max_model_len"] == CONTRACT.max_input_len  # nothing generated
    # prefix caching and structured outputs are vLLM's default for the model / a generator's only
    assert "enable_prefix_caching" not in kwargs and "structured_outputs_config" not in kwargs
    plain = vllm_llm_kwargs(VLLMSettings(model="m"), CONTRACT)
    assert "runner" not in plain and plain["max_model_len"] == CONTRACT.max_input_len + 256


def test_each_item_is_one_pooling_request_and_its_vector_its_result(pooling):
    fake = FakePoolingVLLM(max_running=3)
    engine = pooling(fake)
    assert engine.honours == {"embed", "dimensions"}
    prompts = [list(range(1, 40)), list(range(1, 40)) + [7], [5, 6], [9] * 20]
    opts = [embedding(), embedding(), embedding(8), None]
    engine.add(batch_of([1, 2, 3, 4], prompts, [0] * 4, options=opts))
    got = drain(engine)
    assert [p.task for _, _, p in fake.added] == ["embed"] * 4
    assert [p.dimensions for _, _, p in fake.added] == [None, None, 8, None]
    for i, p, o in zip([1, 2, 3, 4], prompts, opts):
        r = got[i]
        assert r.status == OK and r.tokens.dtype == np.uint32
        want = vector_for(p, None if o is None else o.dimensions)
        assert np.array_equal(r.tokens.view(np.float32), want)  # bit-exact: the engine's float32 values
    from shmbroker.request.extras import decode_extras

    extras = decode_extras(got[2].extras, got[2].tokens.size)
    assert extras.vector and extras.cached_tokens == 32  # two 16-token blocks item 1 computed


def test_dimensions_are_refused_by_name_without_matryoshka(pooling):
    assert pooling(FakePoolingVLLM(matryoshka=False)).honours == {"embed"}


def test_a_step_that_raises_fails_only_the_item_that_causes_it(pooling):
    fake = FakePoolingVLLM(max_running=8, poison=666)
    engine = pooling(fake)
    engine.add(batch_of([1, 2, 3], [[1, 2], [3, 666], [4]], [0, 0, 0], options=[embedding()] * 3))
    got = drain(engine)
    assert {i: r.status for i, r in got.items()} == {1: OK, 2: ENGINE_ERROR, 3: OK}
    assert "index out of bounds" in got[2].error
    probe = [p for rid, _, p in fake.added if rid == "shmbroker-probe"]
    assert len(probe) == 1 and probe[0].task == "embed"  # charged after a pooling probe answered


def test_a_dead_engine_fails_no_item(pooling):
    class Dying(FakePoolingVLLM):
        def step(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    engine = pooling(Dying())
    engine.add(batch_of([1, 2], [[1, 2], [3]], [0, 0]))
    with pytest.raises(EngineDead, match="illegal memory access"):
        engine.poll(0.5)


def test_a_dimension_vllm_refuses_fails_alone_invalid(pooling):
    from test_engines_packed import StubClientError

    class Refusing(FakePoolingVLLM):
        def add_request(self, request_id, prompt, params):
            if params.dimensions == 50:
                raise StubClientError("Model 'm' only supports Matryoshka dimensions [8, 16], got 50.")
            super().add_request(request_id, prompt, params)

    engine = pooling(Refusing())
    engine.add(batch_of([1, 2], [[1, 2], [3]], [0, 0], options=[embedding(50), embedding(8)]))
    got = drain(engine)
    assert got[1].status == INVALID and "got 50" in got[1].error and got[2].status == OK


# -- the real vLLM --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return check_report("vllm_embed_check.py", tmp_path_factory.mktemp("vllm-embed"), 600)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.mark.timeout(700)
def test_every_vector_through_a_real_vllm_consumer_equals_llm_embed(report):
    assert report["supervisor_exit"] == 0, report["log_tail"]
    got, ref = report["results"], report["reference"]
    assert len(got) == len(report["kinds"]), report["log_tail"]
    for k, kind in enumerate(report["kinds"]):
        r = got[str(k)]
        assert r["status"] == kind, (k, r["status"], r["error"])
        if kind != "ok":
            continue
        want = ref[str(k)]
        assert len(r["vector"]) == len(want) == (report["dimensions"][k] or 128), k
        assert cosine(r["vector"], want) >= 0.9999, k
        assert abs(float(np.linalg.norm(r["vector"])) - 1.0) < 1e-4
    errors = {kind: got[str(k)]["error"] for k, kind in enumerate(report["kinds"]) if kind != "ok"}
    assert "Matryoshka dimensions [32, 64, 128], got 50" in errors["invalid"]
    assert "out of the model's vocabulary" in errors["engine_error"]
    # the families' later members found their shared prefixes in vLLM's cache
    assert sum(got[str(k)]["cached_tokens"] or 0 for k in range(len(got))) > 0
    assert report["consumer"]["reused_tokens"] > 0 and report["consumer"]["hit_blocks"] > 0


@pytest.mark.timeout(700)
def test_an_embeddings_batch_file_through_a_real_vllm_consumer_equals_llm_embed(report):
    """The runnable prompts as `/v1/embeddings` lines (token arrays, float and base64, one line of
    three inputs) through `submit --job --wait`: each line's vectors are `LLM.embed`'s, in order."""
    file, ref = report["file"], report["reference"]
    assert file["exit"] == 0, report["log_tail"]
    runnable = [k for k, kind in enumerate(report["kinds"]) if kind == "ok"]
    assert sorted(file["vectors"]) == sorted([f"p{k}" for k in runnable] + ["three"])
    for k in runnable:
        (v,) = file["vectors"][f"p{k}"]
        assert len(v) == len(ref[str(k)]) and cosine(v, ref[str(k)]) >= 0.9999, k
    assert [cosine(v, ref[str(k)]) >= 0.9999 for v, k in zip(file["vectors"]["three"], file["three"])] == [True] * 3


@pytest.mark.timeout(700)
def test_every_vector_through_an_openai_consumer_of_vllm_serve_equals_llm_embed(report):
    """The same items through the `openai` engine in front of `vllm serve --runner pooling` (base64
    vectors, two items a request): each equals `LLM.embed`'s; what the server refuses fails alone,
    `invalid`, with its message (a token id past the vocabulary too: the server checks it)."""
    served = report["served"]
    assert served["supervisor_exit"] == 0, served["log_tail"]
    got, ref = served["results"], report["reference"]
    assert len(got) == len(report["kinds"]), served["log_tail"]
    refusals = {}
    for k, kind in enumerate(report["kinds"]):
        r = got[str(k)]
        if kind == "ok":
            assert r["status"] == "ok", (k, r["error"])
            assert len(r["vector"]) == len(ref[str(k)]) and cosine(r["vector"], ref[str(k)]) >= 0.9999, k
        else:
            assert r["status"] == ("too_long" if kind == "too_long" else "invalid"), (k, r)
            refusals[kind] = r["error"]
    assert refusals["invalid"].startswith("HTTP 400") and "got 50" in refusals["invalid"]
    assert "out of vocabulary" in refusals["engine_error"]
