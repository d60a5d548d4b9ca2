"""The packer's numba kernels against the pure-Python reference model (shmbroker.pack.reference).

One consumer, no aging, both engine modes. The same calls (adds in chunks, a few decisions
between chunks, then a drain) go to a `Packer` and to a `ReferencePacker`; after every add the
sizes agree and after every decision the batches agree exactly: the keys taken in order, the keys
failed back in order (all "too_long"), the shape's model, family and length bounds; both end with
nothing left but items of another model, and the guard refused nothing.

Workloads: a few shared "system prompts" with tails, conversations (an item extending an earlier
one by a turn, or cut back to a prefix of one, so the trie grows deep, out of order and
path-compressed), declared prefixes, block_tokens 4/16/32, random contracts (max_input_len up to
700, so bands wider than one token and items failed back too long), padding tolerance 0, 1/16 or
1/2, now and then an item of another model. Hand-written cases pin the orders down literally,
including the ones random workloads rarely reach: the 64-failures cap, the sweep's second pass,
the inclusive tolerance bound, family listing at band resolution, the affine list before the
overflow list, the hint table's collisions.

Not compared (the model does not cover them): several consumers, aging, guard refusals (asserted
never to happen here), capacity limits.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shmbroker.pack import packer as packer_mod
from shmbroker.pack import shapes
from shmbroker.pack.contract import DEFAULT_STEP_TOKENS, LOOSE_FAMILY, Contract
from shmbroker.pack.packer import ConsumerSpec, Packer
from shmbroker.pack.policy import DEFAULT_PADDING_TOLERANCE
from shmbroker.pack.reference import FAILED_MAX, ReferencePacker
from shmbroker.pack.reference_index import LENGTH_MAX, NUM_BANDS, band_floor, band_of, hint_slots, out_band
from shmbroker.pack.shapes import shape_items
from shmbroker.pack.state import C_BAND

EXAMPLES = 50
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
OTHER_MODEL = 9  # items of a model the consumer does not serve


# ---- the twin -----------------------------------------------------------------------------

class Twin:
    """A Packer and a ReferencePacker fed the same calls, compared after each."""

    def __init__(self, contract: Contract, mode: str, capacity: int, tol: float = DEFAULT_PADDING_TOLERANCE,
                 block_tokens: int = 16, step_tokens: float = DEFAULT_STEP_TOKENS):
        self.contract = contract
        self.mode = mode
        self.block_tokens = block_tokens
        self.packer = Packer([ConsumerSpec("one", contract, mode)], capacity=capacity, nodes=3 * capacity + 16,
                             families=max(capacity, 16), tolerance=tol, step_tokens=step_tokens)
        self.ref = ReferencePacker(contract, mode, capacity=capacity, tolerance=tol, step_tokens=step_tokens)
        self.batches: list = []  # (keys, failed keys) of each decision, from the packer
        self.max_new = lambda key: 8  # max_new_tokens of each key (the order of generations)

    def add_items(self, items, first_key: int = 0) -> list:
        """items: (tokens, prefix_len, model); keys first_key, first_key + 1...; returns the keys."""
        if not items:
            return []
        tokens = [np.asarray(t, np.uint32) for t, _, _ in items]
        lengths = np.array([t.size for t in tokens], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        prefixes = np.array([p for _, p, _ in items], np.int64)
        models = np.array([m for _, _, m in items], np.int64)
        sh = shape_items(np.concatenate(tokens), offsets, prefixes, models, block_tokens=self.block_tokens)
        keys = []
        for i in range(len(items)):
            key = first_key + i
            fam, hashes, n, model = int(sh.families[i]), sh.blocks(i), int(lengths[i]), int(models[i])
            max_new, base = self.max_new(key), int(sh.bases[i])
            self.packer.add(key, 0.0, n, max_new, model, fam, hashes, base)
            self.ref.add(key, n, fam, hashes, model, max_new, base)
            assert len(self.packer) == len(self.ref)
            keys.append(key)
        return keys

    def decide(self):
        """One decision on both; the packer's batch as (keys, failed keys), or None."""
        got = self.packer.next_batch(0, 0.0)
        want = self.ref.next_batch()
        step = len(self.batches)
        if want is None:
            assert got is None, (step, got.handles.tolist(), got.failed)
            return None
        assert got is not None, (step, want)
        keys = [int(k) for k in got.handles]
        failed = [int(k) for k, _ in got.failed]
        assert {r for _, r in got.failed} <= {"too_long"}
        assert (keys, failed) == (list(want.handles), list(want.failed)), (step, keys, failed, want)
        s = got.shape
        assert (s.model, s.family, s.length_min, s.length_max) == \
            (self.contract.model, want.family, want.length_min, want.length_max), (step, s, want)
        assert len(self.packer) == len(self.ref)
        assert self.packer.guards[0].num_refusals == 0, self.packer.guards[0].refusals
        self.batches.append((keys, failed))
        return keys, failed

    def drain(self, limit: int = 10_000) -> list:
        out = []
        for _ in range(limit):
            got = self.decide()
            if got is None:
                return out
            out.append(got)
        raise AssertionError("never ran dry")


