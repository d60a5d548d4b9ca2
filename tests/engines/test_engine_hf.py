"""The `hf` engine on the CPU with a tiny random-weight Llama: prefix reuse changes no output, a bad
item fails alone (once a probe answers) while a dead engine fails none, generation through the whole
broker, request options and constraints (xgrammar, with a byte-level BPE tokenizer), and a small
`bench gpu` run."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the hf engine needs torch (the test extra installs it)")
pytest.importorskip("transformers", reason="the hf engine needs transformers (the test extra installs it)")

from support.bpetok import bpe_tokenizer_dir  # noqa: E402
from support.brokerproc import BrokerProc  # noqa: E402

from shmbroker.client.producer import Producer  # noqa: E402
from shmbroker.engines.base import BatchResults, EngineBatch, EngineDead, EngineUnavailable  # noqa: E402
from shmbroker.engines.batch_stream import BatchStream  # noqa: E402
from shmbroker.engines.catalogue import load_engine  # noqa: E402
from shmbroker.engines.deaths import PROBE_ITEM_ID  # noqa: E402
from shmbroker.engines.hf import HF, alone, unbatched  # noqa: E402
from shmbroker.engines.options import HFSettings  # noqa: E402
from shmbroker.gpu.core import ConsumerCore  # noqa: E402
from shmbroker.pack.contract import Batch, Contract, Shape  # noqa: E402
from shmbroker.request.extras import decode_extras, samples_of  # noqa: E402
from shmbroker.request.options import RequestOptions, parse_options  # noqa: E402

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 500, "max_position_embeddings": 1024,
        "eos_token_id": None, "bos_token_id": None, "pad_token_id": None}
# float64: batched and unbatched sums then differ by ~1e-15, far below any gap between two logits
EXACT = HFSettings(config=TINY, dtype="float64", device="cpu", seed=3)


@pytest.fixture(scope="module")
def engine():
    return HF(EXACT, block_tokens=16)


def _family(rng, prefix_len: int, suffixes) -> list[np.ndarray]:
    prefix = rng.integers(0, 500, size=prefix_len).astype(np.uint32)
    return [np.concatenate([prefix, rng.integers(0, 500, size=int(k)).astype(np.uint32)]) for k in suffixes]


def test_prefix_reuse_changes_no_output(engine):
    rng = np.random.default_rng(1)
    items = _family(rng, 48, (5, 17, 1, 9))
    max_new = np.array([3, 6, 2, 4])
    out = engine.run(EngineBatch(np.arange(4, dtype=np.uint64), items, max_new))
    for r, tokens, m in zip(out.results.items(), items, max_new):
        assert r.status == "ok"
        assert r.tokens.size == m  # max_new_tokens honoured (no EOS in this model)
        assert r.tokens.tolist() == unbatched(engine, tokens, int(m))
    # the prefix (48 tokens = 3 blocks of 16) was computed once and served all four items
    assert out.reused_tokens == 3 * 48 and out.hit_blocks == 3 * 3
    assert out.queried_blocks == sum(t.size // 16 for t in items)
    suffixes = [t.size - 48 for t in items]
    assert out.rect_tokens == 4 * max(suffixes) and out.padded_tokens == 4 * max(suffixes) - sum(suffixes)


def test_the_next_batch_of_the_family_reuses_the_kept_prefix(engine):
    rng = np.random.default_rng(2)
    first = _family(rng, 40, (4, 6))
    engine.run(EngineBatch(np.arange(2, dtype=np.uint64), first, np.array([2, 2])))
    second = [np.concatenate([first[0][:40], rng.integers(0, 500, size=k).astype(np.uint32)]) for k in (3, 8, 2)]
    out = engine.run(EngineBatch(np.arange(3, dtype=np.uint64), second, np.array([3, 3, 3])))
    assert out.reused_tokens == 3 * 40  # all of it from the kept cache, none recomputed
    for r, tokens in zip(out.results.items(), second):
        assert r.tokens.tolist() == unbatched(engine, tokens, 3)
    other = _family(rng, 40, (5, 5))  # another family: the kept prefix does not match
    out = engine.run(EngineBatch(np.arange(2, dtype=np.uint64), other, np.array([2, 2])))
    assert out.reused_tokens == 40  # computed once, reused by the second item
    assert [r.tokens.tolist() for r in out.results.items()] == [unbatched(engine, t, 2) for t in other]


def test_max_new_tokens_zero_is_prefill_only(engine):
    rng = np.random.default_rng(13)
    items = _family(rng, 20, (4, 6))
    out = engine.run(EngineBatch(np.arange(2, dtype=np.uint64), items, np.array([0, 3])))
    got = [r.tokens.tolist() for r in out.results.items()]
    assert got[0] == [] and got[1] == unbatched(engine, items[1], 3)


def test_without_reuse_it_is_a_plain_padded_batch(engine):
    plain = HF(dataclasses.replace(EXACT, reuse_prefix=False, keep_prefix=False), block_tokens=16)
    rng = np.random.default_rng(4)
    items = _family(rng, 32, (3, 11))
    out = plain.run(EngineBatch(np.arange(2, dtype=np.uint64), items, np.array([2, 2])))
    assert out.reused_tokens == 0 and out.hit_blocks == 0
    assert out.rect_tokens == 2 * max(t.size for t in items)
    assert [r.tokens.tolist() for r in out.results.items()] == [unbatched(engine, t, 2) for t in items]


def test_generation_stops_at_eos():
    probe = HF(EXACT, block_tokens=16)
    tokens = np.arange(20, dtype=np.uint32)
    first = unbatched(probe, tokens, 1)[0]
    with_eos = HF(dataclasses.replace(EXACT, config={**TINY, "eos_token_id": first}), block_tokens=16)
    out = with_eos.run(EngineBatch(np.array([7], np.uint64), [tokens], np.array([5])))
    assert out.results.items()[0].tokens.tolist() == [first]  # the EOS is kept, nothing after it


def test_a_failing_item_does_not_fail_its_batch(engine):
    rng = np.random.default_rng(5)
    items = _family(rng, 32, (4, 4, 4))
    items[1] = items[1].copy()
    items[1][-1] = 10_000  # outside the 500-token vocabulary
    contract = Contract(8, 4096, 512)
    rows = np.arange(3, dtype=np.uint64)
    lengths = np.array([t.size for t in items], np.int64)
    batch = Batch.of(0, Shape(0, 1, int(lengths.min()), int(lengths.max())), rows, lengths, np.full(3, 2, np.int64),
                     families=np.ones(3, np.uint64))
    res = ConsumerCore(contract, engine).process(batch, items)
    assert res.status.tolist() == [0, 3, 0]  # ok, engine_error, ok
    assert "outside the model's vocabulary" in res.errors[1]
    assert res.flat[res.offsets[0] : res.offsets[1]].tolist() == unbatched(engine, items[0], 2)


# -- a dead engine told apart from a bad item (engines/deaths.py, BatchStream in engines/base.py) --

CUDA_LOST = "CUDA error: an illegal memory access was encountered"


class FailingHF:
    """Test double around the real HF engine: `run` is the real engine's until `fail_after` calls
    have run, then every call raises `error` (a lost CUDA context repeats on every later call).
    `ran` keeps each call's item ids; `close` leaves the shared real engine open."""

    def __init__(self, real: HF, fail_after: int | None = None, error: Exception | None = None):
        self.real, self.fail_after, self.error = real, fail_after, error
        self.mode = real.mode
        self.engine_name = "hf"
        self.ran: list[list[int]] = []

    def run(self, batch):
        self.ran.append([int(i) for i in batch.item_ids])
        if self.fail_after is not None and len(self.ran) > self.fail_after:
            raise self.error
        return self.real.run(batch)

    def close(self) -> None:
        pass


