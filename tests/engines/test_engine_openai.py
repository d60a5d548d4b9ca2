"""The `openai` engine against a completions server: results per item, failures kept to their items.

No OpenAI-compatible server that runs here without a model download fits in a unit test (a real
vLLM CPU build serves a tiny random-weight model, but takes ~20 s to start and ~1 GB to install),
so these tests run the engine against `FakeCompletionsServer`, a test double: a stdlib HTTP server
on 127.0.0.1 implementing `POST /v1/completions` for token-id prompts as vLLM documents it
(`CompletionRequest` / `CompletionResponse` in vllm/entrypoints/openai/completion/protocol.py),
with knobs for the failures a real server shows, and `POST /v1/embeddings` for token-id inputs
(`EmbeddingCompletionRequest` in vllm/entrypoints/pooling/embed/protocol.py). Its generated tokens
and its vectors are functions of the prompt, so every item's result can be checked. tests/engines/test_vllm_chat.py runs the engine
against a real server: `vllm serve` from `.venv-vllm`, behind a broker.
"""

from __future__ import annotations

import base64
import json
import socket
import sys
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from shmbroker.engines.base import EngineBatch, EngineUnavailable
from shmbroker.engines.catalogue import load_engine
from shmbroker.engines.openai import ITEMS_PER_REQUEST_AUTO_MAX, OpenAICompatible, default_items_per_request
from shmbroker.engines.openai_reply import NO_TOKEN_IDS
from shmbroker.engines.options import OpenAISettings
from shmbroker.gpu.core import ConsumerCore
from shmbroker.pack.contract import Batch, Contract, Shape

MODEL = "fake-model"
BLOCK_TOKENS = 16
CONTRACT = Contract(16, 8192, 1000)
REJECTED = 5000  # a prompt holding this token id is refused (400) by the fake, as out of vocabulary
SLOW = 4000  # a request with a prompt holding this token id answers after slow_seconds


EMBED_DIMS = 12  # the fake's vectors' length
MATRYOSHKA = (4, 8, 12)  # the cuts its embedding model declares (with matryoshka=True)


def embedded(prompt, dimensions=None) -> np.ndarray:
    """The fake's vector of a prompt (float32): a function of the prompt, cut and renormalised."""
    v = np.cos(np.arange(1, EMBED_DIMS + 1) * (1 + int(np.sum(np.asarray(prompt, np.int64))) % 997))[:dimensions]
    return (v / np.linalg.norm(v)).astype(np.float32)


def generated(prompt, count: int) -> list:
    """The fake's generated tokens for a prompt: a function of the prompt, so results are checkable."""
    total = int(np.sum(np.asarray(prompt, np.int64)))
    return [(total + k) % 1000 for k in range(count)]


