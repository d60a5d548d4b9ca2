"""The `openai` engine: items streamed to any OpenAI-compatible completions server (vLLM, SGLang, ...).

Why an HTTP engine at all: a card whose inference server already runs (`vllm serve`, SGLang,
trtllm-serve) is fed without loading a model into the GPU process. The server pages its KV cache
and batches continuously, so the mode is `packed` (docs/design.md "Words", "Feeding an engine"): what
the broker gives it is the order (families together, parents first), and what this engine must do
is keep the server full, handing each item's result back the moment its request returns.

The streaming interface (`base.py`): `add(batch)` cuts the items into small requests to
`POST {base_url}/completions` with token-id prompts (`"prompt": [[ids], ...]`, n choices per prompt,
`choices[i].index` naming prompt index // n and its sample index % n) and queues them, in the batch's order, on a pool of `max_in_flight`
threads (a small blocking pool: no asyncio on the hot path, docs/design.md), so at most `max_in_flight`
requests are at the server at once and the rest wait inside the engine; it returns at once.
`poll(timeout)` waits (at most the timeout) for at least one request to return and hands back the
results of every request returned since the last poll (in any order): a slow request holds back
only its own items. `StreamingRun.run` gives the one-batch-at-a-time call on top.

Request size. `max_tokens` is per request, and so are the sampling fields an item's request options
set (temperature, seed, stop, n, ...: the body's fields of the same names; greedy without any;
logprobs as the completions API's `logprobs` count, read back from each choice's `token_logprobs`
and its `top_logprobs` keyed by token id, `openai_reply.choice_logprobs`), so a
request's items share max_new_tokens and options (items of an add are grouped by both, the groups kept in the add's order); then each group is cut to
`max_items_per_request`. Its default (0: `default_items_per_request`) is small, 1 to 4: one item per
request is best for a continuously batching server, since each request returns (and its slot is
refilled) the moment its one sequence ends, with no wait for the longest of a group, and the server
still batches across requests; more than one item per request is used only where `max_in_flight`
requests of one item would leave the consumer's `max_batch_size` sequences unfilled (it is
ceil(max_batch_size / max_in_flight), capped at ITEMS_PER_REQUEST_AUTO_MAX = 4, so a request's tail
wait stays short). So set `max_in_flight` to about the server's batch size (its `max_num_seqs`): an
HTTP request costs the server well under a millisecond, against tens of milliseconds per decode step.
Each request has `timeout_seconds` (httpx's connect, write and read timeout: a non-streaming
completion sends nothing until it is done).

Failures: the server being down is not the items' fault; a refusal is. Connection errors,
timeouts, 408, 429 and 5xx are retried with exponential back-off (`backoff_seconds`, doubled per
try, at most `retries` retries; a 429/503's Retry-After in seconds is honoured, every wait capped at
BACKOFF_MAX_SECONDS). A request that still fails so is the server being down, and its items are
handed back (`EngineOutcome.down`, `base.EngineDown`): the GPU process adds them again after its own
back-off, for as long as the outage lasts, and nothing fails for it. One exception: a request that
timed out or got a 5xx while the server answered other requests (a 200 since its last try was
sent) failed on its own content, and its items fail (`engine_error`, with the reason); a 429 or
503 (the server's load) and a connection error (the server went away) are always handed back. A
400/413/422 (the server refused the request's content, often one prompt: too long, a token id out
of vocabulary) is not retried as is: a request of several prompts is split in halves and each
half sent again, so only the prompts the server refuses fail, with its message; a request whose
items carry a constraint refused as a whole fails them `invalid` (the constraint, which they share,
is what the server could not compile). Other 4xx (auth,
unknown model) fail the request's items at once. Nothing raises out of `add` or `poll` for a
failed request.

The broker deals in token ids, so they are asked for and read back in this order:

- `choices[i].token_ids`, asked with `"return_token_ids": true` (vLLM >= 0.10.2 and SGLang,
  `CompletionRequest.return_token_ids` / `CompletionResponseChoice.token_ids` in their
  `.../openai/protocol.py`);
- `choices[i].logprobs.tokens` as `"token_id:N"` strings, asked with
  `"return_tokens_as_token_ids": true` and `"logprobs": 0` (older vLLM);
- `choices[i].output_ids` (SGLang's native field name, in case a server uses it).

The logprobs fields cost the server work per generated token, so they are asked only until a
response carries `token_ids`. A response with no token ids at all fails its items with an error
that names what was asked.

Cache figures: `usage.prompt_tokens_details.cached_tokens` (vLLM with
`--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`) is reported as
`reused_tokens`, with hit blocks = cached // block_tokens and queried blocks = prompt tokens //
block_tokens; a server that does not report it counts 0 for both. Each poll reports the requests
it returns. Its `engine_seconds` are the wall seconds since the last poll during which at least one
request was at the server (`BusyClock`): the server's busy time as far as this consumer can see it. Reading an answer (the token ids, the
usage, a server's error text) is `openai_reply.py`'s.

Embeddings (`task = "embed"`): the items go to `POST {base_url}/embeddings` instead, grouped and cut
into requests the same way (by their options: `dimensions`), with the same retries, hand-backs and
splits of a refused request, except that a refusal of an embedding's content (400, 413, 422: too
long, a token id out of vocabulary, `dimensions` the model does not declare) fails its item
`invalid`, with the server's message; each vector is read bit-exact from base64 (`openai_embed.py`).
"""

