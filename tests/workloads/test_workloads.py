"""The Mooncake trace replayer (workloads/trace.py) and the seeded workload generator (workloads/synthetic.py)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from shmbroker.pack.shapes import shape_items
from shmbroker.workloads.synthetic import generate
from shmbroker.workloads.trace import TRACE_BLOCK_TOKENS, load

BT = TRACE_BLOCK_TOKENS
TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not TRACE.exists(),
                                 reason=f"Mooncake trace not found at {TRACE} (the shared traces folder is optional)")

# timestamp ms, input_length, output_length, hash_ids; blocks of 512, the last possibly partial
RECORDS = [
    {"timestamp": 0, "input_length": 3 * BT, "output_length": 7, "hash_ids": [1, 2, 3]},
    {"timestamp": 1500, "input_length": 2 * BT + 76, "output_length": 0, "hash_ids": [1, 2, 4]},
    {"timestamp": 2750, "input_length": 2 * BT, "output_length": 300, "hash_ids": [3, 5]},  # 3 first, not third
    {"timestamp": 4000, "input_length": BT + 188, "output_length": 1, "hash_ids": [1, 3]},  # 3 partial
    {"timestamp": 4001, "input_length": 100, "output_length": 12, "hash_ids": [6]},
]


def write_trace(path: Path, records, extra_lines=()) -> Path:
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def block(wl, row: int, k: int) -> np.ndarray:
    """Block k of item `row` (cut to the item's length)."""
    return wl.item(row)[k * BT : (k + 1) * BT]


@pytest.fixture
def small_trace(tmp_path):
    return write_trace(tmp_path / "trace.jsonl", RECORDS)


# ---------------------------------------------------------------- trace replay


def test_trace_lengths_times_and_outputs(small_trace):
    wl = load(small_trace)
    assert len(wl) == len(RECORDS)
    assert wl.lengths.tolist() == [r["input_length"] for r in RECORDS]
    assert wl.tokens.dtype == np.uint32
    assert wl.tokens.size == sum(r["input_length"] for r in RECORDS)
    assert wl.arrivals.tolist() == pytest.approx([0.0, 1.5, 2.75, 4.0, 4.001])  # ms -> s
    assert wl.max_new_tokens.tolist() == [7, 1, 300, 1, 12]  # output_length, at least 1
    assert wl.prefix_lens.tolist() == [0] * 5
    assert wl.models.tolist() == [0] * 5
    assert "trace.jsonl" in wl.name


def test_trace_equal_hash_ids_give_equal_blocks_wherever_they_appear(small_trace):
    wl = load(small_trace)
    # id 1 at position 0 of three items, id 2 at position 1 of two
    assert np.array_equal(block(wl, 0, 0), block(wl, 1, 0))
    assert np.array_equal(block(wl, 0, 0), block(wl, 3, 0))
    assert np.array_equal(block(wl, 0, 1), block(wl, 1, 1))
    # id 3: third block of item 0, first block of item 2
    assert block(wl, 0, 2).size == BT
    assert np.array_equal(block(wl, 0, 2), block(wl, 2, 0))


def test_trace_different_hash_ids_give_different_blocks(small_trace):
    wl = load(small_trace)
    full = {1: block(wl, 0, 0), 2: block(wl, 0, 1), 3: block(wl, 0, 2), 5: block(wl, 2, 1)}
    for a in full:
        for b in full:
            if a < b:
                assert not np.array_equal(full[a], full[b]), (a, b)
    # the partial blocks 4 and 6 are not the heads of other blocks either
    assert not np.array_equal(block(wl, 1, 2), full[3][:76])
    assert not np.array_equal(block(wl, 4, 0), full[1][:100])


def test_trace_partial_last_block_is_the_head_of_the_full_block_with_its_id(small_trace):
    wl = load(small_trace)
    partial = block(wl, 3, 1)  # id 3, 188 tokens
    assert partial.size == 188
    assert np.array_equal(partial, block(wl, 0, 2)[:188])


def test_trace_tokens_stay_below_the_vocabulary(small_trace):
    wl = load(small_trace, vocab=50)
    assert int(wl.tokens.max()) < 50
    assert len(np.unique(wl.tokens)) > 1


def test_trace_limit_keeps_the_first_items(small_trace):
    full = load(small_trace)
    head = load(small_trace, limit=2)
    assert len(head) == 2
    assert head.lengths.tolist() == full.lengths[:2].tolist()
    assert np.array_equal(head.tokens, full.tokens[: full.offsets[2]])
    assert len(load(small_trace, limit=100)) == len(RECORDS)


def test_trace_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "blank.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n\n   \n" + json.dumps(RECORDS[1]) + "\n")
    assert load(path).lengths.tolist() == [RECORDS[0]["input_length"], RECORDS[1]["input_length"]]


