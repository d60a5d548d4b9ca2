"""The results process's count of each job's results: `<data_dir>/jobs/<name>/counts.json`.

The results process counts every result record it takes from a GPU (not the replays of the log)
whose producer name is a job's, by status, once per item id: a SeenSet per producer id says which
sequence numbers were counted, so an item run twice (a GPU process killed after its result was
logged, before the ack was saved) counts once. The counts are saved at the results process's
checkpoint, after the log is synced and before the acks are saved: an item whose ack is on disk is
counted on disk, and one whose count was lost runs again and is counted then.

    {"counts": {"ok": n, "too_long": n, ...}, "generated_tokens": n, "seen": {"<producer id>": SeenSet.state()}}
"""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np

from ..client.seen import SeenSet
from ..disk.durable import atomic_write
from ..ring.items import SEQ_MASK, STATUS_NAMES
from ..ring.wire import result_num_tokens
from .store import is_job, job_dir, read_counts


class JobTally:
    def __init__(self, data_dir: str | os.PathLike, name: str):
        self.path = job_dir(data_dir, name) / "counts.json"
        saved = read_counts(data_dir, name)
        self.counts: Counter[str] = Counter({str(k): int(v) for k, v in saved.get("counts", {}).items()})
        self.generated_tokens = int(saved.get("generated_tokens", 0))
        self.seen: dict[int, SeenSet] = {}
        for pid, state in saved.get("seen", {}).items():
            try:
                self.seen[int(pid)] = SeenSet.from_state(state)
            except (ValueError, KeyError, TypeError):
                continue
        self.dirty = False

    def add(self, producer_id: int, seqs: np.ndarray, status: np.ndarray, generated: np.ndarray) -> None:
        fresh = self.seen.setdefault(producer_id, SeenSet()).add(seqs)
        if not fresh.any():
            return
        self.generated_tokens += int(generated[fresh].sum())
        for code, n in enumerate(np.bincount(status[fresh].astype(np.int64)).tolist()):
            if n:
                self.counts[STATUS_NAMES.get(code, f"status_{code}")] += n
        self.dirty = True

    def save(self) -> None:
        body = {"counts": dict(self.counts), "generated_tokens": self.generated_tokens, "seen": {str(p): s.state() for p, s in self.seen.items()}}
        atomic_write(self.path, json.dumps(body).encode())
        self.dirty = False


class JobTallies:
    """Every job's tally in the results process, found by producer id (`name_of` the router's)."""

    def __init__(self, data_dir: str | os.PathLike, name_of):
        self.data_dir = data_dir
        self.name_of = name_of
        self.by_producer: dict[int, JobTally | None] = {}
        self.by_name: dict[str, JobTally] = {}

    def _tally(self, producer_id: int) -> JobTally | None:
        if producer_id in self.by_producer:
            return self.by_producer[producer_id]
        name = self.name_of(producer_id)
        tally = None
        if name is not None and is_job(self.data_dir, name):
            tally = self.by_name.get(name)
            if tally is None:
                tally = self.by_name[name] = JobTally(self.data_dir, name)
        self.by_producer[producer_id] = tally
        return tally

    def count(self, producer_id: int, mine, item_ids: np.ndarray, status: np.ndarray, data: np.ndarray,
              rows: np.ndarray) -> None:
        """Count producer `producer_id`'s results when it is a job's: `mine` selects them (None: all) of the
        router's columns `item_ids`, `status`; `rows` are their records' positions in `data`."""
        tally = self._tally(producer_id)
        if tally is not None:
            sel = slice(None) if mine is None else mine
            tally.add(producer_id, (item_ids[sel] & np.uint64(SEQ_MASK)).astype(np.int64), status[sel],
                      result_num_tokens(data, rows))

    def save(self) -> None:
        for tally in self.by_name.values():
            if tally.dirty:
                tally.save()