def _batches(rng, count: int, size: int) -> list[EngineBatch]:
    return [EngineBatch(np.arange(b * 10, b * 10 + size, dtype=np.uint64), _family(rng, 16, [3] * size),
                        np.full(size, 2, np.int64)) for b in range(count)]


def _until_dead(stream: BatchStream, deadline_seconds: float = 60.0) -> tuple[list, EngineDead]:
    """Poll until the stream raises EngineDead: (the results that came before it, the EngineDead)."""
    got: list = []
    deadline = time.monotonic() + deadline_seconds
    while time.monotonic() < deadline:
        try:
            out = stream.poll(0.2)
        except EngineDead as dead:
            return got, dead
        got.extend(out.results.items() if isinstance(out.results, BatchResults) else out.results)
    raise AssertionError(f"no EngineDead within {deadline_seconds} s; results: {got}")


@pytest.mark.parametrize("error, runs_after", [
    (RuntimeError(CUDA_LOST), 1),  # a lost context: dead at once, nothing run alone
    (RuntimeError("the kernel said no"), 3),  # no death words: the batch, its first item, the probe
])
def test_a_dead_engine_fails_no_item(engine, error, runs_after):
    """After 2 batches every call raises: poll hands back the 2 finished batches, then raises
    EngineDead; the batch that was running and the one after it get no result, none engine_error."""
    double = FailingHF(engine, fail_after=2, error=error)
    stream = BatchStream(double)
    batches = _batches(np.random.default_rng(40), 4, 3)
    for b in batches:
        stream.add(b)
    got, dead = _until_dead(stream)
    assert sorted(r.item_id for r in got) == [0, 1, 2, 10, 11, 12] and {r.status for r in got} == {"ok"}
    assert str(error) in str(dead) and stream.gone() == str(dead)
    assert len(double.ran) == 2 + runs_after  # nothing after the death: the 4th batch never ran
    if runs_after == 3:
        assert double.ran[3:] == [[20], [PROBE_ITEM_ID]] and "3 times in a row" in str(dead)
    with pytest.raises(EngineDead):
        stream.add(batches[0])
    with pytest.raises(EngineDead):
        stream.poll(0.0)
    assert stream.pending() == 6  # the last two batches: neither answered nor failed
    stream.close()


