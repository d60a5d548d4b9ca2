"""TensorRT-LLM's `LLM` API behind the streaming engine interface (`base.py`): token ids in, token ids
out, one request per item with its own `SamplingParams` from the item's request options (greedy
without any), many outstanding, each result handed back when it finishes.

TensorRT-LLM pages its KV cache, batches in flight (it keeps up to `max_batch_size` sequences running
and admits the next request the moment one finishes) and, with block reuse on, computes per item only
the blocks its radix tree does not already hold, so the engine is `packed` (docs/design.md "Words",
"Feeding an engine"). The GPU process keeps a window of items added and not yet returned a little
larger than `max_batch_size`, so TensorRT-LLM never waits for its next request.

APIs followed (TensorRT-LLM LLM API: nvidia.github.io/TensorRT-LLM "API Reference" (LLM, RequestOutput,
SamplingParams, KvCacheConfig, GuidedDecodingParams), the "Generate text asynchronously" example
(examples/llm-api/llm_inference_async.py), and the NVIDIA/TensorRT-LLM sources named below):
- `tensorrt_llm.LLM(model, skip_tokenizer_init, tensor_parallel_size, dtype, max_batch_size,
  max_num_tokens, max_input_len, max_seq_len, enable_iter_perf_stats, guided_decoding_backend,
  kv_cache_config=tensorrt_llm.llmapi.KvCacheConfig(enable_block_reuse=True, free_gpu_memory_fraction))`;
- `LLM.generate_async(inputs, sampling_params=..., streaming=False) -> RequestOutput`
  (tensorrt_llm/llmapi/llm.py): one prompt (a token-id list) per call; it submits the request to the
  executor and returns its future. `LLM.generate` itself is generate_async per prompt, then `.result()`
  on each in order; here the futures are collected as they complete instead;
- `RequestOutput` (a `GenerationResult`, tensorrt_llm/executor/result.py): `aresult()` waits for the
  request and returns it (`await llm.generate_async(...)` in the example, `await promise.aresult()`
  in trtllm-serve, tensorrt_llm/serve/openai_server.py); then `outputs[i].token_ids` are sample i's
  generated ids and `outputs[i].finish_reason` one of 'stop', 'length', 'timeout', 'cancelled';
- `tensorrt_llm.SamplingParams(max_tokens, top_k=1, detokenize=False, end_id, pad_id, ...)`
  (tensorrt_llm/sampling_params.py): without a tokenizer `LLM._prepare_sampling_params` raises unless
  `end_id` is given, so the engine reads the end-of-sequence ids from the model directory
  (`packed_args.eos_token_ids`). An item's request options set the fields of the same names
  (`trtllm_params.py`), its constraint `guided_decoding=GuidedDecodingParams(json, regex, grammar,
  json_object)` (tensorrt_llm.llmapi), compiled by the LLM's `guided_decoding_backend`. Stop strings
  and constraints need the tokenizer (the LLM API encodes stop strings, the backend reads its
  vocabulary): a model directory that holds one has it loaded (`skip_tokenizer_init` false); without
  one they are not honoured (`unhonoured`: such an item fails `invalid`), nor is a field the installed
  SamplingParams lacks. With the xgrammar backend each distinct constraint is compiled once here first
  (`grammars.PreCheck`): one it cannot compile fails its item `invalid` at add, never in the library.
  The n samples come back as `outputs[i]` (`index` i), with their finish reasons, carried one after
  another as extras (`samples.py`); the LLM API reports no per-request cached tokens;
- `LLM.get_stats_async(timeout) -> IterationResult` (beta): an async iterator over the iteration stats
  queued since the last read (dicts; JSON text in older versions), ending after `timeout` seconds
  without one; collected only with `enable_iter_perf_stats=True`. Each holds `kvCacheStats` with
  `reusedBlocks`, `missedBlocks` (counted since the engine started) and `tokensPerBlock`;
- `LLM.shutdown()`: aborts what is in flight and stops the executor;
- errors (tensorrt_llm/executor/utils.py, executor.py, result.py, proxy.py, llmapi/llm.py): a request's
  own failure (an `ErrorResponse(client_id, error_msg, request_id)`) is raised by its `aresult()` as
  `RequestError`, a RuntimeError ("a per-request error", `GenerationExecutor._handle_background_error`);
  any other error, from the executor's threads or its MPI worker (`mpi_done_callback`), shuts the
  executor down and is raised by the next `generate_async` or `aresult()`; then `is_shutdown()` is true
  and `LLM.generate_async` raises `RuntimeError("LLM is shutting down")`. trtllm-serve
  (serve/openai_server.py) stops on `CppExecutorError` (tensorrt_llm.executor), answers `/health` from
  `LLM._check_health()` (private by name: looked up defensively; `gone()` reads it) and
  `/health_generate` by generating one token, as the probe here does. "Executor worker returned
  error" is a start-up error: `LLM(...)` raises it.

Why an event loop: a `GenerationResult` takes in its responses only when its owner waits on it
(`result(timeout)` / `aresult()` read its queue; the dispatch thread only fills it), so polling a
window of hundreds of futures would call `result(timeout=0)` on each, every few milliseconds, against
the GIL the executor's threads need. A result made inside a running asyncio event loop gets an AsyncQueue
instead, which the dispatch thread wakes with `call_soon_threadsafe` (`_SyncQueue.notify_many` in
tensorrt_llm/llmapi/utils.py and executor/proxy.py). So the engine runs one event loop on a thread of
its own: `add` hands the items to it and returns at once; on the loop each item's `generate_async` is
called, in the order added (so TensorRT-LLM's FIFO admission keeps the scheduler's order), and a task
awaits its `aresult()` and puts the item's result on a thread-safe queue; `poll(timeout)` waits on
that queue. Nothing runs until a request finishes. (The executor makes its iteration-stats queue at
the first `generate_async`, in the calling thread's mode, so the stats are read on the loop too, with
`get_stats_async`.)

Failures (engines/deaths.py). `plan_batch` answers items without tokens (`invalid`), longer than
max_input_len (`too_long`), asking more than the engine's max_new_tokens, or none, at add; a
`SamplingParams` the LLM API refuses fails its item at once. A `generate_async` or `aresult()` that
raises, or a sample ended 'cancelled' or 'timeout', is the engine's fault until proven otherwise. It is
dead (`EngineDead` from `add`, and from `poll` once the results before it are out) when the error is
`CppExecutorError`, says "LLM is shutting down" or another death's words, or `LLM._check_health()` is
false; or after ENGINE_FAILURES_MAX failures in a row. Otherwise the item is a suspect, charged (its
`engine_error`) when another request completes after it, or, with nothing else in flight, once a
probe (PROBE_TOKENS, one new token) does. A dead engine fails nothing: what it held stays pending.

Cache figures: a task on the loop keeps the latest stats entry's counters; each poll reports their
growth since the last, in the broker's `block_tokens` (stats come every 0.2 s or so: a poll may report
an item's blocks after its result; the counters are cumulative, so nothing is lost). No stats: zeros.
`engine_seconds`: wall seconds with at least one request in TensorRT-LLM (`BusyClock`).

`TRTLLM(settings, contract=..., llm=fake)` runs the same code over an injected LLM object (tests use a
test double); without `llm` it builds the real one.
"""

