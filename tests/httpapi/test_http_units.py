"""The HTTP API's parts without a server: the upload's line reader across any chunking, pages,
windows, metadata, the `[http]` table, and the stores on disk."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shmbroker.config import settings
from shmbroker.config.http import key_hash
from shmbroker.errors import ConfigError
from shmbroker.httpapi.app import check_metadata, window_seconds
from shmbroker.httpapi.batches import BatchRecord, BatchStore, batch_object, job_view_ended, status
from shmbroker.httpapi.files import FileStore
from shmbroker.httpapi.objects import ApiError, cut
from shmbroker.httpapi.runner import validate
from shmbroker.httpapi.upload import LINE_BYTES_MAX, Lines

ROWS = [{"custom_id": "a", "url": "/v1/completions"}, {"custom_id": "b", "url": "/v1/chat/completions"},
        {"custom_id": "a", "url": "/v1/completions"}, "not json", {"url": "/v1/completions"}, [1, 2]]


def file_bytes(rows) -> bytes:
    return b"".join((r if isinstance(r, str) else json.dumps(r)).encode() + b"\n" for r in rows)


@given(st.lists(st.integers(0, 200), max_size=12), st.booleans())
def test_lines_read_the_same_whatever_the_chunks(cuts, final_newline):
    data = file_bytes(ROWS)
    data = data if final_newline else data[:-1]
    lines = Lines()
    at = 0
    for c in sorted(cuts):
        lines.feed(data[at:max(at, c)])
        at = max(at, c)
    lines.feed(data[at:])
    lines.finish()
    assert lines.number == 6
    assert lines.urls == {"/v1/completions": 1, "/v1/chat/completions": 2}
    assert lines.duplicates == [(3, "a")]


def test_a_line_over_the_limit_is_counted_not_kept():
    lines = Lines()
    lines.feed(b'{"url": "/x", "pad": "' + b"z" * (LINE_BYTES_MAX + 10))
    lines.feed(b'"}\n{"custom_id": "k", "url": "/v1/completions"}\n')
    lines.finish()
    assert lines.number == 2 and lines.urls == {"/v1/completions": 2} and len(lines._carry) == 0


def test_validate_from_the_summary_or_the_file(tmp_path):
    path = tmp_path / "f.jsonl"
    path.write_bytes(file_bytes(ROWS))
    errors = validate(path, "/v1/completions")
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_url"), (3, "duplicate_custom_id")]
    clean = {"urls": {"/v1/completions": 1}, "duplicates": []}
    assert validate(path, "/v1/completions", clean) == []  # not read again
    assert validate(path, "/v1/completions", {"urls": {"/v1/chat/completions": 2}, "duplicates": []}) == errors


def test_pages_cut_after_an_id():
    rows = [{"id": f"x{i}"} for i in range(5)]
    assert cut(rows, None, 2) == (rows[:2], True)
    assert cut(rows, "x1", 2) == (rows[2:4], True)
    assert cut(rows, "x3", 2) == (rows[4:], False)
    with pytest.raises(ApiError) as e:
        cut(rows, "nope", 2)
    assert e.value.status == 400 and e.value.param == "after"


def test_windows_and_metadata():
    assert window_seconds("24h") == 86400 and window_seconds("30m") == 1800 and window_seconds("5s") == 5
    for bad in ("24", "0h", "1d", 24, None):
        with pytest.raises(ApiError):
            window_seconds(bad)
    assert check_metadata({"a": "b"}) == {"a": "b"} and check_metadata(None) is None
    for bad in ({"a": 1}, {f"k{i}": "v" for i in range(17)}, ["a"], {"k": "v" * 513}):
        with pytest.raises(ApiError):
            check_metadata(bad)


def test_the_http_table_holds_keys_hashed_and_shows_none():
    cfg = settings.parse({"http": {"keys": {"a": "secret-key-1", "b": "sha256:" + key_hash("secret-key-2")}}})
    assert cfg.http.addr == "127.0.0.1:8400"
    assert cfg.http.tenant_of("secret-key-1") == "a" and cfg.http.tenant_of("secret-key-2") == "b"
    assert cfg.http.tenant_of("secret-key-3") is None
    assert "secret-key-1" not in repr(cfg)
    shown = settings.as_dict(cfg)["http"]
    assert shown["keys"] == {"a": "***", "b": "***"} and "tenants" not in shown
    for raw, words in (({"keys": {"a": "short"}}, "at least 8"), ({"keys": {"a": "same-key-1", "b": "same-key-1"}}, "same key"),
                       ({"keys": {"a b": "secret-key-1"}}, "tenant name"), ({"port": 1}, "port"),
                       ({"addr": "nowhere"}, "http.addr")):
        with pytest.raises(ConfigError, match=words):
            settings.parse({"http": raw})


def test_stores_reload_from_disk_and_keep_tenants_apart(tmp_path):
    files = FileStore(tmp_path)
    fd, tmp = files.begin_upload()
    import os

    os.write(fd, b'{"x": 1}\n')
    meta = files.commit(fd, tmp, "alice", "f.jsonl", "batch", 9, 1)
    (files.dir / ".upload-torn").write_bytes(b"half")
    again = FileStore(tmp_path)  # a restart: the torn upload is gone, the file is there
    assert not (files.dir / ".upload-torn").exists()
    assert again.get("alice", meta["id"])["bytes"] == 9
    with pytest.raises(ApiError) as e:
        again.get("bob", meta["id"])
    assert e.value.status == 404
    assert (files.dir.stat().st_mode & 0o777) == 0o700 and (files.path(meta["id"]).stat().st_mode & 0o777) == 0o600

    batches = BatchStore(tmp_path)
    rec = BatchRecord(id="batch_" + "0" * 24, owner="alice", endpoint="/v1/completions", input_file_id=meta["id"],
                      completion_window="24h", created_at=1, expires_at=2, output_file_id="file-" + "1" * 24,
                      error_file_id="file-" + "2" * 24)
    batches.save(rec)
    back = BatchStore(tmp_path).get("alice", rec.id)
    assert back == rec and status(back, None) == "validating"
    assert batch_object(back, None, 1)["request_counts"] == {"total": 1, "completed": 0, "failed": 0}
    with pytest.raises(ApiError):
        BatchStore(tmp_path).get("bob", rec.id)


def test_a_running_batch_shows_its_jobs_status():
    rec = BatchRecord(id="batch_" + "0" * 24, owner="a", endpoint="/v1/completions", input_file_id="f",
                      completion_window="24h", created_at=1, expires_at=2, output_file_id="o", error_file_id="e",
                      phase="running")
    for job, shown in (("in_progress", "in_progress"), ("finalizing", "finalizing"), ("completed", "finalizing"),
                       ("cancelling", "cancelling"), ("cancelled", "cancelling"), ("failed", "in_progress")):
        assert status(rec, {"status": job}) == shown
    assert job_view_ended({"status": "failed", "total": 3, "failed": 3})  # every line refused
    assert not job_view_ended({"status": "failed", "total": 3, "failed": 0})  # its submitter could not start: resumed


def test_tenant_limits_are_answered_as_the_api_does(tmp_path):
    from starlette.testclient import TestClient

    from shmbroker.httpapi.server import build_app, open_api

    cfg = settings.parse({"http": {"tenant_max_files": 2, "tenant_max_bytes": 250, "tenant_max_batches": 1,
                                   "keys": {"a": "tenant-key-a", "b": "tenant-key-b"}}})
    api = open_api(cfg.http, str(tmp_path), ["default"])
    web = TestClient(build_app(api))
    auth = {"Authorization": "Bearer tenant-key-a"}
    line = json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": [1, 2], "max_tokens": 1}}).encode() + b"\n"

    def upload(data, headers=auth):
        return web.post("/v1/files", files={"file": ("f.jsonl", data)}, data={"purpose": "batch"}, headers=headers)

    first = upload(line)
    assert first.status_code == 200, first.text
    too_big = upload(line * 2)  # 108 + 216 bytes: over the tenant's 250
    assert too_big.status_code == 413 and too_big.json()["error"]["param"] == "file"
    assert upload(line[:40] + b"\n").status_code == 200
    third = upload(b"{}\n")
    assert third.status_code == 429 and third.json()["error"]["code"] == "file_limit_exceeded"
    assert upload(line, {"Authorization": "Bearer tenant-key-b"}).status_code == 200  # another tenant's own
    body = {"input_file_id": first.json()["id"], "endpoint": "/v1/completions", "completion_window": "24h"}
    assert web.post("/v1/batches", json=body, headers=auth).status_code == 200
    again = web.post("/v1/batches", json=body, headers=auth)
    assert again.status_code == 429 and again.json()["error"]["code"] == "batch_limit_exceeded"
    busy = web.delete(f"/v1/files/{first.json()['id']}", headers=auth)
    assert busy.status_code == 409  # its batch has not ended
    assert sorted(p.name for p in api.files.dir.iterdir() if p.name.startswith(".upload")) == []