class FakeCompletionsServer:
    """Test double of an OpenAI-compatible completions server (vLLM's `/v1/completions` for
    token-id prompts). It validates the request body (model, prompt as a list of non-empty token-id
    lists, max_tokens >= 1), answers one choice per prompt (in reverse order, so the engine must use
    `index`), with `token_ids` when asked with `return_token_ids`, or "token_id:N" strings in
    `logprobs.tokens` when asked with `return_tokens_as_token_ids` and `logprobs`, and `usage` with
    prompt_tokens and prompt_tokens_details.cached_tokens from a prefix cache of 16-token blocks.

    Knobs: `fail_first` requests answer `fail_status` (500, 429); a prompt holding REJECTED makes
    its request a 400; a prompt holding SLOW makes its request wait `slow_seconds`; `latency_seconds`
    delays every answer; `held=True` holds every answer until `release()`; `refuse_field`: a strict
    server refusing (400) a request carrying that field; `retry_after`: a Retry-After header (seconds)
    on the failures; `style` "vllm" (the above), "old_vllm" (ignores return_token_ids),
    "sglang_output_ids" (answers `output_ids` only), "text_only" (no token ids at all).
    Embeddings: vectors `embedded` of each input, base64 of little-endian float32 when asked (else
    lists of floats, as `style="float_only"` always answers), `dimensions` one of MATRYOSHKA when
    `matryoshka`, else refused (400) as vLLM refuses a model without Matryoshka dimensions.
    It counts requests in flight at once (`in_flight_max`) and keeps every request body and time."""

    def __init__(self, *, fail_first=0, fail_status=500, slow_seconds=5.0, latency_seconds=0.0, style="vllm",
                 refuse_field=None, retry_after=None, held=False, matryoshka=True):
        self.refuse_field = refuse_field
        self.matryoshka = matryoshka
        self.gate = threading.Event()  # answers wait for it (open unless held)
        if not held:
            self.gate.set()
        self.retry_after = retry_after
        self.fail_first = fail_first
        self.fail_status = fail_status
        self.slow_seconds = slow_seconds
        self.latency_seconds = latency_seconds
        self.style = style
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.bodies: list = []
        self.times: list = []
        self.headers: list = []
        self.statuses: list = []
        self.in_flight = 0
        self.in_flight_max = 0
        self.cache: set = set()  # prefixes (tuples) of whole blocks computed before
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body are two writes: no 40 ms delayed-ACK stall

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with fake.lock:
                    fake.in_flight += 1
                    fake.in_flight_max = max(fake.in_flight_max, fake.in_flight)
                try:
                    status, answer = fake.answer(self.path, dict(self.headers), body)
                finally:
                    with fake.lock:
                        fake.in_flight -= 1
                data = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    if status != 200 and fake.retry_after is not None:
                        self.send_header("Retry-After", str(fake.retry_after))
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client gave up (timed out) and closed the connection
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def answer(self, path: str, headers: dict, raw: bytes):
        with self.lock:
            self.times.append(time.monotonic())
            self.headers.append(headers)
            tries = len(self.times)
        status, answer = self._answer(path, raw, tries)
        with self.lock:
            self.statuses.append(status)
        return status, answer

    def _answer(self, path: str, raw: bytes, tries: int):
        if path not in ("/v1/completions", "/v1/embeddings"):
            return 404, error(f"no route {path}", 404)
        try:
            body = json.loads(raw)
        except ValueError:
            return 400, error("the body is not JSON", 400)
        with self.lock:
            self.bodies.append(body)
        if body.get("model") != MODEL:
            return 404, error(f"The model `{body.get('model')}` does not exist.", 404)
        if self.refuse_field and self.refuse_field in body:
            return 400, error(f"unknown field {self.refuse_field!r}", 400)
        if path == "/v1/embeddings":
            return self.embeddings(body, tries)
        prompts, max_tokens = body.get("prompt"), body.get("max_tokens")
        if not (isinstance(prompts, list) and prompts and all(isinstance(p, list) and p for p in prompts)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for p in prompts for t in p)):
            return 400, error("prompt must be a non-empty list of non-empty token id lists", 400)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return 400, error("max_tokens must be at least 1", 400)
        self.gate.wait()
        if self.latency_seconds:
            self.stopping.wait(self.latency_seconds)
        if any(SLOW in p for p in prompts):
            self.stopping.wait(self.slow_seconds)
        if tries <= self.fail_first:
            return self.fail_status, error("the server is busy" if self.fail_status == 429 else "engine overloaded",
                                           self.fail_status)
        if any(REJECTED in p for p in prompts):
            return 400, error(f"token id {REJECTED} is out of vocabulary", 400)
        n = body.get("n", 1)
        choices = [self.choice(i * n + j, p, max_tokens, body, j) for i, p in enumerate(prompts) for j in range(n)]
        cached = sum(self.cached_tokens(p) for p in prompts)
        prompt_tokens = sum(len(p) for p in prompts)
        return 200, {"id": f"cmpl-{tries}", "object": "text_completion", "created": 0, "model": MODEL,
                     "choices": choices[::-1],
                     "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens * len(prompts),
                               "total_tokens": prompt_tokens + max_tokens * len(prompts),
                               "prompt_tokens_details": {"cached_tokens": cached}}}

    def embeddings(self, body: dict, tries: int):
        """The fake's answer to an embeddings request (the knobs as for completions)."""
        inputs, dims = body.get("input"), body.get("dimensions")
        if not (isinstance(inputs, list) and inputs and all(isinstance(p, list) and p for p in inputs)
                and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for p in inputs for t in p)):
            return 400, error("input must be a non-empty list of non-empty token id lists", 400)
        if dims is not None and not self.matryoshka:
            return 400, error(f"Model '{MODEL}' does not support Matryoshka embeddings; dimensions must be unset "
                              f"(received dimensions={dims}).", 400)
        if dims is not None and dims not in MATRYOSHKA:
            return 400, error(f"Model '{MODEL}' only supports Matryoshka dimensions {list(MATRYOSHKA)}, got {dims}.", 400)
        self.gate.wait()
        if self.latency_seconds:
            self.stopping.wait(self.latency_seconds)
        if tries <= self.fail_first:
            return self.fail_status, error("engine overloaded", self.fail_status)
        if any(REJECTED in p for p in inputs):
            return 400, error(f"token id {REJECTED} is out of vocabulary", 400)
        as_base64 = body.get("encoding_format") == "base64" and self.style != "float_only"
        data = [{"index": i, "object": "embedding",
                 "embedding": base64.b64encode(embedded(p, dims).astype("<f4").tobytes()).decode() if as_base64
                 else [float(x) for x in embedded(p, dims)]} for i, p in enumerate(inputs)]
        total = sum(len(p) for p in inputs)
        return 200, {"id": f"embd-{tries}", "object": "list", "created": 0, "model": MODEL, "data": data[::-1],
                     "usage": {"prompt_tokens": total, "total_tokens": total}}

    def choice(self, index: int, prompt: list, max_tokens: int, body: dict, sample: int = 0) -> dict:
        """Choice `index`, sample `sample` of its prompt (sample 0 is the greedy `generated`; a sample
        of a stop id ends before max_tokens, finish_reason "stop")."""
        out = generated(prompt + [sample] * (sample > 0), max_tokens)
        stops = [k for k, t in enumerate(out) if t in (body.get("stop_token_ids") or ())]
        finish = "stop" if stops else "length"
        out = out[: stops[0] + 1] if stops else out
        choice = {"index": index, "text": "", "logprobs": None, "finish_reason": finish}
        if self.style == "vllm" and body.get("return_token_ids"):
            choice["token_ids"] = out
        if self.style in ("vllm", "old_vllm") and body.get("return_tokens_as_token_ids") \
                and body.get("logprobs") is not None:
            k = body["logprobs"]  # each token's top k: itself and the next ids, their logprobs -1, -2, ...
            choice["logprobs"] = {"tokens": [f"token_id:{t}" for t in out], "token_logprobs": [-1.0] * len(out),
                                  "text_offset": list(range(len(out))),
                                  "top_logprobs": [{f"token_id:{t + r}": -1.0 - r for r in range(k)} for t in out] if k
                                  else None}
        if self.style == "sglang_output_ids":
            choice["output_ids"] = out
        return choice

    def cached_tokens(self, prompt: list) -> int:
        """Tokens of the prompt's leading whole blocks computed before (then all its blocks are)."""
        with self.lock:
            cached, hitting = 0, True
            for end in range(BLOCK_TOKENS, len(prompt) + 1, BLOCK_TOKENS):
                key = tuple(prompt[:end])
                if hitting and key in self.cache:
                    cached += BLOCK_TOKENS
                else:
                    hitting = False
                    self.cache.add(key)
            return cached

    def release(self):
        self.gate.set()

    def close(self):
        self.gate.set()
        self.stopping.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def error(message: str, code: int) -> dict:
    return {"error": {"message": message, "type": "BadRequestError" if code < 500 else "InternalServerError",
                      "param": None, "code": code}}