from __future__ import annotations

import asyncio
import queue
import threading

from tensorrt_llm import LLM, SamplingParams
from tensorrt_llm.llmapi import GuidedDecodingParams, KvCacheConfig

from ..pack.shapes import DEFAULT_BLOCK_TOKENS
from .base import ENGINE_ERROR, INVALID, EngineDead, EngineOutcome, ItemResult, StreamingRun, engine_error
from .deaths import PROBE_ITEM_ID, PROBE_TOKENS, Streak, causes
from .packed_args import (
    BusyClock,
    as_token_ids,
    eos_token_ids,
    hits_between,
    plan_batch,
    trtllm_cache_tokens,
    trtllm_llm_kwargs,
)
from .samples import samples_result
from .trtllm_params import constraint_precheck, sampling_fields, trtllm_sampling, trtllm_unhonoured

try:  # the executor's internal error: trtllm-serve stops on it (absent in a stub package)
    from tensorrt_llm.executor import CppExecutorError

    FATAL_TYPES: tuple = (CppExecutorError,)
except ImportError:
    FATAL_TYPES = ()

STATS_TIMEOUT_SECONDS = 1.0  # get_stats_async ends a read after this long without a stats entry
STATS_IDLE_SECONDS = 0.2  # then the next read starts this much later
CLOSE_SECONDS = 30.0  # close waits at most this long for the loop to run what it was given and stop
CANCEL_ROUNDS, CANCEL_WAIT_SECONDS = 10, 0.2  # close cancels the loop's tasks this often, this far apart
ENDED = ("cancelled", "timeout")  # finish reasons that are not a completion
DEATH_WORDS = ("llm is shutting down",)  # LLM.generate_async's, once the executor is shut down (llm.py)


