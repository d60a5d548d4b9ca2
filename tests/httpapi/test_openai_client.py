"""The OpenAI Files and Batches API of a real broker (`supervise` with an `[http]` table, the
simulated engine), driven by the real `openai` package with the client code of OpenAI's own
documentation: upload, create, poll, download, list, cancel, delete; and by raw HTTP for what a
client gets wrong (keys, ids, bodies, sizes, a stalled upload)."""

from __future__ import annotations

import io
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest
from openai import OpenAI
from openai.types import Completion
from openai.types.chat import ChatCompletion
from support.brokerproc import serve
from support.chattok import tokenizer_dir
from support.harness import wait_for

from shmbroker.httpapi.files import UPLOAD_PREFIX

pytestmark = pytest.mark.timeout(300)
ALICE, BOB = "alice-key-0123", "bob-key-456789"


def config(tok_dir) -> str:
    return f"""
segment_bytes = 4194304
index_items = 65536
max_wait_seconds = 0.2

[[consumers]]
name = "fast"
max_batch_size = 64
max_batch_tokens = 65536
max_input_len = 1024
engine_settings = {{ mode = "packed", cache_tokens = 262144 }}

[[consumers]]
name = "enc"
model = "enc"
max_batch_size = 16
max_batch_tokens = 8192
max_input_len = 256
engine_settings = {{ mode = "padded", task = "embed", embed_dimensions = 32, pace_seconds = 0 }}

[[consumers]]
name = "slow"
model = "slow"
max_batch_size = 4
max_batch_tokens = 4096
max_input_len = 1024
engine_settings = {{ mode = "packed", cache_tokens = 65536, pace_seconds = 20.0 }}

[tokenizers]
default = "{tok_dir}"
enc = "{tok_dir}"

[http]
addr = "127.0.0.1:0"
max_file_lines = 2000
max_file_bytes = 1000000
upload_idle_seconds = 2.0
[http.keys]
alice = "{ALICE}"
bob = "{BOB}"
"""


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("http")
    tok = tmp / "tokenizer"
    tok.mkdir()
    tokenizer_dir(tok)
    with serve(tmp, "http", config(tok)) as b:
        b.url = f"http://{json.loads((Path(b.data_dir) / 'broker.json').read_text())['http_addr']}/v1"
        yield b


def client(broker, key: str = ALICE) -> OpenAI:
    return OpenAI(base_url=broker.url, api_key=key, max_retries=0)


def wait(c: OpenAI, batch_id: str, until=("completed", "failed", "cancelled", "expired"), timeout: float = 120.0):
    """The batch once its status is one of `until`."""
    return wait_for(lambda: next((b for b in [c.batches.retrieve(batch_id)] if b.status in until), None), timeout,
                    f"batch {batch_id} reaching {until}")


def lines_of(c: OpenAI, file_id: str | None) -> list[dict]:
    return [] if file_id is None else [json.loads(x) for x in c.files.content(file_id).text.splitlines()]


def chat_line(i: int, model: str = "default", **body) -> str:
    words = " ".join(f"w{(i * 7 + k) % 200}" for k in range(5 + i % 9))
    return json.dumps({"custom_id": f"chat-{i}", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": model, "messages": [{"role": "system", "content": "w1 w2 w3 w4"},
                                                             {"role": "user", "content": words}],
                                "max_tokens": 6, **body}})


def completion_line(i: int, model: str = "default") -> str:
    return json.dumps({"custom_id": f"cmp-{i}", "method": "POST", "url": "/v1/completions",
                       "body": {"model": model, "prompt": list(range(3, 12 + i % 5)), "max_tokens": 5}})


def jsonl(lines: list[str]) -> io.BytesIO:
    return io.BytesIO(("\n".join(lines) + "\n").encode())


