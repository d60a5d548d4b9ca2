"""`shmbroker bench embed`: a corpus's vectors through the broker against a user's loop and against
sentence-transformers' own `encode`, in one run.

The corpus: 200,000 texts x `scale`, lengths long-tailed between 16 and 512 tokens
(`embed_model.corpus`); the model: a random BERT-like encoder (4 layers x 256) written as a
sentence-transformers directory (Transformer, mean Pooling, Normalize) in a temporary directory,
run on the CPU in float32. Three sides:

(a) the broker: `shmbroker supervise` with one `hf` consumer (`task = "embed"`, padded, the
    directory as its model), every text submitted with `Producer.embed_many` and every vector read
    back; from the first submit to the last vector, the engine already built;
(b) fixed batches: the same engine's forward (`HFEmbed.vectors`) in this process, the texts in
    arrival order, `max_batch_size` at a time: what a user's loop over the corpus does;
(c) sentence-transformers: `SentenceTransformer.encode(texts, batch_size=max_batch_size)` over the
    whole corpus in one call (it sorts the texts by length first).

Fair by construction: one directory, so the same weights; the same token ids (each text's words
are its ids under the directory's word-level tokenizer, checked on a sample, so (c) tokenizes text
to exactly the ids (a) and (b) are given; its time includes that tokenization, reported alone as
`st_tokenize_seconds`); the same torch threads in all three (`--threads`: the engine's `threads`
setting in the broker's GPU process, `torch.set_num_threads` here); the same batch size. The
broker's own processes (ingest, scheduler, results, this producer reading) share the machine's
cores with its engine, as they would in use. Every vector of (a) and (b) is compared with (c)'s:
`vectors_equal` says whether each cosine is at least 0.9999. The broker's padding waste is its GPU
process's own count (the engine's padded over rectangle tokens), as `bench gpu` reads it.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

TEXTS = 200_000  # at scale 1
BATCH = 32  # max_batch_size of every side (sentence-transformers' default batch size)
COSINE_MIN = 0.9999
SAMPLE_CHECKED = 256  # texts whose tokenization is checked against their ids


@dataclass(frozen=True)
class Setup:
    num_texts: int
    threads: int
    seed: int = 0
    batch: int = BATCH
    max_tokens: int = 512
    layers: int = 4
    hidden: int = 256
    vocab_size: int = 8192
    padding_tolerance: float = 1 / 64  # a rectangle's longest at most 1/64 past its shortest


def broker_config(setup: Setup, model_dir: str) -> str:
    """The broker of side (a): one `hf` consumer embedding with the directory, `threads` as the others."""
    return (f'instance = "embed{os.getpid()}"\nmetrics_addr = ""\nindex_items = {max(1 << 16, 2 * setup.num_texts)}\n'
            f"padding_tolerance = {setup.padding_tolerance}\n\n"
            f'[[consumers]]\nname = "card"\nengine = "hf"\nmax_batch_size = {setup.batch}\n'
            f"max_batch_tokens = {setup.batch * setup.max_tokens}\nmax_input_len = {setup.max_tokens}\n\n"
            f'[consumers.engine_settings]\nmodel = "{model_dir}"\ntask = "embed"\ndevice = "cpu"\n'
            f'dtype = "float32"\nthreads = {setup.threads}\n')


def broker_side(setup: Setup, model_dir: str, flat, offsets, tmp: str, dims: int) -> dict:
    """(a): the corpus through a running broker; its seconds, vectors (in corpus order) and the card's counters."""
    from ..client.producer import Producer
    from ..observe.watch import BrokerView
    from .broker import BenchBroker

    n = len(offsets) - 1
    vectors = np.zeros((n, dims), np.float32)
    os.makedirs(tmp, exist_ok=True)
    broker = BenchBroker(tmp, broker_config(setup, model_dir))
    try:
        broker.wait_ready()
        with Producer("bench-embed", data_dir=broker.data_dir) as p:
            view = BrokerView.attach(broker.data_dir)
            try:
                broker.wait_engine(view, "gpu-card", 300)
                before = view.snapshot()["consumers"]["card"]
                t0 = time.perf_counter()
                ids = p.embed_many(flat, offsets)
                row = {int(i): k for k, i in enumerate(ids.tolist())}
                got = 0
                deadline = time.monotonic() + 600 + n * 0.05  # the slowest machine: 20 texts/s
                while got < n:
                    for r in p.results(1.0):
                        if r.status != "ok":
                            raise RuntimeError(f"item {r.item_id} came back {r.status}: {r.error}")
                        vectors[row[r.item_id]] = r.vector
                        got += 1
                        if got == n:
                            break
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{got} of {n} vectors through the broker")
                seconds = time.perf_counter() - t0
                card = counted(view, before, n, deadline)
            finally:
                view.close()
    finally:
        broker.stop()
    return {"seconds": seconds, "vectors": vectors, "card": card}