@pytest.mark.parametrize(
    "bad",
    [
        {"timestamp": 9, "output_length": 1, "hash_ids": [1]},  # no input_length
        {"timestamp": 9, "input_length": 10, "output_length": 1},  # no hash_ids
        {"timestamp": 9, "input_length": "ten", "output_length": 1, "hash_ids": [1]},
        {"timestamp": 9, "input_length": 2 * BT + 1, "output_length": 1, "hash_ids": [1, 2]},  # a block short
        {"timestamp": 9, "input_length": BT, "output_length": 1, "hash_ids": [1, 2]},  # a block too many
        {"timestamp": 9, "input_length": 0, "output_length": 1, "hash_ids": [1]},
        {"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": []},
    ],
)
def test_trace_malformed_line_names_file_and_line(tmp_path, bad):
    # line 3 is blank: line numbers count the file's lines
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps(RECORDS[1]) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=r"bad\.jsonl:4\b"):
        load(path)


def test_trace_line_that_is_not_json_names_file_and_line(tmp_path):
    path = write_trace(tmp_path / "junk.jsonl", RECORDS[:1], ["{not json"])
    with pytest.raises(ValueError, match=r"junk\.jsonl:2\b"):
        load(path)


@needs_trace
def test_mooncake_trace_blocks_and_hashes_follow_its_hash_ids():
    limit = 300
    records = []
    with open(TRACE) as fh:
        for line in fh:
            if line.strip():
                records.append(json.loads(line))
            if len(records) == limit:
                break
    wl = load(TRACE, limit=limit)
    assert len(wl) == limit
    assert wl.lengths.tolist() == [r["input_length"] for r in records]

    # equal ids give equal blocks; a partial block is the head of the full one
    full: dict[int, np.ndarray] = {}
    partial: list[tuple[int, np.ndarray]] = []
    for row, r in enumerate(records):
        for k, h in enumerate(r["hash_ids"]):
            b = block(wl, row, k)
            if b.size == BT:
                assert np.array_equal(full.setdefault(h, b), b), (row, k, h)
            else:
                partial.append((h, b))
    for h, b in partial:
        if h in full:
            assert np.array_equal(full[h][: b.size], b), h

    # shape_items' chained block hashes (the family key names the first block) are equal exactly where the ids are
    shapes = shape_items(wl.tokens, wl.offsets, block_tokens=BT)
    hashes_of_id: dict[int, set] = defaultdict(set)
    ids_of_hash: dict[tuple, set] = defaultdict(set)
    occurrences = 0
    for row, r in enumerate(records):
        num_full = r["input_length"] // BT
        keys = [("family", int(shapes.families[row]))] + [("block", int(x)) for x in shapes.blocks(row)]
        for k in range(num_full):
            hashes_of_id[r["hash_ids"][k]].add(keys[k])
            ids_of_hash[keys[k]].add(r["hash_ids"][k])
            occurrences += 1
    assert occurrences > len(hashes_of_id)  # the sample does repeat ids
    assert all(len(v) == 1 for v in hashes_of_id.values())
    assert all(len(v) == 1 for v in ids_of_hash.values())


# ---------------------------------------------------------------- the generator

GEN = {"num_families": 20}


def workload_fields(wl):
    return (wl.tokens, wl.offsets, wl.arrivals, wl.max_new_tokens, wl.prefix_lens, wl.models)


def family_of(wl, i: int) -> bytes:
    """Items of one family start with its system prompt (at least 16 random tokens)."""
    return wl.item(i)[:16].tobytes()


def test_generator_same_seed_same_workload():
    a, b = generate(300, seed=7, **GEN), generate(300, seed=7, **GEN)
    for x, y in zip(workload_fields(a), workload_fields(b)):
        assert np.array_equal(x, y)
    assert a.name == b.name


def test_generator_different_seeds_differ():
    a, b = generate(300, seed=7, **GEN), generate(300, seed=8, **GEN)
    assert not np.array_equal(a.offsets, b.offsets)
    assert not np.array_equal(a.tokens[:1000], b.tokens[:1000])
    assert not np.array_equal(a.arrivals, b.arrivals)