@pytest.fixture
def server_factory():
    made = []

    def make(**knobs):
        made.append(FakeCompletionsServer(**knobs))
        return made[-1]

    yield make
    for server in made:
        server.close()


@pytest.fixture
def engines():
    made = []

    def make(server_or_url, **settings):
        url = server_or_url if isinstance(server_or_url, str) else server_or_url.url
        # 4 in flight, as the tests' request counts assume (the default is sized for a real server)
        options = {"timeout_seconds": 2.0, "retries": 2, "backoff_seconds": 0.01, "max_in_flight": 4, **settings}
        contract = options.pop("contract", CONTRACT)
        made.append(load_engine("openai", OpenAISettings(base_url=url, model=options.pop("model", MODEL), **options),
                                block_tokens=BLOCK_TOKENS, contract=contract))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def prompts(n, prefix=40, seed=0):
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 1000, prefix, dtype=np.uint32)
    return [np.concatenate([head, rng.integers(0, 1000, int(rng.integers(1, 30)), dtype=np.uint32)]) for _ in range(n)]


def batch(tokens, max_new):
    ids = np.arange(100, 100 + len(tokens), dtype=np.uint64)
    max_new = np.full(len(tokens), max_new, np.int64) if np.isscalar(max_new) else np.asarray(max_new, np.int64)
    return EngineBatch(ids, tokens, max_new)


def assert_ok(result, prompt, count):
    assert result.status == "ok" and result.error is None, result.error
    assert result.tokens.dtype == np.uint32
    assert result.tokens.tolist() == generated(prompt, count)


def test_results_per_item_one_request_per_max_new_tokens(server_factory, engines):
    server = server_factory()
    engine = engines(server, max_items_per_request=8)
    tokens = prompts(5)
    max_new = [3, 5, 3, 5, 3]
    out = engine.run(batch(tokens, max_new))
    assert engine.mode == "packed"
    assert [r.item_id for r in out.results] == list(range(100, 105))
    for r, t, m in zip(out.results, tokens, max_new):
        assert_ok(r, t, m)
    assert sorted(b["max_tokens"] for b in server.bodies) == [3, 5]
    first = next(b for b in server.bodies if b["max_tokens"] == 3)
    assert first["prompt"] == [tokens[i].tolist() for i in (0, 2, 4)]
    assert first["model"] == MODEL and first["temperature"] == 0 and first["return_token_ids"] is True
    assert out.engine_seconds > 0


def test_request_options_become_body_fields_and_split_requests(server_factory, engines):
    """Items whose options differ go in different requests (a body holds one set); each request's
    body carries its items' options under the API's own names; items without any stay greedy."""
    from shmbroker.request.options import RequestOptions

    server = server_factory()
    engine = engines(server, max_items_per_request=8)
    tokens = prompts(4)
    a = RequestOptions(temperature=0.8, seed=7, stop=("\n",), stop_token_ids=(2,))
    b = RequestOptions(temperature=0.0, min_tokens=2, repetition_penalty=1.2)
    out = engine.run(EngineBatch(np.arange(100, 104, dtype=np.uint64), tokens, np.full(4, 3, np.int64),
                                 options=[a, b, a, None]))
    assert [r.status for r in out.results] == ["ok"] * 4
    assert len(server.bodies) == 3
    by_prompt = {json.dumps(b["prompt"]): b for b in server.bodies}
    with_a = by_prompt[json.dumps([tokens[0].tolist(), tokens[2].tolist()])]
    assert (with_a["temperature"], with_a["seed"], with_a["stop"], with_a["stop_token_ids"]) == (0.8, 7, ["\n"], [2])
    with_b = by_prompt[json.dumps([tokens[1].tolist()])]
    assert (with_b["temperature"], with_b["min_tokens"], with_b["repetition_penalty"]) == (0.0, 2, 1.2)
    plain = by_prompt[json.dumps([tokens[3].tolist()])]
    assert plain["temperature"] == 0 and "seed" not in plain and "stop" not in plain
    assert engine.honours >= {"temperature", "seed", "stop", "stop_token_ids", "n"}


