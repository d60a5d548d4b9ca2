"""The packing core (shmbroker.pack): the guard, contracts, shapes, and the packer's promises.

docs/design.md "Words" and "The packing index": every batch is shape-pure (one model,
one prefix family, padded engines within the padding tolerance) and packed to
its consumer's contract; items no consumer of their model can take come back
failed "too_long"; a consumer keeps its family until drained (no excess shape
switches); aging dispatches an item that has waited longer than
`max_wait_seconds`; the index is bounded and says so (`IndexFull`).
"""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from shmbroker.pack.contract import LOOSE_FAMILY, Batch, Contract, Shape
from shmbroker.pack.guard import Guard
from shmbroker.pack.index import IndexFull
from shmbroker.pack.packer import ConsumerSpec, Packer
from shmbroker.pack.policy import DEFAULT_PADDING_TOLERANCE
from shmbroker.pack.shapes import BAND_SUB, LENGTH_MAX, NUM_BANDS, band_floor, band_of, shape_items

FAST = settings(max_examples=30, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
TOL = DEFAULT_PADDING_TOLERANCE
VOCAB = 40  # a small vocabulary: distinct sequences still differ, equal ones are common



# ---- helpers -------------------------------------------------------------------------------

@dataclass
class Workload:
    """Items as token lists, with the shapes `shape_items` gives them."""

    tokens: list  # list[np.ndarray uint32]
    prefixes: np.ndarray
    models: np.ndarray
    arrivals: np.ndarray
    block_tokens: int
    max_new: np.ndarray | None = None  # max_new_tokens of each item; 8 each by default

    def __post_init__(self):
        lengths = np.array([t.size for t in self.tokens], np.int64)
        if self.max_new is None:
            self.max_new = np.full(lengths.size, 8, np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        flat = np.concatenate(self.tokens).astype(np.uint32) if self.tokens else np.zeros(0, np.uint32)
        self.shapes = shape_items(flat, offsets, self.prefixes, self.models, block_tokens=self.block_tokens)
        self.lengths = lengths

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, packer: Packer, i: int) -> None:
        packer.add(i, float(self.arrivals[i]), int(self.lengths[i]), int(self.max_new[i]), int(self.models[i]),
                   int(self.shapes.families[i]), self.shapes.blocks(i), int(self.shapes.bases[i]))


def make_workload(items, block_tokens: int, arrivals=None) -> Workload:
    """items: (tokens, prefix_len, model) triples."""
    tokens = [np.asarray(t, np.uint32) for t, _, _ in items]
    prefixes = np.array([p for _, p, _ in items], np.int64)
    models = np.array([m for _, _, m in items], np.int64)
    arrivals = np.zeros(len(items)) if arrivals is None else np.asarray(arrivals, np.float64)
    return Workload(tokens, prefixes, models, arrivals, block_tokens)


def roomy_packer(specs, n: int, **kw) -> Packer:
    """A packer with room for n items whatever their families and trie depths (3 nodes an item at most)."""
    return Packer(specs, capacity=max(n, 1), nodes=3 * max(n, 1) + 16, families=max(n, 16), **kw)


def drain(packer: Packer, clock=None, limit: int = 10_000) -> list:
    """next_batch for each consumer in turn until all return None; [(consumer, batch)].

    clock(round) gives `now` for a round (default 0). Every round that returns a batch must
    take something out of the packer (a refusal would not, and would loop)."""
    out = []
    for r in range(limit):
        now = 0.0 if clock is None else clock(r)
        got = False
        for c in range(len(packer.consumers)):
            before = len(packer)
            batch = packer.next_batch(c, now)
            if batch is None:
                continue
            got = True
            assert len(packer) == before - len(batch) - len(batch.failed), "the index lost or kept other items"
            assert len(batch) or batch.failed, "an empty batch (a refusal?) was returned"
            out.append((c, batch))
        if not got:
            return out
    raise AssertionError("the packer never ran dry")


def run_isolated(func: str, *args) -> subprocess.CompletedProcess:
    """Call this module's `func(*args)` in a fresh interpreter: a bug that corrupts the index's
    memory may crash the process instead of failing an assert, and must not take pytest with it."""
    code = f"import runpy; runpy.run_path({__file__!r})[{func!r}](*{args!r})"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def family_runs(batches, c: int) -> list:
    """Families of consumer c's non-empty batches, in order; a padded engine's loose rectangles hold
    no prefix (`loose.py`), so they are no family's run."""
    return [b.shape.family for d, b in batches if d == c and len(b) and b.shape.family != LOOSE_FAMILY]


def excess_switches(families: list) -> int:
    switches = sum(1 for a, b in zip(families, families[1:]) if a != b)
    return switches - max(len(set(families)) - 1, 0)


# ---- 1. the guard ----------------------------------------------------------------------------

F, G = 0x1234_5678_9ABC_DEF0, 0x0FED_CBA9_8765_4321
GUARD_CONTRACT = Contract(max_batch_size=4, max_batch_tokens=1000, max_input_len=300, model=7)
GUARD_SHAPE = Shape(model=7, family=F, length_min=100, length_max=120)


def _cols(lengths, families=None, models=None):
    n = len(lengths)
    fams = np.array([F] * n if families is None else families, np.uint64)
    mods = np.array([7] * n if models is None else models, np.int64)
    return fams, mods, np.array(lengths, np.int64)


GUARD_CASES = [
    ("empty", _cols([]), GUARD_SHAPE),
    ("family", _cols([100, 101], families=[F, G]), GUARD_SHAPE),
    ("model", _cols([100, 101], models=[7, 8]), GUARD_SHAPE),
    ("band", _cols([100, 107]), GUARD_SHAPE),  # 107 > (1 + 1/16) x 100
    ("band", _cols([100, 104]), Shape(7, F, 101, 120)),  # an item below the shape's band
    ("count", _cols([100] * 5), GUARD_SHAPE),
    ("tokens", _cols([260, 250, 255, 251]), Shape(7, F, 250, 300)),  # 4 x 260 > 1000
    ("too_long", _cols([100, 301]), Shape(7, F, 100, 400)),
]


@pytest.mark.parametrize("reason, cols, shape", GUARD_CASES, ids=[f"{c[0]}{i}" for i, c in enumerate(GUARD_CASES)])
def test_guard_refuses_with_reason_and_counts(reason, cols, shape):
    guard = Guard(TOL)
    assert guard.check(*cols, shape, GUARD_CONTRACT) == reason
    assert guard.refusals == {reason: 1}
    assert guard.num_refusals == 1


def test_guard_counts_every_refusal_and_passes_pure_batches():
    guard = Guard(TOL)
    for reason, cols, shape in GUARD_CASES:
        assert guard.check(*cols, shape, GUARD_CONTRACT) == reason
    # pure batches: one family, one model, within contract and tolerance
    assert guard.check(*_cols([100, 106, 103, 104]), GUARD_SHAPE, GUARD_CONTRACT) is None
    assert guard.check(*_cols([120]), GUARD_SHAPE, GUARD_CONTRACT) is None
    assert guard.check(*_cols([250, 250, 250, 250]), Shape(7, F, 250, 250), GUARD_CONTRACT) is None
    expected = {}
    for reason, _, _ in GUARD_CASES:
        expected[reason] = expected.get(reason, 0) + 1
    assert dict(guard.refusals) == expected
    assert guard.num_refusals == len(GUARD_CASES)


def test_guard_takes_a_loose_rectangle_only_on_a_padded_engine_and_only_of_generating_rows():
    loose = Shape(7, LOOSE_FAMILY, 100, 200)

    def batch(max_new):
        return Batch.of(0, loose, np.arange(3), [100, 150, 200], max_new, families=np.array([F, G, F], np.uint64))

    assert Guard(TOL).check_batch(batch([8, 2, 30]), GUARD_CONTRACT) is None  # any families, any spread
    assert Guard(TOL).check_batch(batch([8, 1, 30]), GUARD_CONTRACT) == "family"  # a prefill-only row
    assert Guard(None).check_batch(batch([8, 2, 30]), GUARD_CONTRACT) == "family"  # a packed engine's group
    assert Guard(TOL).check_batch(Batch.of(0, loose, np.arange(4), [260, 250, 255, 251], [8] * 4,
                                           families=np.array([F, G, F, G], np.uint64)), GUARD_CONTRACT) == "tokens"


def test_guard_of_a_packed_engine_does_not_bound_count_x_longest():
    rect = ("tokens", _cols([260, 250, 255, 251]), Shape(7, F, 250, 300))  # 4 x 260 > 1000
    assert Guard(None).check(*rect[1], rect[2], GUARD_CONTRACT) is None  # a packed consumer's guard
    assert Guard(None, "packed").check(*rect[1], rect[2], GUARD_CONTRACT) is None
    assert Guard(None, "padded").check(*rect[1], rect[2], GUARD_CONTRACT) == "tokens"
    assert Guard(TOL).check(*rect[1], rect[2], GUARD_CONTRACT) == "tokens"
    packed = Guard(None)
    assert packed.check(*_cols([100] * 5), GUARD_SHAPE, GUARD_CONTRACT) == "count"  # count still bounds it
    assert packed.check(*_cols([301]), Shape(7, F, 1, 400), GUARD_CONTRACT) == "too_long"
    with pytest.raises(ValueError, match="mode"):
        Guard(None, "rectangle")


def test_guard_without_tolerance_takes_any_spread_and_checks_in_order():
    packed = Guard(None)  # a packed engine: no padding bound
    assert packed.check(*_cols([1, 300]), Shape(7, F, 1, 300), GUARD_CONTRACT) is None
    assert packed.num_refusals == 0
    # the first failing check is the reason: count before family, too_long before tokens
    assert packed.check(*_cols([100] * 5, families=[F, G, F, G, F]), GUARD_SHAPE, GUARD_CONTRACT) == "count"
    assert packed.check(*_cols([301] * 4), Shape(7, F, 1, 400), GUARD_CONTRACT) == "too_long"
    assert dict(packed.refusals) == {"count": 1, "too_long": 1}


# ---- 2. contracts ---------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, field", [
    ({"max_batch_size": 0}, ValueError, "max_batch_size"),
    ({"max_batch_size": -3}, ValueError, "max_batch_size"),
    ({"max_batch_tokens": 0}, ValueError, "max_batch_tokens"),
    ({"max_batch_tokens": -1}, ValueError, "max_batch_tokens"),
    ({"max_input_len": 0}, ValueError, "max_input_len"),
    ({"max_input_len": -512}, ValueError, "max_input_len"),
    ({"model": -1}, ValueError, "model"),
    ({"model": 1 << 32}, ValueError, "model"),
    ({"max_batch_size": 4.0}, TypeError, "max_batch_size"),
    ({"max_batch_size": True}, TypeError, "max_batch_size"),
    ({"max_batch_tokens": "4096"}, TypeError, "max_batch_tokens"),
    ({"max_input_len": 512.5}, TypeError, "max_input_len"),
    ({"max_input_len": None}, TypeError, "max_input_len"),
    ({"model": 1.0}, TypeError, "model"),
    ({"max_input_len": 4097}, ValueError, "max_input_len"),  # > max_batch_tokens
    ({"max_batch_tokens": 1 << 25, "max_input_len": LENGTH_MAX + 1}, ValueError, "max_input_len"),
])
def test_contract_rejects_bad_values_naming_the_field(kwargs, error, field):
    args = {"max_batch_size": 8, "max_batch_tokens": 4096, "max_input_len": 512, "model": 0} | kwargs
    with pytest.raises(error, match=rf"\b{field}\b"):
        Contract(**args)


