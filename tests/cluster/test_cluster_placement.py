"""Where an item goes in a cluster: its partition (cluster.partition) and the partition's owner (cluster.placement).

Partition: the numba kernels against `partition_reference` (built on the broker's own
`shape_items` hashes) on random items; the declared prefix honoured as the family key honours
it; items sharing their first key_blocks blocks kept together; items sharing only a system prompt
spread. Placement: hypothesis properties (every partition owned by a live node, determinism,
bounded loads when the greedy's condition holds, a fixed point, minimal movement on a join and
a leave against placing from scratch) and hand-computed cases.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shmbroker.cluster.partition import partition_of, partition_reference, partitions_of
from shmbroker.cluster.placement import assign, moved
from shmbroker.pack.shapes import shape_items

SETTINGS = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
NODE_NAMES = [f"node-{i}" for i in range(6)]


# ---- partition ------------------------------------------------------------------------------

@st.composite
def items(draw):
    """(tokens, prefix_len, model, key_blocks, block_tokens): few distinct tokens, so blocks repeat."""
    block_tokens = draw(st.integers(1, 24))
    n = draw(st.integers(1, 6 * block_tokens + 5))
    tokens = np.array(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)), np.uint32)
    prefix = draw(st.one_of(st.just(0), st.integers(0, n)))
    return tokens, prefix, draw(st.integers(0, 5)), draw(st.integers(0, 5)), block_tokens


@SETTINGS
@given(st.lists(items(), min_size=1, max_size=8), st.integers(1, 300))
def test_the_kernels_equal_the_reference(batch, num_partitions):
    for tokens, prefix, model, key_blocks, block_tokens in batch:
        expect = partition_reference(tokens, prefix, model, num_partitions, key_blocks=key_blocks,
                                     block_tokens=block_tokens)
        assert 0 <= expect < num_partitions
        assert partition_of(tokens, prefix, model, num_partitions, key_blocks=key_blocks,
                            block_tokens=block_tokens) == expect
    # many at once: one key depth and block size for the whole batch
    _, _, _, key_blocks, block_tokens = batch[0]
    offsets = np.zeros(len(batch) + 1, np.int64)
    np.cumsum([b[0].size for b in batch], out=offsets[1:])
    got = partitions_of(np.concatenate([b[0] for b in batch]), offsets, [b[1] for b in batch],
                        [b[2] for b in batch], num_partitions, key_blocks=key_blocks, block_tokens=block_tokens)
    assert got.tolist() == [partition_reference(b[0], b[1], b[2], num_partitions, key_blocks=key_blocks,
                                                block_tokens=block_tokens) for b in batch]


@SETTINGS
@given(items())
def test_key_blocks_zero_is_the_brokers_family_key(item):
    tokens, prefix, model, _, block_tokens = item
    fam = shape_items(tokens, np.array([0, tokens.size]), [prefix], [model], block_tokens=block_tokens).families[0]
    assert partition_of(tokens, prefix, model, 97, key_blocks=0, block_tokens=block_tokens) == int(fam) % 97


@SETTINGS
@given(st.integers(1, 4), st.integers(2, 16), st.integers(0, 40), st.data())
def test_items_sharing_key_blocks_blocks_stay_together(key_blocks, block_tokens, prefix, data):
    """Same root (declared prefix or first block) and same next key_blocks blocks: one partition, whatever follows."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    root = prefix if prefix else block_tokens
    head = rng.integers(0, 50_000, root + key_blocks * block_tokens).astype(np.uint32)
    parts = set()
    for _ in range(6):
        tail = rng.integers(0, 50_000, int(rng.integers(0, 3 * block_tokens))).astype(np.uint32)
        parts.add(partition_of(np.concatenate([head, tail]), prefix, 1, 128, key_blocks=key_blocks,
                               block_tokens=block_tokens))
    assert len(parts) == 1


def test_the_declared_prefix_is_the_root_whatever_its_length():
    """A declared prefix of any length is the root: the key is the block after it, as the family key's trie."""
    rng = np.random.default_rng(3)
    system = rng.integers(0, 50_000, 3000).astype(np.uint32)  # six blocks of system prompt, declared
    turn = rng.integers(0, 50_000, 512).astype(np.uint32)
    a = np.concatenate([system, turn, rng.integers(0, 50_000, 700).astype(np.uint32)])
    b = np.concatenate([system, turn, rng.integers(0, 50_000, 90).astype(np.uint32)])
    assert partition_of(a, 3000, 0, 128) == partition_of(b, 3000, 0, 128)
    # undeclared, the same items share their first key block (inside the system prompt) with every other
    others = [np.concatenate([system, rng.integers(0, 50_000, 600).astype(np.uint32)]) for _ in range(50)]
    assert len({partition_of(x, None, 0, 128) for x in others}) == 1
    assert len({partition_of(x, 3000, 0, 128) for x in others}) > 30


