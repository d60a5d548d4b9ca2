"""What the commands share: the data directory, error lines, the results output, the id sidecar and result rows.

A prompt's `id` is kept in `<data_dir>/submit-ids/<name>.jsonl` ({"item_id",
"id", "line"} a line), so `results` (or `submit --wait`) hands it back with the
item's result. Results are written as JSON lines {"item_id", "id", "status",
"tokens", "error"}, appended to --out (a result is read from the broker once: a
second run must not overwrite the first one's).
"""

from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from pathlib import Path

IDS_DIR = "submit-ids"


def _err(message: str) -> None:
    print(f"shmbroker: {message}", file=sys.stderr, flush=True)


def _data_dir(args) -> str | None:
    from .. import settings

    try:
        return settings.load(args.config, data_dir=args.data_dir).data_dir
    except settings.ConfigError as exc:
        _err(str(exc))
        return None


@contextmanager
def _output(path: str | None):
    """The results file (appended to: results are read once) or standard output."""
    if path is None:
        yield sys.stdout
        sys.stdout.flush()
        return
    with open(path, "a", encoding="utf-8") as fh:
        yield fh


def _ids_path(data_dir: str, name: str) -> Path:
    return Path(data_dir) / IDS_DIR / f"{name}.jsonl"


def _load_ids(data_dir: str, name: str) -> dict[int, str | int]:
    """item id -> user id from the sidecar of producer `name` (a torn last line is skipped)."""
    out: dict[int, str | int] = {}
    try:
        fh = open(_ids_path(data_dir, name), encoding="utf-8")
    except FileNotFoundError:
        return out
    with fh:
        for line in fh:
            try:
                row = json.loads(line)
                out[int(row["item_id"])] = row["id"]
            except (ValueError, KeyError, TypeError):
                continue
    return out


class _IdLog:
    """Appends {"item_id", "id", "line"} for every submitted prompt that has an id; opened on first use."""

    def __init__(self, data_dir: str, name: str):
        self.path = _ids_path(data_dir, name)
        self._fh = None

    def write(self, item_id: int, user_id, line: int) -> None:
        if self._fh is None:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            os.chmod(self.path.parent, 0o700)
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.fchmod(fd, 0o600)
            self._fh = os.fdopen(fd, "a", encoding="utf-8")
        self._fh.write(json.dumps({"item_id": item_id, "id": user_id, "line": line}) + "\n")

    def flush(self) -> None:
        if self._fh is not None:
            self._fh.flush()

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def _result_row(r, ids: dict) -> str:
    return json.dumps({"item_id": r.item_id, "id": ids.get(r.item_id), "status": r.status,
                       "tokens": r.tokens.tolist(), "error": r.error})
