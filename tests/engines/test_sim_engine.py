"""The simulated engine (engines/sim.py) against small cases computed by hand.

Blocks are 4 tokens, so every figure can be checked on paper. An item's
blocks (docs/design.md "Words", pack/shapes.py): the family root (its first block),
then one block per 4 tokens, the last one possibly partial. `P` is an 8-token
prefix: the root plus one block.
"""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.engines.cost import SimCost
from shmbroker.engines.sim import SimEngine
from shmbroker.pack.shapes import ItemShapes, shape_items

B = 4
BIG_CACHE = 1 << 20
P = list(range(1, 9))  # two blocks: the family root [0:4] and the block [4:8]
Q = list(range(501, 509))  # another family's two blocks
COST = SimCost(batch_overhead_seconds=1.0, prefill_token_seconds=0.01, decode_step_seconds=0.5,
               decode_token_seconds=0.1)


def run(start: int, n: int) -> list[int]:
    """n distinct tokens from `start` (distinct starts give distinct blocks)."""
    return list(range(start, start + n))


def shapes_of(*items: list[int], prefixes=None) -> ItemShapes:
    tokens = np.concatenate([np.asarray(t, np.uint32) for t in items])
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(t) for t in items], out=offsets[1:])
    return shape_items(tokens, offsets, prefixes, block_tokens=B)


def engine(mode: str, cache_tokens: int = BIG_CACHE, cost: SimCost = COST) -> SimEngine:
    return SimEngine(mode, cache_tokens=cache_tokens, block_tokens=B, cost=cost)


def ones(n: int) -> list[int]:
    return [1] * n


# ---------------------------------------------------------------- padded mode


def test_padded_computes_common_prefix_once_then_count_times_longest_suffix():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5), P + run(300, 6))  # 11, 13, 14 tokens
    cost = engine("padded").run(shapes, [0, 1, 2], ones(3))
    assert cost.items == 3
    assert cost.input_tokens == 11 + 13 + 14
    assert cost.prefix_tokens == 8
    assert cost.rect_tokens == 3 * 6  # count x longest suffix
    assert cost.padded_tokens == 3 * 6 - (3 + 5 + 6)
    assert cost.computed_tokens == 8 + 3 * 6
    assert cost.queried_blocks == 3 + 4 + 4  # root + [4:8] + the suffix blocks
    assert cost.hit_blocks == 2 * 2  # every item's two prefix blocks except the one computation


def test_padded_common_prefix_is_whole_blocks():
    # the items share 6 tokens, but only the root block [0:4] is common: [4:8] differs
    shapes = shapes_of(P[:6] + run(100, 4), P[:6] + run(200, 2))  # 10 and 8 tokens
    cost = engine("padded").run(shapes, [0, 1], ones(2))
    assert cost.prefix_tokens == 4
    assert cost.rect_tokens == 2 * 6
    assert cost.padded_tokens == 12 - (6 + 4)
    assert cost.computed_tokens == 4 + 12
    assert cost.hit_blocks == 1


def test_padded_keeps_one_block_of_an_item_that_is_all_prefix_outside_the_prefix():
    # item 0 is exactly the common prefix P: one block moves back into the suffixes
    shapes = shapes_of(P, P + run(100, 3))  # 8 and 11 tokens
    cost = engine("padded").run(shapes, [0, 1], ones(2))
    assert cost.prefix_tokens == 4
    assert cost.rect_tokens == 2 * 7
    assert cost.padded_tokens == 14 - (4 + 7)
    assert cost.computed_tokens == 4 + 14
    assert cost.hit_blocks == 1


def test_padded_single_item_batch_has_no_padding():
    shapes = shapes_of(P + run(100, 3))
    cost = engine("padded").run(shapes, [0], ones(1))
    assert cost.padded_tokens == 0
    assert cost.computed_tokens == 11
    assert cost.hit_blocks == 0
    assert cost.queried_blocks == 3