def test_a_poison_item_alone_fails_once_a_probe_answers(engine):
    """A token the model cannot take makes the real batch raise: the items run alone, and the
    poison one is charged engine_error only after a one-token probe ran; the others are ok."""
    double = FailingHF(engine)
    stream = BatchStream(double)
    rng = np.random.default_rng(41)
    items = _family(rng, 24, (4, 4, 4))
    items[1] = items[1].copy()
    items[1][-1] = 10_000  # outside the 500-token vocabulary
    stream.add(EngineBatch(np.array([7, 8, 9], np.uint64), items, np.full(3, 2, np.int64)))
    got = []
    deadline = time.monotonic() + 60
    while len(got) < 3 and time.monotonic() < deadline:
        out = stream.poll(0.2)
        got.extend(out.results.items() if isinstance(out.results, BatchResults) else out.results)
    by_id = {r.item_id: r for r in got}
    assert [by_id[i].status for i in (7, 8, 9)] == ["ok", "engine_error", "ok"]
    assert "outside the model's vocabulary" in by_id[8].error
    assert by_id[7].tokens.tolist() == unbatched(engine, items[0], 2)
    assert double.ran == [[7, 8, 9], [7], [8], [PROBE_ITEM_ID], [9]]  # the probe answered before 8 was charged
    assert stream.streak.count == 0 and stream.gone() is None
    stream.close()


def test_a_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers -> ImportError
    monkeypatch.delitem(sys.modules, "shmbroker.engines.hf", raising=False)
    with pytest.raises(EngineUnavailable, match=r"pip install 'shmbroker\[hf\]'"):
        load_engine("hf", EXACT, block_tokens=16)


HF_CONFIG = """
metrics_addr = ""
block_tokens = 16

[[consumers]]
name = "cpu"
engine = "hf"
max_batch_size = 8
max_batch_tokens = 4096
max_input_len = 512

[consumers.engine_settings]
dtype = "float64"
device = "cpu"
seed = 3
threads = 1

[consumers.engine_settings.config]
model_type = "llama"
hidden_size = 64
intermediate_size = 128
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
vocab_size = 500
max_position_embeddings = 1024
"""


@pytest.mark.timeout(180)
def test_generation_through_the_whole_broker(tmp_path, engine):
    rng = np.random.default_rng(6)
    # the first family fills a rectangle (max_batch_size 8) and pays for its own: its prefix is
    # computed once; the second, of 3, is too small to and batches loose (pack/loose.py)
    items = _family(rng, 48, (3, 9, 14, 2, 7, 5, 11, 4)) + _family(rng, 20, (6, 6, 30))
    items.append(np.arange(600, dtype=np.uint32) % 500)  # longer than max_input_len: too_long
    with BrokerProc(tmp_path, config=HF_CONFIG) as broker:
        with Producer("hf", data_dir=broker.data_dir) as p:
            ids = [p.submit(t, max_new_tokens=3) for t in items]
            got = {}
            deadline = time.monotonic() + 120
            while len(got) < len(items):
                assert time.monotonic() < deadline, "results did not all arrive"
                for r in p.results(timeout_seconds=1.0):
                    got[r.item_id] = r
        from shmbroker.observe.watch import BrokerView

        view = BrokerView.attach(broker.data_dir)
        try:
            while view.snapshot()["consumers"]["cpu"]["items"] < len(items) - 1:  # counted just after results
                assert time.monotonic() < deadline
                time.sleep(0.02)
            card = view.snapshot()["consumers"]["cpu"]
        finally:
            view.close()
    # the GPU process's accounting: the engine's own seconds, the loop's busy time, the prefixes reused
    assert card["tokens"] == sum(t.size for t in items[:-1])
    assert card["busy_ns"] >= card["engine_own_ns"] > 0
    assert card["reused_tokens"] > 0 and card["rect_tokens"] > 0
    for item_id, tokens in zip(ids[:-1], items[:-1]):
        assert got[item_id].status == "ok", got[item_id].error
        assert got[item_id].tokens.tolist() == unbatched(engine, tokens, 3)  # same seed, same weights
    assert got[ids[-1]].status == "too_long"