def test_n_samples_come_back_as_one_result_with_their_finish_reasons(server_factory, engines):
    """n choices per prompt, numbered prompt * n + sample as vLLM numbers them, are one item's samples
    in sample order, each with its finish reason; the usage's cached tokens are the item's own only
    when its request holds it alone."""
    from shmbroker.request.extras import decode_extras, samples_of
    from shmbroker.request.options import RequestOptions

    server = server_factory()
    engine = engines(server, max_items_per_request=8)
    tokens = prompts(3)
    stop_id = generated(tokens[1].tolist() + [2], 5)[2]
    opts = RequestOptions(n=3, temperature=0.9, seed=1, stop_token_ids=(stop_id,))
    out = engine.run(EngineBatch(np.arange(100, 103, dtype=np.uint64), tokens, np.full(3, 5, np.int64),
                                 options=[opts, opts, None]))
    assert [r.status for r in out.results] == ["ok"] * 3
    assert sorted(b["n"] for b in server.bodies) == [1, 3]
    for r, t in zip(out.results[:2], tokens):
        extras = decode_extras(r.extras, r.tokens.size)
        want = []
        for j in range(3):
            g = generated(t.tolist() + [j] * (j > 0), 5)
            cut = [k for k, x in enumerate(g) if x == stop_id]
            want.append(g[: cut[0] + 1] if cut else g)
        assert [s.tolist() for s in samples_of(r.tokens, extras)] == want
        assert extras.finish_reasons == tuple("stop" if len(w) < 5 or w[-1] == stop_id else "length" for w in want)
        assert extras.cached_tokens is None  # two prompts in one request: the usage is the request's
    assert "stop" in decode_extras(out.results[1].extras, out.results[1].tokens.size).finish_reasons
    alone = decode_extras(out.results[2].extras, out.results[2].tokens.size)
    assert alone.lengths == (5,) and alone.cached_tokens is not None


def test_logprobs_are_read_from_the_servers_top_logprobs(server_factory, engines):
    """An item asking logprobs (top 2) gets the body's `logprobs` count and token-id keys; each
    token's logprob and its top two by value come back in its extras; items without stay plain."""
    from shmbroker.request.extras import decode_extras
    from shmbroker.request.options import RequestOptions

    server = server_factory()
    engine = engines(server, max_items_per_request=4)
    tokens = prompts(2)
    asked = RequestOptions(temperature=0.0, logprobs=True, top_logprobs=2)
    out = engine.run(EngineBatch(np.arange(100, 102, dtype=np.uint64), tokens, np.full(2, 3, np.int64),
                                 options=[asked, None]))
    assert [r.status for r in out.results] == ["ok", "ok"]
    body = next(b for b in server.bodies if b.get("logprobs") == 2)
    assert body["return_tokens_as_token_ids"] is True and "top_logprobs" not in body
    (lp,) = decode_extras(out.results[0].extras, out.results[0].tokens.size).logprobs
    got = out.results[0].tokens.astype(np.int64)
    assert lp.token.tolist() == [-1.0] * got.size
    assert lp.top_ids.tolist() == [[t, t + 1] for t in got.tolist()] and lp.top.tolist() == [[-1.0, -2.0]] * got.size
    assert decode_extras(out.results[1].extras, out.results[1].tokens.size).logprobs is None


def test_max_items_per_request_splits_a_group(server_factory, engines):
    server = server_factory()
    engine = engines(server, max_items_per_request=2)
    tokens = prompts(5)
    out = engine.run(batch(tokens, 4))
    assert sorted(len(b["prompt"]) for b in server.bodies) == [1, 2, 2]
    for r, t in zip(out.results, tokens):
        assert_ok(r, t, 4)


def test_logprobs_are_asked_until_a_response_carries_token_ids(server_factory, engines):
    server = server_factory()
    engine = engines(server)
    tokens = prompts(2)
    engine.run(batch(tokens, 2))
    engine.run(batch(tokens, 2))
    first, second = server.bodies
    assert first["logprobs"] == 0 and first["return_tokens_as_token_ids"] is True
    assert "logprobs" not in second and "return_tokens_as_token_ids" not in second
    assert second["return_token_ids"] is True


def test_token_id_strings_in_logprobs_when_the_server_ignores_return_token_ids(server_factory, engines):
    server = server_factory(style="old_vllm")
    engine = engines(server)
    tokens = prompts(3)
    for _ in range(2):
        out = engine.run(batch(tokens, 4))
        for r, t in zip(out.results, tokens):
            assert_ok(r, t, 4)
    assert all(b["logprobs"] == 0 for b in server.bodies)  # still asked: token_ids never came


def test_sglang_output_ids_are_read(server_factory, engines):
    server = server_factory(style="sglang_output_ids")
    tokens = prompts(2)
    out = engines(server).run(batch(tokens, 3))
    for r, t in zip(out.results, tokens):
        assert_ok(r, t, 3)


def test_a_response_without_token_ids_fails_its_items_with_a_clear_error(server_factory, engines):
    server = server_factory(style="text_only")
    out = engines(server).run(batch(prompts(2), 3))
    assert [r.status for r in out.results] == ["engine_error"] * 2
    assert out.results[0].error == NO_TOKEN_IDS
    assert "return_token_ids" in NO_TOKEN_IDS and "return_tokens_as_token_ids" in NO_TOKEN_IDS
    assert len(server.bodies) == 1  # a malformed answer is not retried


