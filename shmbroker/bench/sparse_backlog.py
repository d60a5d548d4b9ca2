"""The benchmark's 1e9-token recovery backlog, built so that its payloads stay holes.

Writing 1e9 zero tokens through the writer would take ~14 s and ~4 GB of
disk, so each writer's sealed segments are written here: a sparse file (ftruncate)
with a real segment header, each record's 64-byte header as the backlog's own
encoder (`spill.records.write_records`) writes it for an all-zero payload,
put in place with one pwrite, and a real `.idx` seal index. Each writer's last,
unsealed segment is appended through the real writer (fsync=never,
sparse=True); half the writers close cleanly, half not, so recovery also
CRC-scans active segments. Recovery is then timed in a fresh process.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import crc32c
import numpy as np

from ..ingest.loop import BATCH_RECORDS
from ..ring.items import SEQ_BITS, SEQ_MASK
from ..spill import layout as L
from ..spill.records import write_records
from ..spill.store import BACKLOG_DIR, Backlog

SEED = 20261130
APPEND_BATCH = BATCH_RECORDS
PAGE_BYTES = 4096
RECOVERY_RECORD_TOKENS = 4096
RECOVERY_WRITERS = 4
RECOVERY_SAMPLE = 256
PRODUCER_RECOVERY = 2

_SEGMENT_HEADER = struct.Struct("<QIIQQQ20x")  # layout.py: magic, version, writer, first_seq, capacity, created_ns


def _record_headers(seqs: np.ndarray, ids: np.ndarray, num_tokens: int) -> np.ndarray:
    """(n, 64) uint8 committed record headers for all-zero payloads of num_tokens, each written by the
    backlog's own encoder (spill.records.write_records) into a scratch record."""
    n = seqs.size
    length = L.record_bytes(num_tokens)
    scratch = np.zeros(length, np.uint8)
    flat = np.zeros(num_tokens, np.uint32)
    offsets = np.array([0, num_tokens], np.int64)
    item = np.zeros(1, L.ITEM_DTYPE)
    item["producer"], item["max_new_tokens"], item["shape_band"] = PRODUCER_RECOVERY, 128, int(np.log2(num_tokens))
    order = np.zeros(1, np.int64)
    out_seq, out_offset = np.zeros(1, np.uint64), np.zeros(1, np.int64)
    raw = np.empty((n, L.RECORD_HEADER_BYTES), np.uint8)
    for r in range(n):
        item["item_id"] = ids[r]
        item["prefix_key"] = (ids[r] & np.uint64(SEQ_MASK)) // np.uint64(512) + np.uint64(1)
        written, _ = write_records(scratch, 0, length, flat, offsets, item, order, 0, seqs[r], out_seq, out_offset)
        assert written == 1
        raw[r] = scratch[: L.RECORD_HEADER_BYTES]
    return raw


