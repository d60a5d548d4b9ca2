"""`bench pack`'s padded lower bound: no feeding of a padded (static-batch) engine can spend fewer
modeled seconds than `lower_bound_padded_seconds`.

A padded batch on a consumer of contract (S, T) holds at most S items whose count x longest input
is at most T, so its items' inputs add up to at most T. It pays (`engines/sim.py`, `SimCost`) an
overhead, its computed prefill tokens, and, while its rows decode, one step per token of its
longest real output plus one sequence-step per row and token decoded. The bound relaxes every
consumer to the largest S and T among them (summed seconds, as `modeled_seconds` sums them) and
counts, with m_i = max(real output, 1) - 1 the tokens item i decodes after the first (which its
prefill gives), w_i its input tokens, P the workload's distinct prefill tokens:

    B(k)   = max(ceil(k / S), ceil(W_k / T))    the fewest batches that can hold the k items of
                                                the largest m (W_k: their inputs' sum)
    steps  = sum over k = 1..n of (m_(k) - m_(k+1)) x B(k)     m_(1) >= m_(2) >= ... >= m_(n),
                                                m_(n+1) = 0: every batch whose longest decode is
                                                at least x is one of the >= B(#{m_i >= x}) that
                                                hold those items, so sum of batch maxima >= steps
    lower_bound_padded = prefill_token_seconds x P          every distinct token once, no padding
                       + decode_token_seconds x sum(m_i)    every row pays its own decode, no more
                       + decode_step_seconds x steps
                       + batch_overhead_seconds x B(n)

With every rectangle full of items of like outputs (sorted by m and cut into S rows where inputs
are short) it is what an ideal padded feeding pays; inputs too long for S rows to fit T raise it
through B. A policy is judged by `modeled_vs_padded_bound` on any workload.
"""

from __future__ import annotations

import numpy as np

from ..engines.sim import SimCost


def decode_steps(m: np.ndarray, widths: np.ndarray, max_items: int, max_tokens: int) -> int:
    """`steps` of the module docstring: `m` each item's tokens decoded after its first, `widths` its input."""
    order = np.argsort(-m, kind="stable")
    ms = m[order].astype(np.int64)
    w = np.cumsum(widths[order].astype(np.int64))
    k = np.arange(1, ms.size + 1, dtype=np.int64)
    batches = np.maximum(-(-k // max_items), -(-w // max_tokens))
    drops = ms - np.append(ms[1:], 0)
    return int(np.sum(drops * batches))


def lower_bound_padded_seconds(distinct_tokens: int, real_new: np.ndarray, widths: np.ndarray, max_items: int,
                               max_tokens: int, cost: SimCost) -> float:
    m = np.maximum(np.asarray(real_new, np.int64), 1) - 1
    widths = np.asarray(widths, np.int64)
    n = m.size
    batches = max(-(-n // max_items), -(-int(widths.sum()) // max_tokens)) if n else 0
    return (cost.prefill_token_seconds * distinct_tokens + cost.decode_token_seconds * int(m.sum())
            + cost.decode_step_seconds * decode_steps(m, widths, max_items, max_tokens)
            + cost.batch_overhead_seconds * batches)