@pytest.mark.timeout(180)
def test_bench_gpu_small_run_on_the_cpu():
    from shmbroker.bench import gpu, gpu_alone

    out = gpu.run(scale=0.25, device="cpu")  # on the CPU also where a GPU is (the device check runs this)
    assert out["device"] == "cpu"
    assert out["items"] >= 8 and out["input_tokens"] > 0
    for side in ("fifo", "broker"):
        assert out[side]["useful_tokens_per_s"] > 0 and out[side]["batches"] > 0
        assert out[side]["consumer_overhead"] is not None
    assert out["fifo"]["prefix_tokens_reused"] == 0
    assert out["broker"]["padding_waste"] < out["fifo"]["padding_waste"]
    assert out["sample_outputs_equal_unbatched"] == out["sample_items"] > 0
    live = out["live"]  # through a running broker with an hf consumer
    assert live["batches"] > 0 and live["useful_tokens_per_s"] > 0
    assert live["busy_seconds"] >= live["engine_seconds"] > 0 and live["consumer_loop_overhead"] >= 0
    assert out["speedup"] == pytest.approx(out["broker"]["useful_tokens_per_s"] / out["fifo"]["useful_tokens_per_s"],
                                           rel=1e-2)
    alone = out["engine_alone"]  # every item in arrival order through transformers' own batching
    assert alone["method"] in (gpu_alone.CONTINUOUS, gpu_alone.CONTINUOUS_ONE_CALL, gpu_alone.PADDED)
    assert (alone["fallback_reason"] is None) == (alone["method"] != gpu_alone.PADDED)
    assert alone["items"] == out["items"] and alone["generated_tokens"] == out["items"] * out["max_new_tokens"]
    assert alone["useful_tokens_per_s"] > 0
    assert alone["broker_speedup"] == pytest.approx(out["broker"]["useful_tokens_per_s"] / alone["useful_tokens_per_s"],
                                                    rel=1e-2)


def test_the_broker_imports_no_engine_package_until_a_gpu_process_loads_one():
    import subprocess

    code = ("import sys\n"
            "from shmbroker import cli\n"
            "from shmbroker.config import settings\n"
            "from shmbroker.observe import watch\n"
            "from shmbroker.supervisor import supervise as supervisor\n"
            "from shmbroker.gpu import consumer\n"
            "settings.parse({'consumers': [{'name': 'a', 'max_batch_size': 4, 'max_batch_tokens': 4096, "
            "'max_input_len': 1024, 'engine': 'hf', 'engine_settings': {'config': {'model_type': 'llama'}}}]})\n"
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'tensorrt_llm', 'httpx') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine (CI has none)")


@CUDA
def test_on_a_gpu_prefix_reuse_changes_no_output():
    gpu = HF(dataclasses.replace(EXACT, device="cuda"), block_tokens=16)  # float64 on the GPU: exact
    rng = np.random.default_rng(9)
    items = _family(rng, 64, (5, 30, 2, 17))
    out = gpu.run(EngineBatch(np.arange(4, dtype=np.uint64), items, np.array([4, 4, 4, 4])))
    assert [r.tokens.tolist() for r in out.results.items()] == [unbatched(gpu, t, 4) for t in items]
    assert out.reused_tokens == 3 * 64


@CUDA
def test_on_a_gpu_bf16_runs_by_default():
    gpu = HF(dataclasses.replace(EXACT, dtype="auto", device="auto"), block_tokens=16)
    assert gpu.device.type == "cuda" and gpu.dtype == torch.bfloat16
    rng = np.random.default_rng(10)
    items = _family(rng, 32, (4, 8))
    out = gpu.run(EngineBatch(np.arange(2, dtype=np.uint64), items, np.array([3, 5])))
    assert [r.status for r in out.results.items()] == ["ok", "ok"]
    assert [r.tokens.size for r in out.results.items()] == [3, 5]


def test_a_sliding_window_model_runs_its_suffixes_unpadded():
    """Sliding-window masks follow cache columns: a right-padded item would lose real tokens from its
    window while decoding. Such a model keeps the shared prefix but runs each suffix unpadded."""
    cfg = {**TINY, "model_type": "mistral", "sliding_window": 8}
    cfg.pop("max_position_embeddings")
    sliding = HF(dataclasses.replace(EXACT, config=cfg), block_tokens=16)
    assert sliding.sliding
    rng = np.random.default_rng(12)
    items = _family(rng, 30, (3, 12, 7))
    out = sliding.run(EngineBatch(np.arange(3, dtype=np.uint64), items, np.array([6, 6, 6])))
    assert [r.tokens.tolist() for r in out.results.items()] == [unbatched(sliding, t, 6) for t in items]
    assert out.padded_tokens == 0 and out.reused_tokens == 2 * 30


