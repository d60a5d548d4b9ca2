"""Embeddings through a broker with a real vLLM pooling consumer (run by tests/engines/test_vllm_embed.py
under .venv-vllm; prints one JSON object, the last line):

    .venv-vllm/bin/python tests/support/vllm_embed_check.py WORK_DIR

1. A tiny random-weight Llama on disk whose config declares Matryoshka dimensions (32, 64, 128), with
   a byte-level BPE tokenizer (vLLM's `LLM` builds its pooling front end only with one).
2. The reference: every runnable prompt through vLLM's own `LLM.embed` in one call (pooling runner,
   the consumer's engine arguments), each with its own `PoolingParams(dimensions=...)`.
3. `shmbroker supervise` with one consumer, engine = "vllm", task = "embed", on the same model; the
   same prompts submitted with `Producer.embed`, among them items that must fail alone: one longer
   than the contract, one with a token id past the vocabulary, one asking for dimensions the model
   does not declare. Every result and the consumer's counters (`BrokerView`) are recorded; then the
   runnable prompts as a `/v1/embeddings` batch file through `submit --job --wait`.
4. `vllm serve` on the same model (`--runner pooling`) and a broker whose consumer is engine =
   "openai", task = "embed", pointed at it (two items a request): the same items, recorded alike.
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
MATRYOSHKA = [32, 64, 128]
CONTRACT = {"max_batch_size": 4, "max_batch_tokens": 1024, "max_input_len": 256}
EXTRA = {"block_size": BLOCK, "num_gpu_blocks_override": 64}  # 2048 tokens of KV cache
SETTINGS = {"task": "embed", "dtype": "float32", "gpu_memory_utilization": 0.15, "seed": 0, "enforce_eager": True}


def tiny_model(path: Path) -> str:
    import torch
    from support.bpetok import bpe_tokenizer_dir
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    config.matryoshka_dimensions = MATRYOSHKA
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(bpe_tokenizer_dir(path, VOCAB))


def workload():
    """(prompts, dimensions, kinds): two families sharing 96- and 64-token prefixes (their later
    members find the prefix in vLLM's cache), loners, a cut to 64 values on every fifth item; then
    one item too long for the contract, one with a token id past the vocabulary, one asking for 50
    dimensions (not among the model's)."""
    rng = np.random.default_rng(11)
    prompts, dims, kinds = [], [], []
    for prefix_len, count in ((96, 6), (64, 6)):
        prefix = rng.integers(3, VOCAB, prefix_len).tolist()
        for _ in range(count):
            prompts.append(prefix + rng.integers(3, VOCAB, int(rng.integers(4, 40))).tolist())
    for n in (1, 17, 150, 230, 256):
        prompts.append(rng.integers(3, VOCAB, n).tolist())
    dims = [64 if k % 5 == 0 else None for k in range(len(prompts))]
    kinds = ["ok"] * len(prompts)
    prompts.append(rng.integers(3, VOCAB, CONTRACT["max_input_len"] + 40).tolist())
    bad = rng.integers(3, VOCAB, 40).tolist()
    bad[9] = VOCAB + 77
    prompts += [bad, rng.integers(3, VOCAB, 30).tolist()]
    dims += [None, None, 50]
    kinds += ["too_long", "engine_error", "invalid"]
    order = rng.permutation(len(prompts))  # arrival order mixes the families
    return [prompts[i] for i in order], [dims[i] for i in order], [kinds[i] for i in order]


def engine_args(model: str) -> dict:
    return dict(model=model, runner="pooling", max_num_seqs=CONTRACT["max_batch_size"],
                max_model_len=CONTRACT["max_input_len"], max_num_batched_tokens=CONTRACT["max_batch_tokens"],
                dtype=SETTINGS["dtype"], gpu_memory_utilization=SETTINGS["gpu_memory_utilization"],
                seed=SETTINGS["seed"], enforce_eager=True, **EXTRA)


def reference(model: str, prompts, dims, kinds) -> dict:
    """vLLM's own `LLM.embed` of every runnable prompt, in one call: {index: vector}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM, PoolingParams
    from vllm.inputs import TokensPrompt

    from shmbroker.engines.vllm import llvmlite_scan_workaround

    llvmlite_scan_workaround()
    llm = LLM(**engine_args(model))
    runnable = [i for i, k in enumerate(kinds) if k == "ok"]
    try:
        outs = llm.embed([TokensPrompt(prompt_token_ids=prompts[i]) for i in runnable], use_tqdm=False,
                         pooling_params=[PoolingParams(dimensions=dims[i]) for i in runnable])
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return {i: [float(x) for x in o.outputs.embedding] for i, o in zip(runnable, outs)}


def broker_config(model: str) -> str:
    extra = ", ".join(f"{k} = {v}" for k, v in EXTRA.items())
    settings = "\n".join(f"{k} = {json.dumps(v)}" for k, v in SETTINGS.items())
    contract = "\n".join(f"{k} = {v}" for k, v in CONTRACT.items())
    return (f'instance = "vllmembed{os.getpid()}"\nblock_tokens = {BLOCK}\ningest_ring_bytes = 1048576\n'
            f"result_ring_bytes = 1048576\nsegment_bytes = 4194304\nindex_items = 65536\nmax_wait_seconds = 0.2\n\n"
            f'[[consumers]]\nname = "cpu"\nengine = "vllm"\nmodel = "emb"\n{contract}\n\n'
            f"[consumers.engine_settings]\nmodel = {json.dumps(model)}\n{settings}\nextra = {{ {extra} }}\n")


def openai_config(base_url: str) -> str:
    """A broker whose consumer embeds through the server at `base_url` (two items a request)."""
    from support.vllm_chat_check import SERVED

    contract = "\n".join(f"{k} = {v}" for k, v in CONTRACT.items())
    return (f'instance = "vllmembedoa{os.getpid()}"\nblock_tokens = {BLOCK}\nmax_wait_seconds = 0.2\n\n'
            f'[[consumers]]\nname = "cpu"\nengine = "openai"\nmodel = "emb"\n{contract}\n\n'
            f'[consumers.engine_settings]\nbase_url = "{base_url}"\nmodel = "{SERVED}"\ntask = "embed"\n'
            f"max_in_flight = 4\nmax_items_per_request = 2\ntimeout_seconds = 120.0\n")


def through_served(work: Path, model: str, prompts, dims) -> dict:
    """The items through an `openai` consumer in front of `vllm serve --runner pooling`."""
    import signal

    from support import vllm_chat_check as chat

    chat.MAX_NEW = 0  # the server's max_model_len: the contract's max_input_len
    work.mkdir(parents=True, exist_ok=True)
    proc, base_url = chat.vllm_serve(model, work / "serve.log", ["--runner", "pooling", "--enforce-eager"])
    try:
        return through_broker(work / "broker", openai_config(base_url), prompts, dims)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)


def through_file(work: Path, data_dir: str, prompts, dims, kinds) -> dict:
    """The runnable prompts as `/v1/embeddings` lines of a batch file (token arrays; base64 on every
    other line; one line of three inputs) through `submit --job --wait`: {custom_id: [its vectors]}."""
    import base64

    from shmbroker.cli import main as cli

    runnable = [i for i, k in enumerate(kinds) if k == "ok"]
    rows = []
    for n, i in enumerate(runnable):
        body = {"model": "emb", "input": prompts[i], **({"dimensions": dims[i]} if dims[i] else {}),
                **({"encoding_format": "base64"} if n % 2 else {})}
        rows.append({"custom_id": f"p{i}", "method": "POST", "url": "/v1/embeddings", "body": body})
    three = [i for i in runnable if not dims[i]][:3]
    rows.append({"custom_id": "three", "method": "POST", "url": "/v1/embeddings",
                 "body": {"model": "emb", "input": [prompts[i] for i in three]}})
    src, out = work / "file.jsonl", work / "file.out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = cli(["submit", str(src), "--data-dir", data_dir, "--job", "vllm-file", "--wait", "--out", str(out),
                "--out-format", "openai"])
    vectors = {}
    for line in (out.read_text().splitlines() if out.exists() else ()):
        row = json.loads(line)
        body = row["response"]["body"] if row.get("response") else {}
        vectors[row["custom_id"]] = [np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()
                                     if isinstance(d["embedding"], str) else d["embedding"] for d in body.get("data", ())]
    return {"exit": code, "vectors": vectors, "three": three}


def through_broker(work: Path, config: str, prompts, dims, kinds=None) -> dict:
    from shmbroker.client.producer import Producer
    from shmbroker.observe.watch import BrokerView
    from support.brokerproc import BrokerProc

    work.mkdir(parents=True, exist_ok=True)
    broker = BrokerProc(work, config)
    broker.start(ready_timeout_seconds=180)
    got: dict = {}
    try:
        with Producer("vllm-embed-check", data_dir=broker.data_dir) as p:
            ids = [p.embed(np.asarray(t, np.uint32), model="emb", dimensions=d) for t, d in zip(prompts, dims)]
            index = {int(i): k for k, i in enumerate(ids)}
            deadline = time.monotonic() + 300
            while len(got) < len(ids) and time.monotonic() < deadline:
                for r in p.results(1.0):
                    v = r.vector
                    got[index[int(r.item_id)]] = {"status": r.status, "error": r.error, "cached_tokens": r.cached_tokens,
                                                  "vector": None if v is None else [float(x) for x in v]}
        file = through_file(work, broker.data_dir, prompts, dims, kinds) if kinds is not None else None
        view = BrokerView.attach(broker.data_dir)
        try:
            for _ in range(200):  # the consumer's counters follow its results closely
                card = view.snapshot()["consumers"]["cpu"]
                if card.get("items", 0) >= sum(1 for g in got.values() if g["status"] != "too_long"):
                    break
                time.sleep(0.05)
            counters = {k: card.get(k) for k in ("items", "ok", "engine_errors", "hit_blocks", "queried_blocks",
                                                  "reused_tokens")}
        finally:
            view.close()
    finally:
        code = broker.stop(120)
    return {"results": {str(k): v for k, v in got.items()}, "consumer": counters, "supervisor_exit": code, "file": file,
            "log_tail": broker.log()[-3000:] if len(got) < len(prompts) or code else ""}


def main(work: str) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report alone
    work_dir = Path(work)
    t0 = time.monotonic()
    model = tiny_model(work_dir / "model")
    prompts, dims, kinds = workload()
    ref = reference(model, prompts, dims, kinds)
    live = through_broker(work_dir / "broker", broker_config(model), prompts, dims, kinds)
    served = through_served(work_dir / "served", model, prompts, dims)
    print(json.dumps({"kinds": kinds, "dimensions": dims, "prompt_lengths": [len(p) for p in prompts],
                      "reference": {str(k): v for k, v in ref.items()}, "total_seconds": round(time.monotonic() - t0, 1),
                      **live, "served": served}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