# ---- random workloads ---------------------------------------------------------------------

@st.composite
def scenarios(draw):
    """(contract, tol, block_tokens, items, schedule): schedule is [(items added, decisions after)]."""
    block_tokens = draw(st.sampled_from([4, 16, 32]), label="block_tokens")
    max_in = draw(st.one_of(st.integers(8, 160), st.integers(200, 700)), label="max_input_len")
    bs = draw(st.integers(1, 8), label="max_batch_size")
    bt = draw(st.integers(max_in, max_in * 8), label="max_batch_tokens")
    model = draw(st.sampled_from([0, 3]), label="model")
    tol = draw(st.sampled_from([DEFAULT_PADDING_TOLERANCE, 0.0, 0.5]), label="tol")
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1), label="seed"))  # token contents only
    systems = [rng.integers(0, 40, int(k)).tolist()
               for k in draw(st.lists(st.integers(1, 48), min_size=1, max_size=4), label="system lengths")]
    others = draw(st.booleans(), label="other-model items")
    longest_tail = max(240, max_in + max_in // 4)
    items: list = []
    schedule = []
    for _ in range(draw(st.integers(1, 6), label="chunks")):
        for _ in range(draw(st.integers(0, 16), label="chunk items")):
            kind = draw(st.sampled_from(["new", "new", "turn", "cut"] if items else ["new"]))
            if kind == "new":
                system = systems[draw(st.integers(0, len(systems) - 1))]
                tail_len = draw(st.one_of(st.integers(0, 24), st.integers(0, longest_tail)))
                tokens = system + rng.integers(0, 4, tail_len).tolist()  # tails share blocks too
                prefix = min(len(system), len(tokens)) if draw(st.booleans()) else 0
                m = OTHER_MODEL if others and draw(st.integers(0, 9)) == 0 else model
            else:  # of any earlier item, often one already served
                tokens, prefix, m = items[draw(st.integers(0, len(items) - 1))]
                if kind == "turn":  # the next turn of that conversation
                    tokens = tokens + rng.integers(0, 4, draw(st.integers(1, 3 * block_tokens))).tolist()
                else:  # an earlier turn, arriving late
                    tokens = tokens[:draw(st.integers(max(prefix, 1), len(tokens)))]
            items.append((tokens, prefix, m))
        schedule.append((len(items), draw(st.integers(0, 8), label="decisions")))
    return Contract(bs, bt, max_in, model), tol, block_tokens, items, schedule


def run_scenario(mode: str, scenario, spread: int = 1) -> Twin:
    """spread: the keys' max_new_tokens take `spread` values (1: all equal)."""
    contract, tol, block_tokens, items, schedule = scenario
    twin = Twin(contract, mode, max(len(items), 1), tol, block_tokens)
    twin.max_new = lambda key: 1 + (key * 7919) % spread * 3
    done = 0
    for hi, decisions in schedule:  # streaming: adds in chunks, decisions between them
        twin.add_items(items[done:hi], done)
        done = hi
        for _ in range(decisions):
            twin.decide()
    twin.drain()
    left = sum(1 for _, _, m in items if m != contract.model)
    assert len(twin.packer) == len(twin.ref) == left, "both end with only the items nobody serves"
    assert twin.packer.index.num_families == len(twin.ref.families)
    served = sorted(k for keys, failed in twin.batches for k in keys + failed)
    assert served == [k for k, (_, _, m) in enumerate(items) if m == contract.model], "each item exactly once"
    event("some failed" if any(f for _, f in twin.batches) else "none failed")
    event(f"{len(twin.batches) // 10 * 10}+ batches")
    return twin


@SETTINGS
@given(scenario=scenarios(), spread=st.sampled_from([1, 2, 7]))
def test_padded_kernels_match_the_reference(scenario, spread):
    run_scenario("padded", scenario, spread)


@SETTINGS
@given(scenario=scenarios(), spread=st.sampled_from([1, 2, 7]))
def test_packed_kernels_match_the_reference(scenario, spread):
    run_scenario("packed", scenario, spread)


# ---- the model's own pieces ---------------------------------------------------------------

def test_reference_constants_and_bands_are_the_packers():
    assert FAILED_MAX == packer_mod.FAILED_MAX
    assert NUM_BANDS == shapes.NUM_BANDS
    for n in list(range(1, 5000)) + [shapes.LENGTH_MAX, 1 << 20, (1 << 20) + 4097]:
        assert band_of(n) == shapes.band_of(n), n
    for b in range(0, NUM_BANDS, 7):
        assert band_floor(b) == shapes.band_floor(b), b
    assert LENGTH_MAX == shapes.LENGTH_MAX
    for m in list(range(0, 5000)) + [(1 << 31) - 1, 1 << 20, 3 << 19]:
        assert out_band(m) == shapes.out_band(m) < shapes.NUM_OUT_BANDS, m
    for capacity in (1, 16, 40_000, 100_000):
        p = Packer([ConsumerSpec("one", Contract(2, 100, 50))], capacity=capacity)
        assert hint_slots(capacity) == p.index.state.hint_keys.size


# ---- hand-written cases: the expected batches, literally -----------------------------------

SYS = list(range(100, 116))  # a 16-token system prompt: one block


def filler(n: int, salt: int) -> list:
    """n tokens, the first one naming salt: fillers of distinct salts share no block."""
    return [1000 + salt] + [(salt * 7 + i) % 40 for i in range(n - 1)]


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_oversized_items_fail_back_at_most_64_a_decision(mode):
    twin = Twin(Contract(4, 400, 50), mode, 80)
    # 70 items of 100 tokens (too long for max_input_len 50), then three of 20, one family
    twin.add_items([(SYS + filler(84, i), 0, 0) for i in range(70)] + [(SYS + filler(4, 100 + i), 0, 0) for i in range(3)])
    batches = twin.drain()
    assert batches[0] == ([], list(range(64)))
    assert batches[1] == ([70, 71, 72], list(range(64, 70)))
    assert len(batches) == 2


def test_padded_sweep_wraps_to_the_top_when_it_took_nothing_below_the_cursor():
    twin = Twin(Contract(4, 400, 50), "padded", 80)
    twin.add_items([(SYS + filler(84, i), 0, 0) for i in range(70)])  # 100 tokens: too long
    assert twin.decide() == ([], list(range(64)))  # the cap: the cursor stays on band 100
    twin.add_items([(SYS + filler(104, 200), 0, 0)], 70)  # 120 tokens, above the cursor
    assert twin.decide() == ([], list(range(64, 71)))  # band 100 and below took nothing: then the top
    assert twin.decide() is None


def test_padded_sweeps_down_from_the_top_band_with_a_tolerance_cut():
    """Descending bands, FIFO within a band, a cut where longest > (1 + 1/16) x shortest, the cursor
    kept on the band where a batch stopped; an item added above the cursor waits until the sweep has
    run off the bottom and starts again at the top."""
    twin = Twin(Contract(3, 1000, 150), "padded", 16)
    twin.max_new = lambda key: 1  # prefill only: the tolerance cuts the band (generating: see below)
    lengths = [50, 100, 52, 98, 60, 94, 200, 100, 53]
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate(lengths)])
    # top first: 200 is failed; 100, 100 (key 1 before key 7), 98; 94 would be a 4th item
    assert twin.decide() == ([1, 7, 3], [6])
    assert twin.ref.band == twin.packer.index.cons[0, C_BAND] == 94  # the cursor: where the batch stopped
    assert twin.decide() == ([5], [])  # 94, then 60: 94 > 1.0625 x 60
    twin.add_items([(SYS + filler(104, 20), 0, 0)], 9)  # 120 tokens, above the cursor
    assert twin.decide() == ([4], [])  # 60, then 53: 60 > 1.0625 x 53 = 56.3
    assert twin.decide() == ([8, 2, 0], [])  # 53, 52, 50: 53 <= 1.0625 x 50 = 53.125; off the bottom
    assert twin.ref.band == twin.packer.index.cons[0, C_BAND] == NUM_BANDS - 1
    assert twin.decide() == ([9], [])
    assert twin.decide() is None
    assert len(twin.packer) == 0