class TRTLLM(StreamingRun):
    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, llm=None, **_options):
        self._configure("trtllm", settings, block_tokens, contract, needs="max_seq_len")
        self.llm_kwargs = trtllm_llm_kwargs(settings, contract)
        if llm is None:
            kwargs = dict(self.llm_kwargs)
            kwargs["kv_cache_config"] = KvCacheConfig(**kwargs["kv_cache_config"])
            llm = LLM(**kwargs)
        self.llm = llm
        self.eos_ids = eos_token_ids(settings.model) or _configured_eos(llm)
        self.fields = sampling_fields(SamplingParams)  # what this release's SamplingParams takes
        self.unhonoured = trtllm_unhonoured(self.fields, tokenizer=not self.llm_kwargs.get("skip_tokenizer_init"),
                                            guided=bool(self.llm_kwargs.get("guided_decoding_backend")))
        self.precheck = constraint_precheck(settings.model, self.eos_ids, self.unhonoured, self.llm_kwargs)
        self.busy = BusyClock()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # ItemResult of each finished item
        self._pending = 0
        self._stats_lock = threading.Lock()
        self._latest = None  # CacheTokens of the newest stats entry (None: none seen)
        self._seen = None  # ... as of the last poll
        self._stats_task = None
        self._closing = False
        # the loop's alone: requests in flight, held suspects in completion order, the streak
        self._running = 0
        self._suspects: list[ItemResult] = []
        self.streak = Streak("trtllm", FATAL_TYPES)
        self._dead: EngineDead | None = None  # set on the loop, read by poll, add and gone
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="trtllm-engine", daemon=True)
        self._thread.start()

    # -- the caller's side ----------------------------------------------------------------------

    def add(self, batch) -> None:
        """Hand the batch's items to the loop, which submits them in this order; returns at once."""
        if self.llm is None:
            raise RuntimeError("engine 'trtllm' is closed")
        if self._dead is not None:
            raise self._dead
        n = len(batch)
        if n == 0:
            return
        plan = plan_batch(batch, max_new_tokens_max=self.settings.max_new_tokens,
                          max_input_len=self.contract.max_input_len)
        self._pending += n
        for result in plan.results:
            if result is not None:
                self._done.put(result)
        jobs = []
        for row, prompt, m in zip(plan.rows, plan.prompts, plan.max_new_tokens):
            item_id, opts = int(batch.item_ids[row]), batch.options_of(row)
            try:
                if (why := self.precheck.error(opts) if self.precheck else None) is not None:  # grammars.PreCheck
                    self._done.put(ItemResult(item_id, INVALID, error=why))
                    continue
                params = SamplingParams(**trtllm_sampling(m, self.eos_ids, opts, self.fields, GuidedDecodingParams))
            except Exception as exc:  # noqa: BLE001 - the LLM API refuses these parameters: the item fails alone
                self._done.put(engine_error(item_id, exc))
                continue
            # a greedy item asking for n samples runs once: its output is each of them (trtllm_params.py)
            jobs.append((item_id, prompt, params, opts.samples if opts is not None and opts.greedy else 1))
        if jobs:
            self._loop.call_soon_threadsafe(self._submit, jobs)

    def pending(self) -> int:
        return self._pending

    def gone(self) -> str | None:
        """Why the engine is dead, or None while it runs: the death judged here, else the LLM API's
        own health check, else the loop's thread ended. Cheap, and safe from any thread."""
        if self._dead is not None:
            return str(self._dead)
        llm = self.llm
        if llm is None or self._closing:
            return None
        return executor_down(llm) or (None if self._thread.is_alive() else "the engine's event loop thread ended")

    def poll(self, timeout_seconds: float) -> EngineOutcome:
        """The results of the items finished since the last poll (waiting at most timeout_seconds for
        one when none has and some are in flight) and the cache counters' growth meanwhile; once the
        engine is dead and those are out, EngineDead."""
        results = []
        if self._pending and self._dead is None:
            try:
                results.append(self._done.get(timeout=timeout_seconds) if timeout_seconds > 0
                               else self._done.get_nowait())
            except queue.Empty:
                pass
        while True:
            try:
                results.append(self._done.get_nowait())
            except queue.Empty:
                break
        results = [r for r in results if r is not None]  # None: a death's wake-up
        if not results and self._dead is not None:
            raise self._dead
        self._pending -= len(results)
        with self._stats_lock:
            now = self._latest
            hits = hits_between(self._seen, now, self.block_tokens)
            if now is not None:
                self._seen = now
        return EngineOutcome(results, hits.hit_blocks, hits.queried_blocks, self.busy.take(),
                             reused_tokens=hits.reused_tokens)

    def close(self) -> None:
        """Stop submitting (items not yet submitted fail), shut TensorRT-LLM down (it aborts what is in
        flight), then stop the loop."""
        llm, self.llm = self.llm, None
        if llm is None:
            return
        self._closing = True
        try:
            # the loop runs what add queued before this: no generate_async runs during the shutdown
            self._on_loop(_nothing())
            shutdown = getattr(llm, "shutdown", None)
            if callable(shutdown):
                shutdown()
        finally:
            self._on_loop(_cancel_tasks())
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=CLOSE_SECONDS)
            if not self._thread.is_alive():
                self._loop.close()

    def _on_loop(self, coroutine) -> None:
        """Run a coroutine on the loop and wait for it (at most CLOSE_SECONDS)."""
        if not self._loop.is_running():
            coroutine.close()
            return
        try:
            asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=CLOSE_SECONDS)
        except Exception:  # noqa: BLE001 - closing: a task that will not stop is left to the daemon thread
            pass

    # -- the loop's side ------------------------------------------------------------------------

    def _submit(self, jobs) -> None:
        """On the loop: one generate_async per item, in order; a task awaits each future."""
        llm = self.llm
        for item_id, prompt, params, copies in jobs:
            if llm is None:
                self._done.put(ItemResult(item_id, ENGINE_ERROR, error="engine 'trtllm' was closed"))
            elif self._dead is None:  # a dead engine's items stay pending: they are handed back
                self._start(llm, item_id, prompt, params, copies)
        if self._stats_task is None and llm is not None and callable(getattr(llm, "get_stats_async", None)):
            self._stats_task = self._loop.create_task(self._collect_stats(llm))

    def _start(self, llm, item_id: int, prompt: list, params, copies: int) -> None:
        self.busy.begin()
        try:
            future = llm.generate_async(prompt, sampling_params=params)
        except Exception as exc:  # noqa: BLE001 - refused at submission: judged (module docstring)
            self.busy.end()
            self._failed(engine_error(item_id, exc), exc)
            return
        self._running += 1
        self._loop.create_task(self._collect(item_id, future, copies))

    async def _collect(self, item_id: int, future, copies: int = 1) -> None:
        out = error = None
        try:
            out = await future.aresult()
        except Exception as exc:  # noqa: BLE001 - judged below: the item's, or the engine's death
            error = exc
        finally:
            self.busy.end()
            self._running -= 1
        if error is not None:
            self._failed(engine_error(item_id, error), error)
            return
        ended = [r for r in (getattr(c, "finish_reason", None) for c in out.outputs) if r in ENDED]
        if ended:
            error = RuntimeError(f"TensorRT-LLM ended the request ({ended[0]})")
            self._failed(ItemResult(item_id, ENGINE_ERROR, error=str(error)), error)
        else:
            self._answered(samples_result(item_id, out.outputs, copies=copies))

    def _answered(self, result: ItemResult) -> None:
        """On the loop: a request completed, so the engine answers: the suspects before it are charged."""
        if self._dead is not None:
            return
        self.streak.answered()
        charged, self._suspects = self._suspects, []
        for r in charged + ([] if result.item_id == PROBE_ITEM_ID else [result]):
            self._done.put(r)

    def _failed(self, result: ItemResult, exc: BaseException) -> None:
        """On the loop: a request failed: the engine's death, or one more in the streak and a suspect."""
        if self._dead is not None:
            return
        try:
            why = executor_down(self.llm) or death_words(exc)
            if why is not None:
                raise EngineDead(f"engine 'trtllm' is dead: {why}") from exc
            self.streak.failed(exc)
        except EngineDead as dead:
            self._dead, self._suspects = dead, []
            self._done.put(None)  # wakes a waiting poll
            return
        if result.item_id != PROBE_ITEM_ID:
            self._suspects.append(result)
        self._loop.call_soon(self._probe)  # once the submissions under way are made

    def _probe(self) -> None:
        """On the loop: with suspects held and nothing in flight, a one-token request."""
        llm = self.llm
        if not self._suspects or self._running or self._dead is not None or llm is None:
            return
        params = SamplingParams(**trtllm_sampling(1, self.eos_ids, None, self.fields))
        self._start(llm, PROBE_ITEM_ID, [int(t) for t in PROBE_TOKENS], params, 1)

    async def _collect_stats(self, llm) -> None:
        """Keep the newest block-reuse counters; ends when the LLM has no stats to give."""
        while not self._closing:
            got = False
            try:
                async for entry in llm.get_stats_async(timeout=STATS_TIMEOUT_SECONDS):
                    got = True
                    counters = trtllm_cache_tokens([entry])
                    if counters is not None:
                        with self._stats_lock:
                            self._latest = counters
            except Exception:  # noqa: BLE001 - stats not collected (or not in this version): no figures
                return
            if not got:
                await asyncio.sleep(STATS_IDLE_SECONDS)