from __future__ import annotations

import json
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from time import monotonic

import httpx

from ..pack.shapes import DEFAULT_BLOCK_TOKENS
from .base import ENGINE_ERROR, INVALID, OK, EngineDown, EngineOutcome, ItemResult, StreamingRun
from .openai_embed import embeddings_body, parse_embeddings
from .openai_reply import Reply, RequestFailed, parse_reply, server_message
from .options import embeds
from .packed_args import BusyClock, structured_fields

RETRY_STATUSES = (408, 429)  # and every 5xx
LOAD_STATUSES = (429, 503)  # the server's load: handed back (down) even while it answers others
SPLIT_STATUSES = (400, 413, 422)  # the request's content was refused: maybe one prompt, so split


BACKOFF_MAX_SECONDS = 30.0  # no single wait between tries is longer (a server's Retry-After included)
ITEMS_PER_REQUEST_AUTO_MAX = 4  # the default request size never exceeds this (module docstring)


def default_items_per_request(settings, contract) -> int:
    """Items per request: `max_items_per_request` when set (> 0), else the fewest (1 to
    ITEMS_PER_REQUEST_AUTO_MAX) with which `max_in_flight` requests hold the contract's
    max_batch_size sequences (module docstring)."""
    if int(settings.max_items_per_request) > 0:
        return int(settings.max_items_per_request)
    if contract is None:
        return 1
    in_flight = max(1, int(settings.max_in_flight))
    return max(1, min(ITEMS_PER_REQUEST_AUTO_MAX, math.ceil(int(contract.max_batch_size) / in_flight)))


def retry_after(resp) -> float | None:
    """A response's Retry-After in seconds (the delay form; an HTTP date is ignored), or None."""
    try:
        value = float(resp.headers.get("retry-after", ""))
    except (TypeError, ValueError):
        return None
    return value if value >= 0 else None