def test_work_sharing_only_a_first_block_spreads():
    """The trace's shape: every item shares its first block; conversations differ from the second on."""
    rng = np.random.default_rng(5)
    first = rng.integers(0, 50_000, 512).astype(np.uint32)
    convs = [np.concatenate([first, rng.integers(0, 50_000, 1500).astype(np.uint32)]) for _ in range(400)]
    parts = np.array([partition_of(c, None, 0, 128) for c in convs])
    assert np.unique(parts).size > 100  # 400 balls in 128 bins leave about 5 empty
    assert np.unique(partitions_of(np.concatenate(convs), np.arange(401) * 2012, num_partitions=128,
                                   key_blocks=0)).size == 1
    # items with no whole block past the first share nothing cacheable: spread by their own tokens
    short = [np.concatenate([first, rng.integers(0, 50_000, 100).astype(np.uint32)]) for _ in range(400)]
    assert np.unique([partition_of(s, None, 0, 128) for s in short]).size > 100


def test_bad_input_is_refused():
    tok = np.arange(10, dtype=np.uint32)
    with pytest.raises(ValueError, match="prefix_len"):
        partition_of(tok, 11, 0, 128)
    with pytest.raises(ValueError, match="num_partitions"):
        partition_of(tok, None, 0, 0)
    with pytest.raises(ValueError, match="key_blocks"):
        partition_of(tok, None, 0, 8, key_blocks=-1)
    with pytest.raises(ValueError, match="non-empty"):
        partition_of(np.empty(0, np.uint32), None, 0, 8)
    with pytest.raises(ValueError, match="offsets"):
        partitions_of(tok, np.array([0, 5, 3, 10]), num_partitions=8)
    with pytest.raises(ValueError, match="one value per item"):
        partitions_of(tok, np.array([0, 5, 10]), [0], num_partitions=8)


# ---- placement ------------------------------------------------------------------------------

weights_st = st.lists(st.one_of(st.just(0.0), st.floats(0, 1e6, allow_nan=False)), min_size=1, max_size=160)
nodes_st = st.lists(st.sampled_from(NODE_NAMES), min_size=1, max_size=5, unique=True)
epsilon_st = st.sampled_from([0.0, 0.05, 0.25, 1.0])


def loads(w, owners, nodes) -> dict:
    out = dict.fromkeys(nodes, 0.0)
    for p, node in enumerate(owners):
        out[node] += w[p]
    return out


def bound(w, nodes, epsilon) -> float:
    return (1 + epsilon) * sum(w) / len(nodes) * (1 + 1e-9)


def home(p: int, nodes) -> str:
    """Highest random weight, computed here from the docstring's definition."""
    return max(nodes, key=lambda n: hashlib.blake2b(p.to_bytes(4, "little") + n.encode(), digest_size=8).digest()[::-1])


@SETTINGS
@given(weights_st, nodes_st, epsilon_st, st.randoms(use_true_random=False))
def test_owners_are_live_deterministic_and_bounded(w, nodes, epsilon, rnd):
    owners = assign(w, nodes, epsilon=epsilon)
    assert len(owners) == len(w)
    assert set(owners) <= set(nodes)
    shuffled = nodes * 2
    rnd.shuffle(shuffled)
    assert assign(w, shuffled, epsilon=epsilon) == owners
    got = loads(w, owners, nodes)
    mean = sum(w) / len(nodes)
    assert max(got.values()) <= max(bound(w, nodes, epsilon), (mean + max(w)) * (1 + 1e-9))
    if max(w) <= epsilon * mean:  # the greedy's guarantee
        assert max(got.values()) <= bound(w, nodes, epsilon)


@SETTINGS
@given(weights_st, nodes_st, epsilon_st, st.lists(st.sampled_from(NODE_NAMES + [None]), max_size=160))
def test_with_current_owners_it_stays_bounded_and_is_a_fixed_point(w, nodes, epsilon, current):
    current = dict(enumerate(current[: len(w)]))
    owners = assign(w, nodes, epsilon=epsilon, current=current)
    assert owners == assign(w, nodes, epsilon=epsilon, current=current)  # deterministic with a current too
    assert set(owners) <= set(nodes)
    if max(w) <= epsilon * sum(w) / len(nodes):  # the greedy's guarantee holds whatever the current owners
        assert max(loads(w, owners, nodes).values()) <= bound(w, nodes, epsilon)
    if max(loads(w, owners, nodes).values()) <= bound(w, nodes, epsilon):
        assert assign(w, nodes, epsilon=epsilon, current=owners) == owners


@SETTINGS
@given(st.lists(st.floats(1, 2), min_size=40, max_size=160), nodes_st, st.sampled_from([0.1, 0.25, 1.0]),
       st.lists(st.sampled_from(NODE_NAMES), min_size=160, max_size=160))
