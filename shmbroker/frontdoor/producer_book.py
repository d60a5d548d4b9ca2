"""`<data_dir>/producers.json`: every producer id ever given out, by name (kept twice, checksummed)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import NamedTuple

import crc32c

from ..disk.durable import atomic_write
from ..ring.items import MAX_PRODUCER_ID


class BookCopy(NamedTuple):
    """One copy of the producer book, read and checked: where it is, its next id, its names, and
    whether it had a checksum (a copy written before the checksum was kept has none)."""

    path: Path
    next_id: int
    names: dict[str, list[int]]
    checked: bool


class ProducerBook:
    """`<data_dir>/producers.json`: every producer id ever given out, by name, so that ids are never
    reused across broker restarts (item ids stay unique) and results for a name's earlier ids reach
    whoever connects under that name later. {"next_id": int, "names": {name: [ids]}, "crc32c": int}

    Kept twice, `producers.json` and `producers.json.1`, each whole with the crc32c of its content
    (of `json.dumps` of the other two keys, sorted): a copy that fails its checks (bit rot, a torn
    write) is passed over (`damaged` names it) and the sound copy with the highest next_id is the
    book; both damaged is an error (ids could be reused), not a silent empty book."""

    FILE = "producers.json"
    COPY = "producers.json.1"

    def __init__(self, data_dir: str | os.PathLike):
        self.path = Path(data_dir) / self.FILE
        self.copy_path = Path(data_dir) / self.COPY
        self.next_id = 1
        self.names: dict[str, list[int]] = {}
        self.damaged: list[str] = []
        found: list[BookCopy] = []
        for path in (self.path, self.copy_path):
            try:
                found.append(_read_book(path))
            except FileNotFoundError:
                continue
            except ValueError as exc:
                self.damaged.append(f"{path.name}: {exc}")
        if any(book.checked for book in found):  # then one without a checksum lost its key to damage
            self.damaged += [f"{book.path.name}: no checksum" for book in found if not book.checked]
            found = [book for book in found if book.checked]
        if self.damaged and not found:
            raise ValueError(f"the producer book is damaged in every copy ({'; '.join(self.damaged)}): "
                             "ids given out before cannot be known")
        if found:
            best = max(found, key=lambda book: book.next_id)
            self.next_id, self.names = best.next_id, best.names

    def assign(self, name: str) -> int:
        """A fresh id for `name`, recorded on disk (both copies) before it is handed out."""
        pid = self.next_id
        if pid > MAX_PRODUCER_ID:
            raise ValueError("producer ids are exhausted")
        self.next_id += 1
        self.names.setdefault(name, []).append(pid)
        body = {"next_id": self.next_id, "names": self.names}
        data = json.dumps({**body, "crc32c": crc32c.crc32c(json.dumps(body, sort_keys=True).encode())}).encode()
        atomic_write(self.path, data)
        atomic_write(self.copy_path, data)
        return pid

    def name_of(self) -> dict[int, str]:
        return {i: name for name, ids in self.names.items() for i in ids}


def _read_book(path: Path) -> BookCopy:
    """One copy of the producer book; ValueError when it fails its checks (a copy written before the
    checksum was kept has none to check)."""
    try:
        record = json.loads(path.read_bytes())
        body = {"next_id": int(record["next_id"]),
                "names": {str(k): [int(i) for i in v] for k, v in record["names"].items()}}
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"unreadable ({exc})") from None
    if "crc32c" in record and record["crc32c"] != crc32c.crc32c(json.dumps(body, sort_keys=True).encode()):
        raise ValueError("checksum mismatch")
    return BookCopy(path, body["next_id"], body["names"], "crc32c" in record)
