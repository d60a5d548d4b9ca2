"""Template-major jobs: prefix groups whose members are spread evenly through the file.

A script that loops over prompt templates writes its job question-major: every document's
questions sit a fifth of the file apart. Each group here is a system prompt (one of a few, 64 to
1,024 tokens) and a document (100 to 4,000 tokens, log-uniform), shared by its members (2 to 16,
log-uniform), each member adding a question of 8 to 200 tokens. Member k of a group of m sits at
the fraction (k + u) / m of the file, u drawn once a group, so a group's members are as far apart
as the file allows. Half the groups declare their system prompt as `prefix_len`. Outputs are short
(log-uniform up to 300 tokens, capped at 64 or 256 a group).

`grouped=True` writes the same items group by group, members in a row: the order that lets a
cache compute each document once, what the spread order is judged against.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .synthetic import Workload

SYSTEM_PROMPTS = 6
SYSTEM_TOKENS = (64, 1024)
DOCUMENT_TOKENS = (100, 4000)
QUESTION_TOKENS = (8, 200)
GROUP_SIZES = (2, 16)
CAPS = (64, 256)


class Spread(NamedTuple):
    """The workload, and each item's group (its index in generation order)."""

    workload: Workload
    groups: np.ndarray


def _log_uniform(rng, bounds: tuple[int, int], n: int) -> np.ndarray:
    lo, hi = bounds
    return np.exp(rng.uniform(np.log(lo), np.log(hi + 1), n)).astype(np.int64).clip(lo, hi)


def spread(num_items: int, seed: int = 0, grouped: bool = False, vocab: int = 32_000) -> Spread:
    """`num_items` items in groups, spread through the file (or grouped); seeded."""
    rng = np.random.default_rng(seed)
    sizes = []
    while sum(sizes) < num_items:
        sizes.append(int(_log_uniform(rng, GROUP_SIZES, 1)[0]))
    sizes[-1] -= sum(sizes) - num_items
    sizes = np.array([s for s in sizes if s > 0], np.int64)
    g = sizes.size
    systems = [rng.integers(0, vocab, int(m), dtype=np.uint32) for m in _log_uniform(rng, SYSTEM_TOKENS, SYSTEM_PROMPTS)]
    system_of = rng.integers(0, SYSTEM_PROMPTS, g)
    docs = _log_uniform(rng, DOCUMENT_TOKENS, g)
    declares = rng.random(g) < 0.5
    caps = rng.choice(np.array(CAPS), g)
    group = np.repeat(np.arange(g), sizes)
    member = np.arange(num_items) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    questions = _log_uniform(rng, QUESTION_TOKENS, num_items)
    sys_len = np.array([s.size for s in systems], np.int64)[system_of]
    lengths = sys_len[group] + docs[group] + questions
    u = rng.random(g)  # drawn either way: both orders hold the same items
    order = np.arange(num_items) if grouped else np.argsort((member + u[group]) / sizes[group], kind="stable")
    q_at = np.cumsum(questions) - questions  # each item's question in `rand`, in generation order
    group, lengths, questions, q_at = group[order], lengths[order], questions[order], q_at[order]
    offsets = np.zeros(num_items + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.empty(int(offsets[-1]), np.uint32)
    doc_tokens = [rng.integers(0, vocab, int(d), dtype=np.uint32) for d in docs]
    rand = rng.integers(0, vocab, int(questions.sum()), dtype=np.uint32)
    for i, k in enumerate(group.tolist()):
        s, d, q, a = systems[system_of[k]], doc_tokens[k], int(questions[i]), int(q_at[i])
        o = int(offsets[i])
        flat[o : o + s.size] = s
        flat[o + s.size : o + s.size + d.size] = d
        flat[o + s.size + d.size : o + s.size + d.size + q] = rand[a : a + q]
    prefixes = np.where(declares[group], sys_len[group], 0)
    real = np.minimum(np.exp(rng.uniform(0, np.log(300), num_items)).astype(np.int64).clip(1)[order], caps[group])
    arrivals = np.cumsum(rng.exponential(1 / 50.0, num_items))
    name = f"spread{'-grouped' if grouped else ''}(seed={seed}, items={num_items})"
    wl = Workload(flat, offsets, arrivals, caps[group].astype(np.int64), prefixes.astype(np.int64),
                  np.zeros(num_items, np.int64), name, real)
    return Spread(wl, group)
