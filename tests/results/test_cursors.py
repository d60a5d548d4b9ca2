"""The cursor file's entries (`Cursor`, `BehindEntry`), `CursorKeeper`'s entries, floor and trims,
`FarBehind`'s move of a name to its own log and back, and `ReplayPlans`: on real files."""

from __future__ import annotations

import json

import crc32c
import numpy as np

from shmbroker.frontdoor.registry import ProducerBook
from shmbroker.results.behind import BEHIND_DIR, FarBehind
from shmbroker.results.cursor_save import CursorKeeper
from shmbroker.results.delivery import BehindEntry, Cursor, Cursors
from shmbroker.results.log import CURSOR_FILE, FILE_BYTES_MIN, OffsetQueue, ResultsLog
from shmbroker.results.recipients import Recipients
from shmbroker.results.replay import ReplayPlans
from shmbroker.results.slots import C_MOVED, NUM_SLOTS
from shmbroker.ring.wire import encode_results, res_bytes

TOKENS = 60
RECORD = res_bytes(TOKENS)


def records(ids: np.ndarray) -> np.ndarray:
    """One ok result record of TOKENS tokens per item id, as a GPU batch holds them."""
    count = ids.size
    out = np.zeros(count * RECORD, np.uint8)
    zeros = np.zeros(count, np.uint32)
    done, at = encode_results(out, 0, ids, ids, zeros, zeros, np.ones(TOKENS * count, np.uint32),
                              np.arange(count + 1, dtype=np.int64) * TOKENS, 0, count)
    assert done == count and at == out.size
    return out


def _write_cursor_file(root, body: dict) -> None:
    root.mkdir(parents=True, exist_ok=True)
    doc = {**body, "crc32c": crc32c.crc32c(json.dumps(body, sort_keys=True).encode())}
    (root / CURSOR_FILE).write_text(json.dumps(doc))


def test_cursor_json_keeps_its_format_lists_with_a_fourth_element_for_a_name_far_behind(tmp_path):
    root = tmp_path / "results"
    body = {"floor": 7, "names": {"a": [10, "ring-a", 3], "b": [5, None, 0, {"dir": "0badc0de-0", "through": 90, "end": 40}]}}
    _write_cursor_file(root, body)
    cursors = Cursors(root)
    assert cursors.floor == 7 and not cursors.damaged
    assert cursors.names == {"a": Cursor(10, "ring-a", 3), "b": Cursor(5, None, 0, BehindEntry("0badc0de-0", 90, 40))}
    assert cursors.of("nobody") == Cursor(7, None, 0)
    assert not cursors.save(dict(cursors.names), 7)  # unchanged: not written
    names = {**cursors.names, "c": Cursor(12, "ring-c", 0)}
    assert cursors.save(names, 5)
    doc = json.loads((root / CURSOR_FILE).read_text())
    assert doc["floor"] == 5
    assert doc["names"] == {**body["names"], "c": [12, "ring-c", 0]}
    rest = {k: v for k, v in doc.items() if k != "crc32c"}
    assert doc["crc32c"] == crc32c.crc32c(json.dumps(rest, sort_keys=True).encode())
    assert Cursors(root).names == names  # read back as saved


def test_a_damaged_cursor_file_is_replaced_by_floor_0(tmp_path):
    root = tmp_path / "results"
    _write_cursor_file(root, {"floor": 3, "names": {"a": [1, None]}})  # an entry of two elements
    cursors = Cursors(root)
    assert cursors.damaged and cursors.floor == 0 and cursors.names == {}


class _Parts:
    """A results directory's collaborators as the Router wires them (no producer connected)."""

    def __init__(self, tmp_path, name_bytes: int):
        self.root = tmp_path / "results"
        self.log = ResultsLog(self.root, "never", FILE_BYTES_MIN)
        self.counters = np.zeros(NUM_SLOTS, np.int64)
        self.recipients = Recipients(str(tmp_path))
        self.cursors = Cursors(self.root)
        self.behind = FarBehind(self.root, self.log, name_bytes, self.counters, self.cursors.names)
        self.keeper = CursorKeeper(self.cursors, self.log, self.recipients, self.behind)

    def park(self, name: str, ids: np.ndarray) -> np.ndarray:
        at = self.log.append(records(ids))
        offsets = at + np.arange(ids.size, dtype=np.int64) * RECORD
        self.recipients.park(name, offsets)
        return offsets

    def close(self) -> None:
        self.log.close()
        self.behind.close()


