"""`shmbroker bench embed --engine vllm`: embeddings through a broker with a real vLLM pooling consumer,
against vLLM's own `LLM.embed` of the same inputs in one call (`vllm_part`, called by `bench/embed.py`;
it needs vllm: `.venv-vllm`, `make vllm`).

The corpus is `bench embed`'s (`embed_model.corpus`: token-id inputs, long-tailed lengths from 16 to
512 tokens), 2,000 x `--scale` inputs (at least 64): fewer than the simulated side's, since a real
model on a CPU computes every token. The model is `bench gen`'s random 4-layer, 256-wide Llama
(`gen.MODEL`) with a byte-level BPE tokenizer (vLLM builds `LLM`'s pooling front end only with one),
run as an embedding model by vLLM's pooling runner (`convert` "embed": last-token pooling, normalised).

Both sides get the same engine arguments (`packed_args.vllm_llm_kwargs` of the consumer's settings and
contract: `runner="pooling"`, `max_num_seqs` 64, 8,192 tokens a step, 1,024 KV blocks of 32 tokens,
float32, eager), and both first embed the same 32 other inputs untimed (a first call's one-time
costs; other inputs, so that the timed ones find none of their blocks cached):

- `llm_embed_seconds`: `LLM.embed(all inputs)`, vLLM's own batching of a list handed over at once;
- `broker_seconds`: from the first `Producer.embed_many` to the last result, the consumer's engine
  built before the clock starts (the broker started on a scratch directory, stopped afterwards).

Figures: `vs_llm_embed` = llm_embed_seconds / broker_seconds (above 1: the broker is faster),
`tokens_per_s` (input tokens per broker second; `llm_embed_tokens_per_s` the other side's),
`vectors_equal` (every broker vector's cosine with `LLM.embed`'s >= 0.9999; `min_cosine`), the counts,
and `cached_tokens`, the prompt tokens the consumer's vLLM served from its prefix cache.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..pack.contract import Contract

INPUTS = 2000  # at --scale 1
INPUTS_MIN = 64
WARMUP = 32  # inputs embedded untimed on both sides first
VOCAB = 2048
CONTRACT = Contract(64, 8192, 512)
KV_BLOCKS = 1024  # of 32 tokens: room for max_num_seqs inputs of 512 tokens
COSINE_MIN = 0.9999
RESULTS_SECONDS = 900.0  # every result back, or the run fails


def settings(model_dir: str) -> dict:
    """The consumer's engine settings (and so both sides' engine arguments)."""
    from .gen import BLOCK_TOKENS, VLLM_MEMORY_FRACTION

    return {"model": model_dir, "task": "embed", "dtype": "float32", "gpu_memory_utilization": VLLM_MEMORY_FRACTION,
            "seed": 0, "enforce_eager": True, "extra": {"block_size": BLOCK_TOKENS, "num_gpu_blocks_override": KV_BLOCKS}}


def llm_embed(setup, prompts: list, warmup: list) -> tuple[float, list]:
    """(seconds, vectors) of vLLM's own `LLM.embed` over every prompt in one call, after the warm-up's."""
    from vllm import LLM
    from vllm.inputs import TokensPrompt

    from ..engines.packed_args import vllm_llm_kwargs
    from ..engines.vllm import llvmlite_scan_workaround

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process, as the consumer's engine
    llvmlite_scan_workaround()
    llm = LLM(**vllm_llm_kwargs(setup.settings_object(), setup.contract))
    try:
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        llm.embed([TokensPrompt(prompt_token_ids=p) for p in warmup], use_tqdm=False)
        t0 = time.perf_counter()
        outs = llm.embed(inputs, use_tqdm=False)
        seconds = time.perf_counter() - t0
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return seconds, [np.asarray(o.outputs.embedding, np.float32) for o in outs]


def collect(p, ids: np.ndarray, deadline: float) -> dict:
    """{item id: its vector} of every item of `ids`; an item that fails fails the run."""
    want = {int(i) for i in ids.tolist()}
    got: dict = {}
    while len(got) < len(want):
        for r in p.results(1.0):
            if r.status != "ok":
                raise RuntimeError(f"item {r.item_id} failed through the broker: {r.status} {r.error}")
            got[int(r.item_id)] = np.array(r.vector, np.float32)
            if len(got) == len(want):
                break
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(got)} of {len(want)} results through the broker")
    return got


def through_broker(setup, corpus: tuple, warmup: tuple, tmp: str) -> dict:
    """The corpus (flat, offsets) through a broker of one vLLM pooling consumer, after the warm-up's:
    seconds, vectors in input order and the consumer's cached tokens."""
    from ..client.producer import Producer
    from ..observe.watch import BrokerView
    from .broker import BenchBroker
    from .gen import broker_config

    os.makedirs(tmp, exist_ok=True)
    broker = BenchBroker(tmp, broker_config(setup))
    try:
        broker.wait_ready()
        deadline = time.monotonic() + RESULTS_SECONDS
        with Producer("bench-embed-vllm", data_dir=broker.data_dir) as p:
            view = BrokerView.attach(broker.data_dir)
            try:
                broker.wait_engine(view, "gpu-card", RESULTS_SECONDS)
                collect(p, p.embed_many(*warmup), deadline)  # untimed
                before = view.snapshot()["consumers"]["card"]
                t0 = time.perf_counter()
                ids = p.embed_many(*corpus)
                got = collect(p, ids, deadline)
                seconds = time.perf_counter() - t0
                card = before
                while card["items"] - before["items"] < ids.size and time.monotonic() < deadline:
                    time.sleep(0.02)  # the consumer's counters follow its results
                    card = view.snapshot()["consumers"]["card"]
            finally:
                view.close()
    finally:
        broker.stop()
    return {"seconds": seconds, "vectors": [got[int(i)] for i in ids.tolist()],
            "cached_tokens": int(card["reused_tokens"] - before["reused_tokens"])}


