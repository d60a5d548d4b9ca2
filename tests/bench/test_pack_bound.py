"""The padded lower bound (`bench/pack_bound.py`) on small cases computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.bench.pack_bound import decode_steps, lower_bound_padded_seconds
from shmbroker.engines.sim import SimCost


def test_rows_only_bind_when_inputs_are_short():
    # m = 9, 5, 5, 1; S = 2, T large: batches {9, 5} and {5, 1} -> 9 + 5 = 14 steps
    assert decode_steps(np.array([5, 9, 1, 5]), np.array([1, 1, 1, 1]), 2, 1000) == 14
    # one row per batch: every item its own batch -> 9 + 5 + 5 + 1
    assert decode_steps(np.array([5, 9, 1, 5]), np.array([1, 1, 1, 1]), 1, 1000) == 20


def test_the_token_budget_binds_when_inputs_are_long():
    # S = 4 but T = 10 and inputs of 6: a real feeding runs one item a batch (9 + 5 + 5 + 1 = 20);
    # the bound counts inputs' sums only: B = 1, 2, 2, 3 for the 1..4 largest -> 4x1 + 0x2 + 4x2 + 1x3
    assert decode_steps(np.array([5, 9, 1, 5]), np.array([6, 6, 6, 6]), 4, 10) == 15
    # inputs of 5: two items a batch (W_k / T) -> 9 + 5 = 14
    assert decode_steps(np.array([5, 9, 1, 5]), np.array([5, 5, 5, 5]), 4, 10) == 14


def test_the_whole_bound():
    cost = SimCost(batch_overhead_seconds=1.0, prefill_token_seconds=0.1, decode_step_seconds=10.0,
                   decode_token_seconds=0.01)
    real = np.array([6, 10, 2, 6])  # m = 5, 9, 1, 5
    got = lower_bound_padded_seconds(30, real, np.array([1, 1, 1, 1]), 2, 1000, cost)
    # prefill 0.1 x 30 + decode tokens 0.01 x 20 + steps 10 x 14 + overhead 1 x 2 batches
    assert got == pytest.approx(3.0 + 0.2 + 140.0 + 2.0)
    # prefill only (every output one token): prefill and ceil(n / S) batches
    assert lower_bound_padded_seconds(30, np.ones(4), np.ones(4), 2, 1000, cost) == pytest.approx(3.0 + 2.0)