@pytest.fixture
def waits(monkeypatch):
    """The engine's waits between tries, in seconds (they are still waited): measured at the client, as
    the server's clock would count a handler thread's scheduling delay too."""
    import shmbroker.engines.openai as module

    got = []

    def sleep(seconds):
        got.append(seconds)
        time.sleep(seconds)

    monkeypatch.setattr(module, "time", types.SimpleNamespace(sleep=sleep))
    return got


def test_500_on_the_first_tries_is_retried_with_doubling_back_off(server_factory, engines, waits):
    server = server_factory(fail_first=2, fail_status=500)
    tokens = prompts(3)
    out = engines(server, retries=3, backoff_seconds=0.05).run(batch(tokens, 2))
    for r, t in zip(out.results, tokens):
        assert_ok(r, t, 2)
    assert server.statuses == [500, 500, 200]
    assert waits == [0.05, 0.1]


def test_429_backs_off_then_succeeds(server_factory, engines, waits):
    server = server_factory(fail_first=1, fail_status=429)
    tokens = prompts(2)
    out = engines(server, backoff_seconds=0.05).run(batch(tokens, 2))
    for r, t in zip(out.results, tokens):
        assert_ok(r, t, 2)
    assert server.statuses == [429, 200]
    assert waits == [0.05]


def test_429_honours_retry_after(server_factory, engines, waits):
    server = server_factory(fail_first=1, fail_status=429, retry_after=0.4)
    tokens = prompts(2)
    out = engines(server, backoff_seconds=0.01).run(batch(tokens, 2))
    assert [r.status for r in out.results] == ["ok", "ok"]
    assert server.statuses == [429, 200]
    assert waits == [0.4]  # the server's delay, not the 0.01 s back-off


def test_a_500_that_persists_fails_its_items_after_the_retries(server_factory, engines):
    server = server_factory(fail_first=100, fail_status=500)
    out = engines(server, retries=2).run(batch(prompts(2), 2))
    assert [r.status for r in out.results] == ["engine_error"] * 2
    assert out.results[0].error == "HTTP 500: engine overloaded (after 3 tries)"
    assert len(server.statuses) == 3


def test_a_400_fails_only_the_refused_prompt_with_the_servers_message(server_factory, engines):
    server = server_factory()
    tokens = prompts(6)
    tokens[4] = np.concatenate([tokens[4], [REJECTED]]).astype(np.uint32)
    out = engines(server, max_items_per_request=6).run(batch(tokens, 3))
    assert [r.status for r in out.results] == ["ok"] * 4 + ["engine_error", "ok"]
    assert out.results[4].error == f"HTTP 400: token id {REJECTED} is out of vocabulary"
    for i in (0, 1, 2, 3, 5):
        assert_ok(out.results[i], tokens[i], 3)
    # never retried as is: the first prompt alone is tried ([0] ok: the refusal is a prompt's), then the
    # request is split in halves, and the halves holding the refused prompt again
    # [0..5] 400 -> [0] ok -> [0, 1, 2] ok, [3, 4, 5] 400 -> [3] ok, [4, 5] 400 -> [4] 400, [5] ok
    assert server.statuses == [400, 200, 200, 400, 200, 400, 400, 200]
    assert [len(b["prompt"]) for b in server.bodies] == [6, 1, 3, 3, 1, 2, 1, 1]


def test_a_refusal_of_the_request_itself_fails_it_without_splitting(server_factory, engines):
    """A strict server refusing a field the engine sends refuses every request alike: three requests
    (the batch, its first and its last prompt alone), not 2n - 1."""
    server = server_factory(refuse_field="return_token_ids")
    out = engines(server, max_items_per_request=16).run(batch(prompts(16), 2))
    assert [r.status for r in out.results] == ["engine_error"] * 16
    assert out.results[0].error == "HTTP 400: unknown field 'return_token_ids'"
    assert [len(b["prompt"]) for b in server.bodies] == [16, 1, 1]


def test_a_constraint_the_server_refuses_fails_its_items_invalid_and_reaches_it_as_structured_outputs(
        server_factory, engines):
    """A constraint travels as vLLM's `structured_outputs` body field; a server that cannot compile it
    refuses every request of it alike: those items fail `invalid` (the constraint, which they share),
    the others run."""
    from shmbroker.request.options import parse_options

    server = server_factory(refuse_field="structured_outputs")
    b = batch(prompts(6), 2)
    bad = parse_options({"structured_outputs": {"regex": "(unclosed"}})
    b.options = [bad] * 4 + [None] * 2
    out = engines(server, max_items_per_request=4).run(b)
    assert [r.status for r in out.results] == ["invalid"] * 4 + ["ok"] * 2
    assert out.results[0].error == "HTTP 400: unknown field 'structured_outputs'"
    assert [b["structured_outputs"] for b in server.bodies if "structured_outputs" in b][0] == {"regex": "(unclosed"}


@pytest.mark.parametrize("bad", [0, 1])
def test_a_refused_prompt_first_or_last_of_a_request_fails_alone(server_factory, engines, bad):
    """The prompts asked alone to tell a request's refusal from a prompt's may be the refused one: the
    first and the last are both asked, so only it fails (the last alone was asked before: when it was
    the refused one, its neighbour failed with it, as tests/gpu/test_poison.py once saw)."""
    server = server_factory()
    tokens = prompts(2)
    tokens[bad] = np.concatenate([tokens[bad], [REJECTED]]).astype(np.uint32)
    out = engines(server, max_items_per_request=2).run(batch(tokens, 3))
    assert [r.status for r in out.results] == ["engine_error" if i == bad else "ok" for i in range(2)]
    assert_ok(out.results[1 - bad], tokens[1 - bad], 3)