def test_padded_batch_is_cut_by_count_x_longest():
    twin = Twin(Contract(8, 300, 100), "padded", 16)
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate([90, 95, 92, 91, 94])])
    assert twin.drain() == [([1, 4, 2], []), ([3, 0], [])]  # 4 x 95 > 300; then 91 and 90


def test_padded_tolerance_bound_is_inclusive():
    twin = Twin(Contract(8, 10_000, 200), "padded", 8)
    twin.max_new = lambda key: 1  # prefill only
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate([63, 64, 68])])
    assert twin.drain() == [([2, 1], []), ([0], [])]  # 68 == 1.0625 x 64 goes; 68 > 1.0625 x 63 does not


def test_padded_generating_batches_group_by_max_new_within_the_contract_not_the_tolerance():
    """Items that generate (max_new > 1), whose tolerance band cannot fill the rectangle: the band
    widens past the tolerance, as far as count x longest allows; of the caps on input length (from
    the shortest candidate up, x (1 + tol) each), the batch is the one that keeps the most rows
    decoding (decode work over its longest max_new), taken longest max_new first, skipping items
    that do not fit. (A decode step priced at no prefill tokens: the family pays for its own
    rectangles, `test_a_family_that_does_not_pay_batches_loose` has the other side.)"""
    twin = Twin(Contract(4, 400, 200), "padded", 16, step_tokens=0.0)
    lengths = [40, 100, 60, 95, 45, 180]
    max_new = [100, 100, 98, 10, 99, 100]
    twin.max_new = lambda key: max_new[key]
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate(lengths)])
    # the band of 180 alone leaves room for another 180: widen.
    # longest max_new first, walk order (top down) among equals: 180, 100, 40, then 45, 60, 95.
    # caps 40: [0] (1 row); 45: [0, 4] (1.99); 60: [0, 4, 2] (2.97); 95: [0, 4, 2, 3] (3.07);
    # 100: [1, 0, 4, 2] (3.97, the best; 95 would be a 5th); 180: [5, 1] (2; 3 x 180 > 400)
    assert twin.decide() == ([1, 0, 4, 2], [])
    assert twin.drain() == [([5, 3], [])]  # 180 and 95: 2 x 180 <= 400
    # a band that fills the rectangle is not widened: 100, 100, 99 are more than 200 tokens hold,
    # so the batch is two of them, longest max_new first (99, then key 3's 100); the 100 left alone
    # could take another 100: widened, it shares a batch with 20 (whose max_new is the longest)
    twin = Twin(Contract(4, 200, 200), "padded", 16, step_tokens=0.0)
    twin.max_new = lambda key: [5, 9, 100, 7][key]
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate([100, 99, 20, 100])])
    assert twin.drain() == [([1, 3], []), ([2, 0], [])]
    # the same lengths prefill only: bands within 1/16, top down
    twin = Twin(Contract(4, 400, 200), "padded", 16)
    twin.max_new = lambda key: 1
    twin.add_items([(SYS + filler(n - 16, i), 0, 0) for i, n in enumerate(lengths)])
    assert twin.drain() == [([5], []), ([1, 3], []), ([2], []), ([4], []), ([0], [])]


