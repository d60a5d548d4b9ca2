"""The GPU process's core: one result per item, failures kept to their items."""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.config.settings import SimSettings
from shmbroker.engines import catalogue as registry
from shmbroker.engines.base import EngineDead, EngineOutcome, EngineUnavailable, ItemResult
from shmbroker.engines.catalogue import load_engine
from shmbroker.engines.cost import SimCost
from shmbroker.engines.sim import Sim
from shmbroker.request.extras import decode_extras
from shmbroker.gpu.core import ConsumerCore
from shmbroker.pack.contract import Batch, Contract, Shape
from shmbroker.pack.shapes import shape_items

CONTRACT = Contract(8, 4096, 1000)


def batch_of(tokens, max_new=3, family=None):
    """A batch of these token arrays (ids 100, 101, ...): rows carry their real family keys, or
    `family` for every row (when some item has no tokens to hash)."""
    lengths = [t.size for t in tokens]
    if family is None:
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        families = shape_items(np.concatenate(tokens), offsets, block_tokens=16).families
        family = int(families[0])
    else:
        families = np.full(len(tokens), family, np.uint64)
    ids = np.arange(100, 100 + len(tokens), dtype=np.uint64)
    return Batch.of(0, Shape(0, family, 1, CONTRACT.max_input_len), ids, lengths, np.full(len(tokens), max_new),
                    families=families)


def prompts(n, prefix=64, seed=0):
    rng = np.random.default_rng(seed)
    head = rng.integers(0, 1000, prefix, dtype=np.uint32)
    return [np.concatenate([head, rng.integers(0, 1000, int(rng.integers(1, 50)), dtype=np.uint32)]) for _ in range(n)]


def sim(mode="packed"):
    return Sim(SimSettings(mode=mode, cache_tokens=1 << 16, cost=SimCost()), block_tokens=16)


def test_sim_results_one_per_item_with_its_generated_tokens():
    tokens = prompts(5)
    core = ConsumerCore(CONTRACT, sim())
    results = core.process(batch_of(tokens, max_new=4), tokens).items()
    assert [r.item_id for r in results] == list(range(100, 105))
    assert all(r.status == "ok" and r.error is None for r in results)
    assert all(np.array_equal(r.tokens, Sim.generated(r.item_id, 4, t)) for r, t in zip(results, tokens))
    assert core.stats.ok == 5 and core.stats.queried_blocks > 0 and core.stats.hit_blocks > 0
    assert core.stats.guard_violations == 0


def test_too_long_and_empty_items_fail_back_alone():
    tokens = prompts(3)
    tokens.insert(1, np.zeros(1500, np.uint32))  # longer than max_input_len 1000
    tokens.append(np.zeros(0, np.uint32))
    core = ConsumerCore(CONTRACT, sim())
    results = core.process(batch_of(tokens, family=7), tokens).items()
    assert [r.status for r in results] == ["ok", "too_long", "ok", "ok", "invalid"]
    assert "1500 tokens > max_input_len 1000" in results[1].error
    assert (core.stats.ok, core.stats.too_long, core.stats.invalid) == (3, 1, 1)


class PoisonEngine:
    """Test double: fails any batch holding a poisoned item id, or everything."""

    mode = "packed"

    def __init__(self, poison=(), everything=False):
        self.poison = set(poison)
        self.everything = everything
        self.calls = 0

    def run(self, batch):
        self.calls += 1
        if self.everything or self.poison & set(int(i) for i in batch.item_ids):
            raise RuntimeError("a kernel failed on this prompt")
        return EngineOutcome([ItemResult(int(i), "ok", np.ones(2, np.uint32)) for i in batch.item_ids])

    def close(self):
        pass


def test_an_engine_error_fails_its_item_not_the_batch():
    tokens = prompts(4)
    core = ConsumerCore(CONTRACT, PoisonEngine(poison={102}))
    results = core.process(batch_of(tokens, family=7), tokens).items()
    assert [r.status for r in results] == ["ok", "ok", "engine_error", "ok"]
    assert results[2].error == "RuntimeError: a kernel failed on this prompt"
    assert core.stats.engine_errors == 1 and core.stats.ok == 3


def test_an_engine_failing_everything_is_dead_and_fails_no_item():
    """Every call raising: the batch, its first item alone, then the probe that would have charged that
    item: three failures in a row with no success between, so the engine is dead (the GPU process
    hands its items back and restarts) and no item is failed for it."""
    tokens = prompts(3)
    engine = PoisonEngine(everything=True)
    core = ConsumerCore(CONTRACT, engine)
    with pytest.raises(EngineDead, match="3 times in a row"):
        core.process(batch_of(tokens, family=7), tokens)
    assert engine.calls == 3 and core.stats.engine_errors == 0


class ForgetfulEngine(PoisonEngine):
    """Test double: drops the result of one item and answers for an id it was not given."""

    def run(self, batch):
        ids = [int(i) for i in batch.item_ids]
        return EngineOutcome([ItemResult(i, "ok") for i in ids[1:]] + [ItemResult(999, "ok")])


