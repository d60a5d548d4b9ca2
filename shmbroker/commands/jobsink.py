"""A job's results written: its output and error files keyed by custom_id, each line once.

The output is keyed by custom_id (a native line's `id`, else its line number): a run on the same
--out (and error file) skips the keys they hold (`written_keys`), so each custom_id is in the output
once. An embeddings line's vectors wait in the job's `parts.bin` (`jobs/parts.py`) until its last
came, and the line is written whole.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

from ..jobs import store
from ..jobs.embeddings import EMBEDDINGS, embeddings_body
from ..jobs.openai_batch import line_error_row, ok_row, output_row
from ..jobs.parts import FILE_NAME as PARTS_FILE
from ..jobs.parts import LineParts
from .common import ResultSink


def key_of(cid, line: int) -> str:
    return f"line:{line}" if cid is None else f"id:{json.dumps(cid)}"


def _row_key(row: dict) -> str | None:
    if "custom_id" in row:  # an OpenAI output or error line
        if row["custom_id"] is not None:
            return key_of(row["custom_id"], 0)
        err = row.get("error") or {}
        return key_of(None, err["line"]) if isinstance(err.get("line"), int) else None
    if row.get("id") is not None:
        return key_of(row["id"], 0)
    return key_of(None, row["line"]) if isinstance(row.get("line"), int) else None


def written_keys(*paths: str | None) -> set[str]:
    """The keys the output files hold already (an earlier run's whole lines)."""
    keys = set()
    for path in paths:
        try:
            fh = open(path, encoding="utf-8") if path else None
        except FileNotFoundError:
            continue
        if fh is None:
            continue
        with fh:
            for line in fh:
                try:
                    k = _row_key(json.loads(line))
                except (ValueError, KeyError, TypeError):
                    continue
                if k is not None:
                    keys.add(k)
    return keys


class JobSink(ResultSink):
    """A job's results to its output (and, in the OpenAI format, failed ones to the error file), keyed
    by custom_id (`key_of`), on `ResultSink`'s rule: acknowledged once both files are durable. An
    embeddings line's vectors wait in the job's `parts.bin` (`jobs/parts.py`) until its last came."""

    def __init__(self, out, errors, producer, fmt: str, tokenizer, written: set[str], job_dir=None):
        super().__init__(out, producer, written, errors)
        self.fmt, self.tokenizer = fmt, tokenizer
        self.cancel = store.CANCEL_REASONS["cancelled"]  # code and message of a cancelled result
        self.parts = LineParts(Path(job_dir) / PARTS_FILE, self.written) if job_dir is not None else None

    def result(self, r, entry: dict | None) -> bool:
        """Write one result (False: its key is in the output already, or no entry names it)."""
        if entry is not None and entry.get("endpoint") == EMBEDDINGS:
            return self._embedding(r, entry)
        if entry is None or not self._fresh(key_of(entry.get("id"), int(entry["line"]))):
            return False
        tokenizer = self.tokenizer.of(entry.get("model")) if self.tokenizer is not None else None
        tail = entry.get("tail", ())
        texts = [tokenizer.decode(s, tail) for s in r.samples] if tokenizer is not None and r.status == "ok" else None
        text = texts[0] if texts is not None and len(texts) == 1 else None
        if self.fmt == "openai":
            self._row(*output_row(r, entry.get("id"), entry, texts, None if tokenizer is None else tokenizer.token_text,
                                  self.cancel))
        else:
            row = {"item_id": r.item_id, "id": entry.get("id"), "line": entry["line"], "status": r.status,
                   "tokens": r.tokens.tolist(), "error": r.error}
            if text is not None:
                row["text"] = text
            if r.extras is not None:  # samples, finish reasons and cached prompt tokens, as the engine said
                row.update(samples=[list(map(int, x)) for x in r.samples], finish_reasons=list(r.finish_reasons),
                           cached_tokens=r.cached_tokens)
                if texts is not None and len(texts) > 1:
                    row["texts"] = texts
            self._row(row, False)
        return True

    def _embedding(self, r, entry: dict) -> bool:
        """One input's vector: its line is written once every input's came (or the first failed)."""
        key = key_of(entry.get("id"), int(entry["line"]))
        if key in self.written:
            self.skipped += 1
            return False
        parts, part = int(entry.get("parts", 1)), int(entry.get("part", 0))
        if r.status != "ok" or r.vector is None:
            if self.parts is not None:
                self.parts.forget(key)
            self._fresh(key)
            why = r.error or ("the engine returned no vector" if r.status == "ok" else r.status)
            failed = replace(r, status="engine_error" if r.status == "ok" else r.status,
                             error=f"input {part}: {why}" if parts > 1 else why)
            if self.fmt == "openai":
                self._row(*output_row(failed, entry.get("id"), entry, None, None, self.cancel))
            else:
                self._row({"item_id": r.item_id, "id": entry.get("id"), "line": entry["line"], "status": failed.status,
                           "tokens": [], "error": failed.error}, False)
            return True
        if parts == 1:
            got = [r.vector], int(entry.get("n", 0))
        elif self.parts is None:
            raise ValueError("an embeddings line of several inputs needs its job's directory (parts.bin)")
        else:
            got = self.parts.add(key, part, parts, r.vector, int(entry.get("n", 0)))
            if got is None:
                return True
        self._fresh(key)
        self._vectors(r.item_id, entry, got)
        return True

    def _vectors(self, item_id: int, entry: dict, got: tuple) -> None:
        """A line's output: its vectors (in input order) and prompt tokens, as the API's body or, in the
        native format, a row with its `embeddings` (lists of floats)."""
        if self.fmt == "openai":
            self._row(ok_row(item_id, entry.get("id"), embeddings_body(*got, entry)), False)
            return
        vectors, tokens = got
        self._row({"item_id": item_id, "id": entry.get("id"), "line": entry["line"], "status": "ok", "tokens": [],
                   "error": None, "embeddings": [v.tolist() for v in vectors], "prompt_tokens": tokens}, False)

    def write_whole(self, entries) -> None:
        """Write the lines whose vectors are all held already (`LineParts.whole`): a killed run held
        their last and did not write them. `entries`: the job's items' entries (any of a line names it)."""
        whole = set(self.parts.whole()) if self.parts is not None else set()
        for e in sorted(entries, key=lambda e: int(e["item_id"])) if whole else ():
            key = key_of(e.get("id"), int(e["line"]))
            if key in whole and self._fresh(key):
                whole.discard(key)
                self._vectors(int(e["item_id"]), e, self.parts.take(key))

    def holds(self, entry: dict) -> bool:
        """Whether this item's vector is held for its line already (its result was acknowledged)."""
        return self.parts is not None and int(entry.get("parts", 1)) > 1 and \
            self.parts.holds(key_of(entry.get("id"), int(entry["line"])), int(entry.get("part", 0)))

    def commit(self) -> None:
        if self.parts is not None:
            self.parts.sync()  # the vectors held before the results that brought them are acknowledged
        super().commit()

    def close(self) -> None:
        if self.parts is not None:
            self.parts.close()

    def line(self, number: int, message: str, cid=None, code: str = "invalid_request", status: str = "invalid") -> None:
        """A line that was not submitted: not a prompt (its error), or left when the job was cancelled."""
        if not self._fresh(key_of(cid, number)):
            return
        if self.parts is not None:
            self.parts.forget(key_of(cid, number))
        if self.fmt == "openai":
            self._row(line_error_row(number, message, cid, code), True)
        else:
            self._row({"item_id": None, "id": cid, "line": number, "status": status, "tokens": [], "error": message}, False)

    def _fresh(self, key: str) -> bool:
        if key in self.written:
            self.skipped += 1
            return False
        self.written.add(key)
        return True

    def _row(self, row: dict, is_error: bool) -> None:
        self._put(self.errors if is_error and self.errors is not None else self.out, json.dumps(row))


def error_path(out: str | None) -> str | None:
    """The error file beside --out: results.jsonl -> results.errors.jsonl."""
    if out is None:
        return None
    root, ext = os.path.splitext(out)
    return f"{root}.errors{ext or '.jsonl'}"


