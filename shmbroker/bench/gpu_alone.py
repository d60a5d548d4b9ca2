"""`bench gpu`'s engine-alone side: the backlog as a user of transformers runs it with no broker.

Every item, in arrival order, handed at once to the engine's own batching, on the same weights as
the other sides of `bench gpu`:

- transformers' continuous batching, when the installed release has it (`generate_batch`'s
  manager: a paged KV cache, its own scheduler, chunked prefill, prefix sharing between requests
  by whole pages; recent releases also sort a list of requests by their tokens when they share
  pages). Its per-step budget is the bench's contract (`max_batch_tokens`, `max_batch_size`
  requests) and its page the backlog's block (`block_tokens`), so its prefix sharing sees the same
  shared blocks as the broker's packer; the attention stays the hf engine's (no switch to flash
  attention), so the sides differ in their feeding, not their kernels. The cache is transformers'
  own size (a share of the free GPU memory) unless the setup names one (the CPU). The manager is
  built and warmed (its kernels, CUDA graphs) on prompts of random tokens before the timed run,
  as the other sides are warmed on one batch: `seconds` is the backlog's alone, `setup_seconds`
  the manager's start.
- else (a release without continuous batching, or one whose manager fails here): `generate` on
  left-padded batches in arrival order (the FIFO side's batches). `method` names which ran and
  `fallback_reason` why.
"""

from __future__ import annotations

import dataclasses
import inspect
import time

import numpy as np

CONTINUOUS = "transformers continuous batching"
CONTINUOUS_ONE_CALL = "transformers continuous batching (generate_batch: its setup inside the seconds)"
PADDED = "generate, left-padded batches in arrival order"
DEADLINE_SECONDS = 900.0  # the whole backlog's results, or the run fails
POLL_SECONDS = 1.0
NUM_WARM_PROMPTS = 4


@dataclasses.dataclass
class AloneRun:
    method: str
    seconds: float
    setup_seconds: float | None  # the manager's start and warm-up; None when inside `seconds`
    outputs: dict[int, list[int]]  # backlog row -> generated tokens
    settings: dict  # what the engine was given
    fallback_reason: str | None = None


def run(model, prompts: list[list[int]], plan: list, setup, *, continuous: bool = True) -> AloneRun:
    """The backlog (`prompts`, in arrival order) through transformers' continuous batching, else
    (or with `continuous=False`) through `generate` on `plan` (the arrival-order batches)."""
    import transformers

    if not continuous:
        reason = "asked for generate (continuous=False)"
    elif not hasattr(model, "generate_batch"):
        reason = f"transformers {transformers.__version__} has no continuous batching (generate_batch)"
    else:
        try:
            return _continuous(model, prompts, setup)
        except Exception as exc:  # a release whose manager differs from the one this was written for
            reason = f"continuous batching failed: {type(exc).__name__}: {exc}"
            _release(model)
    out = _padded(model, prompts, plan, setup)
    return dataclasses.replace(out, fallback_reason=reason)


def figures(alone: AloneRun, input_tokens: int, broker: dict, live: dict, broker_outputs: dict) -> dict:
    """The side's figures; the broker's speed-ups over it (in process and through a live broker);
    how many sampled items it generated as the broker's side did (`broker_outputs`: row -> tokens)."""
    import transformers

    per_s = round(input_tokens / alone.seconds, 1)
    rows = sorted(broker_outputs)
    equal = sum(alone.outputs.get(r) == broker_outputs[r] for r in rows)
    return {"method": alone.method, "fallback_reason": alone.fallback_reason,
            "transformers": transformers.__version__, "settings": alone.settings,
            "items": len(alone.outputs), "generated_tokens": sum(len(t) for t in alone.outputs.values()),
            "seconds": round(alone.seconds, 4),
            "setup_seconds": None if alone.setup_seconds is None else round(alone.setup_seconds, 4),
            "useful_tokens_per_s": per_s,
            "broker_speedup": round(broker["useful_tokens_per_s"] / per_s, 3),
            "live_speedup": round(live["useful_tokens_per_s"] / per_s, 3),
            "sample_items": len(rows), "sample_outputs_equal_broker": int(equal)}


# -- continuous batching ---------------------------------------------------------------------------