def counted(view, before: dict, n: int, deadline: float) -> dict:
    """The card's counters since `before`, once they count all `n` items (they follow the results)."""
    while True:
        card = view.snapshot()["consumers"]["card"]
        if card["items"] - before["items"] >= n or time.monotonic() > deadline:
            return {k: card[k] - before.get(k, 0) for k in ("items", "batches", "padded_tokens", "rect_tokens",
                                                             "busy_ns", "engine_own_ns")}
        time.sleep(0.01)


def fixed_side(engine, flat, offsets, batch: int) -> dict:
    """(b): the engine's forward over the corpus in arrival order, `batch` texts at a time."""
    n = len(offsets) - 1
    items = [flat[offsets[i] : offsets[i + 1]] for i in range(n)]
    engine.vectors(items[:batch])  # warm-up: kernels, allocator
    parts = []
    rect = 0
    t0 = time.perf_counter()
    for start in range(0, n, batch):
        chunk = items[start : start + batch]
        parts.append(engine.vectors(chunk))
        rect += len(chunk) * max(t.size for t in chunk)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "vectors": np.concatenate(parts), "padding_waste": 1 - int(offsets[-1]) / rect}


def st_side(st, text: list[str], batch: int, lengths: np.ndarray) -> dict:
    """(c): sentence-transformers' own encode over the whole corpus in one call; its padding waste
    from the order it runs (longest text first, `batch` at a time)."""
    ordered = np.sort(lengths)[::-1]
    rect = sum(int(ordered[i]) * ordered[i : i + batch].size for i in range(0, ordered.size, batch))
    st.encode(text[:batch], batch_size=batch)  # warm-up
    t0 = time.perf_counter()
    vectors = st.encode(text, batch_size=batch, convert_to_numpy=True, show_progress_bar=False)
    seconds = time.perf_counter() - t0
    t0 = time.perf_counter()
    for start in range(0, len(text), batch):  # its tokenization alone, as encode batches it
        st.tokenizer(text[start : start + batch], padding=True, return_tensors="pt")
    return {"seconds": seconds, "vectors": np.asarray(vectors, np.float32), "tokenize_seconds": time.perf_counter() - t0,
            "padding_waste": 1 - int(lengths.sum()) / rect}


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The smallest cosine between the rows of a and b."""
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    return float(np.min(np.einsum("ij,ij->i", a, b) / np.maximum(na * nb, 1e-30)))


def check_ids(st, text: list[str], flat, offsets, seed: int) -> None:
    """Raise unless the tokenizer maps a sample of the texts to exactly their ids."""
    rng = np.random.default_rng(seed)
    for i in rng.choice(len(text), size=min(SAMPLE_CHECKED, len(text)), replace=False).tolist():
        if st.tokenizer(text[i])["input_ids"] != flat[offsets[i] : offsets[i + 1]].tolist():
            raise RuntimeError(f"text {i} does not tokenize to its ids: the sides would embed different inputs")


def _to_stderr(line: str) -> None:
    print(f"bench embed: {line}", file=sys.stderr, flush=True)


def run(scale: float = 1.0, *, threads: int = 1, seed: int = 0, say: Callable[[str], None] = _to_stderr) -> dict:
    """The figures of (a), (b) and (c) on one corpus and one model; `say` gets a line as each side ends."""
    if not scale > 0:
        raise ValueError(f"bench embed: --scale must be > 0, got {scale}")
    if threads < 1:
        raise ValueError(f"bench embed: --threads must be >= 1, got {threads}")
    torch = _torch()
    from sentence_transformers import SentenceTransformer

    from ..engines.hf import HF
    from ..engines.options import HFSettings
    from ..request.options import Task
    from .embed_model import corpus, texts, write_model

    setup = Setup(max(BATCH, int(TEXTS * scale)), threads, seed)
    torch.set_num_threads(threads)
    tmp = tempfile.mkdtemp(prefix="shmb-embed-")
    try:
        model_dir = write_model(os.path.join(tmp, "model"), layers=setup.layers, hidden=setup.hidden,
                                vocab_size=setup.vocab_size, max_tokens=setup.max_tokens, seed=seed)
        flat, offsets = corpus(setup.num_texts, vocab_size=setup.vocab_size, seed=seed, max_tokens=setup.max_tokens)
        text = texts(flat, offsets)
        st = SentenceTransformer(model_dir, device="cpu", local_files_only=True)
        check_ids(st, text, flat, offsets, seed)
        tokens = int(offsets[-1])
        say(f"{setup.num_texts} texts, {tokens} tokens; {threads} torch thread(s) a side")
        engine = HF(HFSettings(model=model_dir, task=Task.EMBED, device="cpu", dtype="float32", threads=threads))
        a = broker_side(setup, model_dir, flat, offsets, os.path.join(tmp, "broker"), engine.dims)
        say(f"broker {a['seconds']:.1f} s")
        b = fixed_side(engine, flat, offsets, setup.batch)
        say(f"fixed batches {b['seconds']:.1f} s")
        c = st_side(st, text, setup.batch, np.diff(offsets))
        say(f"sentence-transformers {c['seconds']:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return figures(setup, tokens, engine.dims, a, b, c)


def figures(setup: Setup, tokens: int, dims: int, a: dict, b: dict, c: dict) -> dict:
    card = a["card"]
    cos_broker, cos_fixed = min_cosine(a["vectors"], c["vectors"]), min_cosine(b["vectors"], c["vectors"])
    own = card["engine_own_ns"]
    return {
        "broker_seconds": round(a["seconds"], 3), "fixed_batches_seconds": round(b["seconds"], 3),
        "sentence_transformers_seconds": round(c["seconds"], 3),
        "vs_fixed_batches": round(a["seconds"] / b["seconds"], 4),
        "vs_sentence_transformers": round(a["seconds"] / c["seconds"], 4),
        "padding_waste": round(card["padded_tokens"] / card["rect_tokens"], 4) if card["rect_tokens"] else 0.0,
        "tokens_per_s": round(tokens / a["seconds"], 1),
        "vectors_equal": bool(min(cos_broker, cos_fixed) >= COSINE_MIN),
        "min_cosine_broker": round(cos_broker, 7), "min_cosine_fixed_batches": round(cos_fixed, 7),
        "scale": setup.num_texts / TEXTS, "items": setup.num_texts, "tokens": tokens, "dims": dims,
        "torch_threads": setup.threads, "max_batch_size": setup.batch, "padding_tolerance": setup.padding_tolerance,
        "model": f"BERT-like, {setup.layers} layers x {setup.hidden}, vocabulary {setup.vocab_size}, float32, cpu",
        "broker_batches": card["batches"],
        "broker_engine_seconds": round(own / 1e9, 3),
        "broker_consumer_loop_overhead": round(card["busy_ns"] / own - 1, 4) if own else None,
        "fixed_batches_padding_waste": round(b["padding_waste"], 4),
        "fixed_batches_tokens_per_s": round(tokens / b["seconds"], 1),
        "sentence_transformers_tokens_per_s": round(tokens / c["seconds"], 1),
        "sentence_transformers_padding_waste": round(c["padding_waste"], 4),
        "st_tokenize_seconds": round(c["tokenize_seconds"], 3),
        "cpus": os.cpu_count(),
    }


def _torch():
    """torch, when the hf engine's packages and sentence-transformers are installed."""
    try:
        import sentence_transformers  # noqa: F401 - side (c), and the directory the engine loads
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        from ..engines.base import EngineUnavailable

        raise EngineUnavailable(f"bench embed runs the hf engine and sentence-transformers, not installed here "
                                f"({exc}): pip install 'shmbroker[hf]'") from None
    return torch