def test_padded_prefix_of_the_previous_batch_is_not_computed_again():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5), P + run(300, 2), P + run(400, 4),
                       Q + run(600, 1), Q + run(700, 2))
    eng = engine("padded")
    first = eng.run(shapes, [0, 1], ones(2))
    assert first.computed_tokens == 8 + 2 * 5
    assert first.hit_blocks == 2
    second = eng.run(shapes, [2, 3], ones(2))  # same common prefix P
    assert second.prefix_tokens == 8
    assert second.computed_tokens == 2 * 4  # the rectangle only
    assert second.padded_tokens == 2 * 4 - (2 + 4)
    assert second.hit_blocks == 2 * 2  # every item's prefix blocks are hits: count x cached
    assert second.queried_blocks == 3 + 3
    other = eng.run(shapes, [4, 5], ones(2))  # another family: nothing cached
    assert other.computed_tokens == 8 + 2 * 2
    assert other.hit_blocks == 2
    # only the previous batch's prefix is remembered: P was replaced by Q
    again = eng.run(shapes, [2, 3], ones(2))
    assert again.computed_tokens == 8 + 2 * 4
    assert again.hit_blocks == 2


def test_padded_partly_cached_prefix_computes_the_rest_once():
    r, s = run(50, 4), run(60, 4)
    shapes = shapes_of(P + r + run(100, 2), P + r + run(200, 3), P + s + run(300, 1), P + s + run(400, 2))
    eng = engine("padded")
    first = eng.run(shapes, [0, 1], ones(2))
    assert first.prefix_tokens == 12
    assert first.computed_tokens == 12 + 2 * 3
    # common prefix P + s: its first two blocks (P) are cached, the block s is computed once
    second = eng.run(shapes, [2, 3], ones(2))
    assert second.prefix_tokens == 12
    assert second.computed_tokens == 4 + 2 * 2
    assert second.hit_blocks == 2 * 2 + 1 * 1  # count x cached + (count - 1) x computed prefix blocks
    assert second.queried_blocks == 4 + 4


# ---------------------------------------------------------------- packed mode


def test_packed_computes_only_blocks_after_the_longest_cached_prefix():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5))
    eng = engine("packed")
    first = eng.run(shapes, [0], ones(1))
    assert first.computed_tokens == 11
    assert first.hit_blocks == 0
    assert first.queried_blocks == 3
    second = eng.run(shapes, [1], ones(1))
    assert second.computed_tokens == 5  # root and [4:8] hit; [8:12] and [12:13] computed
    assert second.hit_blocks == 2
    assert second.queried_blocks == 4
    assert (second.padded_tokens, second.rect_tokens, second.prefix_tokens) == (0, 0, 0)
    rerun = eng.run(shapes, [1], ones(1))
    assert rerun.computed_tokens == 0
    assert rerun.hit_blocks == 4


def test_packed_later_item_hits_blocks_an_earlier_item_of_the_batch_computed():
    shapes = shapes_of(P + run(100, 3), P + run(200, 5), P + run(300, 6))
    cost = engine("packed").run(shapes, [0, 1, 2], ones(3))
    assert cost.input_tokens == 38
    assert cost.computed_tokens == 11 + 5 + 6  # no padding, no recomputed prefix
    assert cost.hit_blocks == 2 + 2
    assert cost.queried_blocks == 11
    assert cost.padded_tokens == 0


def test_packed_partial_last_block_hits_only_an_identical_block():
    # item 1 extends item 0 by one token: its block [8:12] is not item 0's partial [8:11]
    shapes = shapes_of(P + run(100, 3), P + run(100, 4))
    cost = engine("packed").run(shapes, [0, 1], ones(2))
    assert cost.computed_tokens == 11 + 4
    assert cost.hit_blocks == 2


