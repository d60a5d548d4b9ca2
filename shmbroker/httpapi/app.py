"""The HTTP API's routes on Starlette: OpenAI's Files, Batches and Models endpoints, per tenant.

Every request but none names its tenant with `Authorization: Bearer <key>` (`[http.keys]`); a
missing or unknown key is a 401 with the API's error body. Every answer that is not a 200 is an
`objects.ApiError`'s body, unknown routes and methods included.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import threading
import time
from dataclasses import dataclass, field

from ..jobs.openai_batch import ENDPOINTS  # the batch line formats served
from .batches import BatchRecord, BatchStore, batch_object, now
from .files import PURPOSES, FileStore
from .objects import (BATCH_PREFIX, FILE_PREFIX, FILES_LIMIT_MAX, LIST_LIMIT_MAX, ApiError, after_and_limit, cut,
                      file_object, new_id, page)
from .runner import Runner
from .upload import receive_file

WINDOW_RE = re.compile(r"([1-9][0-9]{0,6})(h|m|s)")  # "24h" as the API; minutes and seconds too
UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1}
METADATA_PAIRS, METADATA_KEY, METADATA_VALUE = 16, 64, 512  # the API's limits on a batch's metadata
BATCH_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata", "output_expires_after"}


@dataclass
class Api:
    """What the routes share: the configuration (`config.http.HttpConfig`), the stores, the runner
    and the models the broker's consumers serve."""

    cfg: object
    data_dir: str
    files: FileStore
    batches: BatchStore
    runner: Runner
    models: list = field(default_factory=list)
    # held (in worker threads) from a check to the change it allows: a file is not deleted while a
    # batch takes it, and a tenant's batch limit holds against two creates at once
    admit: threading.Lock = field(default_factory=threading.Lock)

    def tenant(self, request) -> str:
        auth = request.headers.get("authorization", "")
        scheme, _, secret = auth.partition(" ")
        name = self.cfg.tenant_of(secret.strip()) if scheme.lower() == "bearer" and secret.strip() else None
        if name is None:
            hint = "no API key was given" if not auth else "the API key is not a key of this server"
            raise ApiError(401, f"Incorrect API key provided: {hint}. Give it as 'Authorization: Bearer <key>'.",
                           code="invalid_api_key")
        return name

    def batch_view(self, rec: BatchRecord) -> dict:
        view = None if rec.phase == "ended" else self.batches.job_view(rec)
        return batch_object(rec, view, self.files.lines(rec.owner, rec.input_file_id))


async def json_body(request) -> dict:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except ValueError:
        raise ApiError(400, "We could not parse the JSON body of your request. The body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "The body of your request must be a JSON object.")
    return body


async def create_file(api: Api, request) -> dict:
    owner = api.tenant(request)
    cfg = api.cfg
    if cfg.tenant_max_files and api.files.usage(owner)[0] >= cfg.tenant_max_files:
        raise ApiError(429, f"this tenant keeps {cfg.tenant_max_files} files already: delete some first",
                       code="file_limit_exceeded")
    fd, tmp = api.files.begin_upload()
    try:
        parts = await receive_file(request, fd, cfg.max_file_bytes, cfg.max_file_lines, cfg.upload_idle_seconds)
        purpose = parts.fields.get("purpose")
        if purpose not in PURPOSES:
            raise ApiError(400, f"'purpose' must be one of {', '.join(PURPOSES)}, got {purpose!r}", param="purpose")
        if parts.size == 0:
            raise ApiError(400, "the file is empty", param="file")
        if cfg.tenant_max_bytes and api.files.usage(owner)[1] + parts.size > cfg.tenant_max_bytes:
            raise ApiError(413, f"this tenant's files would be over {cfg.tenant_max_bytes} bytes", param="file")
        meta = await asyncio.to_thread(api.files.commit, fd, tmp, owner, parts.filename, purpose, parts.size,
                                       parts.requests.number, parts.requests.summary())
        fd = -1
        return file_object(meta)
    finally:
        if fd >= 0:
            os.close(fd)
            tmp.unlink(missing_ok=True)


def list_files(api: Api, request) -> dict:
    owner = api.tenant(request)
    q = request.query_params
    after, limit = after_and_limit(q, FILES_LIMIT_MAX, FILES_LIMIT_MAX)
    rows = [file_object(m) for m in api.files.owned(owner) if not q.get("purpose") or m["purpose"] == q.get("purpose")]
    if q.get("order", "desc") == "asc":
        rows.reverse()
    data, more = cut(rows, after, limit)
    return page(data, more)


def delete_file(api: Api, request, file_id: str) -> dict:
    owner = api.tenant(request)
    with api.admit:
        api.files.get(owner, file_id)
        busy = api.batches.uses_file(owner, file_id)
        if busy is not None:
            raise ApiError(409, f"file {file_id} is in use by batch {busy.id}, which has not ended", param="file_id")
        api.files.delete(owner, file_id)
    return {"id": file_id, "object": "file", "deleted": True}


def window_seconds(window) -> int:
    m = WINDOW_RE.fullmatch(window) if isinstance(window, str) else None
    if m is None:
        raise ApiError(400, f"'completion_window' must be like \"24h\" (or minutes \"30m\", seconds \"90s\"), "
                            f"got {window!r}", param="completion_window")
    return int(m.group(1)) * UNIT_SECONDS[m.group(2)]


def check_metadata(metadata) -> dict | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= METADATA_KEY and len(v) <= METADATA_VALUE
            for k, v in metadata.items()):
        raise ApiError(400, f"'metadata' is at most {METADATA_PAIRS} string pairs (keys up to {METADATA_KEY} "
                            f"characters, values up to {METADATA_VALUE})", param="metadata")
    return metadata


