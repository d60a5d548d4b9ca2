"""The API's objects as OpenAI writes them: ids, files, lists and errors (batches: `batches.py`).

Every error is an `ApiError`, answered as the API answers one: its HTTP status and
`{"error": {"message", "type", "param", "code"}}`. Another tenant's file or batch is answered as
one that does not exist (404), never as a refusal (403) that would confirm it does.
"""

from __future__ import annotations

import re
import secrets

FILE_PREFIX = "file-"
BATCH_PREFIX = "batch_"
ID_RE = re.compile(r"(file-|batch_)[0-9a-f]{24}")
LIST_LIMIT_MAX = 100  # a page of batches (files: FILES_LIMIT_MAX)
FILES_LIMIT_MAX = 10_000


class ApiError(Exception):
    """An answer that is not a 200: its status and the API's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        kind = "rate_limit_error" if self.status == 429 else "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind,
                          "param": self.param, "code": self.code}}


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


def not_found(kind: str, object_id: str) -> ApiError:
    return ApiError(404, f"No such {kind} object: {object_id}", param="id")


def file_object(meta: dict) -> dict:
    return {"id": meta["id"], "object": "file", "bytes": meta["bytes"], "created_at": meta["created_at"],
            "filename": meta["filename"], "purpose": meta["purpose"], "status": "processed", "status_details": None,
            "expires_at": None}


def page(objects: list[dict], has_more: bool) -> dict:
    """A cursor page: the openai client asks for the next with `after` = `last_id` while `has_more`."""
    return {"object": "list", "data": objects, "first_id": objects[0]["id"] if objects else None,
            "last_id": objects[-1]["id"] if objects else None, "has_more": has_more}


def after_and_limit(params, default: int, most: int) -> tuple[str | None, int]:
    """The `after` cursor and `limit` of a list request's query."""
    after = params.get("after") or None
    raw = params.get("limit")
    try:
        limit = default if raw is None else int(raw)
    except ValueError:
        raise ApiError(400, f"'limit' must be an integer, got {raw!r}", param="limit") from None
    if not 1 <= limit <= most:
        raise ApiError(400, f"'limit' must be 1 to {most}, got {limit}", param="limit")
    return after, limit


def cut(rows: list[dict], after: str | None, limit: int) -> tuple[list[dict], bool]:
    """The page of `rows` (in list order) after the one whose id is `after`."""
    if after is not None:
        at = next((i for i, r in enumerate(rows) if r["id"] == after), None)
        if at is None:
            raise ApiError(400, f"'after' names no object of this list: {after}", param="after")
        rows = rows[at + 1:]
    return rows[:limit], len(rows) > limit