async def _nothing() -> None:
    pass


async def _cancel_tasks() -> None:
    """Cancel every other task on the running loop and wait (a little) for them to end. Cancelled again
    while any is left: `asyncio.wait_for`, which the LLM API's AsyncQueue.get uses, can swallow a
    cancellation that meets its inner wait's completion (CPython gh-86296)."""
    me = asyncio.current_task()
    tasks = {t for t in asyncio.all_tasks() if t is not me}
    for _ in range(CANCEL_ROUNDS):
        if not tasks:
            return
        for t in tasks:
            t.cancel()
        _, tasks = await asyncio.wait(tasks, timeout=CANCEL_WAIT_SECONDS)


def executor_down(llm) -> str | None:
    """Why TensorRT-LLM's executor is down by its own health check (module docstring), or None."""
    check = getattr(llm, "_check_health", None)
    if not callable(check):
        return None
    try:
        healthy = check()
    except Exception as exc:  # noqa: BLE001 - a health check that cannot answer says the engine is gone
        return f"LLM._check_health() raised {type(exc).__name__}: {exc}"
    return None if healthy else "TensorRT-LLM's executor is shut down (LLM._check_health() is false)"


def death_words(exc: BaseException) -> str | None:
    """exc (or what caused it) in the words of a shut-down LLM API, or None."""
    for e in causes(exc):
        if any(w in str(e).lower() for w in DEATH_WORDS):
            return f"{type(e).__name__}: {e}"
    return None


def _configured_eos(llm) -> list[int]:
    """End-of-sequence ids from the configs the LLM loaded (a model from the Hugging Face hub has no
    local directory to read); private attributes of the LLM API, so looked up defensively."""
    for name in ("_generation_config", "_hf_model_config"):
        ids = as_token_ids(getattr(getattr(llm, name, None), "eos_token_id", None))
        if ids:
            return ids
    return []