def test_chat_and_completions_batches_through_the_openai_client(broker):
    c = client(broker)
    chat_lines = [chat_line(i, temperature=0.7, seed=i) for i in range(20)] + [chat_line(20, n=3, temperature=1.0, seed=5)]
    chat = c.files.create(file=("chat.jsonl", jsonl(chat_lines)), purpose="batch")
    assert (chat.object, chat.purpose, chat.filename, chat.bytes) == ("file", "batch", "chat.jsonl",
                                                                      len("\n".join(chat_lines)) + 1)
    cmp_lines = [completion_line(i) for i in range(15)]
    cmp_lines.insert(7, "{not json")  # line 8
    cmp = c.files.create(file=("cmp.jsonl", jsonl(cmp_lines)), purpose="batch")
    b1 = c.batches.create(input_file_id=chat.id, endpoint="/v1/chat/completions", completion_window="24h",
                          metadata={"run": "chat"})
    b2 = c.batches.create(input_file_id=cmp.id, endpoint="/v1/completions", completion_window="24h")
    assert b1.status == "validating" and b1.metadata == {"run": "chat"} and b1.input_file_id == chat.id
    b1, b2 = wait(c, b1.id), wait(c, b2.id)

    assert b1.status == "completed" and b1.error_file_id is None
    assert (b1.request_counts.total, b1.request_counts.completed, b1.request_counts.failed) == (21, 21, 0)
    assert b1.created_at <= b1.in_progress_at <= b1.finalizing_at <= b1.completed_at
    bodies = {}
    for row in lines_of(c, b1.output_file_id):
        assert row["response"]["status_code"] == 200 and row["error"] is None
        bodies[row["custom_id"]] = ChatCompletion.model_validate(row["response"]["body"])
    assert sorted(bodies) == sorted(f"chat-{i}" for i in range(21))
    assert all(b.usage.prompt_tokens > 0 and b.choices[0].message.content is not None for b in bodies.values())
    assert len(bodies["chat-20"].choices) == 3
    assert c.files.retrieve(b1.output_file_id).purpose == "batch_output"
    assert (Path(broker.data_dir) / "http" / "files" / b1.output_file_id).stat().st_mode & 0o777 == 0o600

    assert b2.status == "completed"
    assert (b2.request_counts.total, b2.request_counts.completed, b2.request_counts.failed) == (16, 15, 1)
    done = [row["custom_id"] for row in lines_of(c, b2.output_file_id)
            if Completion.model_validate(row["response"]["body"]).choices]
    assert sorted(done) == sorted(f"cmp-{i}" for i in range(15))
    errors = lines_of(c, b2.error_file_id)
    assert len(errors) == 1 and errors[0]["error"]["line"] == 8 and errors[0]["custom_id"] is None

    from shmbroker.jobs import store

    view = store.view(broker.data_dir, b1.id)  # a batch is a job: `shmbroker jobs` shows it
    assert view["status"] == "completed" and view["completed"] == 21


def embedding_line(i: int) -> str:
    words = [" ".join(f"w{(i * 5 + k) % 200}" for k in range(2 + (i + j) % 11)) for j in range(1 + i % 4)]
    return json.dumps({"custom_id": f"emb-{i}", "method": "POST", "url": "/v1/embeddings",
                       "body": {"model": "enc", "input": words if i % 2 else words[0],
                                "encoding_format": "base64" if i % 3 == 0 else "float"}})


def test_an_embeddings_batch_through_the_openai_client(broker):
    """Every custom_id once in the output, each body the API's CreateEmbeddingResponse (one vector
    per input, in order), the request counts by line (a line of four inputs is one request)."""
    import base64

    import numpy as np
    from openai.types import CreateEmbeddingResponse

    c = client(broker)
    lines = [embedding_line(i) for i in range(30)] + [json.dumps({
        "custom_id": "emb-bad", "method": "POST", "url": "/v1/embeddings", "body": {"model": "enc", "input": []}})]
    f = c.files.create(file=("emb.jsonl", jsonl(lines)), purpose="batch")
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h").id)
    assert b.status == "completed"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (31, 30, 1)
    out = lines_of(c, b.output_file_id)
    assert sorted(r["custom_id"] for r in out) == sorted(f"emb-{i}" for i in range(30))
    for row in out:
        i = int(row["custom_id"].split("-")[1])
        body = row["response"]["body"]
        if i % 3 == 0:
            body["data"] = [{**d, "embedding": np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()}
                            for d in body["data"]]
        got = CreateEmbeddingResponse.model_validate(body)
        assert len(got.data) == (1 if i % 2 == 0 else 1 + i % 4) and [d.index for d in got.data] == list(range(len(got.data)))
        assert all(len(d.embedding) == 32 for d in got.data) and got.usage.prompt_tokens > 0
    (err,) = lines_of(c, b.error_file_id)
    assert err["custom_id"] == "emb-bad" and "input" in err["error"]["message"]