def test_an_unknown_model_fails_at_once_without_retries_or_splits(server_factory, engines):
    server = server_factory()
    out = engines(server, model="other-model", max_items_per_request=4).run(batch(prompts(4), 2))
    assert [r.status for r in out.results] == ["engine_error"] * 4
    assert out.results[0].error == "HTTP 404: The model `other-model` does not exist."
    assert server.statuses == [404]


def test_a_slow_request_times_out_and_fails_only_its_items(server_factory, engines):
    server = server_factory(slow_seconds=5.0)
    tokens = prompts(4)
    tokens[1] = np.concatenate([tokens[1], [SLOW]]).astype(np.uint32)
    engine = engines(server, timeout_seconds=0.3, retries=1, backoff_seconds=0.01)
    started = time.monotonic()
    out = engine.run(batch(tokens, [2, 7, 2, 2]))  # the slow prompt is alone in its request (max_new 7)
    assert time.monotonic() - started < 1.5
    assert [r.status for r in out.results] == ["ok", "engine_error", "ok", "ok"]
    assert out.results[1].error == "timed out after 0.3 s (after 2 tries)"
    for i in (0, 2, 3):
        assert_ok(out.results[i], tokens[i], 2)


def test_a_refused_connection_fails_the_items_and_never_raises(engines):
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/v1"
    out = engines(url, retries=1).run(batch(prompts(2), 2))
    assert [r.status for r in out.results] == ["engine_error"] * 2
    assert out.results[0].error.startswith("ConnectError") and out.results[0].error.endswith("(after 2 tries)")


def test_max_in_flight_bounds_the_requests_at_once(server_factory, engines):
    server = server_factory(latency_seconds=0.1)
    tokens = prompts(12)
    max_new = list(range(1, 13))  # twelve groups: twelve requests
    out = engines(server, max_in_flight=3).run(batch(tokens, max_new))
    assert len(server.bodies) == 12
    assert server.in_flight_max == 3
    for r, t, m in zip(out.results, tokens, max_new):
        assert_ok(r, t, m)


def added_without_answers(server, add, seconds=10.0):
    """Run `add` while the server holds every answer, then let it answer: add must return without one
    (an add that waited for the server would not return at all)."""
    done = threading.Event()
    thread = threading.Thread(target=lambda: (add(), done.set()), daemon=True)
    thread.start()
    returned = done.wait(seconds)
    answered = list(server.statuses)
    server.release()
    thread.join(seconds)
    assert returned, "add waited for the server"
    assert answered == []


def poll_until(engine, count, deadline_seconds=10.0):
    """Poll until `count` results came back; [(seconds since the call, ItemResult)] in arrival order."""
    started = time.monotonic()
    got = []
    while len(got) < count and time.monotonic() - started < deadline_seconds:
        out = engine.poll(0.5)
        got.extend((time.monotonic() - started, r) for r in out.results)
    return got


def test_results_come_back_as_each_request_returns_fast_ones_first(server_factory, engines):
    """Streaming: a slow request holds back only its own item; the items added after it, and in a
    later add, come back first, each as its request returns, not when the batch is done."""
    server = server_factory(slow_seconds=1.5, held=True)
    engine = engines(server, max_items_per_request=1, max_in_flight=8)
    tokens = prompts(6, seed=3)
    tokens[0] = np.concatenate([tokens[0], [SLOW]]).astype(np.uint32)  # the first item added is the slow one
    first = batch(tokens[:4], 3)
    second = EngineBatch(np.arange(200, 202, dtype=np.uint64), tokens[4:], np.full(2, 3, np.int64))
    added_without_answers(server, lambda: (engine.add(first), engine.add(second)))
    assert engine.pending() == 6
    fast = poll_until(engine, 5)
    assert sorted(r.item_id for _, r in fast) == [101, 102, 103, 200, 201]  # everything but the slow item
    assert all(seconds < 1.2 for seconds, _ in fast)  # came back before the slow request did
    by_id = {r.item_id: r for _, r in fast}
    for item_id, t in zip([101, 102, 103, 200, 201], tokens[1:]):
        assert_ok(by_id[item_id], t, 3)
    assert engine.pending() == 1
    ((seconds, slow),) = poll_until(engine, 1)
    assert slow.item_id == 100
    assert_ok(slow, tokens[0], 3)
    assert engine.pending() == 0
    assert engine.poll(0.0).results == []


def test_poll_with_nothing_in_flight_returns_at_once(server_factory, engines):
    engine = engines(server_factory())
    started = time.monotonic()
    out = engine.poll(2.0)
    assert out.results == [] and engine.pending() == 0
    assert time.monotonic() - started < 0.5