class OpenAICompatible(StreamingRun):
    """The streaming engine interface (`base.Engine`) over an OpenAI-compatible completions server."""

    def __init__(self, settings, *, block_tokens: int = DEFAULT_BLOCK_TOKENS, contract=None, **_options):
        if not settings.model:
            raise ValueError("engine 'openai' needs engine_settings.model (the served model's name)")
        self._configure("openai", settings, block_tokens, contract, needs=None)
        self.embeds = embeds(settings)  # task "embed": the server's embeddings endpoint (openai_embed.py)
        self.url = settings.base_url.rstrip("/") + ("/embeddings" if self.embeds else "/completions")
        self.in_flight_max = max(1, int(settings.max_in_flight))
        self.items_per_request = default_items_per_request(settings, contract)
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(settings.api_key_env) if settings.api_key_env else None
        if key:
            headers["Authorization"] = f"Bearer {key}"
        self.client = httpx.Client(headers=headers, timeout=httpx.Timeout(settings.timeout_seconds),
                                   limits=httpx.Limits(max_connections=self.in_flight_max,
                                                       max_keepalive_connections=self.in_flight_max))
        # FIFO: requests start in the order they were added, at most in_flight_max at once
        self.pool = ThreadPoolExecutor(max_workers=self.in_flight_max, thread_name_prefix="openai-engine")
        self.ask_logprobs = True  # until a response carries choices[].token_ids
        self.closed = False
        self.busy = BusyClock()
        self._requests: dict = {}  # future -> the item ids of its request, in its prompts' order
        self._constrained: set = set()  # the futures of requests whose items carry a constraint
        self._pending = 0
        self.last_ok = 0.0  # monotonic time of the server's last 200
        tries = int(settings.retries) + 1
        backoffs = sum(min(BACKOFF_MAX_SECONDS, settings.backoff_seconds * 2 ** k) for k in range(tries - 1))
        # the longest this engine takes to answer or hand back one request (a batch deadline's floor)
        self.call_seconds_max = tries * float(settings.timeout_seconds) + backoffs

    # -- the stream ---------------------------------------------------------------------------

    def add(self, batch) -> None:
        """Queue the batch's items as requests (module docstring) and return at once."""
        if self.closed:
            raise RuntimeError("engine 'openai' is closed")
        n = len(batch)
        if n == 0:
            return
        ids = [int(i) for i in batch.item_ids]
        max_new = [max(1, int(m)) for m in batch.max_new_tokens]
        options = [batch.options_of(k) for k in range(n)]
        for part in self.parts(max_new, options):
            # tokens are read here, in the caller's thread (they may be views into the caller's mappings)
            prompts = [batch.tokens[i].tolist() for i in part]
            future = self.pool.submit(self._timed_request, prompts, max_new[part[0]], options[part[0]])
            self._requests[future] = [ids[i] for i in part]
            if options[part[0]] is not None and options[part[0]].structured is not None:
                self._constrained.add(future)
        self._pending += n

    def pending(self) -> int:
        return self._pending

    def poll(self, timeout_seconds: float) -> EngineOutcome:
        """The results of the requests returned since the last poll, waiting at most timeout_seconds
        for one when none has."""
        if self._requests:
            done, _ = wait(list(self._requests), timeout=max(0.0, timeout_seconds), return_when=FIRST_COMPLETED)
        else:
            done = ()
        results: list = []
        down: list = []
        reason = ""
        hit_blocks = queried_blocks = reused_tokens = 0
        for future in done:
            ids = self._requests.pop(future)
            constrained = future in self._constrained
            self._constrained.discard(future)
            try:
                reply = future.result()
            except RequestFailed as exc:
                if exc.down and (exc.always or self.last_ok <= exc.sent):
                    down.extend(ids)  # the server is down: handed back, retried later
                    reason = str(exc)
                else:  # refused for its content with a constraint (which all its items share): that constraint
                    status = INVALID if (constrained or self.embeds) and exc.status in SPLIT_STATUSES else ENGINE_ERROR
                    results.extend(ItemResult(i, status, error=str(exc)) for i in ids)
                continue
            except Exception as exc:  # noqa: BLE001 - a bug or an odd answer fails this request's items only
                results.extend(ItemResult(i, ENGINE_ERROR, error=f"{type(exc).__name__}: {exc}") for i in ids)
                continue
            for k, i in enumerate(ids):
                tokens, error = reply.tokens[k], reply.errors[k]
                refused = self.embeds and reply.refused_of(k)  # an embedding's content the server refused
                results.append(ItemResult(i, OK, tokens, extras=reply.extras_of(k)) if error is None
                               else ItemResult(i, INVALID if refused else ENGINE_ERROR, error=error))
            for r in reply.sub_replies or [reply]:
                if r.cached_tokens is not None:
                    reused_tokens += r.cached_tokens
                    hit_blocks += r.cached_tokens // self.block_tokens
                    queried_blocks += r.prompt_tokens // self.block_tokens
        self._pending -= len(results) + len(down)
        return EngineOutcome(results, hit_blocks=hit_blocks, queried_blocks=queried_blocks,
                             engine_seconds=self.busy.take(), reused_tokens=reused_tokens,
                             down=EngineDown(reason, down) if down else None)

    def parts(self, max_new: list, options: list | None = None) -> list:
        """Item rows grouped by max_new_tokens and request options (a request's body holds one of
        each), cut to `items_per_request`: one request each, in the order of their first rows (so
        requests start in the order the items were added)."""
        groups: dict = {}
        for i, m in enumerate(max_new):
            groups.setdefault((m, None if options is None else options[i]), []).append(i)
        size = self.items_per_request
        parts = [rows[k : k + size] for rows in groups.values() for k in range(0, len(rows), size)]
        return sorted(parts, key=lambda part: part[0])

    def _timed_request(self, prompts: list, max_tokens: int, options=None) -> Reply:
        self.busy.begin()
        try:
            return self.request(prompts, max_tokens, options)
        finally:
            self.busy.end()

    # -- one request ------------------------------------------------------------------------

    def request(self, prompts: list, max_tokens: int, options=None, *, probed: bool = False) -> Reply:
        """The reply to these prompts; a refused request of several prompts is split in halves, so that
        only the prompts the server refuses fail. First the first prompt alone is tried, then (refused
        alike) the last: when the server refuses both with the very same reason, the refusal is the
        request's, not a prompt's (an option it does not take, say), and every prompt fails at once
        instead of after 2n - 1 requests. (One prompt alone was asked before, the last: when it was the
        refused one, every prompt of the request failed with it.)"""
        try:
            return self.post(prompts, max_tokens, options)
        except RequestFailed as exc:
            if exc.status not in SPLIT_STATUSES or len(prompts) == 1:
                raise
            whole = exc
        if not probed and self._refused_alone(prompts[:1], whole, max_tokens, options) \
                and self._refused_alone(prompts[-1:], whole, max_tokens, options):
            raise whole from None  # the first and the last prompt alone refused alike: the request's fault
        half = len(prompts) // 2
        replies = []
        for sub in (prompts[:half], prompts[half:]):
            try:
                replies.append(self.request(sub, max_tokens, options, probed=True))
            except RequestFailed as exc:
                if exc.down:
                    raise
                replies.append(Reply([None] * len(sub), [str(exc)] * len(sub),
                                     refused=[exc.status in SPLIT_STATUSES] * len(sub)))
        return Reply(replies[0].tokens + replies[1].tokens, replies[0].errors + replies[1].errors,
                     sub_replies=[s for r in replies for s in (r.sub_replies or [r])],
                     extras=[r.extras_of(k) for r in replies for k in range(len(r.tokens))],
                     refused=[r.refused_of(k) for r in replies for k in range(len(r.tokens))])

    def _refused_alone(self, prompt: list, whole, max_tokens: int, options=None) -> bool:
        """Whether this one prompt alone is refused with the very reason the whole request was. Both the
        first and the last prompt are asked: one of them may be the prompt the server refuses."""
        try:
            self.post(prompt, max_tokens, options)
        except RequestFailed as exc:
            if exc.down:
                raise  # the server went down meanwhile: the whole request is handed back
            return str(exc) == str(whole) and exc.status == whole.status
        return False

    def post(self, prompts: list, max_tokens: int, options=None) -> Reply:
        """One request, retried on connection errors, timeouts, 408, 429 and 5xx; raises RequestFailed:
        a completion (`completion_body`) or, for an engine that embeds, the prompts' vectors."""
        if self.embeds:
            resp = self.send(json.dumps(embeddings_body(self.settings.model, prompts, options)).encode())
            return parse_embeddings(resp, prompts)
        body, top = self.completion_body(prompts, max_tokens, options)
        resp = self.send(json.dumps(body, separators=(",", ":")).encode())
        reply, from_token_ids = parse_reply(resp, prompts, int(body["n"]), top)
        if from_token_ids:
            self.ask_logprobs = False
        return reply

    def completion_body(self, prompts: list, max_tokens: int, options=None) -> tuple[dict, int | None]:
        """(a completions request's body, the logprobs its items ask: None for none). The request
        options become the body's fields of the same names (greedy without any)."""
        body = {"model": self.settings.model, "prompt": prompts, "max_tokens": int(max_tokens), "temperature": 0,
                "n": 1, "stream": False, "return_token_ids": True}
        top = None  # the logprobs the items ask: the completions API's `logprobs` count
        if options is not None:
            given = options.given()
            if given.pop("logprobs", None):
                top = int(given.pop("top_logprobs", 0) or 0)
            given.pop("top_logprobs", None)
            structured = given.pop("structured", None)
            if structured is not None:  # vLLM's body field, the server compiles it
                body["structured_outputs"] = structured_fields(structured)
            body.update({k: list(v) if isinstance(v, tuple) else v for k, v in given.items()})
        if self.ask_logprobs or top is not None:
            body["logprobs"] = top or 0
            body["return_tokens_as_token_ids"] = True  # top_logprobs' keys then name their token ids
        return body, top

    def send(self, content: bytes) -> httpx.Response:
        """POST `content` to the engine's endpoint until the server answers 200 (that answer), retried
        as `post` says; raises RequestFailed."""
        s = self.settings
        delay_seconds = s.backoff_seconds
        tries = int(s.retries) + 1
        for attempt in range(tries):
            status = None
            sent = monotonic()
            transport = False
            try:
                resp = self.client.post(self.url, content=content)
            except httpx.TimeoutException:
                reason = f"timed out after {s.timeout_seconds:g} s"
            except httpx.TransportError as exc:
                reason = f"{type(exc).__name__}: {exc}"
                transport = True
            else:
                status = resp.status_code
                if status == 200:
                    self.last_ok = monotonic()
                    return resp
                reason = f"HTTP {status}: {server_message(resp)}"
                if status not in RETRY_STATUSES and status < 500:
                    raise RequestFailed(reason, status)
            if attempt + 1 < tries:
                # the server's Retry-After (seconds) when it gives one, else the doubling back-off; both capped
                wait = retry_after(resp) if status in (429, 503) else None
                time.sleep(min(BACKOFF_MAX_SECONDS, wait if wait is not None else delay_seconds))
                delay_seconds *= 2
        raise RequestFailed(f"{reason} (after {tries} tries)" if tries > 1 else reason, status, down=True, sent=sent,
                            always=transport or status in LOAD_STATUSES)

    def close(self) -> None:
        """Requests not started are dropped, those at the server waited for (at most their timeout)."""
        if self.closed:
            return
        self.closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.client.close()
        self._requests.clear()
        self._pending = 0