def from_args(args, say: Callable[[str], None] = _to_stderr) -> dict:
    """`bench embed` from its command line: the hf engine's comparison (the default), or with
    `--engine vllm` the vLLM part (`embed_vllm.vllm_part`, run under .venv-vllm)."""
    engine = args.engine or "hf"
    if engine == "vllm":
        return vllm_part(args)
    if engine != "hf":
        raise ValueError(f"bench embed: --engine must be hf or vllm, not {engine!r}")
    return run(scale=args.scale, threads=args.threads, seed=args.seed, say=say)


def from_command(args) -> dict | None:
    """`from_args` for `shmbroker bench embed`: None, with the reason on stderr, when it cannot run
    here (no engine packages, no vLLM part, a bad option)."""
    from ..errors import BrokerError

    try:
        return from_args(args)
    except (BrokerError, ValueError) as exc:
        print(f"shmbroker: {exc}", file=sys.stderr)
        return None


def vllm_part(args) -> dict:
    """The vLLM part's figures, its module imported only now; a clear error when it is not there."""
    name = f"{__package__}.embed_vllm"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        if exc.name == name:
            raise ValueError(f"bench embed --engine vllm: there is no vLLM part ({name} is missing)") from None
        raise ValueError(f"bench embed --engine vllm: its part does not import here ({exc}); run it with "
                         ".venv-vllm/bin/shmbroker (make vllm)") from None
    part = getattr(module, "vllm_part", None)
    if not callable(part):
        raise ValueError(f"bench embed --engine vllm: {name} has no vllm_part(args)")
    return part(args)
