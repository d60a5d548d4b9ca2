"""`shmbroker bench gpu`: a real engine (`hf`) fed by the broker, against fed FIFO and against alone.

One backlog, drawn from the Mooncake-format conversation trace (`../shared/traces/`; the seeded
generator when the trace is absent) and scaled to fit the card: each 512-token hash block of the
trace becomes `block_tokens` synthetic tokens (equal hashes give equal blocks, so the trace's
shared prefixes survive the scaling), lengths capped at the contract's `max_input_len`. One model:
a random-weight Llama-style model, about 1B parameters on a GPU (bf16), tiny on the CPU (fp32),
with max_new_tokens fixed for every item.

In the same run, on the same weights:

(a) FIFO: batches in arrival order, as many items as the contract takes (count x longest <=
    max_batch_tokens), right-padded, no prefix reuse: what a plain queue feeds an engine;
(b) the broker: the backlog through shmbroker's packer (the scheduler's kernels, padded mode, this
    one consumer's contract), each shape-pure batch run with its shared prefix computed once
    (`hf` with reuse_prefix and keep_prefix).

Both go through the GPU process's core (`ConsumerCore.process`: guard, failures, results), so
`consumer_overhead` is the consumer's own cost per batch over the engine's time. Then (c) `live`:
the same backlog through a running broker with one `hf` consumer of the same weights, where the
GPU process's own accounting gives the whole consumer loop's cost (taking a batch, viewing its
tokens in the segment files, the engine, writing results) over the engine's. And (d) `engine_alone`:
what a user of transformers runs with no broker, every item in arrival order through the engine's
own batching (continuous batching where the release has it; `gpu_alone.py`), on the same weights,
with the broker's speed-ups over it. Figures:
useful input tokens per second (the backlog's input tokens over the seconds to run all batches),
padding waste, prefix tokens reused, the speed-up of (b) over (a), and on a sample of items
whether (b)'s outputs equal the item run alone (greedy, same weights, no batch, no reuse).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ..pack.contract import Contract, Mode
from ..workloads.synthetic import Workload

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"

# ~1.0B parameters: 16 layers of 2048 (GQA 32/8 heads), 32k vocabulary
GPU_MODEL = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
             "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
             "max_position_embeddings": 8192, "eos_token_id": 32000, "bos_token_id": 32000, "pad_token_id": None}
CPU_MODEL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
             "max_position_embeddings": 2048, "eos_token_id": 1000, "bos_token_id": 1000, "pad_token_id": None}
# (eos = vocab_size: an id the model never produces, so every item generates max_new_tokens, in
# process and in the live broker alike; a TOML file has no null to say "none")


@dataclasses.dataclass(frozen=True)
class Setup:
    device: str
    model: dict
    dtype: str
    contract: Contract
    items: int
    block_tokens: int  # tokens per trace hash block after scaling
    max_new_tokens: int
    sample: int
    alone_cache_tokens: int | None = None  # the engine-alone side's KV cache; None: transformers sizes it


GPU_SETUP = Setup("cuda", GPU_MODEL, "bfloat16", Contract(64, 16384, 4096), 2048, 128, 4, 32)
# (on the CPU transformers would size its cache from the machine's memory: a cache for the whole backlog)
CPU_SETUP = Setup("cpu", CPU_MODEL, "float32", Contract(16, 2048, 512), 96, 16, 2, 6, alone_cache_tokens=65536)
CPU_THREADS = 1  # torch's own threads spin against the other processes of a small machine


class _Consumer:
    def __init__(self, contract: Contract):
        self.name = "card"
        self.contract = contract
        self.cache_tokens = 0


def backlog(setup: Setup, trace: str | os.PathLike | None, scale: float, seed: int) -> Workload:
    """The scaled backlog: the first items of the trace (or the generator's), hash blocks of
    `setup.block_tokens` tokens, lengths capped at max_input_len."""
    from ..workloads import trace as tr

    n = max(8, int(setup.items * scale))
    vocab = int(setup.model["vocab_size"])
    path = Path(trace) if trace else TRACE
    if path.exists():
        rows = []
        with open(path) as fh:
            for line in fh:
                if line.strip():
                    rows.append(json.loads(line))
                if len(rows) >= n:
                    break
        b = setup.block_tokens
        lengths, ids, counts = [], [], []
        for r in rows:
            scaled = max(1, -(-int(r["input_length"]) * b // tr.TRACE_BLOCK_TOKENS))
            scaled = min(scaled, setup.contract.max_input_len - setup.max_new_tokens)
            blocks = [int(h) for h in r["hash_ids"]][: -(-scaled // b)]
            lengths.append(scaled)
            ids.extend(blocks)
            counts.append(len(blocks))
        tokens, offsets = tr.synthesise_items(lengths, ids, counts, b, vocab)
        lengths_a = np.diff(offsets)
        name = f"trace({path.name}, {len(rows)} items, {b} tokens a block)"
    else:
        from ..workloads.synthetic import generate

        wl = generate(n, seed=seed, max_len=setup.contract.max_input_len - setup.max_new_tokens,
                      system_tokens_median=setup.block_tokens * 4, turn_tokens_median=setup.block_tokens * 2,
                      reply_tokens_median=setup.block_tokens)
        tokens, offsets, lengths_a = wl.tokens % np.uint32(vocab), wl.offsets, wl.lengths
        name = f"generator({n} items; no trace at {path})"
    count = lengths_a.size
    return Workload(tokens.astype(np.uint32), offsets, np.zeros(count), np.full(count, setup.max_new_tokens, np.int64),
                    np.zeros(count, np.int64), np.zeros(count, np.int64), name)


def batches(feeder_cls, setup: Setup, wl: Workload, shapes) -> list:
    """Every batch the feeder gives the one consumer for the whole backlog, in order."""
    feeder = feeder_cls([_Consumer(setup.contract)], Mode.PADDED, shapes, wl)
    for row in range(len(wl)):
        feeder.add(row, 0.0)
    out = []
    while True:
        batch = feeder.next_batch(0, 0.0)
        if batch is None:
            return out
        assert not batch.failed, "the backlog is scaled to fit the contract"
        out.append(batch)


def _feed(core, wl: Workload, plan: list) -> dict:
    """Every batch of `plan` through a fresh ConsumerCore; its stats hold the engine's own figures."""
    views = [wl.tokens[wl.offsets[i] : wl.offsets[i + 1]] for i in range(len(wl))]
    outputs = {}
    core_ns = 0
    t0 = time.perf_counter()
    for batch in plan:
        rows = batch.handles.astype(np.int64)
        c0 = time.perf_counter_ns()
        res = core.process(batch, [views[r] for r in rows])
        core_ns += time.perf_counter_ns() - c0
        for k, r in enumerate(rows.tolist()):
            outputs[r] = res.flat[res.offsets[k] : res.offsets[k + 1]].copy()
        assert (res.status == 0).all(), res.errors
    seconds = time.perf_counter() - t0
    s = core.stats
    engine_seconds = s.engine_seconds
    tokens = int(wl.lengths.sum())
    return {"batches": len(plan), "seconds": round(seconds, 4), "useful_tokens_per_s": round(tokens / seconds, 1),
            "padded_tokens": s.padded_tokens, "rect_tokens": s.rect_tokens,
            "padding_waste": round(s.padded_tokens / s.rect_tokens, 4) if s.rect_tokens else 0.0,
            "prefix_tokens_reused": s.reused_tokens,
            "engine_seconds": round(engine_seconds, 4),
            "consumer_overhead": round(core_ns / 1e9 / engine_seconds - 1, 4) if engine_seconds else None,
            "_outputs": outputs}


def _combine(parts: list[dict], tokens: int) -> dict:
    """Two runs of one side: times summed, the counts of one run (they are equal), outputs of the last."""
    out = dict(parts[-1])
    seconds = sum(p["seconds"] for p in parts)
    engine = sum(p["engine_seconds"] for p in parts)
    core = sum(p["engine_seconds"] * (1 + p["consumer_overhead"]) for p in parts if p["consumer_overhead"] is not None)
    out["seconds"] = round(seconds, 4)
    out["runs_seconds"] = [p["seconds"] for p in parts]
    out["useful_tokens_per_s"] = round(len(parts) * tokens / seconds, 1)
    out["engine_seconds"] = round(engine, 4)
    out["consumer_overhead"] = round(core / engine - 1, 4) if engine else None
    return out


def _sample_check(engine, wl: Workload, plan: list, sample: np.ndarray, setup: Setup, outputs: dict) -> tuple[int, str]:
    """Sampled items of (b) against the same item alone (greedy, same weights, no batch, no reuse).

    In float32 (the CPU) the timed run's outputs are compared. In bf16 two kernels that sum in a
    different order (a batch's shapes against one item's) can flip a greedy choice between two
    near-equal logits of a random-weight model, which says nothing about the batching: there the
    sampled items' batches are run again on a float32 copy of the same weights, and compared with
    that copy's unbatched outputs."""
    import torch

    from ..engines.base import EngineBatch
    from ..engines.hf import unbatched

    def alone(e, r):
        return unbatched(e, wl.tokens[wl.offsets[r] : wl.offsets[r + 1]], setup.max_new_tokens)

    if engine.dtype in (torch.float32, torch.float64):
        return sum(outputs[int(r)].tolist() == alone(engine, int(r)) for r in sample), str(engine.dtype).split(".")[1]
    ref = copy.copy(engine)
    ref.model = copy.deepcopy(engine.model).float()
    ref.dtype = torch.float32
    ref.forget_prefix()
    wanted = {int(r) for r in sample}
    equal = 0
    for batch in plan:
        rows = [int(r) for r in batch.handles]
        if not wanted.intersection(rows):
            continue
        toks = [wl.tokens[wl.offsets[r] : wl.offsets[r + 1]] for r in rows]
        got = ref.run(EngineBatch(np.asarray(rows, np.uint64), toks, np.full(len(rows), setup.max_new_tokens))).results
        for k, r in enumerate(rows):
            if r in wanted:
                equal += got.flat[got.offsets[k] : got.offsets[k + 1]].tolist() == alone(ref, r)
    ref.model = None
    return equal, "float32 copy of the weights"


def _toml_value(v) -> str:
    return json.dumps(v) if isinstance(v, str) else ("true" if v is True else "false" if v is False else str(v))


def live(setup: Setup, wl: Workload, seed: int, tmp: str) -> dict:
    """(c) The same backlog through a running broker (`shmbroker supervise` with one `hf` consumer
    of the same weights): the GPU process's own accounting gives the consumer loop's overhead over
    the engine's time (busy: from taking a batch to releasing it; the engine's own seconds)."""
    from .broker import through_one_card

    model = "\n".join(f"{k} = {_toml_value(v)}" for k, v in setup.model.items() if v is not None)
    c = setup.contract
    config = (f'instance = "gpu{os.getpid()}"\nmetrics_addr = ""\nblock_tokens = {setup.block_tokens}\n'
              f'index_items = 65536\nsegment_bytes = 16777216\n\n[[consumers]]\nname = "card"\nengine = "hf"\n'
              f"max_batch_size = {c.max_batch_size}\nmax_batch_tokens = {c.max_batch_tokens}\n"
              f"max_input_len = {c.max_input_len}\n\n[consumers.engine_settings]\n"
              f'dtype = "{setup.dtype}"\ndevice = "{setup.device}"\nseed = {seed}\n'
              f"threads = {0 if setup.device == 'cuda' else CPU_THREADS}\n\n[consumers.engine_settings.config]\n{model}\n")
    run = through_one_card(tmp, config, "bench-gpu", wl.tokens, wl.offsets, setup.max_new_tokens, 600)
    if (run.status != 0).any():
        raise RuntimeError("an item failed in the live run")
    seconds, card = run.seconds, run.card
    own = card["engine_own_ns"]
    return {"batches": card["batches"], "seconds": round(seconds, 4),
            "useful_tokens_per_s": round(int(wl.lengths.sum()) / seconds, 1),
            "padding_waste": round(card["padding_waste"], 4) if card["padding_waste"] is not None else 0.0,
            "busy_seconds": round(card["busy_ns"] / 1e9, 4), "engine_seconds": round(own / 1e9, 4),
            "consumer_loop_overhead": round(card["busy_ns"] / own - 1, 4) if own else None,
            "consumer_loop_ms_per_batch": round((card["busy_ns"] - own) / 1e6 / card["batches"], 3)
            if card["batches"] else None}


def _fed(setup: Setup, wl: Workload, broker_engine, fifo_plan: list, broker_plan: list) -> tuple[dict, dict]:
    """(a) and (b), each warmed on one batch, then run twice, alternated (a drift of the machine
    falls on both): the figures of FIFO and of the broker, each with its last run's outputs."""
    from ..gpu.core import ConsumerCore

    fifo_engine = copy.copy(broker_engine)  # the same weights, no prefix reuse
    fifo_engine.settings = dataclasses.replace(broker_engine.settings, reuse_prefix=False, keep_prefix=False)
    for e, plan in ((fifo_engine, fifo_plan), (broker_engine, broker_plan)):  # warm-up: kernels, allocator
        _feed(ConsumerCore(setup.contract, e), wl, plan[:1])
    runs = {"fifo": [], "broker": []}
    for side in ("fifo", "broker", "broker", "fifo"):
        engine, plan = (fifo_engine, fifo_plan) if side == "fifo" else (broker_engine, broker_plan)
        broker_engine.forget_prefix()
        runs[side].append(_feed(ConsumerCore(setup.contract, engine), wl, plan))
    fifo, broker = (_combine(runs[side], int(wl.lengths.sum())) for side in ("fifo", "broker"))
    return fifo, broker


def _live_run(setup: Setup, wl: Workload, seed: int) -> dict:
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="shmb-gpu-")
    try:
        return live(setup, wl, seed, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _torch(device: str):
    """torch, when the hf engine's packages are installed and the device asked for is there."""
    try:
        import torch
        import transformers  # noqa: F401 - the hf engine's other package
    except ImportError as exc:
        from ..engines.base import EngineUnavailable

        raise EngineUnavailable(f"bench gpu runs the hf engine, whose packages are not installed ({exc}): "
                                "pip install 'shmbroker[hf]'") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench gpu --device cuda: torch sees no CUDA GPU")
    return torch


def _to_stderr(line: str) -> None:
    print(f"bench gpu: {line}", file=sys.stderr, flush=True)


def run(scale: float = 1.0, *, trace: str | None = None, device: str = "auto", seed: int = 0,
        say: Callable[[str], None] = _to_stderr) -> dict:
    """The figures of (a)-(d); `say` gets a line as each side is done (a run cut short by a time
    limit still shows how far it came)."""
    torch = _torch(device)
    from ..engines.hf import HF
    from ..engines.options import HFSettings
    from ..pack.shapes import shape_items
    from ..workloads.feeders import FifoFeeder, PackerFeeder
    from . import gpu_alone

    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    setup = GPU_SETUP if cuda else CPU_SETUP
    wl = backlog(setup, trace, scale, seed)
    shapes = shape_items(wl.tokens, wl.offsets, block_tokens=setup.block_tokens)
    fifo_plan = batches(FifoFeeder, setup, wl, shapes)
    broker_plan = batches(PackerFeeder, setup, wl, shapes)
    say(f"{wl.name}: {int(wl.lengths.sum())} input tokens; {len(fifo_plan)} FIFO batches, {len(broker_plan)} broker batches")
    settings = HFSettings(config=setup.model, dtype=setup.dtype, device=setup.device, seed=seed,
                          threads=0 if cuda else CPU_THREADS)
    t0 = time.perf_counter()
    broker_engine = HF(settings, block_tokens=setup.block_tokens)
    load_seconds = time.perf_counter() - t0
    say(f"model on {setup.device} in {load_seconds:.1f} s")
    fifo, broker = _fed(setup, wl, broker_engine, fifo_plan, broker_plan)
    say(f"fifo {fifo['runs_seconds']} s, broker {broker['runs_seconds']} s")
    alone = gpu_alone.run(broker_engine.model, [wl.item(i).tolist() for i in range(len(wl))], fifo_plan, setup)
    say(f"engine alone ({alone.method}): {alone.seconds:.2f} s" + (f"; {alone.fallback_reason}" if alone.fallback_reason else ""))
    rng = np.random.default_rng(seed)
    sample = np.sort(rng.choice(len(wl), size=min(setup.sample, len(wl)), replace=False))
    equal, check_dtype = _sample_check(broker_engine, wl, broker_plan, sample, setup, broker["_outputs"])
    sampled = {int(r): broker["_outputs"][int(r)].tolist() for r in sample}
    for part in (fifo, broker):
        part.pop("_outputs")
    say(f"sample check: {equal} of {sample.size} equal ({check_dtype})")
    through = _live_run(setup, wl, seed)
    say(f"live broker: {through['seconds']} s")
    tokens = int(wl.lengths.sum())
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model_parameters": sum(p.numel() for p in broker_engine.model.parameters()),
        "dtype": setup.dtype, "workload": wl.name, "items": len(wl), "input_tokens": tokens,
        "max_new_tokens": setup.max_new_tokens,
        "contract": dataclasses.asdict(setup.contract), "block_tokens": setup.block_tokens,
        "model_load_seconds": round(load_seconds, 2),
        "fifo": fifo, "broker": broker, "live": through,
        "speedup": round(broker["useful_tokens_per_s"] / fifo["useful_tokens_per_s"], 3),
        "sample_items": int(sample.size), "sample_outputs_equal_unbatched": int(equal), "sample_check_dtype": check_dtype,
        "engine_alone": gpu_alone.figures(alone, tokens, broker, through, sampled),
    }