def test_lists_page_and_files_delete(broker):
    c = client(broker)
    ids = [c.files.create(file=(f"f{i}.jsonl", jsonl([completion_line(i)])), purpose="batch").id for i in range(5)]
    seen, page = [], c.files.list(limit=2)
    while True:
        assert len(page.data) <= 2
        seen += [f.id for f in page.data]
        if not page.has_next_page():
            break
        page = page.get_next_page()
    assert set(ids) <= set(seen) and len(seen) == len(set(seen))
    batches = [c.batches.create(input_file_id=i, endpoint="/v1/completions", completion_window="24h").id
               for i in ids[:3]]
    listed, page = [], c.batches.list(limit=1)
    while True:
        listed += [b.id for b in page.data]
        if not page.has_next_page():
            break
        page = page.get_next_page()
    assert listed[:3] == batches[::-1] and len(listed) == len(set(listed))  # newest first
    assert all(wait(c, b).status == "completed" for b in batches)

    gone = c.files.delete(ids[4])
    assert gone.deleted and gone.id == ids[4]
    with pytest.raises(openai.NotFoundError):
        c.files.retrieve(ids[4])
    assert ids[4] not in [f.id for f in c.files.list()]
    assert {m.id for m in c.models.list()} == {"default", "slow", "enc"}


def test_cancelling_a_running_batch_leaves_the_other_exact(broker):
    c = client(broker)
    slow = c.files.create(file=("slow.jsonl", jsonl([completion_line(i, model="slow") for i in range(120)])),
                          purpose="batch")
    fast = c.files.create(file=("fast.jsonl", jsonl([completion_line(i) for i in range(100)])), purpose="batch")
    bs = c.batches.create(input_file_id=slow.id, endpoint="/v1/completions", completion_window="24h")
    bf = c.batches.create(input_file_id=fast.id, endpoint="/v1/completions", completion_window="24h")
    wait(c, bs.id, until=("in_progress",))
    assert c.batches.cancel(bs.id).status == "cancelling"
    bs, bf = wait(c, bs.id), wait(c, bf.id)

    assert bs.status == "cancelled" and bs.cancelling_at and bs.cancelled_at
    counts = bs.request_counts
    assert counts.total == 120 and counts.completed + counts.failed == 120 and counts.failed > 0
    out, err = lines_of(c, bs.output_file_id), lines_of(c, bs.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"cmp-{i}" for i in range(120))
    assert len(out) == counts.completed
    assert all(r["error"]["code"] == "batch_cancelled" for r in err if r["response"] is None)

    assert bf.status == "completed" and bf.request_counts.completed == 100
    assert sorted(r["custom_id"] for r in lines_of(c, bf.output_file_id)) == sorted(f"cmp-{i}" for i in range(100))
    with pytest.raises(openai.ConflictError):
        c.batches.cancel(bf.id)


def test_a_tenant_sees_only_its_own(broker):
    alice, bob = client(broker), client(broker, BOB)
    f = alice.files.create(file=("a.jsonl", jsonl([completion_line(0)])), purpose="batch")
    batch = alice.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    for call in (lambda: bob.files.retrieve(f.id), lambda: bob.files.content(f.id), lambda: bob.files.delete(f.id),
                 lambda: bob.batches.retrieve(batch.id), lambda: bob.batches.cancel(batch.id),
                 lambda: bob.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in bob.files.list()] and batch.id not in [x.id for x in bob.batches.list()]
    assert wait(alice, batch.id).status == "completed"