def test_bench_gpu_checks_bf16_samples_on_a_float32_copy():
    """On a GPU the bench runs bf16; its sample check re-runs the sampled batches on a float32 copy
    of the same weights (here: the same path on the CPU)."""
    from shmbroker.bench import gpu
    from shmbroker.pack.shapes import shape_items
    from shmbroker.workloads.feeders import PackerFeeder

    setup = dataclasses.replace(gpu.CPU_SETUP, dtype="bfloat16", items=24)
    wl = gpu.backlog(setup, None, 1.0, 0)
    shapes = shape_items(wl.tokens, wl.offsets, block_tokens=setup.block_tokens)
    plan = gpu.batches(PackerFeeder, setup, wl, shapes)
    engine = HF(HFSettings(config=setup.model, dtype="bfloat16", device="cpu", seed=0, threads=1),
                block_tokens=setup.block_tokens)
    sample = np.arange(0, len(wl), 5)
    equal, dtype = gpu._sample_check(engine, wl, plan, sample, setup, outputs={})
    assert dtype == "float32 copy of the weights"
    assert equal == sample.size
    assert engine.model.dtype == torch.bfloat16  # the copy, not the engine's weights, went to float32


def test_bench_gpu_engine_alone_generates_what_each_item_alone_does(engine):
    """The engine-alone side, both ways (transformers' continuous batching where the release has it,
    and generate on left-padded arrival-order batches): every item's greedy tokens equal the item
    run alone (float64: exact)."""
    from shmbroker.bench import gpu, gpu_alone
    from shmbroker.pack.shapes import shape_items
    from shmbroker.workloads.feeders import FifoFeeder

    setup = dataclasses.replace(gpu.CPU_SETUP, model=TINY, dtype="float64", items=12, max_new_tokens=3)
    wl = gpu.backlog(setup, None, 1.0, 0)
    plan = gpu.batches(FifoFeeder, setup, wl, shape_items(wl.tokens, wl.offsets, block_tokens=setup.block_tokens))
    prompts = [wl.item(i).tolist() for i in range(len(wl))]
    alone = [unbatched(engine, wl.item(i), 3) for i in range(len(wl))]
    padded = gpu_alone.run(engine.model, prompts, plan, setup, continuous=False)
    assert padded.method == gpu_alone.PADDED and padded.fallback_reason
    assert [padded.outputs[i] for i in range(len(wl))] == alone
    own = gpu_alone.run(engine.model, prompts, plan, setup)
    assert own.seconds > 0 and len(own.outputs) == len(wl)
    if own.method != gpu_alone.PADDED:  # this transformers has continuous batching
        assert own.fallback_reason is None
        assert [own.outputs[i] for i in range(len(wl))] == alone


# -- request options -----------------------------------------------------------------------------------


def _with_options(items, max_new, options) -> EngineBatch:
    return EngineBatch(np.arange(len(items), dtype=np.uint64), items, np.asarray(max_new), options=options)


def _samples(result) -> tuple[list, tuple]:
    extras = decode_extras(result.extras, result.tokens.size)
    return [s.tolist() for s in samples_of(result.tokens, extras)], extras.finish_reasons


def test_options_greedy_unchanged_and_a_seed_samples_the_same_in_any_batch(engine):
    rng = np.random.default_rng(21)
    items = _family(rng, 24, (3, 9, 5, 5))
    items[3] = items[2]  # the same prompt under another seed
    seeded = RequestOptions(temperature=1.5, top_p=0.95, top_k=100, seed=7)
    other = RequestOptions(temperature=1.5, top_p=0.95, top_k=100, seed=8)
    opts = [None, RequestOptions(temperature=0.0), seeded, other]
    out = engine.run(_with_options(items, [6] * 4, opts)).results.items()
    greedy = [unbatched(engine, t, 6) for t in items]
    assert out[0].tokens.tolist() == greedy[0] and out[1].tokens.tolist() == greedy[1]  # greedy: as ever
    assert _samples(out[0]) == ([greedy[0]], ("length",))
    mine = out[2].tokens.tolist()
    assert mine == unbatched(engine, items[2], 6, seeded)  # alone, unpadded, no shared prefix: the same draws
    assert mine != greedy[2] and mine != out[3].tokens.tolist()  # sampled, and the seed is what decides
    again = engine.run(_with_options([_family(rng, 24, (40,))[0], items[2]], [3, 6], [None, seeded]))
    assert again.results.items()[1].tokens.tolist() == mine  # another batch, another row, another width


