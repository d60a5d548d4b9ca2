"""Request options through a broker with one real vLLM consumer (run by tests/engines/test_vllm_sampling.py
under .venv-vllm; prints one JSON object, the last line):

    .venv-vllm/bin/python tests/support/vllm_sampling_check.py WORK_DIR

1. A tiny random-weight Llama on disk with a tokenizer trained here (a word-level vocabulary that
   fits the model's) and a ChatML template, so vLLM loads the tokenizer (stop strings need text).
2. Every request alone through vLLM's own engine, each with its own `SamplingParams`: greedy, seeded
   sampling at temperature 0.8, a stop string, stop ids with min_tokens, penalties: the reference.
3. `shmbroker supervise` with one consumer, engine = "vllm" on the same model; the same requests
   submitted by a Producer with the same options, twice, in two different orders (second broker run).
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

from support.vllm_real_check import CONTRACT, EXTRA, MAX_NEW, SETTINGS, VOCAB, broker_config  # noqa: E402

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<unk>", "<|im_start|>", "<|im_end|>"]


def tiny_model_with_tokenizer(path: Path) -> str:
    """The model of vllm_real_check with a tokenizer.json (word level: w0..w{VOCAB-4} and the special
    tokens, ids below VOCAB) and a tokenizer_config.json holding the chat template."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(path)
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    tok.train_from_iterator([" ".join(words)], trainers.WordLevelTrainer(special_tokens=SPECIAL, vocab_size=VOCAB))
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>", "chat_template": CHATML, "model_max_length": 1024}))
    return str(path)


def requests(model: str) -> list[dict]:
    """Prompts (token ids of text in the vocabulary) and the options each is submitted with."""
    rng = np.random.default_rng(11)
    out = []
    option_sets = [None, {"temperature": 0.0}, {"temperature": 0.8, "seed": 7}, {"temperature": 0.8, "seed": 8},
                   {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "seed": 9},
                   {"temperature": 0.0, "repetition_penalty": 1.3, "presence_penalty": 0.5}]
    for k in range(18):
        prompt = rng.integers(len(SPECIAL), VOCAB, int(rng.integers(8, 60))).tolist()
        out.append({"prompt": prompt, "max_new": MAX_NEW, "options": option_sets[k % len(option_sets)]})
    return out


def reference_engine_args(model: str) -> dict:
    """The reference engine's arguments: the broker's consumer's, without a prefix cache."""
    return dict(model=model, enable_prefix_caching=False, max_num_seqs=CONTRACT["max_batch_size"],
                max_model_len=CONTRACT["max_input_len"] + MAX_NEW,
                max_num_batched_tokens=max(CONTRACT["max_batch_tokens"], CONTRACT["max_input_len"] + MAX_NEW),
                dtype=SETTINGS["dtype"], gpu_memory_utilization=SETTINGS["gpu_memory_utilization"],
                seed=SETTINGS["seed"], **EXTRA)


def reference(model: str, reqs: list[dict]) -> dict:
    """Each request alone through vLLM's engine with its own SamplingParams (the broker's mapping)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import EngineArgs, LLMEngine, SamplingParams
    from vllm.inputs import TokensPrompt

    from shmbroker.engines.packed_args import vllm_sampling
    from shmbroker.engines.vllm import FINAL_ONLY, llvmlite_scan_workaround
    from shmbroker.request.options import parse_options

    llvmlite_scan_workaround()  # numba is imported (the broker's modules): vllm.py says why

    engine = LLMEngine.from_engine_args(EngineArgs(**reference_engine_args(model)))
    out = {}
    try:
        for i, r in enumerate(reqs):
            opts = parse_options(r["options"]) if r["options"] else None
            engine.add_request(f"ref{i}", TokensPrompt(prompt_token_ids=r["prompt"]),
                               SamplingParams(**vllm_sampling(r["max_new"], opts), **FINAL_ONLY))
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if o.finished:
                        samples = sorted(o.outputs, key=lambda c: c.index)
                        out[str(i)] = {"tokens": [t for c in samples for t in c.token_ids], "text": samples[0].text,
                                       "finish_reason": samples[0].finish_reason,
                                       "samples": [list(c.token_ids) for c in samples],
                                       "finish_reasons": [c.finish_reason for c in samples]}
    finally:
        engine.engine_core.shutdown()
    return out


def through_broker(work: Path, model: str, reqs: list[dict], order: list[int]) -> dict:
    from shmbroker.client.producer import Producer
    from support.brokerproc import BrokerProc

    broker = BrokerProc(work, broker_config(model))
    broker.start(ready_timeout_seconds=120)
    try:
        with Producer("vllm-sampling", data_dir=broker.data_dir) as p:
            index = {}
            for k in order:
                r = reqs[k]
                i = p.submit(np.asarray(r["prompt"], np.uint32), max_new_tokens=r["max_new"], options=r["options"])
                index[int(i)] = k
            got = {}
            deadline = time.monotonic() + 300
            while len(got) < len(reqs) and time.monotonic() < deadline:
                for res in p.results(1.0):
                    got[str(index[int(res.item_id)])] = {
                        "status": res.status, "tokens": [int(t) for t in res.tokens], "error": res.error,
                        "samples": [[int(t) for t in s] for s in res.samples], "cached_tokens": res.cached_tokens,
                        "finish_reasons": list(res.finish_reasons or ())}
    finally:
        code = broker.stop(120)
    return {"results": got, "supervisor_exit": code, "log_tail": broker.log()[-3000:] if len(got) < len(reqs) or code else ""}


def main(work: str) -> int:
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report alone
    work_dir = Path(work)
    model = tiny_model_with_tokenizer(work_dir / "model")
    reqs = requests(model)
    ref = reference(model, reqs)
    # one request with a stop string: the third generated word of its greedy reference, as text
    greedy = next(i for i, r in enumerate(reqs) if r["options"] == {"temperature": 0.0})
    from tokenizers import Tokenizer

    stop_word = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).decode(ref[str(greedy)]["tokens"][2:3])
    reqs.append({"prompt": reqs[greedy]["prompt"], "max_new": MAX_NEW, "options": {"temperature": 0.0, "stop": [stop_word]}})
    # four samples of a prompt of four blocks (prefix caching keeps whole blocks)
    long_prompt = np.random.default_rng(5).integers(len(SPECIAL), VOCAB, 4 * 32 + 5).tolist()
    reqs.append({"prompt": long_prompt, "max_new": MAX_NEW, "options": {"n": 4, "temperature": 1.0, "seed": 3}})
    more = reference(model, reqs[-2:])
    ref[str(len(reqs) - 2)], ref[str(len(reqs) - 1)] = more["0"], more["1"]
    # the sampled requests once more, greedy: sampling must not be greedy in disguise
    sampled = [k for k, r in enumerate(reqs) if (r["options"] or {}).get("temperature", 0.0) > 0]
    greedy_runs = reference(model, [{**reqs[k], "options": None} for k in sampled])
    greedy_of = {str(k): greedy_runs[str(j)]["tokens"] for j, k in enumerate(sampled)}
    order = list(range(len(reqs)))
    first = through_broker(work_dir / "run1", model, reqs, order)
    second = through_broker(work_dir / "run2", model, reqs, order[::-1])
    print(json.dumps({"requests": reqs, "reference": ref, "greedy_of_sampled": greedy_of, "stop_word": stop_word,
                      "first": first, "second": second}))
    return 0


if __name__ == "__main__":
    (work_dir,) = sys.argv[1:]
    for sub in ("run1", "run2"):
        (Path(work_dir) / sub).mkdir(parents=True, exist_ok=True)
    sys.exit(main(work_dir))