def test_a_family_that_does_not_pay_batches_loose():
    """Families of one item never pay for a rectangle of their own: their items batch loose, from
    the lanes (highest output band first, each lane's bands top down, then the lower output bands
    from the batch's longest down), with family 0. A family that pays (4 items under a declared
    prefix of 40 tokens, one max_new: 3 x 40 >= 1600 x 0) is passed over, then batched alone."""
    twin = Twin(Contract(4, 400, 200), "padded", 16)
    lengths = [50, 120, 80, 150, 60, 30]
    max_new = [100, 90, 120, 8, 110, 9]  # output bands 14, 13, 14, 7, 14, 7
    prefix = list(range(300, 340))
    twin.max_new = lambda key: max_new[key] if key < 6 else 100
    twin.add_items([(list(range(1000 + 16 * i, 1016 + 16 * i)) + filler(n - 16, i), 0, 0)
                    for i, n in enumerate(lengths)] + [(prefix + filler(60, 10 + k), 40, 0) for k in range(4)])
    # band 14 top down: 100 x 4 (passed over: their family pays), 80, 60, 50; band 13 from the
    # longest a fourth row may be (400 // 4 = 100) down: nothing (120 is longer); band 7 from 100
    # down: 30, the fourth row (4 x 80 <= 400)
    assert twin.decide() == ([2, 4, 0, 5], [])
    # band 13: 120; band 7 from 400 // 2 down: 150 (2 x 150 <= 400)
    assert twin.decide() == ([1, 3], [])
    assert twin.decide() == ([6, 7, 8, 9], [])  # the paying family, alone
    assert twin.decide() is None
    # the shapes: loose batches have family 0 (LOOSE_FAMILY) and their own length bounds
    twin = Twin(Contract(4, 400, 200), "padded", 16)
    twin.max_new = lambda key: max_new[key]
    twin.add_items([(list(range(1000 + 16 * i, 1016 + 16 * i)) + filler(n - 16, i), 0, 0)
                    for i, n in enumerate(lengths)])
    got = twin.packer.next_batch(0, 0.0)
    assert [int(k) for k in got.handles] == [2, 4, 0, 5]
    assert (got.shape.family, got.shape.length_min, got.shape.length_max) == (LOOSE_FAMILY, 30, 80)


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_families_are_listed_by_their_shortest_band_floor(mode):
    """A family is in the overflow list when its lowest band starts above max_input_len: at band
    resolution, so a family of one 601-token item (band [600, 601]) is listed as fitting 600."""
    assert band_of(601) == band_of(600) and band_floor(band_of(601)) == 600
    twin = Twin(Contract(4, 4000, 600), mode, 8)
    twin.max_new = lambda key: 1  # prefill only: families of one item are batched alone, not loose
    fam = [list(range(200 + 16 * k, 216 + 16 * k)) for k in range(3)]  # a first block per family
    twin.add_items([(fam[0] + filler(84, 1), 0, 0), (fam[1] + filler(585, 2), 0, 0), (fam[2] + filler(684, 3), 0, 0)])
    assert twin.drain() == [([], [2]), ([0], []), ([], [1])]  # 700 (overflow), 100, then 601 (failed)