@pytest.mark.parametrize("cache_tokens", [2 * B, 2 * B + 3])  # both hold two blocks
def test_packed_lru_evicts_the_least_recently_used_block(cache_tokens):
    x, y, z = run(10, 4), run(20, 4), run(30, 4)  # one block each
    shapes = shapes_of(x, y, z)
    eng = engine("packed", cache_tokens=cache_tokens)

    def computed(row: int) -> int:
        return eng.run(shapes, [row], ones(1)).computed_tokens

    assert computed(0) == 4  # cache: x
    assert computed(1) == 4  # cache: x y
    assert computed(0) == 0  # a hit makes x the most recently used: y x
    assert computed(2) == 4  # z evicts y, not x: x z
    assert computed(0) == 0
    assert computed(1) == 4  # y was evicted: recomputed, evicting z: x y
    assert computed(2) == 4
    cost = eng.run(shapes, [2], ones(1))
    assert (cost.computed_tokens, cost.hit_blocks) == (0, 1)


def test_packed_without_cache_recomputes_everything():
    shapes = shapes_of(P + run(100, 3))
    cost = engine("packed", cache_tokens=0).run(shapes, [0, 0], ones(2))
    assert cost.computed_tokens == 2 * 11
    assert cost.hit_blocks == 0
    assert cost.queried_blocks == 6


def test_packed_item_longer_than_the_cache_is_recomputed_in_full():
    shapes = shapes_of(P + run(100, 8))  # four blocks, the cache holds two
    eng = engine("packed", cache_tokens=2 * B)
    assert eng.run(shapes, [0], ones(1)).computed_tokens == 16
    again = eng.run(shapes, [0], ones(1))
    assert again.computed_tokens == 16  # the root was evicted by the item's own later blocks
    assert again.hit_blocks == 0


def test_packed_prefix_hit_stops_at_the_first_miss():
    # With chained block hashes and an LRU, a block whose predecessor was evicted is always evicted
    # before it is looked up again, so the rule cannot be observed through shape_items: these shapes
    # give an item a cached block (22) after a missing one (99) directly.
    shapes = ItemShapes(
        families=np.array([11, 11], np.uint64),
        hash_offsets=np.array([0, 2, 4], np.int64),
        hashes=np.array([21, 22, 99, 22], np.uint64),
        lengths=np.array([12, 12], np.int64),
        models=np.zeros(2, np.int64),
        bases=np.array([4, 4], np.int64),
        block_tokens=B,
    )
    eng = engine("packed")
    assert eng.run(shapes, [0], ones(1)).computed_tokens == 12  # caches 11, 21, 22
    cost = eng.run(shapes, [1], ones(1))
    assert cost.hit_blocks == 1  # the root only: 22 is cached but follows the miss 99
    assert cost.computed_tokens == 8
    assert cost.queried_blocks == 3
    still = eng.run(shapes, [0], ones(1))
    assert (still.computed_tokens, still.hit_blocks) == (0, 3)


# ---------------------------------------------------------------- modeled seconds


def three_items() -> ItemShapes:
    return shapes_of(P + run(100, 3), P + run(200, 5), P + run(300, 6))


def test_seconds_formula():
    assert COST.seconds(100, 3, 7) == pytest.approx(1.0 + 0.01 * 100 + 0.5 * 3 + 0.1 * 7)
    assert SimCost().seconds(0, 0, 0) == pytest.approx(SimCost().batch_overhead_seconds)


def test_padded_seconds_step_for_the_longest_output_and_rows_stop_at_their_own():
    cost = engine("padded").run(three_items(), [0, 1, 2], [1, 3, 5])
    assert cost.computed_tokens == 26
    steps = 5 - 1  # the rectangle steps until its longest row stops; a row stops costing at its own end
    assert cost.seconds == pytest.approx(1.0 + 0.01 * 26 + 0.5 * steps + 0.1 * (0 + 2 + 4))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_rows_stop_at_their_real_output(mode):
    """An item that stops early (an EOS: `real_new` below its max_new_tokens) is charged its real
    length, and a batch whose rows all stopped ends: steps for the longest real output."""
    capped = engine(mode).run(three_items(), [0, 1, 2], [9, 9, 9], [1, 3, 5])
    assert capped.seconds == pytest.approx(engine(mode).run(three_items(), [0, 1, 2], [1, 3, 5]).seconds)


