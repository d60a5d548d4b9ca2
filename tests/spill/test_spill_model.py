"""A real `Backlog` in a temporary directory against `spill.model.BacklogModel`, step for step.

Small segments (8-64 KiB) so segments roll, seal and get reclaimed often; one
or two writers. After every reopen the recovered pending set must equal the
model's record for record (sequence, segment, offset, metadata, tokens);
reclaim must delete exactly the non-newest segments whose records are all
acked, and a drained backlog must shrink to at most one segment per writer.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from shmbroker.spill.layout import ITEM_DTYPE, max_tokens
from shmbroker.spill.model import META_FIELDS, BacklogModel
from shmbroker.spill.store import Backlog

SEGMENT_SIZES = [8 << 10, 16 << 10, 64 << 10]
U64 = st.integers(0, 2**64 - 1)
U32 = st.integers(0, 2**32 - 1)
# few distinct shape keys so clustering has ties to keep stable; one key above 2**63
PREFIX_KEYS = st.sampled_from([0, 7, 2**63 + 5, 2**64 - 1])


@st.composite
def batches(draw, max_tokens_per_record: int):
    count = draw(st.integers(0, 12))
    big = st.integers(max_tokens_per_record // 2, max_tokens_per_record)
    lengths = draw(
        st.lists(st.one_of(st.integers(0, 300), big) if draw(st.booleans()) else st.integers(0, 300), min_size=count, max_size=count)
    )
    items = [
        {
            "item_id": draw(U64),
            "prefix_key": draw(PREFIX_KEYS),
            "producer": draw(st.integers(0, 3)),
            "model": draw(st.integers(0, 2)),
            "prefix_len": draw(st.sampled_from([0, 16, 2**32 - 1])),
            "max_new_tokens": draw(U32),
            "shape_band": draw(st.integers(0, 3)),
            "flags": 0,
        }
        for _ in range(count)
    ]
    seed = draw(st.integers(0, 2**32 - 1))
    return lengths, items, seed


def to_arrays(lengths: list[int], items: list[dict], seed: int):
    rng = np.random.default_rng(seed)
    offsets = np.zeros(len(lengths) + 1, np.int64)
    offsets[1:] = np.cumsum(lengths)
    flat = rng.integers(0, 2**32, int(offsets[-1]), dtype=np.uint32)
    arr = np.zeros(len(items), ITEM_DTYPE)
    for i, item in enumerate(items):
        for key, value in item.items():
            arr[i][key] = value
    tokens = [tuple(int(t) for t in flat[offsets[i] : offsets[i + 1]]) for i in range(len(lengths))]
    return flat, offsets, arr, tokens


class BacklogMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="spill-model-"))
        self.backlog = None
        self.writers = {}

    @initialize(
        segment_bytes=st.sampled_from(SEGMENT_SIZES), num_writers=st.integers(1, 2), fsync=st.sampled_from(["never", "interval", "always"])
    )
    def start(self, segment_bytes, num_writers, fsync):
        self.segment_bytes = segment_bytes
        self.num_writers = num_writers
        self.fsync = fsync
        self.model = BacklogModel(segment_bytes)
        self._open()

    def _open(self):
        self.backlog, self.report = Backlog.open(self.tmp, segment_bytes=self.segment_bytes)
        self.writers = {w: self.backlog.writer(w, fsync=self.fsync) for w in range(self.num_writers)}

    def _close(self, clean: bool):
        for w in self.writers.values():
            w.close(clean=clean)
        self.writers = {}
        self.backlog.close()

    def teardown(self):
        if self.backlog is not None:
            self._close(clean=True)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def wdir(self, writer: int) -> Path:
        return self.backlog.root / f"w{writer:03d}"

    def segments_on_disk(self, writer: int) -> list[int]:
        return sorted(int(p.stem) for p in self.wdir(writer).glob("*.seg"))

    # -- rules ---------------------------------------------------------------------

    @rule(data=st.data(), cluster=st.booleans())
    def append_many(self, data, cluster):
        writer = data.draw(st.integers(0, self.num_writers - 1), label="writer")
        lengths, items, seed = data.draw(batches(max_tokens(self.segment_bytes)), label="batch")
        flat, offsets, arr, tokens = to_arrays(lengths, items, seed)
        seqs, segments, rec_offsets = self.writers[writer].append_many(flat, offsets, arr, cluster=cluster)
        expected = self.model.append_many(writer, tokens, items, cluster=cluster)
        assert seqs.tolist() == [r.seq for r in expected]
        assert segments.tolist() == [r.segment for r in expected]
        assert rec_offsets.tolist() == [r.offset for r in expected]
        assert self.writers[writer].next_seq == self.model.next_seq(writer)

    @precondition(lambda self: len(self.model.pending()) > 0)
    @rule(data=st.data(), duplicates=st.booleans())
    def ack(self, data, duplicates):
        pending = sorted(self.model.pending())
        chosen = data.draw(st.lists(st.sampled_from(pending), max_size=len(pending), unique=True), label="acked")
        if duplicates:  # acking again what is done (not yet reclaimed) changes nothing
            live_done = sorted(k for k in self.model.live_records() if k in self.model.acked)
            if live_done:
                chosen += data.draw(st.lists(st.sampled_from(live_done), max_size=5), label="again")
        for writer in range(self.num_writers):
            seqs = [s for w, s in chosen if w == writer]
            seqs = data.draw(st.permutations(seqs), label=f"order w{writer}")
            self.backlog.ack(writer, seqs)
            self.model.ack(writer, seqs)

    @precondition(lambda self: len(self.model.pending()) > 0)
    @rule()
    def ack_everything(self):
        for writer in range(self.num_writers):
            seqs = [s for w, s in self.model.pending() if w == writer]
            self.backlog.ack(writer, seqs)
            self.model.ack(writer, seqs)

    @rule()
    def save_acks(self):
        self.backlog.save_acks()
        self.model.save_acks()

    @rule()
    def reclaim(self):
        before = {w: self.segments_on_disk(w) for w in range(self.num_writers)}
        removed = self.backlog.reclaim()
        expected = self.model.reclaim()
        assert removed == len(expected)
        event(f"reclaim removed {'some' if removed else 'none'}")
        for writer in range(self.num_writers):
            after = self.segments_on_disk(writer)
            for first in set(before[writer]) - set(after):
                # never a segment holding a record that is not acked
                assert all((writer, s) in self.model.acked for s in self.model.segment_range(writer, first))
        self.check_drained()

    @rule(clean=st.booleans())
    def reopen(self, clean):
        self._close(clean)
        recovered = len(self.model.live_records())  # open counts records before it reclaims
        reclaimed = self.model.reopen()
        self._open()
        assert self.report.segments_reclaimed == len(reclaimed)
        assert self.report.torn_bytes == 0
        assert self.report.quarantined == []
        assert self.report.clean_writers == (sum(1 for w in range(self.num_writers) if self.model.live_segments(w)) if clean else 0)
        assert self.report.records == recovered
        self.check_pending()
        event(
            f"reopen {'clean' if clean else 'unclean'}, {'some' if self.model.pending() else 'none'} pending, {'several' if max(len(self.model.live_segments(w)) for w in range(self.num_writers)) > 1 else '<= 1'} segments"
        )
        for writer, w in self.writers.items():
            assert w.next_seq == self.model.next_seq(writer)

    # -- checks --------------------------------------------------------------------

    def check_pending(self):
        real = self.backlog.pending()
        expected = self.model.pending()
        keys = [(int(r["writer"]), int(r["seq"])) for r in real]
        assert len(keys) == len(set(keys)), "a record recovered twice"
        assert set(keys) == set(expected)
        for rec in real:
            want = expected[(int(rec["writer"]), int(rec["seq"]))]
            assert int(rec["segment"]) == want.segment
            assert int(rec["offset"]) == want.offset
            assert int(rec["num_tokens"]) == len(want.tokens)
            for key in META_FIELDS:
                assert int(rec[key]) == want.meta[key], key
            assert tuple(self.backlog.tokens(rec).tolist()) == want.tokens
        assert self.report.pending_records == len(expected)

    def check_drained(self):
        if not self.model.all_acked():
            return
        event("drained backlog checked")
        for writer in range(self.num_writers):
            assert len(self.segments_on_disk(writer)) <= 1
        # one (unsealed, preallocated) segment per writer, plus the ack file and clean markers. A
        # segment reclaimed while its writer's sync thread seals it can show its index for a moment:
        # the seal removes an index whose segment is gone (writer._seal), so the walk is retried a
        # bounded while for that to settle.
        limit = self.num_writers * self.segment_bytes + 4096 * (1 + self.num_writers)
        for _ in range(100):
            used, files = self.disk_used()
            if used <= limit:
                break
            time.sleep(0.01)
        assert used <= limit, files

    def disk_used(self) -> tuple[int, list]:
        """(bytes, [(file, bytes)]) the backlog's files hold, in one walk, without the spares the
        backlog prepares in the background and the disk-full reserve (durable.RESERVE_FILE): two
        walks raced with a spare made between them."""
        used = 0
        files = []
        for p in self.backlog.root.rglob("*"):
            if p.name == ".reserve" or (p.name.startswith(".spare-") and p.name.endswith(".tmp")):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # a spare renamed or removed meanwhile
                continue
            if p.is_file():
                used += st.st_blocks * 512
                files.append((str(p.relative_to(self.backlog.root)), st.st_blocks * 512))
        return used, files

    @invariant()
    def segments_are_the_models(self):
        if self.backlog is None:
            return
        for writer in range(self.num_writers):
            assert self.segments_on_disk(writer) == self.model.live_segments(writer)

    @invariant()
    def acks_are_the_models(self):
        if self.backlog is None:
            return
        for writer, w in self.model.writers.items():
            seqs = np.arange(len(w.records), dtype=np.uint64)
            done = self.backlog.acks.done_mask(writer, seqs)
            assert done.tolist() == [(writer, s) in self.model.acked for s in range(len(w.records))]


BacklogMachine.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
TestBacklogModel = pytest.mark.timeout(120)(BacklogMachine.TestCase)