def test_current_owners_over_their_bound_give_partitions_up(w, nodes, epsilon, current):
    """Even weights (the greedy's condition holds for enough partitions): bounded whatever the current owners."""
    owners = assign(w, nodes, epsilon=epsilon, current=current[: len(w)])
    if max(w) <= epsilon * sum(w) / len(nodes):
        assert max(loads(w, owners, nodes).values()) <= bound(w, nodes, epsilon)
    # everything on one live node: it keeps what it can hold and gives up the rest
    owners = assign(w, nodes, epsilon=epsilon, current=[nodes[0]] * len(w))
    kept = [p for p, n in enumerate(owners) if n == nodes[0]]
    assert sum(w[p] for p in kept) <= bound(w, nodes, epsilon)


@SETTINGS
@given(weights_st, st.lists(st.sampled_from(NODE_NAMES), min_size=2, max_size=5, unique=True), epsilon_st)
def test_a_leave_moves_only_the_dead_nodes_partitions(w, nodes, epsilon):
    before = assign(w, nodes, epsilon=epsilon)
    dead = nodes[-1]
    after = assign(w, nodes[:-1], epsilon=epsilon, current=before)
    ours = [p for p, n in enumerate(before) if n == dead]
    if max(loads(w, before, nodes).values()) <= bound(w, nodes, epsilon):
        assert moved(before, after) == ours
    assert set(ours) <= set(moved(before, after))
    assert set(moved(before, after)) - set(ours) <= set(moved(before, assign(w, nodes[:-1], epsilon=epsilon)))


@SETTINGS
@given(weights_st, st.lists(st.sampled_from(NODE_NAMES), min_size=2, max_size=5, unique=True), epsilon_st)
def test_a_join_moves_only_what_the_new_node_takes_or_what_no_longer_fits(w, nodes, epsilon):
    old, new = nodes[:-1], nodes[-1]
    before = assign(w, old, epsilon=epsilon)
    after = assign(w, nodes, epsilon=epsilon, current=before)
    got = loads(w, after, nodes)
    cap = bound(w, nodes, epsilon)
    for p in moved(before, after):
        assert after[p] == new or got[before[p]] + w[p] > cap, p
        if after[p] == new:
            assert home(p, nodes) == new or got[before[p]] + w[p] > cap


@SETTINGS
@given(st.integers(1, 200), st.lists(st.sampled_from(NODE_NAMES), min_size=2, max_size=6, unique=True))
def test_with_no_load_it_is_rendezvous_hashing_and_a_join_moves_exactly_the_new_nodes_homes(num_partitions, nodes):
    w = [0.0] * num_partitions
    before = assign(w, nodes[:-1])
    assert before == [home(p, nodes[:-1]) for p in range(num_partitions)]
    after = assign(w, nodes, current=before)
    assert after == assign(w, nodes)  # the same as from scratch: nothing moves but the new node's homes
    assert moved(before, after) == [p for p in range(num_partitions) if home(p, nodes) == nodes[-1]]


def test_hand_computed_bounded_loads():
    # bound = 4 per node: the two 3s cannot share a node, each takes a 1, whatever the hashes say
    owners = assign([3, 3, 1, 1], ["a", "b"], epsilon=0.0)
    assert sorted(loads([3, 3, 1, 1], owners, ["a", "b"]).values()) == [4, 4]
    assert owners[0] != owners[1]
    # a partition over the bound (5 > 4) goes to its home, the emptiest node; the rest go to the other node
    w = [5, 1, 1, 1]
    owners = assign(w, ["a", "b"], epsilon=0.0)
    assert owners[0] == home(0, ["a", "b"])
    assert owners[1:] == [{"a": "b", "b": "a"}[owners[0]]] * 3
    # hysteresis: a partition stays on a live owner that has room, even away from its home
    current = [home(p, ["a", "b"]) for p in range(8)]
    away = {"a": "b", "b": "a"}[current[2]]
    current[2] = away
    assert set(current) == {"a", "b"}  # both own something: neither is a joining node
    owners = assign([1] * 8, ["a", "b"], epsilon=1.0, current=current)
    assert owners == current
    # its owner gone (or unknown), it goes home
    current[2] = "gone"
    assert assign([1] * 8, ["a", "b"], epsilon=1.0, current=current)[2] == home(2, ["a", "b"])
    # a joining node (it owns nothing yet) takes its home partitions from a live owner with room
    assert assign([1] * 8, ["a", "b"], epsilon=1.0, current={2: away})[2] == home(2, ["a", "b"])


def test_placement_refuses_bad_input():
    with pytest.raises(ValueError, match="no live node"):
        assign([1.0], [])
    with pytest.raises(ValueError, match=">= 0"):
        assign([1.0, -1.0], ["a"])
    with pytest.raises(ValueError, match="epsilon"):
        assign([1.0], ["a"], epsilon=-0.1)
    with pytest.raises(ValueError, match="partition 5"):
        assign([1.0], ["a"], current={5: "a"})
    with pytest.raises(ValueError, match="node name"):
        assign([1.0], ["a", ""])
