"""`bench pack`'s padded bounds: what a feeding of a padded (static-batch) engine can spend at
best, in modeled seconds (`engines/cost.py`, `SimCost`), so a policy is judged on any workload.

A padded batch on a consumer of contract (S, T) holds at most S items whose count x longest input
is at most T, so its items' inputs add up to at most T. It pays an overhead, its computed prefill
tokens, and, while its rows decode, one step per token of its longest real output plus one
sequence-step per row and token decoded. Both bounds relax every consumer to the largest S and T
among them (summed seconds, as `modeled_seconds` sums them). With m_i = max(real output, 1) - 1
the tokens item i decodes after the first (which its prefill gives), w_i its input tokens and P
the workload's distinct prefill tokens, both are

    prefill_token_seconds x P                every distinct token once, no padding
    + decode_token_seconds x sum(m_i)        every row pays its own decode, no more
    + decode_step_seconds x steps            the rectangles' longest decodes, summed
    + batch_overhead_seconds x batches

and they differ in how the items are cut into rectangles:

- `lower_bound_padded_seconds`, the one a policy is judged by: a feeding knows each item's
  max_new_tokens, never where its output will stop. The items sorted by max_new_tokens (longest
  first; arrival order among equals, so which real lengths share a rectangle is chance, as it is
  for a policy) and cut in that order into rectangles of at most S items whose inputs add up to
  at most T; each pays the longest real output among its rows (`sorted_cut`). A feeding that
  knew no more than max_new could come under it only by chance in which outputs stop early.
- `oracle_bound_padded_seconds`, below any feeding at all: one that knew every real output
  length. With B(k) = max(ceil(k / S), ceil(W_k / T)) the fewest batches that can hold the k
  items of the largest m (W_k: their inputs' sum), and m_(1) >= ... >= m_(n), m_(n+1) = 0,

      steps   = sum over k of (m_(k) - m_(k+1)) x B(k)   (every batch whose longest decode is at
                least x is one of the >= B(#{m_i >= x}) that hold those items)
      batches = B(n)

  (`decode_steps`). Where outputs stop at their max_new_tokens (a trace's output lengths) the
  two nearly agree; where they stop early, the oracle is what knowing each output's length in
  advance would be worth.
"""

from __future__ import annotations

import numpy as np

from ..engines.cost import SimCost


def decode_steps(m: np.ndarray, widths: np.ndarray, max_items: int, max_tokens: int) -> int:
    """`steps` of the module docstring: `m` each item's tokens decoded after its first, `widths` its input."""
    order = np.argsort(-m, kind="stable")
    ms = m[order].astype(np.int64)
    w = np.cumsum(widths[order].astype(np.int64))
    k = np.arange(1, ms.size + 1, dtype=np.int64)
    batches = np.maximum(-(-k // max_items), -(-w // max_tokens))
    drops = ms - np.append(ms[1:], 0)
    return int(np.sum(drops * batches))


def sorted_cut(max_new: np.ndarray, m: np.ndarray, widths: np.ndarray, max_items: int, max_tokens: int) -> tuple[int, int]:
    """(steps, batches) of the items sorted by max_new (longest first, stable) and cut in that order
    into rectangles of at most max_items items whose widths add up to at most max_tokens (an item
    wider than max_tokens alone); each rectangle pays its largest m."""
    order = np.argsort(-np.asarray(max_new, np.int64), kind="stable")
    steps = batches = 0
    rows = used = longest = 0
    for i in order.tolist():
        w = int(widths[i])
        if rows and (rows == max_items or used + w > max_tokens):
            steps += longest
            batches += 1
            rows = used = longest = 0
        rows += 1
        used += w
        longest = max(longest, int(m[i]))
    if rows:
        steps += longest
        batches += 1
    return steps, batches


def _seconds(distinct_tokens: int, m: np.ndarray, steps: int, batches: int, cost: SimCost) -> float:
    return (cost.prefill_token_seconds * distinct_tokens + cost.decode_token_seconds * int(m.sum())
            + cost.decode_step_seconds * steps + cost.batch_overhead_seconds * batches)


def lower_bound_padded_seconds(distinct_tokens: int, max_new: np.ndarray, real_new: np.ndarray, widths: np.ndarray,
                               max_items: int, max_tokens: int, cost: SimCost) -> float:
    """The bound of a feeding that knows only max_new_tokens (module docstring)."""
    m = np.maximum(np.asarray(real_new, np.int64), 1) - 1
    steps, batches = sorted_cut(max_new, m, np.asarray(widths, np.int64), max_items, max_tokens)
    return _seconds(distinct_tokens, m, steps, batches, cost)


def oracle_bound_padded_seconds(distinct_tokens: int, real_new: np.ndarray, widths: np.ndarray, max_items: int,
                                max_tokens: int, cost: SimCost) -> float:
    """The bound of any feeding, even one that knew every real output length (module docstring)."""
    m = np.maximum(np.asarray(real_new, np.int64), 1) - 1
    widths = np.asarray(widths, np.int64)
    n = m.size
    batches = max(-(-n // max_items), -(-int(widths.sum()) // max_tokens)) if n else 0
    return _seconds(distinct_tokens, m, decode_steps(m, widths, max_items, max_tokens), batches, cost)
