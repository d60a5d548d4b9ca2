"""A broker with one real vLLM consumer, end to end (run by tests/engines/test_vllm_real.py under .venv-vllm).

    .venv-vllm/bin/python tests/support/vllm_real_check.py WORK_DIR     # prints one JSON object, the last line

1. A tiny random-weight Llama on disk (transformers' LlamaConfig, save_pretrained; no tokenizer).
2. Every prompt alone through vLLM's own engine (greedy, prefix caching off, one request at a time):
   the reference outputs.
3. `shmbroker supervise` with one consumer, engine = "vllm" on the same model and settings (block_size
   32, a small KV cache); the same prompts submitted through `shmbroker.client.Producer`; every result
   and the consumer's counters (`BrokerView`) collected.
The test asserts on the report; this script only runs and records.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

VOCAB = 512
BLOCK = 32
MAX_NEW = 8  # the engine's max_new_tokens
CONTRACT = {"max_batch_size": 4, "max_batch_tokens": 1024, "max_input_len": 256}
EXTRA = {"block_size": BLOCK, "num_gpu_blocks_override": 64}  # 2048 tokens of KV cache
SETTINGS = {"dtype": "float32", "max_new_tokens": MAX_NEW, "gpu_memory_utilization": 0.15, "seed": 0}


def tiny_model(path: Path) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=0, eos_token_id=VOCAB - 1, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)


def workload():
    """(prompts, max_new_tokens, kinds): two families sharing 96- and 64-token prefixes, loners, one item
    longer than the contract's max_input_len and one with a token id past the vocabulary."""
    rng = np.random.default_rng(7)
    prompts, max_new, kinds = [], [], []
    for prefix_len, count in ((96, 5), (64, 5)):
        prefix = rng.integers(1, VOCAB - 1, prefix_len).tolist()
        for _ in range(count):
            prompts.append(prefix + rng.integers(1, VOCAB - 1, int(rng.integers(5, 40))).tolist())
            max_new.append(int(rng.integers(1, MAX_NEW + 1)))
            kinds.append("ok")
    for n in (20, 150, 230):
        prompts.append(rng.integers(1, VOCAB - 1, n).tolist())
        max_new.append(int(rng.integers(1, MAX_NEW + 1)))
        kinds.append("ok")
    prompts.append(rng.integers(1, VOCAB - 1, CONTRACT["max_input_len"] + 40).tolist())
    max_new.append(4)
    kinds.append("too_long")
    bad = rng.integers(1, VOCAB - 1, 40).tolist()
    bad[17] = VOCAB + 88
    prompts.append(bad)
    max_new.append(4)
    kinds.append("engine_error")
    order = rng.permutation(len(prompts))  # arrival order mixes the families
    return [prompts[i] for i in order], [max_new[i] for i in order], [kinds[i] for i in order]


def reference(model: str, prompts, max_new, kinds) -> dict:
    """Each runnable prompt alone through vLLM's engine: {index: generated ids}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    args = EngineArgs(model=model, skip_tokenizer_init=True, enable_prefix_caching=False,
                      max_num_seqs=CONTRACT["max_batch_size"], max_model_len=CONTRACT["max_input_len"] + MAX_NEW,
                      max_num_batched_tokens=max(CONTRACT["max_batch_tokens"], CONTRACT["max_input_len"] + MAX_NEW),
                      dtype=SETTINGS["dtype"], gpu_memory_utilization=SETTINGS["gpu_memory_utilization"],
                      seed=SETTINGS["seed"], **EXTRA)
    engine = LLMEngine.from_engine_args(args)
    out = {}
    try:
        for i, (p, m, k) in enumerate(zip(prompts, max_new, kinds)):
            if k != "ok":
                continue
            engine.add_request(f"ref{i}", TokensPrompt(prompt_token_ids=p),
                               SamplingParams(max_tokens=m, temperature=0.0, detokenize=False))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        out[i] = list(o.outputs[0].token_ids)
    finally:
        engine.engine_core.shutdown()
    return out


def broker_config(model: str) -> str:
    extra = ", ".join(f"{k} = {v}" for k, v in EXTRA.items())
    settings = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SETTINGS.items())
    contract = "\n".join(f"{k} = {v}" for k, v in CONTRACT.items())
    return (f'instance = "vllmcheck{os.getpid()}"\nblock_tokens = {BLOCK}\ningest_ring_bytes = 1048576\n'
            f"result_ring_bytes = 1048576\nsegment_bytes = 4194304\nindex_items = 65536\nmax_wait_seconds = 1.0\n\n"
            f'[[consumers]]\nname = "cpu"\nengine = "vllm"\n{contract}\n\n[consumers.engine_settings]\n'
            f"model = {json.dumps(model)}\n{settings}\nextra = {{ {extra} }}\n")


def through_broker(work: Path, model: str, prompts, max_new) -> dict:
    from shmbroker.client.producer import Producer
    from shmbroker.observe.watch import BrokerView
    from support.brokerproc import BrokerProc

    broker = BrokerProc(work, broker_config(model))
    broker.start(ready_timeout_seconds=120)
    try:
        t0 = time.monotonic()
        with Producer("vllm-check", data_dir=broker.data_dir) as p:
            ids = [p.submit(np.asarray(t, np.uint32), max_new_tokens=m) for t, m in zip(prompts, max_new)]
            index = {int(i): k for k, i in enumerate(ids)}
            got = {}
            deadline = time.monotonic() + 300
            while len(got) < len(ids) and time.monotonic() < deadline:
                for r in p.results(1.0):
                    got[index[int(r.item_id)]] = {"status": r.status, "tokens": [int(t) for t in r.tokens],
                                                  "error": r.error}
        seconds = time.monotonic() - t0
        view = BrokerView.attach(broker.data_dir)
        try:
            for _ in range(200):  # the consumer's counters follow its results closely
                card = view.snapshot()["consumers"]["cpu"]
                if card.get("items", 0) >= sum(1 for g in got.values() if g["status"] != "too_long"):
                    break
                time.sleep(0.05)
            counters = {k: card.get(k) for k in ("items", "ok", "too_long", "engine_errors", "hit_blocks",
                                                  "queried_blocks", "reused_tokens", "batches", "engine_own_ns")}
        finally:
            view.close()
    finally:
        code = broker.stop(120)
    return {"results": {str(k): v for k, v in got.items()}, "seconds": seconds, "consumer": counters,
            "supervisor_exit": code, "log_tail": broker.log()[-3000:] if len(got) < len(prompts) or code else ""}


def main(work: str) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report alone
    work_dir = Path(work)
    work_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    model = tiny_model(work_dir / "model")
    prompts, max_new, kinds = workload()
    ref = reference(model, prompts, max_new, kinds)
    t_ref = time.monotonic() - t0
    live = through_broker(work_dir / "broker", model, prompts, max_new)
    report = {"kinds": kinds, "max_new_tokens": max_new, "prompt_lengths": [len(p) for p in prompts],
              "reference": {str(k): v for k, v in ref.items()}, "reference_seconds": round(t_ref, 1),
              "total_seconds": round(time.monotonic() - t0, 1), **live}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    (work_dir,) = sys.argv[1:]
    (Path(work_dir) / "broker").mkdir(parents=True, exist_ok=True)
    sys.exit(main(work_dir))