def test_keys_ids_and_bodies_get_the_apis_errors(broker):
    url, auth = broker.url, {"Authorization": f"Bearer {ALICE}"}
    for headers in ({}, {"Authorization": "Bearer not-a-key"}, {"Authorization": ALICE}):
        r = httpx.get(f"{url}/files", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=url, api_key="wrong-key-1", max_retries=0).files.list()
    r = httpx.post(f"{url}/batches", content=b"{not json", headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    for path in ("/batches/batch_000000000000000000000000", "/files/file-nope/content", "/files/file-nope"):
        r = httpx.get(f"{url}{path}", headers=auth)
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    f = client(broker).files.create(file=("x.jsonl", jsonl([completion_line(0)])), purpose="batch")
    for body, param in (({"input_file_id": f.id, "endpoint": "/v1/moderations", "completion_window": "24h"}, "endpoint"),
                        ({"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "forever"},
                         "completion_window"),
                        ({"input_file_id": f.id, "endpoint": "/v1/completions", "completion_window": "24h",
                          "tools": []}, "tools")):
        r = httpx.post(f"{url}/batches", json=body, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{url}/files", files={"file": ("x.jsonl", b"{}\n")}, data={"purpose": "fine-tune"}, headers=auth)
    assert r.status_code == 400 and r.json()["error"]["param"] == "purpose"
    r = httpx.delete(f"{url}/batches", headers=auth)
    assert r.status_code == 405 and "error" in r.json()


def test_a_file_naming_another_endpoint_fails_its_batch(broker):
    c = client(broker)
    f = c.files.create(file=("mixed.jsonl", jsonl([completion_line(0), chat_line(1), completion_line(2)])),
                       purpose="batch")
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id)
    assert b.status == "failed" and b.failed_at and b.output_file_id is None
    assert [(e.line, e.code, e.param) for e in b.errors.data] == [(2, "invalid_url", "url")]


def upload_files(data_dir) -> list[str]:
    return sorted(p.name for p in (Path(data_dir) / "http" / "files").iterdir())


def test_oversized_uploads_are_refused_and_leave_no_file(broker):
    url, auth = broker.url, {"Authorization": f"Bearer {ALICE}"}
    before = upload_files(broker.data_dir)
    for content in (b"x" * 1_100_000, b"{}\n" * 2001):
        r = httpx.post(f"{url}/files", files={"file": ("big.jsonl", content)}, data={"purpose": "batch"}, headers=auth)
        assert r.status_code == 413 and r.json()["error"]["param"] == "file", r.text
    assert upload_files(broker.data_dir) == before


def test_a_stalled_upload_is_dropped_and_holds_up_nothing(broker):
    host, port = broker.url.split("//")[1].split("/")[0].split(":")
    before = upload_files(broker.data_dir)
    boundary = "b0undary"
    head = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"s.jsonl\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode() + b"{}\n" * 300
    with socket.create_connection((host, int(port))) as s:
        s.sendall((f"POST /v1/files HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {ALICE}\r\n"
                   f"Content-Type: multipart/form-data; boundary={boundary}\r\nContent-Length: 100000\r\n\r\n").encode()
                  + head)
        t0 = time.monotonic()
        assert client(broker).files.list() is not None  # served while the upload stalls
        assert time.monotonic() - t0 < 1.5
        assert any(n.startswith(UPLOAD_PREFIX) for n in upload_files(broker.data_dir))  # its bytes, on disk
        s.settimeout(10)
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert upload_files(broker.data_dir) == before


def test_a_batch_past_its_window_expires(broker):
    c = client(broker)
    f = c.files.create(file=("late.jsonl", jsonl([completion_line(i, model="slow") for i in range(80)])),
                       purpose="batch")
    b = wait(c, c.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s").id)
    assert b.status == "expired" and b.expired_at and b.expires_at == b.created_at + 3
    counts = b.request_counts
    assert counts.total == 80 and counts.completed + counts.failed == 80 and counts.failed > 0
    out, err = lines_of(c, b.output_file_id), lines_of(c, b.error_file_id)
    assert sorted(r["custom_id"] for r in out + err) == sorted(f"cmp-{i}" for i in range(80))
    assert err and all(r["error"]["code"] == "batch_expired" for r in err)
