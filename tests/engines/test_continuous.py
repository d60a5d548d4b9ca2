"""The continuous-batching model (engines/continuous.py) against small cases computed by hand.

Blocks are 4 tokens (pack/shapes.py: the family root, then a block per 4 tokens, the last one
possibly partial). COST makes every figure easy on paper: a step costs 1.0 when it only
prefills, 0.5 when anything decodes, plus 0.1 a decoding sequence and 0.01 a prefill token.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.engines.continuous import ContinuousSim
from shmbroker.engines.cost import SimCost
from shmbroker.engines.sim import SimEngine
from shmbroker.pack.shapes import shape_items

B = 4
COST = SimCost(batch_overhead_seconds=1.0, prefill_token_seconds=0.01, decode_step_seconds=0.5,
               decode_token_seconds=0.1)
P = list(range(1, 9))  # two blocks: the family root [0:4] and the block [4:8]


def run(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def shapes_of(*items):
    tokens = np.concatenate([np.asarray(t, np.uint32) for t in items])
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(t) for t in items], out=offsets[1:])
    return shape_items(tokens, offsets, block_tokens=B)


def engine(bs=8, bt=1000, cache=1 << 20, cost=COST) -> ContinuousSim:
    return ContinuousSim(bs, bt, cache, cost)


def add(eng, shapes, row, max_new, key=None):
    eng.add(row if key is None else key, shapes.sized_blocks(row), int(shapes.lengths[row]), max_new)


def drain(eng) -> list:
    """[(seconds, finished keys)] of every step until idle."""
    out = []
    for _ in range(10_000):
        if eng.idle:
            return out
        out.append(eng.step())
    raise AssertionError("never idle")


def test_one_item_alone_costs_what_the_batch_model_charges():
    shapes = shapes_of(P + run(100, 3))  # 11 tokens
    eng = engine()
    add(eng, shapes, 0, 3)
    steps = drain(eng)
    assert [s for s, _ in steps] == pytest.approx([1.0 + 0.11, 0.5 + 0.1, 0.5 + 0.1])
    assert [k for _, k in steps] == [[], [], [0]]
    batch = SimEngine("packed", cache_tokens=1 << 20, block_tokens=B, cost=COST).run(shapes, [0], [3])
    assert sum(s for s, _ in steps) == pytest.approx(batch.seconds)
    assert (eng.computed_tokens, eng.decode_tokens, eng.steps) == (11, 2, 3)
    assert (eng.hit_blocks, eng.queried_blocks) == (0, 3)


def test_prefill_is_chunked_within_the_token_budget_and_the_first_token_comes_with_the_last_chunk():
    shapes = shapes_of(P + run(100, 3))  # 11 tokens
    eng = engine(bt=5)
    add(eng, shapes, 0, 2)
    steps = drain(eng)
    # chunks 5, 5, 1 (the first token), then one decode step
    assert [s for s, _ in steps] == pytest.approx([1.05, 1.05, 1.01, 0.6])
    assert [k for _, k in steps] == [[], [], [], [0]]
    assert eng.scheduled_tokens == 11 + 1


def test_decodes_and_prefill_chunks_share_the_budget():
    shapes = shapes_of(run(10, 4), run(20, 8))
    eng = engine(bt=6)
    add(eng, shapes, 0, 3)  # A: 4 tokens, 2 decode steps after its prefill
    add(eng, shapes, 1, 1)  # B: 8 tokens, prefill only
    steps = drain(eng)
    # step 0: A prefills 4, B is admitted with the 2 tokens left; step 1: A decodes, B takes 5;
    # step 2: A decodes its last token, B its last prompt token (its first output): both finish
    assert [s for s, _ in steps] == pytest.approx([1.0 + 0.06, 0.5 + 0.1 + 0.05, 0.5 + 0.1 + 0.01])
    assert [k for _, k in steps] == [[], [], [1, 0]]
    assert eng.running_steps == 2 + 2 + 2
    assert eng.scheduled_tokens == 6 + 6 + 2


def test_max_batch_size_bounds_the_running_sequences():
    shapes = shapes_of(run(10, 4), run(20, 4))
    eng = engine(bs=1)
    add(eng, shapes, 0, 2)
    add(eng, shapes, 1, 1)
    assert (eng.running, eng.waiting) == (0, 2)
    s0, k0 = eng.step()
    assert (eng.running, eng.waiting, k0) == (1, 1, [])
    s1, k1 = eng.step()  # A decodes its last token; B waits for the slot
    assert k1 == [0] and eng.waiting == 1 and s1 == pytest.approx(0.6)
    s2, k2 = eng.step()
    assert k2 == [1] and s2 == pytest.approx(1.04) and eng.idle
    assert eng.step() == (0.0, [])


def test_running_sequences_are_bounded_by_the_token_budget_too():
    shapes = shapes_of(run(10, 1), run(20, 1), run(30, 1))
    eng = engine(bs=8, bt=2)
    for r in range(3):
        add(eng, shapes, r, 5)
    eng.step()
    assert (eng.running, eng.waiting) == (2, 1)


def test_a_later_item_hits_the_prefix_an_earlier_one_computed():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5))  # 11 and 13 tokens
    eng = engine()
    add(eng, shapes, 0, 1)
    assert eng.step() == (pytest.approx(1.11), [0])
    add(eng, shapes, 1, 1)
    seconds, keys = eng.step()
    assert keys == [1] and seconds == pytest.approx(1.0 + 0.05)  # root and [4:8] hit
    assert (eng.hit_blocks, eng.queried_blocks, eng.computed_tokens) == (2, 3 + 4, 11 + 5)
    assert eng.last_hits == {1: (2, 4)}


def test_an_item_admitted_in_the_same_step_hits_blocks_scheduled_before_it():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5))
    eng = engine()
    add(eng, shapes, 0, 1)
    add(eng, shapes, 1, 1)
    seconds, keys = eng.step()
    assert keys == [0, 1]
    assert eng.computed_tokens == 11 + 5 and eng.hit_blocks == 2
    assert seconds == pytest.approx(1.0 + 0.16)


def test_a_chunk_caches_only_the_blocks_it_completes():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5))
    eng = engine(bt=6)
    add(eng, shapes, 0, 1)
    add(eng, shapes, 1, 1)
    eng.step()  # item 0 schedules 6 tokens: the root [0:4] is complete, [4:8] is not
    assert eng.waiting == 1  # the budget is spent: item 1 is not admitted
    eng.step()  # item 0's last 5 tokens; item 1 admitted with 1 token: it hits root and [4:8]
    assert eng.hit_blocks == 2
    drain(eng)
    assert eng.computed_tokens == 11 + 5


def test_a_whole_prompt_cached_recomputes_its_last_token():
    shapes = shapes_of(P + run(100, 3))
    eng = engine()
    add(eng, shapes, 0, 1, key="a")
    add(eng, shapes, 0, 1, key="b")
    seconds, keys = eng.step()
    assert keys == ["a", "b"]
    assert eng.hit_blocks == 3 and eng.computed_tokens == 11 + 1
    assert seconds == pytest.approx(1.0 + 0.12)


def test_running_blocks_are_pinned_past_the_cache_size_and_released_tail_first():
    x = run(10, 8)  # two blocks
    shapes = shapes_of(x, x[:4] + run(50, 4))  # item 1 shares item 0's root block only
    eng = engine(cache=4)  # room for one block
    add(eng, shapes, 0, 4)
    eng.step()
    assert eng.cached_tokens == 8  # both of item 0's blocks, pinned, past the cache size
    add(eng, shapes, 1, 1)
    eng.step()  # item 1 hits the pinned root while item 0 decodes
    assert eng.hit_blocks == 1
    assert eng.cached_tokens == 8  # item 1's own block was evicted when it finished
    drain(eng)
    # item 0 released its last block first: it was evicted, the root stays
    assert eng.cached_tokens == 4
    add(eng, shapes, 0, 1, key="again")
    eng.step()
    assert eng.last_hits == {"again": (1, 2)}


def test_lru_evicts_the_least_recently_used_block():
    x, y, z = run(10, 4), run(20, 4), run(30, 4)
    shapes = shapes_of(x, y, z)
    eng = engine(cache=8)

    def computed(row: int) -> int:
        before = eng.computed_tokens
        add(eng, shapes, row, 1)
        drain(eng)
        return eng.computed_tokens - before

    assert [computed(r) for r in (0, 1, 0, 2, 0, 1)] == [4, 4, 1, 4, 1, 4]


def test_pooled_items_and_blocks_larger_than_the_cache_are_never_cached():
    shapes = shapes_of(run(10, 3), P + run(100, 3))  # item 0 is pooled (shorter than a block)
    eng = engine(cache=4)
    for r in (0, 0, 1):
        add(eng, shapes, r, 1)
        drain(eng)
    assert eng.hit_blocks == 0
    big = engine(cache=3)  # a 4-token block does not fit
    add(big, shapes, 1, 1)
    drain(big)
    assert big.cached_tokens == 3  # the partial last block only


def test_zero_cost_counts_without_time():
    shapes = shapes_of(P + run(100, 3))
    eng = engine(cost=SimCost(zero_cost=True))
    add(eng, shapes, 0, 4)
    assert [s for s, _ in drain(eng)] == [0.0] * 4
    assert eng.decode_tokens == 3 and eng.seconds == 0.0


def test_finishing_order_follows_the_outputs():
    shapes = shapes_of(run(10, 4), run(20, 4), run(30, 4))
    eng = engine()
    for r, m in ((0, 5), (1, 2), (2, 3)):
        add(eng, shapes, r, m)
    finished = [k for _, keys in drain(eng) for k in keys]
    assert finished == [1, 2, 0]
    assert eng.steps == 5 and eng.decode_tokens == 4 + 1 + 2


@pytest.mark.parametrize("args", [(0, 10, 10), (1, 0, 10), (1, 10, -1)])
def test_bad_sizes_raise(args):
    with pytest.raises(ValueError):
        ContinuousSim(*args, COST)