def test_packed_seconds_retire_each_sequence_at_its_own_output():
    cost = engine("packed").run(three_items(), [0, 1, 2], [1, 3, 5])
    assert cost.computed_tokens == 22
    assert cost.seconds == pytest.approx(1.0 + 0.01 * 22 + 0.5 * (5 - 1) + 0.1 * (0 + 2 + 4))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_no_decode_when_max_new_tokens_is_at_most_one(mode):
    cost = engine(mode).run(three_items(), [0, 1, 2], [0, 1, 0])  # 0 counts as 1: prefill gives the token
    assert cost.seconds == pytest.approx(1.0 + 0.01 * cost.computed_tokens)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_default_cost_matches_its_formula(mode):
    cost = SimEngine(mode, cache_tokens=BIG_CACHE, block_tokens=B).run(three_items(), [0, 1, 2], [2, 2, 9])
    default = SimCost()
    seq_steps = 1 + 1 + 8  # each row decodes until its own end, in either mode
    assert cost.seconds == pytest.approx(default.seconds(cost.computed_tokens, 8, seq_steps))


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_zero_cost_makes_every_batch_free(mode):
    eng = engine(mode, cost=SimCost(zero_cost=True))
    cost = eng.run(three_items(), [0, 1, 2], [1, 3, 5])
    assert cost.seconds == 0.0
    assert cost.computed_tokens == (26 if mode == "padded" else 22)  # the accounting is unchanged


# ---------------------------------------------------------------- arguments


@pytest.mark.parametrize("mode", ["rectangle", "", "PADDED"])
def test_invalid_mode_raises(mode):
    with pytest.raises(ValueError, match="mode"):
        SimEngine(mode, cache_tokens=BIG_CACHE, block_tokens=B)


@pytest.mark.parametrize(("cache_tokens", "block_tokens"), [(-1, B), (BIG_CACHE, 0)])
def test_invalid_sizes_raise(cache_tokens, block_tokens):
    with pytest.raises(ValueError):
        SimEngine("packed", cache_tokens=cache_tokens, block_tokens=block_tokens)


def test_packed_cache_capacity_counts_tokens_not_blocks():
    """A family root of a declared 100-token prefix is one block of 100 tokens: an 8-token cache holds none."""
    toks = np.concatenate([np.arange(100), np.arange(1000, 1100)]).astype(np.uint32)
    shapes = shape_items(toks, np.array([0, 100, 200]), np.array([100, 100]), block_tokens=4)
    engine = SimEngine("packed", cache_tokens=8, block_tokens=4)
    assert [engine.run(shapes, [r], [1]).computed_tokens for r in (0, 1, 0, 1)] == [100, 100, 100, 100]
    big = SimEngine("packed", cache_tokens=200, block_tokens=4)
    assert [big.run(shapes, [r], [1]).computed_tokens for r in (0, 1, 0, 1)] == [100, 100, 0, 0]


def test_padded_prefix_reuse_is_bounded_by_the_cache():
    """Two items sharing a 12-token prefix (3 blocks of 4), run twice: with no cache nothing is kept."""
    shared = np.arange(12, dtype=np.uint32)
    toks = np.concatenate([shared, [100, 101], shared, [200, 201]]).astype(np.uint32)
    shapes = shape_items(toks, np.array([0, 14, 28]), block_tokens=4)
    none = SimEngine("padded", cache_tokens=0, block_tokens=4)
    assert [none.run(shapes, [0, 1], [1, 1]).computed_tokens for _ in range(2)] == [12 + 2 * 2, 12 + 2 * 2]
    two_blocks = SimEngine("padded", cache_tokens=8, block_tokens=4)
    assert [two_blocks.run(shapes, [0, 1], [1, 1]).computed_tokens for _ in range(2)] == [16, 4 + 2 * 2]