def test_the_keeper_saves_each_parked_name_at_its_first_result_and_trims_the_log_below_the_floor(tmp_path):
    parts = _Parts(tmp_path, name_bytes=1 << 40)  # nobody is far behind
    base = ProducerBook(str(tmp_path)).assign("slow") << 40
    try:
        per_file = FILE_BYTES_MIN // RECORD + 1
        parts.park("gone", np.arange(per_file, dtype=np.uint64) + base)  # the first file
        queue = parts.recipients.parked["gone"]
        first = parts.park("slow", np.arange(per_file, dtype=np.uint64) + base)  # starts the second
        assert len(parts.log.files) >= 2
        entries = parts.keeper.entries()
        assert entries["slow"] == Cursor(int(first[0]), None, 0)
        assert entries["gone"] == Cursor(0, None, 0)
        assert parts.keeper.floor(entries) == 0
        queue.take_all()  # everything of "gone" read: its cursor is at the log's end
        parts.keeper.save()
        saved = Cursors(parts.root)
        assert saved.names["gone"] == Cursor(parts.log.end, None, 0)
        assert saved.floor == int(first[0])
        assert parts.log.files == [int(first[0])]  # the file wholly below the floor is gone
        assert not (parts.root / f"{0:020d}.log").exists()
    finally:
        parts.close()


def test_a_name_far_behind_moves_to_its_own_log_and_back_once_it_owes_nothing(tmp_path):
    parts = _Parts(tmp_path, name_bytes=64 * RECORD)
    base = ProducerBook(str(tmp_path)).assign("lazy") << 40
    ids = np.arange(200, dtype=np.uint64) + base
    try:
        parts.park("lazy", ids)
        parts.behind.rebalance(parts.keeper.entries(), parts.recipients)
        assert "lazy" in parts.behind and len(parts.behind) == 1
        assert parts.counters[C_MOVED] == 1
        own = parts.behind.log_of("lazy")
        assert own is not parts.log and parts.behind.log_of("other") is parts.log
        offsets = [int(x) for part in parts.recipients.parked["lazy"].peek_all() for x in part]
        assert offsets == (np.arange(ids.size) * RECORD).tolist()  # the same results, now in its own log
        assert [int(own.read(at, 16)[8:16].view(np.uint64)[0]) for at in offsets] == ids.tolist()
        assert parts.behind.behind_now() == (1, ids.size * RECORD)
        parts.keeper.save()
        entry = Cursors(parts.root).names["lazy"]
        assert entry.offset == 0 and entry.behind is not None
        assert entry.behind.through == parts.log.end and entry.behind.end == own.end
        assert parts.keeper.floor(parts.keeper.entries()) == parts.log.end  # the shared log owes it nothing
        parts.recipients.parked["lazy"].take_all()  # all of it read
        parts.behind.rebalance(parts.keeper.entries(), parts.recipients)
        assert "lazy" not in parts.behind and parts.behind.behind_now() == (0, 0)
        assert (parts.root / BEHIND_DIR / entry.behind.dir_name).is_dir()  # until the cursors stop naming it
        parts.keeper.save()
        assert Cursors(parts.root).names["lazy"].behind is None
        assert not (parts.root / BEHIND_DIR / entry.behind.dir_name).exists()
    finally:
        parts.close()


def test_replay_plans_drop_what_a_name_acknowledged_before_its_cursor(tmp_path):
    root = tmp_path / "results"
    _write_cursor_file(root, {"floor": 0, "names": {"a": [300, None, 0]}})
    plans = ReplayPlans(Cursors(root), frozenset())
    offsets = np.array([100, 200, 300, 400], np.int64)
    assert plans.mask("a", None, offsets).tolist() == [False, False, True, True]
    assert plans.mask("b", None, offsets).tolist() == [True] * 4  # no cursor: from the floor
    assert plans.mask(None, None, offsets).tolist() == [True] * 4  # an unknown producer: all


def test_an_offset_queue_replaced_holds_the_new_offsets_in_order():
    queue = OffsetQueue()
    queue.extend(np.arange(5, dtype=np.int64))
    queue.replace([np.array([7, 8], np.int64), np.array([9], np.int64)])
    assert len(queue) == 3 and [int(x) for part in queue.peek_all() for x in part] == [7, 8, 9]