def test_generator_shapes_and_ranges():
    wl = generate(300, seed=3, vocab=1000, **GEN)
    assert len(wl) == 300
    assert wl.offsets[0] == 0 and wl.offsets[-1] == wl.tokens.size
    assert wl.tokens.dtype == np.uint32
    assert int(wl.tokens.max()) < 1000
    assert (wl.lengths >= 16 + 8).all()  # a system prompt and a user turn
    assert (wl.max_new_tokens >= 1).all()
    assert (wl.prefix_lens < wl.lengths).all()
    assert (wl.prefix_lens >= 0).all()


def extensions(wl) -> list[tuple[int, int]]:
    """(i, j), i < j, where item i is a strict prefix of item j."""
    items = [wl.item(i).tobytes() for i in range(len(wl))]
    return [(i, j) for j in range(len(items)) for i in range(j)
            if len(items[i]) < len(items[j]) and items[j].startswith(items[i])]


def test_generator_multi_turn_items_extend_an_earlier_item_of_their_family():
    wl = generate(300, seed=1, **GEN)
    pairs = extensions(wl)
    continued = {j for _, j in pairs}
    assert len(continued) > 30  # p_continue=0.45: many requests continue a conversation
    for i, j in pairs:
        assert family_of(wl, i) == family_of(wl, j)
        assert wl.models[i] == wl.models[j]
        assert wl.prefix_lens[i] == wl.prefix_lens[j]
        assert wl.lengths[j] >= wl.lengths[i] + 4 + 8  # the reply and a new user turn


def test_generator_without_continuation_has_no_multi_turn_items():
    wl = generate(300, seed=1, p_continue=0.0, **GEN)
    assert extensions(wl) == []


def test_generator_declared_prefix_is_shared_by_its_family():
    wl = generate(400, seed=2, **GEN)
    families: dict[bytes, list[int]] = defaultdict(list)
    for i in range(len(wl)):
        families[family_of(wl, i)].append(i)
    prompts = [wl.item(i).tobytes() for i in range(len(wl))]
    shared = 0
    for rows in families.values():
        p = int(wl.prefix_lens[rows[0]])
        assert all(int(wl.prefix_lens[r]) == p for r in rows)  # a family declares, or not, as one
        assert len({int(wl.models[r]) for r in rows}) == 1  # a family belongs to one model
        if p:
            # the declared prefix starts exactly the items of its family
            head = wl.item(rows[0])[:p].tobytes()
            assert {i for i, prompt in enumerate(prompts) if prompt.startswith(head)} == set(rows)
            shared += len(rows) > 1
    assert shared >= 2
    assert (wl.prefix_lens > 0).any() and (wl.prefix_lens == 0).any()  # about half the families declare


def test_generator_arrivals_are_poisson_and_non_decreasing():
    wl = generate(2000, seed=4, rate_per_second=50.0, **GEN)
    assert (np.diff(wl.arrivals) >= 0).all()
    assert wl.arrivals[0] > 0
    assert wl.arrivals[-1] == pytest.approx(2000 / 50.0, rel=0.1)


def test_generator_several_models():
    wl = generate(300, seed=5, num_models=3, **GEN)
    assert set(wl.models.tolist()) == {0, 1, 2}
    assert set(generate(300, seed=5, **GEN).models.tolist()) == {0}


def test_generator_head_is_a_prefix_of_the_workload():
    wl = generate(300, seed=6, **GEN)
    head = wl.head(10)
    assert len(head) == 10
    assert np.array_equal(head.tokens, wl.tokens[: wl.offsets[10]])
    assert np.array_equal(head.arrivals, wl.arrivals[:10])
    assert len(wl.head(10_000)) == 300


@pytest.mark.parametrize("kwargs", [{"num_items": 0}, {"num_items": -1}, {"num_items": 10, "num_families": 0},
                                    {"num_items": 10, "num_models": 0}])
def test_generator_invalid_arguments_raise(kwargs):
    with pytest.raises(ValueError):
        generate(**kwargs)


@pytest.mark.parametrize("name", ["templates", "chains", "oneoffs", "mixed"])
def test_workload_families_are_seeded_and_stop_within_their_caps(name):
    from shmbroker.workloads.families import generate_family

    a, b = generate_family(name, 300, seed=3), generate_family(name, 300, seed=3)
    assert len(a) == 300 and np.array_equal(a.tokens, b.tokens) and np.array_equal(a.real_new, b.real_new)
    assert np.all(a.real_new >= 1) and np.all(a.outputs <= a.max_new_tokens)
    assert np.all(a.lengths > 0) and np.all(np.diff(a.arrivals) >= 0)
    assert a.real_new.min() < a.max_new_tokens.max()  # some stop early
    assert np.array_equal(a.head(10).real_new, a.real_new[:10])
    with pytest.raises(ValueError):
        generate_family("nope", 10)
