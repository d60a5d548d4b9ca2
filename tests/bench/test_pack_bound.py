"""The padded bounds (`bench/pack_bound.py`) on small cases computed by hand."""

from __future__ import annotations

import numpy as np
import pytest

from shmbroker.bench.pack_bound import decode_steps, lower_bound_padded_seconds, oracle_bound_padded_seconds, sorted_cut
from shmbroker.engines.cost import SimCost


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


def test_the_sorted_cut_sorts_by_max_new_and_pays_the_longest_real():
    # max_new 10, 30, 20, 30 (real decodes m 4, 9, 19, 2): by max_new, stable: items 1, 3, 2, 0
    max_new, m = np.array([10, 30, 20, 30]), np.array([4, 9, 19, 2])
    assert sorted_cut(max_new, m, np.ones(4, np.int64), 2, 1000) == (9 + 19, 2)  # {1, 3}, {2, 0}
    # inputs of 6 against T = 10: one item a rectangle, each pays its own
    assert sorted_cut(max_new, m, np.full(4, 6), 4, 10) == (9 + 2 + 19 + 4, 4)
    # inputs of 5: two a rectangle (their sum <= T)
    assert sorted_cut(max_new, m, np.full(4, 5), 4, 10) == (9 + 19, 2)


def test_the_whole_bounds():
    cost = SimCost(batch_overhead_seconds=1.0, prefill_token_seconds=0.1, decode_step_seconds=10.0,
                   decode_token_seconds=0.01)
    max_new, real, widths = np.array([10, 30, 20, 30]), np.array([5, 10, 20, 3]), np.ones(4, np.int64)
    # prefill 0.1 x 30 + decode tokens 0.01 x (4 + 9 + 19 + 2) + steps 10 x (9 + 19) + overhead 1 x 2
    assert lower_bound_padded_seconds(30, max_new, real, widths, 2, 1000, cost) == pytest.approx(3.0 + 0.34 + 280.0 + 2.0)
    # knowing the real lengths: {19, 9}, {4, 2} -> 19 + 4 steps
    assert oracle_bound_padded_seconds(30, real, widths, 2, 1000, cost) == pytest.approx(3.0 + 0.34 + 230.0 + 2.0)
    # prefill only (every output one token): prefill and ceil(n / S) batches, both ways
    ones = np.ones(4, np.int64)
    assert lower_bound_padded_seconds(30, ones, ones, ones, 2, 1000, cost) == pytest.approx(3.0 + 2.0)
    assert oracle_bound_padded_seconds(30, ones, ones, 2, 1000, cost) == pytest.approx(3.0 + 2.0)
