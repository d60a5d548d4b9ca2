"""A chat batch over HTTP while the vLLM engine core behind it is SIGKILLed (run by
tests/engines/test_vllm_death.py under .venv-vllm; prints one JSON object, the last line):

    .venv-vllm/bin/python tests/support/vllm_kill_check.py WORK_DIR

1. The tiny random Llama of vllm_sampling_check with its tokenizer; LINES greedy chat lines.
2. A broker with an `[http]` role and one consumer, engine = "vllm" (`enforce_eager`: no compile
   warm-up at each start), its engine core in its own process as vLLM runs it by default
   (`VLLM_ENABLE_V1_MULTIPROCESSING=1`, inherited by the broker).
3. The file uploaded and run as a batch with the `openai` package. Once the consumer has KILL_AFTER
   items ok, every `VLLM::EngineCore` process under its GPU process is SIGKILLed; the seconds until
   the consumer's next ok item are measured, then the batch is polled until it ends.
The test asserts on the report; this script only runs and records.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from support.vllm_chat_check import ENDED, HTTP_KEY, SERVED, engine_config  # noqa: E402
from support.vllm_real_check import VOCAB  # noqa: E402
from support.vllm_sampling_check import SPECIAL, tiny_model_with_tokenizer  # noqa: E402

LINES = 150
KILL_AFTER = 40
MAX_NEW = 8


def bodies() -> list[dict]:
    rng = np.random.default_rng(17)
    words = [f"w{i}" for i in range(VOCAB - len(SPECIAL))]
    return [{"model": SERVED, "max_completion_tokens": MAX_NEW, "temperature": 0.0,
             "messages": [{"role": "user", "content": " ".join(rng.choice(words, int(rng.integers(8, 60))).tolist())}]}
            for _ in range(LINES)]


def consumer_ok(data_dir: str) -> dict:
    from shmbroker.observe.watch import BrokerView

    view = BrokerView.attach(data_dir)
    try:
        return view.snapshot()["consumers"]["cpu"]
    finally:
        view.close()


def run_batch(broker, src: Path) -> dict:
    from openai import OpenAI

    from shmbroker.bench.faults import engine_core_pids

    addr = json.loads((Path(broker.data_dir) / "broker.json").read_text())["http_addr"]
    c = OpenAI(base_url=f"http://{addr}/v1", api_key=HTTP_KEY, max_retries=0)
    with src.open("rb") as fh:
        f = c.files.create(file=fh, purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    killed = exited = gpu = None
    ok_at_kill = next_seconds = None
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        card = consumer_ok(broker.data_dir)
        if killed is None and card.get("ok", 0) >= KILL_AFTER:
            gpu = broker.role_pids()["gpu-cpu"]
            cores = engine_core_pids(gpu)
            for pid in cores:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
        elif killed is not None and exited is None and broker.role_pids()["gpu-cpu"] != gpu:
            exited, ok_at_kill = time.monotonic() - killed, card.get("ok", 0)  # what the dead process counted
        elif exited is not None and next_seconds is None and card.get("ok", 0) > ok_at_kill:
            next_seconds = time.monotonic() - killed  # the successor's first result
        b = c.batches.retrieve(b.id)
        if b.status in ENDED:
            break
        time.sleep(0.2)
    out = [] if b.output_file_id is None else [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    errors = [] if b.error_file_id is None else [json.loads(x) for x in c.files.content(b.error_file_id).text.splitlines()]
    card = consumer_ok(broker.data_dir)
    return {"status": b.status, "killed": killed is not None, "kill_to_exit_seconds": exited,
            "kill_to_next_ok_seconds": next_seconds, "out": out, "errors": errors,
            "consumer": {k: card.get(k) for k in ("ok", "engine_errors", "engine_deaths", "engine_restart_ns",
                                                  "engine_load_ns")}}


def main(work: str) -> int:
    from support.brokerproc import BrokerProc

    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the report alone
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    work_dir = Path(work)
    model = tiny_model_with_tokenizer(work_dir / "model")
    src = work_dir / "batch.jsonl"
    src.write_text("".join(json.dumps({"custom_id": f"line-{k}", "method": "POST", "url": "/v1/chat/completions",
                                       "body": b}) + "\n" for k, b in enumerate(bodies())))
    config = engine_config(model)
    table = "[consumers.engine_settings]\n"
    assert config.count(table) == 1, config
    # no torch.compile warm-up at each start (on the CPU it is most of the load): the restart is the
    # processes' start and the model's load
    broker = BrokerProc(work_dir / "broker", config.replace(table, table + "enforce_eager = true\n"))
    broker.start(ready_timeout_seconds=180)
    try:
        report = run_batch(broker, src)
    finally:
        code = broker.stop(120)
    report.update(lines=LINES, supervisor_exit=code, log_tail=broker.log()[-4000:])
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    (Path(sys.argv[1]) / "broker").mkdir(parents=True, exist_ok=True)
    sys.exit(main(sys.argv[1]))