def conversation(turns: list, salt: int) -> list:
    """Token lists of a conversation: turn k is turn k-1 plus turns[k] tokens (after the system prompt)."""
    out, tokens = [], list(SYS)
    for k, n in enumerate(turns):
        tokens = tokens + filler(n, salt * 10 + k)
        out.append(tokens)
    return out


def test_packed_drains_a_conversation_parent_first_on_one_branch():
    """Root items first; branch A (listed first) depth-first, parents before children; then branch B.
    A branch left part-way is resumed by the next batch before any other branch."""
    twin = Twin(Contract(3, 10_000, 500), "packed", 16)
    a = conversation([16, 16, 16], 1)  # 32, 48, 64 tokens: blocks of 16, one trie node per turn
    b = conversation([16, 16], 2)
    # keys: 0 = the system prompt alone (a root item), 1 = A1, 2 = B1, 3 = A2, 4 = B2, 5 = A3
    twin.add_items([(SYS, 0, 0), (a[0], 0, 0), (b[0], 0, 0), (a[1], 0, 0), (b[1], 0, 0), (a[2], 0, 0)])
    assert twin.drain() == [([0, 1, 3], []), ([5, 2, 4], [])]


def test_packed_children_in_the_order_they_became_live():
    """Path compression: turn 4 arriving before turns 2 and 3 hangs under its deep block's node (its
    second block past the root: turn 2's end), made for it under the branch; turn 3, arriving later,
    hangs under that node too, after turn 4 (the order they became live); turn 2 finds its end node
    there, so it drains before both: a parent first, though it came last."""
    twin = Twin(Contract(8, 10_000, 500), "packed", 16)
    a = conversation([16, 16, 16, 16], 1)
    twin.add_items([(a[0], 0, 0), (a[3], 0, 0), (a[2], 0, 0), (a[1], 0, 0)])  # keys 0 = A1, 1 = A4, 2 = A3, 3 = A2
    assert twin.drain() == [([0, 3, 1, 2], [])]