def test_options_n_samples_from_one_prefill(engine):
    rng = np.random.default_rng(22)
    items = _family(rng, 20, (4, 7))
    opts = [RequestOptions(temperature=1.0, seed=3, n=3), RequestOptions(n=2)]
    out = engine.run(_with_options(items, [5, 4], opts))
    samples, reasons = _samples(out.results.items()[0])
    assert len(samples) == 3 and len({tuple(s) for s in samples}) == 3 and reasons == ("length",) * 3
    assert samples == alone(engine, items[0], 5, opts[0]).samples
    assert _samples(out.results.items()[1]) == ([unbatched(engine, items[1], 4)] * 2, ("length",) * 2)  # greedy
    assert out.rect_tokens == 2 * 7  # the prompts were prefilled once each; the samples only decode


def test_options_a_stop_id_ends_its_row_with_finish_reason_stop(engine):
    rng = np.random.default_rng(23)
    items = _family(rng, 16, (5, 5))
    greedy = unbatched(engine, items[0], 8)
    stop = greedy[2]
    opts = [RequestOptions(stop_token_ids=(stop,)), None]
    out = engine.run(_with_options(items, [8, 8], opts)).results.items()
    assert _samples(out[0]) == ([greedy[: greedy.index(stop) + 1]], ("stop",))  # the stop id kept
    assert _samples(out[1]) == ([unbatched(engine, items[1], 8)], ("length",))
    later = engine.run(_with_options(items[:1], [8], [RequestOptions(stop_token_ids=(stop,), min_tokens=4)]))
    first = later.results.items()[0].tokens.tolist()
    assert len(first) >= 4 and stop not in first[:4]  # not drawn before min_tokens are out


def test_options_ignore_eos_runs_to_max_new_tokens():
    probe = HF(EXACT, block_tokens=16)
    tokens = np.arange(20, dtype=np.uint32)
    first = unbatched(probe, tokens, 1)[0]
    with_eos = HF(dataclasses.replace(EXACT, config={**TINY, "eos_token_id": first}), block_tokens=16)
    out = with_eos.run(_with_options([tokens, tokens], [5, 5], [RequestOptions(ignore_eos=True), None]))
    got = out.results.items()
    assert _samples(got[0])[1] == ("length",) and got[0].tokens.size == 5
    assert _samples(got[1]) == ([[first]], ("stop",))  # the model's EOS still ends an item without the option


def test_options_match_transformers_generate_with_the_same_arguments(engine):
    """Greedy with a repetition penalty and a stop id, and sampling from the global generator (no seed),
    give what `model.generate` gives for the same prompt and arguments."""
    rng = np.random.default_rng(24)
    prompt = rng.integers(0, 500, size=12)
    ids = torch.as_tensor(prompt[None].astype(np.int64))

    def generate(**kwargs) -> list[int]:
        out = engine.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=8,
                                    pad_token_id=0, **kwargs)
        return out[0, ids.shape[1]:].tolist()

    plain = generate(do_sample=False, repetition_penalty=1.8)
    stop = plain[3]
    want = generate(do_sample=False, repetition_penalty=1.8, eos_token_id=[stop])
    got = unbatched(engine, prompt, 8, RequestOptions(repetition_penalty=1.8, stop_token_ids=(stop,)))
    assert got == want[: len(got)] and got[-1] == stop
    torch.manual_seed(11)
    sampled = generate(do_sample=True, temperature=0.9, top_k=50, top_p=0.9, min_p=0.01)
    torch.manual_seed(11)
    assert unbatched(engine, prompt, 8, RequestOptions(temperature=0.9, top_k=50, top_p=0.9, min_p=0.01)) == sampled


