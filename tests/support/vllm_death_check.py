"""The vLLM adapter against engines that die (run by tests/engines/test_vllm_death.py under .venv-vllm).

    .venv-vllm/bin/python tests/support/vllm_death_check.py WORK_DIR     # prints one JSON object, the last line

A real in-process vLLM engine (a tiny random Llama) behind `shmbroker.engines.vllm.VLLM`, wrapped in
`DyingEngine`, a test double that stands for what cannot happen on this machine's CPU: after
`after_steps` real steps every `step()` raises, as a real engine does once its CUDA context is lost
or its engine core is dead. Cases:

- `engine_dead`: vLLM's own `EngineDeadError`;
- `cuda`: RuntimeError("CUDA error: an illegal memory access was encountered"), repeated;
- `generic`: a RuntimeError with no words that name death, repeated (a streak decides);
- `poison`: `step()` raises whenever one given request is in the engine; the engine works otherwise.

For each: the results polled before the engine died, whether `poll` raised EngineDead, and the
items never answered. The test asserts on the report.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from vllm_real_check import CONTRACT, EXTRA, SETTINGS, tiny_model  # noqa: E402

ERRORS = {
    "cuda": lambda: RuntimeError("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                                 "asynchronously reported at some other API call"),
    "generic": lambda: RuntimeError("something went wrong in the model runner"),
}


class DyingEngine:
    """Test double around a real vLLM LLMEngine: its `step()` raises after `after_steps` steps (or,
    with `poison`, whenever that request is in the engine); everything else is the real engine's."""

    def __init__(self, real, case: str, after_steps: int, poison: str | None = None):
        self.real, self.case, self.after_steps, self.poison = real, case, after_steps, poison
        self.steps = 0
        self.live: set[str] = set()

    def __getattr__(self, name):
        return getattr(self.real, name)

    def add_request(self, request_id, prompt, params):
        self.real.add_request(request_id, prompt, params)
        self.live.add(str(request_id))

    def abort_request(self, ids):
        self.live.difference_update(str(i) for i in ids)
        return self.real.abort_request(ids)

    def step(self):
        self.steps += 1
        if self.poison is not None and self.poison in self.live:
            raise RuntimeError("a kernel failed on this prompt")
        if self.poison is None and self.steps > self.after_steps:
            if self.case == "engine_dead":
                from vllm.v1.engine.exceptions import EngineDeadError

                raise EngineDeadError()
            raise ERRORS[self.case]()
        outs = self.real.step()
        for o in outs:
            if o.finished:
                self.live.discard(str(o.request_id))
        return outs


def run_case(real, case: str, prompts, after_steps: int) -> dict:
    from shmbroker.engines.base import EngineBatch, EngineDead
    from shmbroker.engines.options import VLLMSettings
    from shmbroker.engines.vllm import VLLM
    from shmbroker.pack.contract import Contract

    poison = "1003" if case == "poison" else None
    settings = VLLMSettings(model="unused", **SETTINGS, extra=EXTRA)
    engine = VLLM(settings, contract=Contract(**CONTRACT), block_tokens=32,
                  engine=DyingEngine(real, case, after_steps, poison))
    ids = np.arange(1000, 1000 + len(prompts), dtype=np.uint64)
    engine.add(EngineBatch(ids, [np.asarray(p, np.uint32) for p in prompts], np.full(len(prompts), 8, np.int64)))
    got, dead = {}, None
    for _ in range(2000):
        if len(got) == len(prompts):
            break
        try:
            out = engine.poll(0.05)
        except EngineDead as exc:
            dead = str(exc)
            break
        for r in out.results:
            got[str(r.item_id)] = {"status": r.status, "error": r.error}
    real.abort_request([str(i) for i in ids.tolist()])  # what the real engine still holds: cleared for the next case
    while real.has_unfinished_requests():
        real.step()
    return {"results": got, "dead": dead, "unanswered": len(prompts) - len(got)}


def main(work: str) -> int:
    import os

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from shmbroker.engines.options import VLLMSettings
    from shmbroker.engines.packed_args import vllm_llm_kwargs
    from shmbroker.engines.vllm import build_engine
    from shmbroker.pack.contract import Contract

    model = tiny_model(Path(work) / "model")
    settings = VLLMSettings(model=model, **SETTINGS, extra=EXTRA)
    real = build_engine(vllm_llm_kwargs(settings, Contract(**CONTRACT)))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(1, 500, int(rng.integers(8, 40))).tolist() for _ in range(8)]
    report = {case: run_case(real, case, prompts, after_steps=6)
              for case in ("engine_dead", "cuda", "generic", "poison")}
    real.engine_core.shutdown()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