def test_never_more_than_max_in_flight_requests_at_the_server(server_factory, engines):
    """Twelve one-item requests, three at a time: the server never sees more than three, the rest wait
    inside the engine and start in the order they were added, three after three."""
    server = server_factory(latency_seconds=0.3, held=True)
    engine = engines(server, max_items_per_request=1, max_in_flight=3)
    tokens = prompts(12, seed=5)
    added_without_answers(server, lambda: engine.add(batch(tokens, 2)))
    got = poll_until(engine, 12)
    assert len(got) == 12 and engine.pending() == 0
    assert server.in_flight_max == 3
    assert len(server.bodies) == 12
    order = [next(k for k, t in enumerate(tokens) if t.tolist() == b["prompt"][0]) for b in server.bodies]
    assert [sorted(order[k : k + 3]) for k in range(0, 12, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    by_id = {r.item_id: r for _, r in got}
    for k, t in enumerate(tokens):
        assert_ok(by_id[100 + k], t, 2)
    # the first results came back with the first wave, long before the last wave was answered
    assert got[0][0] < got[-1][0] - 0.4


def test_failures_in_the_stream_stay_with_their_items(server_factory, engines):
    server = server_factory(slow_seconds=5.0)
    tokens = prompts(5, seed=7)
    tokens[1] = np.concatenate([tokens[1], [REJECTED]]).astype(np.uint32)
    tokens[3] = np.concatenate([tokens[3], [SLOW]]).astype(np.uint32)
    engine = engines(server, max_items_per_request=1, max_in_flight=5, timeout_seconds=0.3, retries=0)
    engine.add(batch(tokens, 2))
    by_id = {r.item_id: r for _, r in poll_until(engine, 5)}
    assert by_id[101].status == "engine_error" and by_id[101].error == f"HTTP 400: token id {REJECTED} is out of vocabulary"
    assert by_id[103].status == "engine_error" and by_id[103].error == "timed out after 0.3 s"
    for k in (0, 2, 4):
        assert_ok(by_id[100 + k], tokens[k], 2)
    assert engine.pending() == 0


def test_engine_seconds_are_the_time_a_request_was_at_the_server(server_factory, engines):
    server = server_factory(latency_seconds=0.3)
    engine = engines(server, max_items_per_request=1)
    started = time.monotonic()
    out = engine.run(batch(prompts(2), 2))  # two requests at once: 0.3 s busy, not 0.6
    wall = time.monotonic() - started
    assert [r.status for r in out.results] == ["ok", "ok"]
    assert 0.3 <= out.engine_seconds <= wall + 0.01
    time.sleep(0.2)
    assert engine.poll(0.0).engine_seconds == 0.0  # idle since: no busy seconds


def test_default_request_size_is_small_and_fills_the_contract():
    def size(max_in_flight, max_batch_size, explicit=0):
        return default_items_per_request(OpenAISettings(model=MODEL, max_in_flight=max_in_flight,
                                                        max_items_per_request=explicit),
                                         Contract(max_batch_size, 8192, 1000) if max_batch_size else None)

    assert size(64, 64) == 1  # enough requests in flight: one item each
    assert size(256, 64) == 1
    assert size(16, 64) == 4  # 16 requests x 4 items fill 64 sequences
    assert size(20, 64) == 4
    assert size(4, 256) == ITEMS_PER_REQUEST_AUTO_MAX  # capped: a request's tail wait stays short
    assert size(4, 0) == 1  # no contract: one item per request
    assert size(4, 64, explicit=10) == 10  # a setting wins


def test_add_after_close_is_refused(server_factory, engines):
    engine = engines(server_factory())
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.add(batch(prompts(1), 1))


def test_cached_tokens_become_hit_blocks(server_factory, engines):
    server = server_factory()
    engine = engines(server, max_items_per_request=4)
    tokens = prompts(4, prefix=48)
    first = engine.run(batch(tokens, 2))
    prompt_tokens = sum(t.size for t in tokens)
    assert first.queried_blocks == prompt_tokens // BLOCK_TOKENS
    assert first.reused_tokens == 3 * 48 and first.hit_blocks == 3 * 48 // BLOCK_TOKENS  # the 3 after the first
    second = engine.run(batch(tokens, 2))
    whole_blocks = sum(t.size // BLOCK_TOKENS * BLOCK_TOKENS for t in tokens)
    assert second.reused_tokens == whole_blocks and second.hit_blocks == whole_blocks // BLOCK_TOKENS


def test_no_usage_details_reports_no_cache_figures(engines, server_factory, monkeypatch):
    server = server_factory()
    monkeypatch.setattr(server, "_answer", lambda path, raw, tries: (200, {"choices": [
        {"index": 0, "token_ids": [1, 2], "finish_reason": "length"}]}))
    out = engines(server).run(batch(prompts(1), 2))
    assert out.results[0].tokens.tolist() == [1, 2]
    assert (out.hit_blocks, out.queried_blocks, out.reused_tokens) == (0, 0, 0)


def test_api_key_is_sent_as_a_bearer_token_when_its_variable_is_set(server_factory, engines, monkeypatch):
    server = server_factory()
    monkeypatch.setenv("SHMB_TEST_KEY", "sekret")
    engines(server, api_key_env="SHMB_TEST_KEY").run(batch(prompts(1), 1))
    monkeypatch.delenv("SHMB_TEST_KEY")
    engines(server, api_key_env="SHMB_TEST_KEY").run(batch(prompts(1), 1))
    assert server.headers[0]["Authorization"] == "Bearer sekret"
    assert "Authorization" not in server.headers[1]


def test_load_engine_by_name_and_close_is_idempotent(server_factory):
    server = server_factory()
    engine = load_engine("openai", OpenAISettings(base_url=server.url, model=MODEL, retries=0), block_tokens=16,
                         contract=Contract(8, 4096, 1000))
    try:
        assert isinstance(engine, OpenAICompatible) and engine.mode == "packed" and engine.block_tokens == 16
        tokens = prompts(2)
        out = engine.run(batch(tokens, 3))
        for r, t in zip(out.results, tokens):
            assert_ok(r, t, 3)
        assert engine.run(batch([], 1)).results == []
    finally:
        engine.close()
        engine.close()
    with pytest.raises(ValueError, match="needs engine_settings.model"):
        OpenAICompatible(OpenAISettings(base_url=server.url))


def test_consumer_core_a_server_error_fails_only_its_items(server_factory, engines):
    server = server_factory()
    tokens = prompts(5)
    tokens[2] = np.concatenate([tokens[2], [REJECTED]]).astype(np.uint32)
    ids = np.arange(100, 105, dtype=np.uint64)
    lengths = [t.size for t in tokens]
    b = Batch.of(0, Shape(0, 7, 1, CONTRACT.max_input_len), ids, lengths, np.full(5, 4), families=np.full(5, 7))
    core = ConsumerCore(CONTRACT, engines(server))
    results = core.process(b, tokens).items()
    assert [r.status for r in results] == ["ok", "ok", "engine_error", "ok", "ok"]
    assert results[2].error == f"HTTP 400: token id {REJECTED} is out of vocabulary"
    for i in (0, 1, 3, 4):
        assert_ok(results[i], tokens[i], 4)
    assert core.stats.engine_errors == 1 and core.stats.ok == 4


def test_without_httpx_load_engine_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "httpx", None)  # `import httpx` raises ImportError
    monkeypatch.delitem(sys.modules, "shmbroker.engines.openai", raising=False)
    with pytest.raises(EngineUnavailable, match=r"pip install 'shmbroker\[openai\]'"):
        load_engine("openai", OpenAISettings(model=MODEL), block_tokens=16)


# -- embeddings (task = "embed": the server's /v1/embeddings) ----------------------------------------


def embed_batch(tokens, options=None):
    from shmbroker.request.options import EMBED

    return EngineBatch(np.arange(100, 100 + len(tokens), dtype=np.uint64), tokens, np.zeros(len(tokens), np.int64),
                       options=options if options is not None else [EMBED] * len(tokens))


def test_embeddings_come_back_bit_exact_one_request_per_dimensions(server_factory, engines):
    """Token-id inputs, several a request, base64 asked; each vector decoded to the server's very
    float32 values, marked a vector by its extras; items asking another cut go in another request."""
    from shmbroker.request.extras import decode_extras
    from shmbroker.request.options import Task, embedding

    server = server_factory()
    engine = engines(server, task=Task.EMBED, max_items_per_request=4)
    assert engine.honours == {"embed", "dimensions"}
    tokens = prompts(6)
    cuts = [None, 8, None, 8, None, None]
    out = engine.run(embed_batch(tokens, [embedding(d) for d in cuts]))
    assert [r.status for r in out.results] == ["ok"] * 6
    for r, t, d in zip(out.results, tokens, cuts):
        assert np.array_equal(r.tokens, embedded(t.tolist(), d).view(np.uint32))  # bit-exact
        assert decode_extras(r.extras, r.tokens.size).vector
    bodies = sorted(server.bodies, key=lambda b: b.get("dimensions", 0))
    assert [len(b["input"]) for b in bodies] == [4, 2] and bodies[1]["dimensions"] == 8
    assert bodies[0]["input"] == [tokens[i].tolist() for i in (0, 2, 4, 5)]
    assert all(b["encoding_format"] == "base64" and "max_tokens" not in b for b in bodies)


def test_embeddings_as_floats_from_a_server_ignoring_base64(server_factory, engines):
    from shmbroker.request.options import Task

    server = server_factory(style="float_only")
    tokens = prompts(3)
    out = engines(server, task=Task.EMBED).run(embed_batch(tokens))
    for r, t in zip(out.results, tokens):
        assert r.status == "ok" and np.array_equal(r.tokens.view(np.float32), embedded(t.tolist()))


def test_an_embedding_the_server_refuses_fails_alone_invalid(server_factory, engines):
    """A 400 for one input fails only its item, `invalid` with the server's message (the request is
    split as for completions); dimensions a model without Matryoshka refuses fail their items."""
    from shmbroker.request.options import EMBED, Task, embedding

    server = server_factory(matryoshka=False)
    tokens = prompts(5)
    tokens[3] = np.concatenate([tokens[3], [REJECTED]]).astype(np.uint32)
    out = engines(server, task=Task.EMBED, max_items_per_request=4).run(
        embed_batch(tokens, [EMBED, EMBED, EMBED, EMBED, embedding(8)]))
    assert [r.status for r in out.results] == ["ok", "ok", "ok", "invalid", "invalid"]
    assert out.results[3].error == f"HTTP 400: token id {REJECTED} is out of vocabulary"
    assert "does not support Matryoshka" in out.results[4].error


def test_an_overloaded_embeddings_server_hands_the_items_back(server_factory, engines):
    from shmbroker.request.options import Task

    server = server_factory(fail_first=100, fail_status=503)
    engine = engines(server, task=Task.EMBED, retries=1)
    engine.add(embed_batch(prompts(2)))
    out = engine.poll(5.0)
    assert out.results == [] and sorted(out.down.item_ids.tolist()) == [100, 101]
    assert "HTTP 503" in str(out.down) and engine.pending() == 0