def _model_with_tokenizer(path, engine) -> str:
    """The engine's weights and a word-level tokenizer ("t0" .. "t498"; "abcdef", which transformers'
    stop-string matching encodes to find each token's text) in one model directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    engine.model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({**{f"t{i}": i for i in range(499)}, "abcdef": 499}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(path)
    return str(path)


def test_options_stop_strings_with_the_model_directorys_tokenizer(engine, tmp_path):
    assert engine.unhonoured == {"stop", "structured"}  # a config model has no tokenizer
    loaded = HF(HFSettings(model=_model_with_tokenizer(tmp_path, engine), dtype="float64", device="cpu"),
                block_tokens=16)
    assert loaded.unhonoured == set()
    rng = np.random.default_rng(25)
    items = _family(rng, 16, (4, 6))
    greedy = unbatched(loaded, items[0], 8)
    assert greedy == unbatched(engine, items[0], 8)  # the same weights
    word = f"t{greedy[3]}"
    out = loaded.run(_with_options(items, [8, 8], [RequestOptions(stop=(word,)), None])).results.items()
    cut = next(k for k, t in enumerate(greedy) if f"t{t}" == word)
    assert _samples(out[0]) == ([greedy[: cut + 1]], ("stop",))
    assert _samples(out[1])[1] == ("length",)


@pytest.mark.timeout(180)
def test_options_through_the_whole_broker(tmp_path, engine):
    """Through a broker with an hf consumer: a seeded sampled item with n = 3 comes back as its three
    samples, each what the engine gives it alone; an option hf does not honour fails that item alone."""
    rng = np.random.default_rng(26)
    items = _family(rng, 32, (4, 6, 8, 5))
    sampled = {"temperature": 1.0, "seed": 5, "n": 3}
    with BrokerProc(tmp_path, config=HF_CONFIG) as broker, Producer("hfo", data_dir=broker.data_dir) as p:
        ids = [p.submit(items[0], max_new_tokens=3), p.submit(items[1], max_new_tokens=4, options=sampled),
               p.submit(items[2], max_new_tokens=3, options={"presence_penalty": 0.5}),
               p.submit(items[3], max_new_tokens=3, options={"stop": ["t1"]}),
               p.submit(items[3], max_new_tokens=3, options={"structured_outputs": {"regex": "[a-z]+"}})]
        got = {}
        deadline = time.monotonic() + 120
        while len(got) < len(ids):
            assert time.monotonic() < deadline, "results did not all arrive"
            got.update((r.item_id, r) for r in p.results(timeout_seconds=1.0))
    assert got[ids[0]].status == "ok" and got[ids[0]].tokens.tolist() == unbatched(engine, items[0], 3)
    many = got[ids[1]]
    assert many.status == "ok" and many.finish_reasons == ("length",) * 3
    assert [s.tolist() for s in many.samples] == alone(engine, items[1], 4, RequestOptions(**sampled)).samples
    assert got[ids[2]].status == "invalid" and "'presence_penalty'" in got[ids[2]].error
    assert got[ids[3]].status == "invalid" and "'stop'" in got[ids[3]].error  # no tokenizer in a config model
    assert got[ids[4]].status == "invalid" and "'structured'" in got[ids[4]].error


def test_options_on_a_sliding_window_model():
    cfg = {**TINY, "model_type": "mistral", "sliding_window": 8}
    cfg.pop("max_position_embeddings")
    sliding = HF(dataclasses.replace(EXACT, config=cfg), block_tokens=16)
    rng = np.random.default_rng(27)
    items = _family(rng, 30, (3, 12))
    opts = [RequestOptions(temperature=1.0, seed=4, n=2), None]
    out = sliding.run(_with_options(items, [6, 6], opts)).results.items()
    assert _samples(out[0])[0] == alone(sliding, items[0], 6, opts[0]).samples
    assert out[1].tokens.tolist() == unbatched(sliding, items[1], 6)


@CUDA
def test_on_a_gpu_options_sample_with_a_generator_of_their_own():
    gpu = HF(dataclasses.replace(EXACT, device="cuda"), block_tokens=16)  # float64: batched equals alone
    rng = np.random.default_rng(28)
    items = _family(rng, 32, (5, 9))
    opts = [RequestOptions(temperature=1.0, top_p=0.9, seed=6, n=3), RequestOptions(stop_token_ids=(1,))]
    out = gpu.run(_with_options(items, [5, 5], opts)).results.items()
    assert _samples(out[0])[0] == alone(gpu, items[0], 5, opts[0]).samples
    assert _samples(out[1])[0] == alone(gpu, items[1], 5, opts[1]).samples


# -- constraints (structured outputs: xgrammar's logits processor, engines/grammars.py) ------------

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "[a-z]{1,6}"},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}}, "required": ["name", "age", "ok"]}
REGEX = r"[a-z]{3}-[0-9]{2}"
CHOICES = ["red", "green", "blue sky", "a|b (c)", 'q"\\']  # regex characters in a choice are its own
UNCLOSED = {"type": "object", "properties": {"s": {"type": "string", "pattern": "(unclosed"}}, "required": ["s"]}


def _constrained(fields: dict) -> RequestOptions:
    return parse_options({"structured_outputs": fields, "temperature": 0.0})


@pytest.fixture(scope="module")
def constrained(engine, tmp_path_factory):
    """The engine's weights with a byte-level BPE tokenizer (a word-level one cannot spell JSON)."""
    path = tmp_path_factory.mktemp("bpe-model")
    engine.model.save_pretrained(path)
    bpe_tokenizer_dir(path, TINY["vocab_size"])
    return HF(HFSettings(model=str(path), dtype="float64", device="cpu"), block_tokens=16)


def _text(engine: HF, result) -> str:
    return engine.tokenizer.decode(result.tokens.tolist(), skip_special_tokens=True)