def _write_sealed_segment(wdir: Path, writer: int, first_seq: int, segment_bytes: int, ids: np.ndarray, num_tokens: int) -> None:
    """A sealed segment whose payloads are holes: header, record headers (one pwrite each), .idx."""
    length = L.record_bytes(num_tokens)
    n = ids.size
    offsets = L.SEGMENT_HEADER_BYTES + length * np.arange(n, dtype=np.int64)
    end = L.SEGMENT_HEADER_BYTES + length * n
    headers = _record_headers(first_seq + np.arange(n, dtype=np.uint64), ids, num_tokens)
    head = _SEGMENT_HEADER.pack(L.SEGMENT_MAGIC, L.LAYOUT_VERSION, writer, first_seq, segment_bytes, time.time_ns())
    fd = os.open(wdir / L.segment_name(first_seq), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, -(-end // PAGE_BYTES) * PAGE_BYTES)  # as a seal cuts it
        os.pwrite(fd, head + struct.pack("<I", crc32c.crc32c(head)), 0)
        for r in range(n):
            os.pwrite(fd, headers[r], int(offsets[r]))
    finally:
        os.close(fd)
    entries = np.empty((n, L.IDX_ENTRY_BYTES), np.uint8)
    entries[:, :8] = offsets.astype("<u8").view(np.uint8).reshape(n, 8)
    entries[:, 8:] = headers
    body = entries.tobytes()
    idx_head = struct.pack("<QQQ", L.IDX_MAGIC, n, end).ljust(L.IDX_HEADER_BYTES - 4, b"\0")
    (wdir / L.idx_name(first_seq)).write_bytes(idx_head + struct.pack("<I", crc32c.crc32c(body, crc32c.crc32c(idx_head))) + body)


def build_recovery_backlog(data_dir: Path, total_tokens: int, segment_bytes: int) -> dict:
    n_tok = RECOVERY_RECORD_TOKENS
    records = -(-total_tokens // n_tok)
    per_seg = (segment_bytes - L.SEGMENT_HEADER_BYTES) // L.record_bytes(n_tok)
    root = data_dir / BACKLOG_DIR
    root.mkdir(mode=0o700, parents=True)
    os.chmod(data_dir, 0o700)
    shares = [records // RECOVERY_WRITERS + (w < records % RECOVERY_WRITERS) for w in range(RECOVERY_WRITERS)]
    first_id = np.cumsum([0] + shares)
    tails = []
    for w, share in enumerate(shares):
        wdir = root / L.writer_dir_name(w)
        wdir.mkdir(mode=0o700)
        sealed = (share - 1) // per_seg
        for k in range(sealed):
            ids = (PRODUCER_RECOVERY << SEQ_BITS) | np.arange(first_id[w] + k * per_seg, first_id[w] + (k + 1) * per_seg, dtype=np.uint64)
            _write_sealed_segment(wdir, w, k * per_seg, segment_bytes, ids, n_tok)
        tails.append((sealed * per_seg, share - sealed * per_seg))
    backlog, report = Backlog.open(data_dir, segment_bytes=segment_bytes)
    if report.records != sum(done for done, _ in tails) or report.torn_records or report.quarantined:
        raise AssertionError(f"hand-built sealed segments did not recover as built: {report.as_dict()}")
    flat = np.zeros(APPEND_BATCH * n_tok, np.uint32)
    offsets = np.arange(0, flat.size + 1, n_tok, dtype=np.int64)
    items = np.zeros(APPEND_BATCH, L.ITEM_DTYPE)
    items["producer"], items["max_new_tokens"], items["shape_band"] = PRODUCER_RECOVERY, 128, int(np.log2(n_tok))
    for w, (done, tail) in enumerate(tails):
        writer = backlog.writer(w, fsync="never", sparse=True)
        assert writer.next_seq == done
        while tail:
            c = min(APPEND_BATCH, tail)
            local = np.arange(done, done + c, dtype=np.uint64)
            items["item_id"][:c] = (PRODUCER_RECOVERY << SEQ_BITS) | (local + np.uint64(first_id[w]))
            items["prefix_key"][:c] = (local + np.uint64(first_id[w])) // np.uint64(512) + np.uint64(1)
            writer.append_many(flat, offsets[: c + 1], items[:c])
            done, tail = done + c, tail - c
        writer.close(clean=w < RECOVERY_WRITERS // 2)
    backlog.close()
    return {"records": records, "tokens": records * n_tok, "writers": RECOVERY_WRITERS}


_RECOVER_SCRIPT = """
import json, sys, time
t0 = time.perf_counter()
from shmbroker.spill.store import Backlog
t1 = time.perf_counter()
backlog, report = Backlog.open(sys.argv[1], segment_bytes=int(sys.argv[2]))
t2 = time.perf_counter()
out = report.as_dict()
out["quarantined"] = len(out["quarantined"])
out.update(open_seconds=t2 - t1, import_seconds=t1 - t0)
print(json.dumps(out))
"""


def recover_in_fresh_process(data_dir: Path, segment_bytes: int) -> tuple[dict, float]:
    """Backlog.open() in a fresh interpreter: (its report plus open_seconds, the process's wall seconds)."""
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _RECOVER_SCRIPT, str(data_dir), str(segment_bytes)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1]), time.perf_counter() - t0


def verify_recovered(backlog: Backlog, report, built: dict) -> None:
    if report.records != built["records"] or report.tokens != built["tokens"] or report.pending_records != built["records"]:
        raise AssertionError(f"recovered {report.records} records / {report.tokens} tokens, built {built}")
    if report.torn_records or report.quarantined:
        raise AssertionError(f"recovery cut {report.torn_records} tails, quarantined {len(report.quarantined)}")
    pending = backlog.pending()
    ids = np.sort(pending["item_id"] & np.uint64(SEQ_MASK))
    if not np.array_equal(ids, np.arange(built["records"], dtype=np.uint64)):
        raise AssertionError("recovered item ids are not each built record exactly once")
    sample = pending[np.random.default_rng(SEED).choice(pending.size, min(RECOVERY_SAMPLE, pending.size), replace=False)]
    for rec in sample:
        seg = backlog.segment(int(rec["writer"]), int(rec["segment"]))
        off = int(rec["offset"])
        words = seg.buf[off : off + L.RECORD_HEADER_BYTES].view(np.uint32)
        length = int(words[L.R_LENGTH])
        if crc32c.crc32c(seg.buf[off + 12 : off + length]) != int(words[L.R_CRC]):
            raise AssertionError(f"record {rec} fails its CRC")
        if backlog.tokens(rec).any() or backlog.tokens(rec).size != RECOVERY_RECORD_TOKENS:
            raise AssertionError(f"record {rec} does not hold {RECOVERY_RECORD_TOKENS} zero tokens")