async def create_batch(api: Api, request) -> dict:
    owner = api.tenant(request)
    body = await json_body(request)
    return await asyncio.to_thread(new_batch, api, owner, body)


def new_batch(api: Api, owner: str, body: dict) -> dict:
    """Check a create's `body` and save its batch (fsynced: a batch answered 200 is on disk), in a
    worker thread."""
    unknown = sorted(set(body) - BATCH_FIELDS)
    if unknown:
        raise ApiError(400, f"unknown field(s) {', '.join(unknown)}", param=unknown[0])
    endpoint = body.get("endpoint")
    if endpoint not in ENDPOINTS:
        raise ApiError(400, f"'endpoint' must be one of {', '.join(ENDPOINTS)} (the ones served), got {endpoint!r}",
                       param="endpoint")
    input_id = body.get("input_file_id")
    if not isinstance(input_id, str):
        raise ApiError(400, "'input_file_id' must be a file id", param="input_file_id")
    limit = api.cfg.tenant_max_batches
    with api.admit:
        meta = api.files.get(owner, input_id)
        if meta["purpose"] != "batch":
            raise ApiError(400, f"file {input_id} has purpose {meta['purpose']!r}, not 'batch'", param="input_file_id")
        seconds = window_seconds(body.get("completion_window"))
        metadata = check_metadata(body.get("metadata"))
        if limit and len([r for r in api.batches.owned(owner) if r.phase != "ended"]) >= limit:
            raise ApiError(429, f"this tenant has {limit} batches not ended already", code="batch_limit_exceeded")
        t = now()
        rec = BatchRecord(id=new_id(BATCH_PREFIX), owner=owner, endpoint=endpoint, input_file_id=input_id,
                          completion_window=body["completion_window"], created_at=t, expires_at=t + seconds,
                          output_file_id=new_id(FILE_PREFIX), error_file_id=new_id(FILE_PREFIX), metadata=metadata)
        view = api.batch_view(rec)  # as created: once saved, the runner may validate it at once
        api.batches.save(rec)
    api.runner.bell.set()
    return view


def list_batches(api: Api, request) -> dict:
    owner = api.tenant(request)
    after, limit = after_and_limit(request.query_params, 20, LIST_LIMIT_MAX)
    data, more = cut([api.batch_view(r) for r in api.batches.owned(owner)], after, limit)
    return page(data, more)


def cancel_batch(api: Api, request, batch_id: str) -> dict:
    """The cancel is saved in the batch's record and left to the runner (`Runner.cancel`): the answer
    waits for no job, file or output description."""
    rec = api.batches.get(api.tenant(request), batch_id)
    if not api.runner.cancel(rec) and rec.final != "cancelled":
        raise ApiError(409, f"batch {batch_id} is {rec.final}: it cannot be cancelled", param="batch_id")
    return api.batch_view(rec)


def list_models(api: Api, request) -> dict:
    api.tenant(request)
    return {"object": "list", "data": [{"id": m, "object": "model", "created": int(time.time()), "owned_by": "shmbroker"}
                                       for m in api.models]}