def test_constraints_mix_with_unconstrained_rows_in_one_batch(constrained, engine):
    jsonschema = pytest.importorskip("jsonschema")
    assert constrained.unhonoured == set()
    rng = np.random.default_rng(29)
    items = _family(rng, 16, (4, 6, 5, 7, 3))
    opts = [_constrained({"json": SCHEMA, "disable_any_whitespace": True}), _constrained({"choice": CHOICES}),
            _constrained({"regex": REGEX}), None, _constrained({"grammar": 'root ::= "yes" | "no"'})]
    out = constrained.run(_with_options(items, [64] * 5, opts)).results.items()
    assert [r.status for r in out] == ["ok"] * 5
    text = [_text(constrained, r) for r in out]
    jsonschema.validate(json.loads(text[0]), SCHEMA)
    assert text[0] == json.dumps(json.loads(text[0]), separators=(",", ":"))  # disable_any_whitespace: compact
    assert text[1] in CHOICES and re.fullmatch(REGEX, text[2]) and text[4] in ("yes", "no")
    for k in (0, 1, 2, 4):  # each ended with its grammar, on the tokenizer's EOS (the model names none)
        assert _samples(out[k])[1] == ("stop",) and int(out[k].tokens[-1]) in constrained.grammars.ends
        assert out[k].tokens.tolist() == unbatched(constrained, items[k], 64, opts[k])  # batched as alone
    assert out[3].tokens.tolist() == unbatched(engine, items[3], 64)  # unconstrained: as without any


def test_a_constraint_xgrammar_cannot_compile_fails_its_item_alone(constrained, monkeypatch):
    from shmbroker.engines import grammars

    compiled = []
    real = grammars.compile_constraint
    monkeypatch.setattr(grammars, "compile_constraint", lambda c, s: compiled.append(s.kind) or real(c, s))
    rng = np.random.default_rng(30)
    items = _family(rng, 8, (3, 4, 5, 6))
    regex = _constrained({"regex": "[0-9]{4}"})
    opts = [_constrained({"json": UNCLOSED}), regex, None, regex]
    for _ in range(2):
        out = constrained.run(_with_options(items, [8] * 4, opts)).results.items()
        assert [r.item_id for r in out] == [0, 1, 2, 3]
        assert [r.status for r in out] == ["invalid", "ok", "ok", "ok"]
        assert out[0].error.startswith("Regex parsing error") and "parenthesis is not closed" in out[0].error
        assert re.fullmatch("[0-9]{4}", _text(constrained, out[1])) and out[3].tokens.size > 0
    assert len(compiled) == 2  # each distinct constraint compiled once per engine, a failure too


@pytest.mark.timeout(180)
def test_constraints_through_the_whole_broker(tmp_path, constrained):
    """The payload is stored by the producer, read back by the GPU process, and compiled by hf."""
    model = constrained.settings.model
    config = HF_CONFIG.split("[consumers.engine_settings.config]")[0] + f'model = "{model}"\n'
    rng = np.random.default_rng(31)
    items = _family(rng, 16, (4, 6, 5))
    with BrokerProc(tmp_path, config=config) as broker, Producer("hfs", data_dir=broker.data_dir) as p:
        ids = [p.submit(items[0], max_new_tokens=16, options={"structured_outputs": {"regex": REGEX}}),
               p.submit(items[1], max_new_tokens=16, options={"structured_outputs": {"json": UNCLOSED}}),
               p.submit(items[2], max_new_tokens=4)]
        got = {}
        deadline = time.monotonic() + 120
        while len(got) < len(ids):
            assert time.monotonic() < deadline, "results did not all arrive"
            got.update((r.item_id, r) for r in p.results(timeout_seconds=1.0))
    assert got[ids[0]].status == "ok" and re.fullmatch(REGEX, _text(constrained, got[ids[0]]))
    assert got[ids[1]].status == "invalid" and "parenthesis is not closed" in got[ids[1]].error
    assert got[ids[2]].status == "ok" and got[ids[2]].tokens.tolist() == unbatched(constrained, items[2], 4)


def test_a_constraint_with_samples_and_min_tokens(constrained):
    """n sampled rows share their option set's processor; min_tokens does not hold a finished grammar
    open (it allows nothing but its end, which ends the row)."""
    rng = np.random.default_rng(32)
    items = _family(rng, 8, (3, 5))
    opts = [parse_options({"structured_outputs": {"choice": CHOICES}, "temperature": 1.0, "seed": 5, "n": 3}),
            parse_options({"structured_outputs": {"regex": REGEX}, "min_tokens": 40,
                           "stop_token_ids": [constrained.tokenizer.eos_token_id]})]  # blocked until 40 are out
    out = constrained.run(_with_options(items, [48, 48], opts)).results.items()
    samples, reasons = _samples(out[0])
    assert reasons == ("stop",) * 3
    assert all(constrained.tokenizer.decode(s, skip_special_tokens=True) in CHOICES for s in samples)
    assert samples == alone(constrained, items[0], 48, opts[0]).samples
    assert _samples(out[1])[1] == ("stop",) and re.fullmatch(REGEX, _text(constrained, out[1]))