def test_packed_prefers_the_branch_it_served_then_overflow_branches():
    """A drained branch's key is remembered: its next turn, added later, is claimed before branches
    that were listed earlier; a branch with an item too long comes next (it is failed, the rest
    taken); then the branches that fit, in listing order."""
    twin = Twin(Contract(2, 10_000, 100), "packed", 16)
    a = conversation([16, 16, 16], 1)
    b = conversation([16], 2)
    c = conversation([16, 200], 3)  # C2 is 232 tokens: too long
    twin.add_items([(a[0], 0, 0), (a[1], 0, 0)])  # 0 = A1, 1 = A2
    assert twin.decide() == ([0, 1], [])  # branch A, drained
    twin.add_items([(b[0], 0, 0), (a[2], 0, 0), (c[0], 0, 0), (c[1], 0, 0)], 2)  # 2 = B1, 3 = A3, 4 = C1, 5 = C2
    assert twin.decide() == ([3, 4], [5])  # A again (affine), then C (overflow); B1 would be a 3rd item
    assert twin.decide() == ([2], [])
    assert twin.decide() is None


def colliding_branches(slots: int) -> tuple:
    """Two one-block tails after SYS whose branch keys share their low bits (one hint-table slot)."""
    tails = [filler(16, 100 + i) for i in range(4000)]
    tokens = [SYS + t for t in tails]
    offsets = np.concatenate([[0], np.cumsum([len(t) for t in tokens])]).astype(np.int64)
    sh = shape_items(np.concatenate(tokens).astype(np.uint32), offsets, block_tokens=16)
    seen: dict = {}
    for i in range(len(tails)):
        slot = int(sh.blocks(i)[0]) % slots
        if slot in seen:
            return tails[seen[slot]], tails[i]
        seen[slot] = i
    raise AssertionError("no two keys share a slot")


def test_packed_hint_table_is_direct_mapped():
    """The hint table keeps one branch key a slot: a branch drained later whose key has the same low
    bits overwrites the first, whose next turn is then listed like any new branch (after Z), while a
    branch whose key is still there goes first."""
    twin = Twin(Contract(1, 10_000, 500), "packed", 16)
    x, y = colliding_branches(hint_slots(16))
    z = filler(16, 99)
    twin.add_items([(SYS + x, 0, 0)])  # 0 = X1
    assert twin.decide() == ([0], [])  # X drained: its key in the slot
    twin.add_items([(SYS + y, 0, 0)], 1)  # 1 = Y1
    assert twin.decide() == ([1], [])  # Y drained: its key overwrites X's
    twin.add_items([(SYS + z, 0, 0), (SYS + x + filler(16, 98), 0, 0)], 2)  # 2 = Z1, 3 = X2
    assert twin.drain() == [([2], []), ([3], [])]
    # X2 drained: X's key is back in the slot. Y2 is listed first, but Z2's branch is the consumer's
    twin.add_items([(SYS + y + filler(4, 96), 0, 0), (SYS + z + filler(4, 97), 0, 0)], 4)  # 4 = Y2, 5 = Z2
    assert twin.drain() == [([5], []), ([4], [])]


@pytest.mark.parametrize("mode, expected", [
    ("padded", [([], [1]), ([4], []), ([2], []), ([0], []), ([6], []), ([5, 3], [])]),
    ("packed", [([], [1]), ([0, 2], []), ([4, 6], []), ([3, 5], [])]),
])
def test_families_overflow_first_then_in_listing_order_each_until_empty(mode, expected):
    """Families are taken from the overflow list (shortest item too long) first, then from the fits
    list in listing order; the consumer keeps a family until it is empty, even as others arrive."""
    twin = Twin(Contract(2, 1000, 100), mode, 32)
    twin.max_new = lambda key: 1  # prefill only: padded batches are cut by the tolerance
    fam = [list(range(200 + 16 * k, 216 + 16 * k)) for k in range(3)]  # a first block per family
    twin.add_items([(fam[0] + filler(10, 1), 0, 0), (fam[1] + filler(150, 2), 0, 0),  # 26 and 166 tokens
                    (fam[0] + filler(20, 3), 0, 0), (fam[2] + filler(4, 4), 0, 0),  # 36, 20
                    (fam[0] + filler(30, 5), 0, 0)])  # 46
    batches = [twin.decide(), twin.decide()]
    twin.add_items([(fam[2] + filler(5, 6), 0, 0), (fam[0] + filler(40, 7), 0, 0)], 5)  # 21, 56
    assert batches + twin.drain() == expected


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_items_of_another_model_are_never_served(mode):
    twin = Twin(Contract(2, 1000, 100, model=1), mode, 8)
    twin.add_items([(SYS + filler(10, 1), 0, 0), (SYS + filler(10, 2), 0, 1), (SYS + filler(300, 3), 0, 0)])
    assert twin.drain() == [([1], [])]
    assert len(twin.packer) == len(twin.ref) == 2