def split(flat: np.ndarray, offsets: np.ndarray) -> list:
    """Each input's token ids as a list."""
    return [flat[offsets[i] : offsets[i + 1]].tolist() for i in range(offsets.size - 1)]


def cosines(a: list, b: list) -> np.ndarray:
    return np.array([float(np.dot(x, y) / (np.linalg.norm(x) * np.linalg.norm(y))) if x.size == y.size else 0.0
                     for x, y in zip(a, b)])


def vllm_part(args) -> dict:
    """`bench embed --engine vllm`'s figures (module docstring); `args`: the command's namespace
    (`scale`; `json` changes nothing here: the caller prints)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the one JSON object
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        from ..engines.base import EngineUnavailable

        raise EngineUnavailable(f"bench embed --engine vllm needs vllm ({exc}): `make vllm`, then "
                                ".venv-vllm/bin/shmbroker bench embed --engine vllm") from None
    from . import gen
    from .embed_model import corpus
    from .gen_structured import write_tokenizer

    num = max(INPUTS_MIN, int(round(INPUTS * float(args.scale))))
    tmp = tempfile.mkdtemp(prefix="shmb-embed-vllm-")
    try:
        model_dir = Path(tmp) / "model"
        vocab, eos = write_tokenizer(model_dir, VOCAB)
        gen.write_model(model_dir, {**gen.MODEL, "vocab_size": vocab, "eos_token_id": eos})
        flat, offsets = corpus(num, vocab_size=vocab, seed=0, max_tokens=CONTRACT.max_input_len)
        warmup = corpus(WARMUP, vocab_size=vocab, seed=1, max_tokens=CONTRACT.max_input_len)  # other inputs
        setup = gen.Setup("vllm", settings(str(model_dir)), CONTRACT)
        alone_seconds, alone = llm_embed(setup, split(flat, offsets), split(*warmup))
        run = through_broker(setup, (flat, offsets), warmup, os.path.join(tmp, "broker"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    cos = cosines(run["vectors"], alone)
    tokens = int(offsets[-1])
    return {"engine": "vllm", "items": num, "input_tokens": tokens, "dimensions": int(alone[0].size),
            "model": f"random Llama, {gen.MODEL['num_hidden_layers']} layers x {gen.MODEL['hidden_size']}, "
                     "vLLM pooling runner (last token, normalised)",
            "contract": {"max_batch_size": CONTRACT.max_batch_size, "max_batch_tokens": CONTRACT.max_batch_tokens,
                         "max_input_len": CONTRACT.max_input_len},
            "broker_seconds": round(run["seconds"], 3), "llm_embed_seconds": round(alone_seconds, 3),
            "vs_llm_embed": round(alone_seconds / run["seconds"], 3),
            "tokens_per_s": round(tokens / run["seconds"], 1), "llm_embed_tokens_per_s": round(tokens / alone_seconds, 1),
            "vectors_equal": bool((cos >= COSINE_MIN).all()), "min_cosine": round(float(cos.min()), 6),
            "vectors_checked": int(cos.size), "cached_tokens": run["cached_tokens"]}