def test_a_missing_result_is_an_engine_error_for_that_item():
    tokens = prompts(3)
    results = ConsumerCore(CONTRACT, ForgetfulEngine()).process(batch_of(tokens, family=7), tokens).items()
    assert [(r.item_id, r.status) for r in results] == [(100, "engine_error"), (101, "ok"), (102, "ok")]


def test_the_guard_runs_again_and_counts_a_violation_but_serves_the_batch():
    tokens = prompts(2, seed=1) + prompts(2, seed=2)  # two prefix families in one batch
    lengths = [t.size for t in tokens]
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    families = shape_items(np.concatenate(tokens), offsets, block_tokens=16).families
    assert len(set(families.tolist())) == 2
    batch = Batch.of(0, Shape(0, int(families[0]), 1, 1000), np.arange(4, dtype=np.uint64), lengths,
                     np.ones(4, np.int64), families=families)
    core = ConsumerCore(CONTRACT, sim())
    assert all(r.status == "ok" for r in core.process(batch, tokens).items())
    assert core.stats.guard_violations == 1 and core.guard.refusals["family"] == 1


def test_load_engine_by_name(monkeypatch):
    engine = load_engine("sim", SimSettings(mode="padded", cache_tokens=0), block_tokens=64)
    assert engine.mode == "padded" and engine.block_tokens == 64
    with pytest.raises(ValueError, match="unknown engine 'nope'"):
        load_engine("nope", None)
    monkeypatch.setitem(registry.ENGINES, "ghost", registry.EngineEntry(
        "ghost", "shmbroker_no_such_module", "Ghost", "ghost", "shmbroker.engines.options:HFSettings", "packed",
        True))
    with pytest.raises(EngineUnavailable, match=r"pip install 'shmbroker\[ghost\]'"):
        load_engine("ghost", None)


class BatchOnly(PoisonEngine):
    """Test double: a batch engine (run only) as the registry constructs it."""

    mode = None

    def __init__(self, settings=None, **_options):
        super().__init__()


class PaddedClaim(BatchOnly):
    mode = "padded"


def test_the_registry_refuses_an_engine_whose_class_and_entry_disagree_on_the_mode(monkeypatch):
    import sys
    import types

    module = types.ModuleType("shmbroker_test_engines")
    module.PaddedClaim = PaddedClaim
    module.BatchOnly = BatchOnly
    monkeypatch.setitem(sys.modules, "shmbroker_test_engines", module)
    opts = "shmbroker.engines.options:HFSettings"
    monkeypatch.setitem(registry.ENGINES, "claim", registry.EngineEntry(
        "claim", "shmbroker_test_engines", "PaddedClaim", None, opts, "packed", False))
    with pytest.raises(TypeError, match="says mode 'padded' but its registry entry says 'packed'"):
        load_engine("claim", None)
    # a batch engine behind an entry that says it streams is refused too
    monkeypatch.setitem(registry.ENGINES, "liar", registry.EngineEntry(
        "liar", "shmbroker_test_engines", "BatchOnly", None, opts, "packed", True))
    with pytest.raises(TypeError, match="no add/poll"):
        load_engine("liar", None)
    # agreeing: loads, behind BatchStream, with the entry's mode
    monkeypatch.setitem(registry.ENGINES, "fine", registry.EngineEntry(
        "fine", "shmbroker_test_engines", "BatchOnly", None, opts, "packed", False))
    engine = load_engine("fine", None)
    assert engine.mode == "packed" and callable(engine.add) and callable(engine.poll)
    with pytest.raises(ValueError, match="mode must be one of"):
        registry.EngineEntry("bad", "m", "C", None, opts, "rectangle", True)


def test_the_families_a_consumer_remembers_are_bounded(monkeypatch):
    """Before: the GPU process kept every family it ever served in a set (one entry per
    family for the life of the process). Now the last MAX_FAMILIES_TRACKED."""
    from shmbroker.gpu import core as core_mod

    monkeypatch.setattr(core_mod, "MAX_FAMILIES_TRACKED", 8)
    core = ConsumerCore(CONTRACT, sim())
    tokens = [np.array([1, 2, 3], np.uint32)]
    for family in range(40):
        core.process(batch_of(tokens, max_new=1, family=family + 1), tokens)
    assert core.stats.families == 40
    assert len(core._families) == 8
    core.process(batch_of(tokens, max_new=1, family=38), tokens)  # a recent one: an excess switch
    assert core.stats.excess_shape_switches == 1


def test_a_packed_sim_says_each_items_cached_prompt_tokens_as_vllm_does():
    """Five prompts sharing a 64-token head (blocks of 16): the first computes it, the others are
    served it from the cache, and each result says so in its extras (`Result.cached_tokens`), as
    vLLM's `num_cached_tokens`; a padded one says nothing of its cache."""
    tokens = prompts(5)
    results = ConsumerCore(CONTRACT, sim()).process(batch_of(tokens, max_new=4), tokens).items()
    cached = [decode_extras(r.extras, r.tokens.size).cached_tokens for r in results]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached
    assert all(decode_extras(r.extras, r.tokens.size).lengths == (4,) for r in results)
    padded = ConsumerCore(CONTRACT, sim("padded")).process(batch_of(tokens, max_new=4), tokens).items()
    assert all(r.extras is None for r in padded)
