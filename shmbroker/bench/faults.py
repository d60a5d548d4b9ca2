"""`shmbroker bench faults`: what an engine death costs a card, against a plain model load.

A broker with one `vllm` consumer (a tiny random Llama on disk, vLLM's engine core in its own
process as vLLM runs it by default: `VLLM_ENABLE_V1_MULTIPROCESSING=1`; `enforce_eager`, so no
compile warm-up at each start) is fed `items` prompts by a
producer. Once `kill_after` results are in, the `VLLM::EngineCore` process (the GPU process's child)
is SIGKILLed. Measured:

- `kill_to_exit_seconds`: from the kill to the GPU process's exit (it sees its engine core gone);
- `kill_to_next_result_seconds`: from the kill to the first result after its successor started
  (the engine's restart: a fresh GPU process starts and loads the model);
- `engine_load_seconds`: the baseline, what the first GPU process took from its start to its engine
  loaded (the consumer's `engine_load_ns` before the kill) and the successor's;
- `results`, `ok`, `distinct`: every item answered `ok` exactly once after the client's dedupe;
- the consumer's `engine_deaths` and `engine_restart_ns` as exported.

Runs under `.venv-vllm` (`make vllm`): `.venv-vllm/bin/shmbroker bench faults --json`.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import numpy as np

from .broker import BenchBroker
from .gen import write_model

VOCAB = 512
MODEL = {"vocab_size": VOCAB, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024, "bos_token_id": 0,
         "eos_token_id": VOCAB - 1, "tie_word_embeddings": False}
MAX_NEW = 16
WAIT_SECONDS = 600.0  # the whole run's bound


def config(model_dir: str, engine_call_seconds: float) -> str:
    return (f'instance = "faults{os.getpid()}"\nblock_tokens = 32\ningest_ring_bytes = 1048576\n'
            f"result_ring_bytes = 1048576\nsegment_bytes = 4194304\nindex_items = 65536\nmax_wait_seconds = 1.0\n"
            f"engine_call_seconds = {engine_call_seconds}\n\n"
            '[[consumers]]\nname = "cpu"\nengine = "vllm"\nmax_batch_size = 4\nmax_batch_tokens = 1024\n'
            "max_input_len = 256\n\n[consumers.engine_settings]\n"
            f"model = {json.dumps(model_dir)}\ndtype = \"float32\"\nmax_new_tokens = {MAX_NEW}\n"
            "gpu_memory_utilization = 0.15\nenforce_eager = true\n"
            "extra = { block_size = 32, num_gpu_blocks_override = 128 }\n")


def engine_core_pids(gpu_pid: int) -> list[int]:
    """The GPU process's children named VLLM::EngineCore (vLLM titles its engine-core process so)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == gpu_pid and b"EngineCore" in cmdline:
            found.append(int(entry.name))
    return found


def consumer_card(data_dir: str) -> dict:
    from ..observe.watch import BrokerView

    view = BrokerView.attach(data_dir)
    try:
        return view.snapshot()["consumers"]["cpu"]
    finally:
        view.close()


def run(*, items: int = 240, kill_after: int = 24, engine_call_seconds: float = 30.0, say=lambda line: None) -> dict:
    from ..client.producer import Producer

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"  # the engine core in its own process (inherited)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, VOCAB - 1, int(rng.integers(16, 120))).astype(np.uint32) for _ in range(items)]
    with tempfile.TemporaryDirectory(prefix="shmb-faults-") as tmp:
        model_dir = write_model(Path(tmp) / "model", MODEL)
        broker = BenchBroker(tmp, config(model_dir, engine_call_seconds))
        try:
            info = broker.wait_ready()
            return _measure(broker, info, prompts, kill_after, Producer, say)
        finally:
            broker.stop()


def _measure(broker, info: dict, prompts: list, kill_after: int, producer_class, say) -> dict:
    got: dict[int, str] = {}
    results = 0
    killed_at = exited_at = next_at = gpu = None
    load_before = None
    with producer_class("faults", data_dir=broker.data_dir) as p:
        ids = [int(p.submit(t, max_new_tokens=MAX_NEW)) for t in prompts]
        deadline = time.monotonic() + WAIT_SECONDS
        while len(got) < len(ids) and time.monotonic() < deadline:
            for r in p.results(0.2):
                results += 1
                got[int(r.item_id)] = r.status
                if exited_at is not None and next_at is None:
                    next_at = time.monotonic()
                if len(got) >= kill_after:
                    break  # the kill comes while most items still wait
            if killed_at is not None and exited_at is None and broker.role_pids(info)["gpu-cpu"] != gpu:
                exited_at = time.monotonic()
            if killed_at is None and len(got) >= kill_after:
                load_before = consumer_card(broker.data_dir).get("engine_load_ns", 0) / 1e9
                gpu = broker.role_pids(info)["gpu-cpu"]
                cores = engine_core_pids(gpu)
                if not cores:
                    raise RuntimeError(f"no VLLM::EngineCore process under the GPU process {gpu}")
                for pid in cores:
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                say(f"killed the engine core {cores} after {len(got)} results")
    card = consumer_card(broker.data_dir)
    return {"benchmark": "faults", "engine": "vllm", "items": len(prompts), "kill_after": kill_after,
            "results": results, "distinct": len(got), "ok": sum(s == "ok" for s in got.values()),
            "kill_to_exit_seconds": None if exited_at is None else round(exited_at - killed_at, 2),
            "kill_to_next_result_seconds": None if next_at is None else round(next_at - killed_at, 2),
            "engine_load_seconds": {"first": round(load_before or 0.0, 2),
                                    "after_death": round(card.get("engine_load_ns", 0) / 1e9, 2)},
            "engine_deaths": card.get("engine_deaths"),
            "engine_restart_seconds": round(card.get("engine_restart_ns", 0) / 1e9, 2)}