def test_contract_input_len_over_batch_tokens_names_both_fields():
    with pytest.raises(ValueError) as info:
        Contract(max_batch_size=8, max_batch_tokens=1000, max_input_len=1001)
    assert "max_input_len" in str(info.value) and "max_batch_tokens" in str(info.value)


def test_contract_accepts_numpy_integers_and_fits():
    c = Contract(np.int64(4), np.int32(1000), np.int64(1000), np.uint32(3))
    assert c.fits(1, 1000) and c.fits(4, 250)
    assert not c.fits(0, 10) and not c.fits(5, 1) and not c.fits(4, 251) and not c.fits(1, 1001)


# ---- 8. shapes (before the packer: the packer's tests rely on them) --------------------------

def _full_chain(ws: Workload, i: int) -> list:
    """Family key, then block hashes: one hash per block of tokens (the first block under the key)."""
    return [int(ws.shapes.families[i])] + [int(h) for h in ws.shapes.blocks(i)]


@FAST
@given(data=st.data(), block_tokens=st.sampled_from([1, 4, 16]))
def test_equal_prefixes_equal_leading_hashes_and_a_change_propagates(data, block_tokens):
    common = data.draw(st.lists(st.integers(0, VOCAB), min_size=0, max_size=70), label="common")
    tail_a = data.draw(st.lists(st.integers(0, VOCAB), max_size=40), label="tail_a")
    tail_b = data.draw(st.lists(st.integers(0, VOCAB), max_size=40), label="tail_b")
    if tail_a and tail_b and tail_a[0] == tail_b[0]:
        tail_b[0] = (tail_b[0] + 1) % (VOCAB + 1)
    a, b = common + tail_a, common + tail_b
    assume(a and b)
    ws = make_workload([(a, 0, 0), (b, 0, 0)], block_tokens)
    # first differing position (or the shorter's end when one is a prefix of the other)
    d = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    chain_a, chain_b = _full_chain(ws, 0), _full_chain(ws, 1)
    assert len(chain_a) == -(-len(a) // block_tokens) and len(chain_b) == -(-len(b) // block_tokens)
    same = d // block_tokens  # blocks wholly inside the common prefix
    if len(a) == len(b) and d == len(a):
        same = len(chain_a)  # identical items
    # an item shorter than one block (no declared prefix) is in its model's pool: its root is the pool's
    pooled_a, pooled_b = len(a) < block_tokens, len(b) < block_tokens
    for j in range(min(len(chain_a), len(chain_b))):
        expected = (pooled_a and pooled_b) if j == 0 and (pooled_a or pooled_b) else j < same
        assert (chain_a[j] == chain_b[j]) == expected, (j, same)


def test_short_items_without_a_declared_prefix_share_their_models_pool():
    short = make_workload([([1, 2, 3], 0, 0), ([9, 8], 0, 0), ([1, 2, 3], 0, 5), (list(range(20)), 0, 0)], 16)
    chains = [_full_chain(short, i) for i in range(4)]
    assert chains[0][0] == chains[1][0]  # two short items of model 0: one pool
    assert chains[2][0] != chains[0][0]  # another model, another pool
    assert chains[3][0] != chains[0][0]  # a full first block is a family of its own


def test_a_token_changed_in_block_k_changes_hashes_from_k_on():
    rng = np.random.default_rng(7)
    base = rng.integers(0, 1000, 16 * 6, dtype=np.uint32)
    items = [(base, 0, 0)]
    for k in range(6):
        t = base.copy()
        t[16 * k + 5] += 1
        items.append((t, 0, 0))
    ws = make_workload(items, 16)
    ref = _full_chain(ws, 0)
    assert len(ref) == 6 and len(set(ref)) == 6
    for k in range(6):
        got = _full_chain(ws, k + 1)
        assert got[:k] == ref[:k]
        assert all(g != r for g, r in zip(got[k:], ref[k:]))
    # the model seeds the chain: same tokens for another model are another family
    other = make_workload([(base, 0, 1)], 16)
    assert int(other.shapes.families[0]) != ref[0] and set(_full_chain(other, 0)).isdisjoint(ref)


def test_declared_prefix_groups_items_into_one_family_beyond_a_block():
    rng = np.random.default_rng(11)
    system = rng.integers(0, 1000, 100, dtype=np.uint32)  # a 100-token system prompt, blocks of 16
    tails = [rng.integers(0, 1000, n, dtype=np.uint32) for n in (0, 1, 15, 16, 17, 90)]
    tails[4][:16] = tails[3]  # tails[3] is a prefix of tails[4]
    items = [(np.concatenate([system, t]), 100, 0) for t in tails]
    altered = system.copy()
    altered[60] += 1  # the same first block, another system prompt
    items.append((np.concatenate([altered, tails[2]]), 100, 0))
    items.append((np.concatenate([system, tails[2]]), 0, 0))  # undeclared
    items.append((np.concatenate([system, tails[3]]), 0, 0))  # undeclared
    ws = make_workload(items, 16)
    fams = [int(f) for f in ws.shapes.families]
    assert len(set(fams[:6])) == 1, "one declared prefix, one family"
    assert fams[6] != fams[0], "a token changed inside the declared prefix is another family"
    assert fams[7] != fams[0] and fams[7] == fams[8], "undeclared: the family is the first block's"
    for i, t in enumerate(tails):
        assert ws.shapes.bases[i] == 100
        assert ws.shapes.blocks(i).size == -(-t.size // 16), "blocks are cut after the declared prefix"
    # after the declared prefix, items with equal tails' leading blocks share those hashes
    assert int(ws.shapes.blocks(3)[0]) == int(ws.shapes.blocks(4)[0])
    assert int(ws.shapes.blocks(2)[0]) != int(ws.shapes.blocks(6)[0])  # another family's chain


def test_shape_items_rejects_bad_input():
    with pytest.raises(ValueError, match="block_tokens"):
        shape_items(np.zeros(4, np.uint32), np.array([0, 4]), block_tokens=0)
    with pytest.raises(ValueError, match="lengths"):
        shape_items(np.zeros(4, np.uint32), np.array([0, 0, 4]))
    with pytest.raises(ValueError, match="prefix_len"):
        shape_items(np.zeros(4, np.uint32), np.array([0, 4]), prefixes=np.array([5]))


def test_band_floor_and_band_of_round_trip():
    floors = [int(band_floor(b)) for b in range(NUM_BANDS)]
    assert floors[:BAND_SUB] == list(range(BAND_SUB)), "exact below 256"
    assert all(x < y for x, y in zip(floors, floors[1:])), "bands are ordered"
    for b, lo in enumerate(floors):
        assert band_of(lo) == b
        if b + 1 < NUM_BANDS:
            assert band_of(floors[b + 1] - 1) == b, "a band ends where the next starts"
    assert band_of(LENGTH_MAX) == NUM_BANDS - 1
    assert floors[-1] <= LENGTH_MAX


@FAST
@given(n=st.one_of(st.integers(1, 4096), st.integers(1, LENGTH_MAX)))
def test_band_of_n_contains_n_and_is_narrow(n):
    b = int(band_of(n))
    lo = int(band_floor(b))
    hi = int(band_floor(b + 1)) - 1 if b + 1 < NUM_BANDS else LENGTH_MAX
    assert lo <= n <= hi
    if n < BAND_SUB:
        assert lo == hi == n
    else:
        assert hi - lo + 1 <= n / BAND_SUB, "width at most n/256"
        assert hi <= lo * (1 + 1 / BAND_SUB)


# ---- 3. the packer over random workloads -----------------------------------------------------

@st.composite
def contracts(draw):
    n = draw(st.integers(1, 3))
    specs = []
    for i in range(n):
        max_in = draw(st.integers(8, 160))
        bs = draw(st.integers(1, 8))
        bt = draw(st.integers(max_in, max_in * 8))
        model = draw(st.sampled_from([0, 1]))
        mode = draw(st.sampled_from(["padded", "packed"]))
        specs.append(ConsumerSpec(f"c{i}", Contract(bs, bt, max_in, model), mode))
    return specs


@st.composite
def workloads(draw, models):
    """Items built from a few shared "system prompts" plus tails; some declare the prompt as prefix_len."""
    block_tokens = draw(st.sampled_from([4, 16, 32]))
    systems = draw(st.lists(st.lists(st.integers(0, VOCAB), min_size=1, max_size=48), min_size=1, max_size=4))
    n = draw(st.integers(1, 60))
    items = []
    for _ in range(n):
        system = draw(st.sampled_from(systems))
        tail_len = draw(st.one_of(st.integers(0, 24), st.integers(0, 240)))
        tail = draw(st.lists(st.integers(0, 3), min_size=tail_len, max_size=tail_len))  # tails share blocks too
        declare = draw(st.booleans())
        model = draw(st.sampled_from(models))
        tokens = system + tail
        items.append((tokens, min(len(system), len(tokens)) if declare else 0, model))
    arrivals = sorted(draw(st.lists(st.floats(0, 3), min_size=n, max_size=n)))
    return make_workload(items, block_tokens, arrivals)


def model_max(specs) -> dict:
    out = {}
    for s in specs:
        out[s.contract.model] = max(out.get(s.contract.model, 0), s.contract.max_input_len)
    return out


def check_drain(specs, ws: Workload, batches, packer: Packer, tol: float) -> None:
    """Every promise of a drained packer: contracts, purity, exactly once, failures, no refusals."""
    biggest = model_max(specs)
    seen: dict = {}
    for c, batch in batches:
        con = specs[c].contract
        keys = [int(k) for k in batch.handles]
        for k, reason in batch.failed:
            assert reason == "too_long"
            assert int(k) not in seen, f"item {k} came out twice"
            seen[int(k)] = "failed"
        if not keys:
            continue
        lengths = ws.lengths[keys]
        assert np.array_equal(batch.lengths, lengths)
        assert np.array_equal(batch.arrivals, ws.arrivals[keys])
        assert len(keys) <= con.max_batch_size
        if specs[c].mode == "padded":  # a rectangle; a packed engine's group is bounded by its count only
            assert len(keys) * lengths.max() <= con.max_batch_tokens
        assert lengths.max() <= con.max_input_len
        # shape-pure: one model (the consumer's), one family (by shape_items), one band; or a padded
        # engine's loose rectangle: rows of any families, every one generating (loose.py)
        assert set(ws.models[keys].tolist()) == {con.model}
        if batch.shape.family == LOOSE_FAMILY:
            assert specs[c].mode == "padded" and tol > 0 and (ws.max_new[keys] > 1).all()
        else:
            assert {int(ws.shapes.families[k]) for k in keys} == {batch.shape.family}
        assert batch.shape.model == con.model
        assert batch.shape.length_min <= lengths.min() and lengths.max() <= batch.shape.length_max
        # a padded batch's input band: within the tolerance for prefill-only work; a family that
        # generates is batched by its generations, its band bounded by count x longest (above)
        generates = batch.shape.family == LOOSE_FAMILY or (
            tol > 0 and ws.max_new[ws.shapes.families == batch.shape.family].max() > 1)
        if specs[c].mode == "padded" and not generates:
            assert lengths.max() <= (1 + tol) * lengths.min()
        for k in keys:
            assert k not in seen, f"item {k} came out twice"
            seen[k] = c
    assert sorted(seen) == list(range(len(ws))), "every item comes out exactly once"
    for k, where in seen.items():
        too_long = ws.lengths[k] > biggest[int(ws.models[k])]
        assert (where == "failed") == too_long, (k, where, ws.lengths[k])
    assert len(packer) == 0 and packer.index.tokens == 0
    assert packer.index.num_families == 0 and packer.index.num_nodes == 0
    for guard in packer.guards:
        assert guard.num_refusals == 0, guard.refusals


@settings(FAST, max_examples=40)
@given(data=st.data(), specs=contracts(), max_wait=st.sampled_from([None, None, 0.5, 2.0]),
       chunks=st.integers(1, 3), tol=st.sampled_from([TOL, 0.0, 0.5]))
def test_packer_drains_random_workloads_to_contract_and_shape(data, specs, max_wait, chunks, tol):
    models = sorted({s.contract.model for s in specs})
    ws = data.draw(workloads(models), label="workload")
    gen = data.draw(st.sampled_from(["prefill", "equal", "spread", "wide"]), label="max_new")
    wide = data.draw(st.lists(st.integers(0, 11), min_size=len(ws), max_size=len(ws)), label="wide")
    ws.max_new = {"prefill": np.ones(len(ws), np.int64), "equal": np.full(len(ws), 8, np.int64),
                  "spread": 1 + np.arange(len(ws), dtype=np.int64) * 7919 % 5 * 3,
                  "wide": 1 << np.array(wide, np.int64)}[gen]  # 1 to 2048: loose rectangles across output bands
    packer = roomy_packer(specs, len(ws), max_wait_seconds=max_wait, tolerance=tol)
    batches = []
    bounds = np.linspace(0, len(ws), chunks + 1).astype(int)
    for lo, hi in zip(bounds, bounds[1:]):  # add in chunks, a round of decisions between them
        for i in range(lo, hi):
            ws.add(packer, i)
        for c in range(len(specs)):
            batch = packer.next_batch(c, float(ws.arrivals[hi - 1]) if hi > lo else 0.0)
            if batch is not None:
                batches.append((c, batch))
    batches += drain(packer, clock=lambda r: 3.0 + 0.25 * r)
    check_drain(specs, ws, batches, packer, tol)
    event(f"modes: {'+'.join(sorted(s.mode for s in specs))}")
    event("some items failed back" if any(b.failed for _, b in batches) else "no item failed back")
    event(f"families: {'1' if len(set(ws.shapes.families.tolist())) == 1 else 'several'}")
    event("loose rectangles" if any(b.shape.family == LOOSE_FAMILY and len(b) for _, b in batches) else "no loose rectangle")


# ---- 4. oversized items ------------------------------------------------------------------

def check_oversized_fail_back(modes: tuple) -> None:
    """Two consumers of model 0 (max_input_len 100 and 150) and one of model 1 (150)."""
    rng = np.random.default_rng(3)
    system = list(rng.integers(0, 1000, 20))
    lengths = [30, 250, 90, 300, 60, 151, 150, 40, 400, 120, 99, 101] * 3
    items = [(system + list(rng.integers(0, 1000, n - 20)), 0, 0) for n in lengths]
    items += [(list(rng.integers(0, 1000, n)), 0, 1) for n in (200, 150, 20)]  # model 1
    ws = make_workload(items, 16)
    specs = [ConsumerSpec("small", Contract(4, 400, 100, 0), modes[0]),
             ConsumerSpec("big", Contract(4, 600, 150, 0), modes[1]),
             ConsumerSpec("other", Contract(2, 300, 150, 1), modes[1])]
    packer = roomy_packer(specs, len(ws))
    for i in range(len(ws)):
        ws.add(packer, i)
    batches = drain(packer)
    check_drain(specs, ws, batches, packer, TOL)
    failed = {int(k) for _, b in batches for k, _ in b.failed}
    assert failed == {i for i in range(len(ws)) if ws.lengths[i] > 150}
    for c, b in batches:
        assert all(ws.lengths[int(k)] <= specs[c].contract.max_input_len for k in b.handles)
    # the items only "big" fits went to "big"
    mid = {i for i in range(len(ws)) if 100 < ws.lengths[i] <= 150 and ws.models[i] == 0}
    assert mid and mid <= {int(k) for c, b in batches if c == 1 for k in b.handles}


def check_only_oversized_fail_back(mode: str) -> None:
    """A family of nothing but items too long for every consumer: one batch of failures, then nothing."""
    ws = make_workload([([5] * 64 + [i] * 10, 0, 0) for i in range(3)], 16)
    packer = roomy_packer([ConsumerSpec("only", Contract(2, 100, 50, 0), mode)], 3)
    for i in range(3):
        ws.add(packer, i)
    batch = packer.next_batch(0, 0.0)
    assert batch is not None and len(batch) == 0
    assert sorted(int(k) for k, _ in batch.failed) == [0, 1, 2], batch.failed
    assert {r for _, r in batch.failed} == {"too_long"}
    assert len(packer) == 0 and packer.next_batch(0, 0.0) is None
    assert packer.guards[0].num_refusals == 0


def check_padded_fails_once() -> None:
    """Regression: a padded sweep that wrapped around with nothing taken failed an oversized item twice
    (the index's item count went negative and a free list was written past its end)."""
    packer = Packer([ConsumerSpec("a", Contract(4, 100, 26), "padded")], capacity=4)
    packer.add(7, 0.0, 66, 8, 0, 12345, np.zeros(0, np.uint64))
    batch = packer.next_batch(0, 0.0)
    assert batch.failed == [(7, "too_long")], batch.failed
    assert len(packer) == 0


@pytest.mark.parametrize("modes", [("packed", "packed"), ("padded", "packed")])
def test_oversized_items_fail_back_and_reach_no_consumer(modes):
    check_oversized_fail_back(modes)  # ("padded", "packed"): the padded consumer is the ascending one
    check_only_oversized_fail_back(modes[1])


@pytest.mark.parametrize("call", [
    ("check_padded_fails_once",),
    ("check_only_oversized_fail_back", "padded"),
    ("check_oversized_fail_back", ("padded", "padded")),
], ids=lambda call: "-".join(map(str, call)))
def test_padded_consumers_fail_oversized_items_back_once(call):
    proc = run_isolated(*call)
    assert proc.returncode == 0, proc.stderr[-4000:]


# ---- 5. aging: no starvation ---------------------------------------------------------------

def _aging_run(mode: str, max_wait: float | None, steps: int):
    """One consumer (4 items a batch) sticks to family A, which is never drained: 8 items at first,
    4 new ones before every decision t = 1, 2... (arrival t); item X of family B (arrival 0.5) comes
    in after the consumer settled on A. Returns (decision X was dispatched at or None, [family of each
    batch])."""
    rng = np.random.default_rng(5)
    system_a = list(rng.integers(0, 1000, 32))
    system_b = list(rng.integers(0, 1000, 32))
    items = [(system_a + list(rng.integers(0, 1000, 68)), 0, 0) for _ in range(8 + 4 * steps)]
    items.append((system_b + list(rng.integers(0, 1000, 68)), 0, 0))
    x = len(items) - 1
    arrivals = [0.0] * 8 + [float(1 + i // 4) for i in range(4 * steps)] + [0.5]
    ws = make_workload(items, 16, arrivals)
    fam_a, fam_b = int(ws.shapes.families[0]), int(ws.shapes.families[x])
    assert fam_a != fam_b and all(len(t) == 100 for t in ws.tokens)
    packer = roomy_packer([ConsumerSpec("one", Contract(4, 400, 100, 0), mode)], len(ws), max_wait_seconds=max_wait)
    for i in range(8):
        ws.add(packer, i)
    first = packer.next_batch(0, 0.0)
    assert first.shape.family == fam_a and first.handles.tolist() == [0, 1, 2, 3]
    ws.add(packer, x)
    served = [fam_a]
    for t in range(1, steps + 1):
        for i in range(4 + 4 * t, 8 + 4 * t):
            ws.add(packer, i)
        batch = packer.next_batch(0, float(t))
        assert batch is not None and len(batch) and not batch.failed
        assert len(packer) == 9 - len(batch)  # 4 left of A, X, 4 new ones, less the batch
        served.append(batch.shape.family)
        if x in batch.handles.tolist():
            # padded: X's family of one does not pay for its own rectangle; a loose one takes X first
            assert batch.shape.family == (LOOSE_FAMILY if mode == "padded" else fam_b)
            assert batch.handles.tolist() == [x]
            return t, served
        assert batch.handles.tolist() == list(range(4 * t, 4 * t + 4)), "A is served oldest first"
    assert packer.guards[0].num_refusals == 0
    return None, served


@pytest.mark.parametrize("mode", ["padded", "packed"])
def test_aging_dispatches_an_overdue_item_that_stickiness_would_starve(mode):
    max_wait = 5.0  # X (arrival 0.5) is overdue at now = 6: 5.5 > 5; at now = 5 it has waited 4.5
    at, served = _aging_run(mode, max_wait, steps=12)
    assert at == 6, f"X dispatched at {at}, expected at the first decision past max_wait"
    assert len(set(served[:-1])) == 1, "until then the consumer stuck to family A"
    # without aging, at the same point and long after, X still waits and A is all that is served
    at, served = _aging_run(mode, None, steps=12)
    assert at is None and len(set(served)) == 1


# ---- 6. stickiness -------------------------------------------------------------------------

@FAST
@given(data=st.data(), specs=contracts())
def test_no_excess_shape_switches_in_an_offline_drain(data, specs):
    models = sorted({s.contract.model for s in specs})
    ws = data.draw(workloads(models), label="workload")
    packer = roomy_packer(specs, len(ws))
    for i in range(len(ws)):
        ws.add(packer, i)
    batches = drain(packer)
    check_drain(specs, ws, batches, packer, TOL)
    for c in range(len(specs)):
        runs = family_runs(batches, c)
        assert excess_switches(runs) == 0, (c, runs)


def test_one_consumer_serves_each_family_in_one_run():
    rng = np.random.default_rng(9)
    systems = [list(rng.integers(0, 1000, 20)) for _ in range(5)]
    items = [(systems[i % 5] + list(rng.integers(0, 1000, int(rng.integers(1, 120)))), 0, 0) for i in range(80)]
    ws = make_workload(items, 16)
    for mode in ("padded", "packed"):
        packer = roomy_packer([ConsumerSpec("one", Contract(4, 512, 128, 0), mode)], len(ws))
        for i in range(len(ws)):
            ws.add(packer, i)
        batches = drain(packer)
        check_drain([packer.consumers[0]], ws, batches, packer, TOL)
        runs = family_runs(batches, 0)
        assert len(set(runs)) == 5 and excess_switches(runs) == 0, runs


def one_branch_family(rng, n: int, long_every: int = 0):
    """n items sharing a 40-token prompt (more than two 16-token blocks: the whole family is one
    branch), each with its own tail; every long_every-th item is 150 tokens long."""
    system = list(rng.integers(0, 1000, 40))
    items = []
    for i in range(n):
        size = 150 - 40 if long_every and i % long_every == long_every - 1 else int(rng.integers(1, 30))
        items.append((system + list(rng.integers(0, 1000, size)), 0, 0))
    return make_workload(items, 16)


def test_a_packed_consumer_takes_over_part_of_a_family_that_is_one_branch():
    """Rather than idle, the small consumer takes over the last children of the branch the big one
    holds; each item still comes out exactly once, the long ones only to the big consumer."""
    rng = np.random.default_rng(11)
    ws = one_branch_family(rng, 60, long_every=7)
    specs = [ConsumerSpec("big", Contract(4, 1024, 160, 0), "packed"),
             ConsumerSpec("small", Contract(4, 512, 100, 0), "packed")]
    packer = roomy_packer(specs, len(ws))
    for i in range(len(ws)):
        ws.add(packer, i)
    first = packer.next_batch(0, 0.0)  # big claims the family and its one branch
    assert first is not None and len(first) == 4
    batches = [(0, first)] + drain(packer)
    check_drain(specs, ws, batches, packer, TOL)
    small = [int(k) for c, b in batches if c == 1 for k in b.handles]
    assert len(small) >= 10, "the small consumer took part of the branch"
    assert all(ws.lengths[k] <= 100 for k in small)
    assert {k for k in range(len(ws)) if ws.lengths[k] > 100} <= {int(k) for c, b in batches if c == 0 for k in b.handles}


def test_taking_over_leaves_nothing_behind_while_items_stream_in():
    rng = np.random.default_rng(12)
    ws = one_branch_family(rng, 80, long_every=5)
    specs = [ConsumerSpec("big", Contract(3, 1024, 160, 0), "packed"),
             ConsumerSpec("small", Contract(2, 512, 100, 0), "packed")]
    packer = roomy_packer(specs, len(ws))
    batches = []
    for lo in range(0, len(ws), 10):  # arrivals between decisions: parts die and come back
        for i in range(lo, lo + 10):
            ws.add(packer, i)
        for c in (1, 0, 1):
            batch = packer.next_batch(c, 0.0)
            if batch is not None:
                batches.append((c, batch))
    batches += drain(packer)
    check_drain(specs, ws, batches, packer, TOL)


# ---- 7. capacity ---------------------------------------------------------------------------

def test_index_full_on_items_leaves_the_packer_consistent():
    rng = np.random.default_rng(13)
    system = list(rng.integers(0, 1000, 16))
    items = [(system + list(rng.integers(0, 1000, int(rng.integers(1, 60)))), 0, 0) for _ in range(12)]
    ws = make_workload(items, 16)
    specs = [ConsumerSpec("a", Contract(3, 300, 80, 0), "padded"), ConsumerSpec("b", Contract(3, 300, 80, 0), "packed")]
    packer = Packer(specs, capacity=10)
    for i in range(10):
        ws.add(packer, i)
    tokens = packer.index.tokens
    for i in (10, 11):
        with pytest.raises(IndexFull) as info:
            ws.add(packer, i)
        assert info.value.what == "items"
    assert len(packer) == 10 and packer.index.tokens == tokens
    batches = drain(packer)
    assert sorted(int(k) for _, b in batches for k in b.handles) == list(range(10))
    check_drain(specs, make_workload(items[:10], 16), batches, packer, TOL)
    # the slots are free again: the two refused items fit now
    for i in (10, 11):
        ws.add(packer, i)
    assert sorted(int(k) for _, b in drain(packer) for k in b.handles) == [10, 11]


def test_index_full_on_families_leaves_the_packer_consistent():
    ws = make_workload([([f] * 20 + [i], 0, 0) for f in range(3) for i in range(2)], 16)
    packer = Packer([ConsumerSpec("a", Contract(4, 400, 100, 0))], capacity=16, families=2)
    for i in range(4):  # families 0 and 1
        ws.add(packer, i)
    with pytest.raises(IndexFull) as info:
        ws.add(packer, 4)
    assert info.value.what == "families"
    assert len(packer) == 4 and packer.index.num_families == 2
    batches = drain(packer)
    assert sorted(int(k) for _, b in batches for k in b.handles) == [0, 1, 2, 3]
    assert excess_switches(family_runs(batches, 0)) == 0
    ws.add(packer, 4)
    ws.add(packer, 5)
    assert sorted(int(k) for _, b in drain(packer) for k in b.handles) == [4, 5]


def test_index_full_on_trie_nodes_leaves_the_packer_consistent():
    # each item: its own family (a root), a branch and an end node: 3 nodes, so 10 nodes hold 3 items
    items = [([f] * 16 + [1] * 16 + [f], 0, 0) for f in range(5)]
    ws = make_workload(items, 16)
    assert all(ws.shapes.blocks(i).size == 2 for i in range(5))
    spec = ConsumerSpec("a", Contract(4, 400, 100, 0), "packed")
    packer = Packer([spec], capacity=16, nodes=10, families=16)
    for i in range(3):
        ws.add(packer, i)
    with pytest.raises(IndexFull) as info:
        ws.add(packer, 3)
    assert info.value.what == "trie nodes"
    assert len(packer) == 3 and packer.index.num_nodes == 9 and packer.index.num_families == 3
    check_drain([spec], make_workload(items[:3], 16), drain(packer), packer, TOL)
    for i in (3, 4):
        ws.add(packer, i)
    assert sorted(int(k) for _, b in drain(packer) for k in b.handles) == [3, 4]


@pytest.mark.parametrize("length, max_new, model, hashes, error", [
    (0, 1, 0, np.zeros(0, np.uint64), ValueError),
    (1 << 24, 1, 0, np.zeros(0, np.uint64), ValueError),
    (10, -1, 0, np.zeros(0, np.uint64), ValueError),
    (10, 1, -3, np.zeros(0, np.uint64), ValueError),
    (10, 1, 0, np.zeros(2, np.int64), TypeError),
    (10, 1, 0, [1, 2], TypeError),
])
def test_add_refuses_bad_items_and_changes_nothing(length, max_new, model, hashes, error):
    packer = Packer([ConsumerSpec("a", Contract(4, 64, 32), "padded")], capacity=4)
    with pytest.raises(error):
        packer.add(1, 0.0, length, max_new, model, 99, hashes)
    assert len(packer) == 0 and packer.index.tokens == 0 and packer.next_batch(0, 0.0) is None


# ---- bulk add ------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None, derandomize=True)
@given(data=st.data(), specs=contracts())
def test_add_many_indexes_exactly_what_add_does(data, specs):
    """One compiled call for a whole backlog (a scheduler's rebuild) gives the same batches as add()."""
    ws = data.draw(workloads(sorted({s.contract.model for s in specs})), label="workload")
    one, bulk = roomy_packer(specs, len(ws)), roomy_packer(specs, len(ws))
    for i in range(len(ws)):
        one.index.insert(i, float(ws.arrivals[i]), int(ws.lengths[i]), 8, int(ws.models[i]),
                         int(ws.shapes.families[i]), ws.shapes.blocks(i), int(ws.shapes.bases[i]))
    assert bulk.add_many(np.arange(len(ws), dtype=np.uint64), ws.arrivals, ws.shapes, 8) == len(ws)
    assert len(bulk) == len(one) and bulk.index.tokens == one.index.tokens
    picks = [(c, b.handles.tolist(), b.failed, b.shape) for c, b in drain(one)]
    assert [(c, b.handles.tolist(), b.failed, b.shape) for c, b in drain(bulk)] == picks


def test_add_many_stops_at_a_full_index_with_whole_items():
    ws = make_workload([([i % 7] * (40 + i), 0, 0) for i in range(10)], block_tokens=16)
    packer = Packer([ConsumerSpec("a", Contract(64, 4096, 4096), "packed")], capacity=6, nodes=64, families=16)
    assert packer.add_many(np.arange(10, dtype=np.uint64), 0.0, ws.shapes, 1) == 6
    assert len(packer) == 6 and packer.index.tokens == int(ws.lengths[:6].sum())
    assert sorted(k for _, b in drain(packer) for k in b.handles.tolist()) == list(range(6))


def test_add_many_refuses_a_bad_column_and_indexes_nothing():
    ws = make_workload([([1, 2, 3] * 10, 0, 0), ([4] * 20, 0, 0)], block_tokens=8)
    packer = Packer([ConsumerSpec("a", Contract(4, 256, 128), "padded")], capacity=8)
    keys = np.arange(2, dtype=np.uint64)
    with pytest.raises(ValueError):
        packer.add_many(keys[:1], 0.0, ws.shapes, 1)
    with pytest.raises(ValueError):
        packer.add_many(keys, 0.0, ws.shapes, -1)
    ws.shapes.hashes = ws.shapes.hashes.astype(np.int64)
    with pytest.raises(TypeError):
        packer.add_many(keys, 0.0, ws.shapes, 1)
    assert len(packer) == 0 and packer.index.tokens == 0