def _continuous(model, prompts: list[list[int]], setup) -> AloneRun:
    from transformers import GenerationConfig

    settings = {"max_batch_tokens": setup.contract.max_batch_tokens,
                "max_requests_per_batch": setup.contract.max_batch_size,
                "page_size": setup.block_tokens, "num_blocks": None, "auto_switch_to_flash": False}
    if setup.alone_cache_tokens is not None:
        settings["num_blocks"] = -(-setup.alone_cache_tokens // setup.block_tokens)
    eos = getattr(model.generation_config, "eos_token_id", None)
    gen = GenerationConfig(max_new_tokens=setup.max_new_tokens, do_sample=False,
                           eos_token_id=-1 if eos is None else eos, pad_token_id=0)
    options = {"generation_config": gen, "continuous_batching_config": _cb_config(settings, gen)}
    attention = model.config._attn_implementation
    t0 = time.perf_counter()
    try:
        if not hasattr(model, "continuous_batching_context_manager"):
            outputs = _one_call(model, prompts, options)
            settings["attn_implementation"] = model.config._attn_implementation
            return AloneRun(CONTINUOUS_ONE_CALL, time.perf_counter() - t0, None, outputs, _shown(settings))
        manager_options = _accepted(model.continuous_batching_context_manager, {**options, "block": True, "timeout": 60})
        with model.continuous_batching_context_manager(**manager_options) as manager:
            settings["attn_implementation"] = model.config._attn_implementation
            rng = np.random.default_rng(len(prompts))
            vocab = int(model.config.vocab_size)
            warm = [rng.integers(0, vocab, size=len(p)).tolist() for p in prompts[:NUM_WARM_PROMPTS]]
            _collect(manager, warm, setup.max_new_tokens)
            t1 = time.perf_counter()
            outputs = _collect(manager, prompts, setup.max_new_tokens)
            seconds = time.perf_counter() - t1
        return AloneRun(CONTINUOUS, seconds, t1 - t0, outputs, _shown(settings))
    finally:
        if model.config._attn_implementation != attention:
            model.set_attn_implementation(attention)
        _release(model)


def _cb_config(settings: dict, gen):
    """The settings as a `ContinuousBatchingConfig`; releases before it read them from the
    generation config (there the page is `block_size`): set there, and None returned."""
    try:
        from transformers.generation import ContinuousBatchingConfig
    except ImportError:
        ContinuousBatchingConfig = None  # noqa: N806 - the class, when this release has it
    values = {k: v for k, v in settings.items() if v is not None}
    if ContinuousBatchingConfig is None:
        values["block_size"] = values.pop("page_size")
        for k, v in values.items():
            setattr(gen, k, v)
        return None
    fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    if "page_size" not in fields:
        values["block_size"] = values.pop("page_size")
    return ContinuousBatchingConfig(**{k: v for k, v in values.items() if k in fields})


def _collect(manager, prompts: list[list[int]], max_new_tokens: int) -> dict[int, list[int]]:
    """Hand every prompt to the running manager at once and wait for all of them (a deadline)."""
    ids = None
    if hasattr(manager, "add_requests"):
        ids = manager.add_requests(**_accepted(manager.add_requests, {"inputs": prompts, "max_new_tokens": max_new_tokens}))
    if not ids:
        ids = [f"item{i}" for i in range(len(prompts))]
        for rid, p in zip(ids, prompts):
            manager.add_request(input_ids=p, request_id=rid, max_new_tokens=max_new_tokens)
    row_of = {rid: i for i, rid in enumerate(ids)}
    outputs: dict[int, list[int]] = {}
    deadline = time.monotonic() + DEADLINE_SECONDS
    while len(outputs) < len(ids):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(ids) - len(outputs)} of {len(ids)} requests unfinished after {DEADLINE_SECONDS:.0f} s")
        result = manager.get_result(timeout=POLL_SECONDS)
        if result is None:
            if hasattr(manager, "is_running") and not manager.is_running():
                raise RuntimeError("the continuous batching manager stopped with requests unfinished")
            continue
        if getattr(result, "error", None):
            raise RuntimeError(f"request {result.request_id} failed: {result.error}")
        if _finished(result) and result.request_id in row_of:
            outputs[row_of[result.request_id]] = [int(t) for t in result.generated_tokens]
    return outputs


def _finished(result) -> bool:
    done = getattr(result, "is_finished", None)
    if callable(done):
        return bool(done())
    return str(getattr(result, "status", "")).upper().endswith("FINISHED")


def _one_call(model, prompts: list[list[int]], options: dict) -> dict[int, list[int]]:
    """A release with `generate_batch` but no manager context: one call, its outputs keyed by the
    requests' order (`generate_batch` returns them in the inputs' order)."""
    out = model.generate_batch(prompts, **_accepted(model.generate_batch, {**options, "progress_bar": False}))
    if len(out) != len(prompts):
        raise RuntimeError(f"generate_batch returned {len(out)} of {len(prompts)} requests")
    return {i: [int(t) for t in r.generated_tokens] for i, r in enumerate(out.values())}


def _accepted(fn, options: dict) -> dict:
    """The options `fn` takes (releases differ), leaving out those set to None."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in options.items() if k in params and v is not None}


def _shown(settings: dict) -> dict:
    return {k: ("auto" if v is None else v) for k, v in settings.items()}


def _release(model) -> None:
    """A manager kept on the model, and the GPU memory the side's cache held, given back."""
    import torch

    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if callable(destroy):
        destroy()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# -- the fallback: generate on arrival-order batches -----------------------------------------------


def _padded(model, prompts: list[list[int]], plan: list, setup) -> AloneRun:
    rows_of = [[int(r) for r in batch.handles] for batch in plan]
    _generate(model, prompts, rows_of[0], setup.max_new_tokens)  # warm-up: kernels, allocator
    t0 = time.perf_counter()
    outputs: dict[int, list[int]] = {}
    for rows in rows_of:
        outputs.update(_generate(model, prompts, rows, setup.max_new_tokens))
    seconds = time.perf_counter() - t0
    settings = {"batches": "the FIFO side's", "padding_side": "left",
                "attn_implementation": model.config._attn_implementation}
    return AloneRun(PADDED, seconds, None, outputs, settings)


def _generate(model, prompts: list[list[int]], rows: list[int], max_new_tokens: int) -> dict[int, list[int]]:
    """One left-padded batch through `generate` (greedy); each row's new tokens."""
    import torch

    width = max(len(prompts[r]) for r in rows)
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for k, r in enumerate(rows):
        ids[k, width - len(prompts[r]) :] = prompts[r]
        mask[k, width - len(prompts[r]) :] = 1
    with torch.inference_mode():
        seq = model.generate(input_ids=torch.as_tensor(ids, device=model.device),
                             attention_mask=torch.as_tensor(mask, device=model.device),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    new = seq[:, width:].tolist()
    return {r: new[k] for k, r in enumerate(rows)}
