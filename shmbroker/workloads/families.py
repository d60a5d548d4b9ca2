"""Seeded workloads of other shapes than the generator's conversations, to judge a packing policy
on traffic it was not tuned on (`bench pack --workload NAME`). Every item has a `max_new_tokens`
(what a feeder sees) and a real output length at most that (`Workload.real_new`: where it stops,
an EOS), drawn from a wide spread.

- `templates`: few-shot jobs. A few dozen templates of 1-6k tokens (Zipf popularity), each item
  one template plus a short question; outputs short, `max_new_tokens` a job-wide cap.
- `chains`: agent chains. Each step repeats its chain's previous prompt, adds the previous reply
  and a tool result, so prompts grow along a chain; many chains interleave; outputs medium.
- `oneoffs`: unrelated prompts of log-uniform length (50 to 12k tokens), outputs log-uniform
  (1 to 2k), caps from a few fixed values.
- `mixed`: the three interleaved in arrival order, a third each.
- `spread`: template-major jobs (`spread.py`): groups sharing a system prompt and a document,
  each member a question, the members spread evenly through the file, as a script that loops over
  its prompt templates writes them; `spread-grouped` is the same items written group by group.
"""

from __future__ import annotations

import numpy as np

from . import FAMILIES
from .spread import spread
from .synthetic import Workload
CAPS = np.array([64, 256, 1024, 2048])


def _pack(prompts, max_new, real, prefixes, rng, name: str) -> Workload:
    n = len(prompts)
    offsets = np.zeros(n + 1, np.int64)
    np.cumsum([p.size for p in prompts], out=offsets[1:])
    arrivals = np.cumsum(rng.exponential(1 / 50.0, n))
    return Workload(np.concatenate(prompts).astype(np.uint32), offsets, arrivals, np.asarray(max_new, np.int64),
                    np.asarray(prefixes, np.int64), np.zeros(n, np.int64), name,
                    np.minimum(np.maximum(1, np.asarray(real, np.int64)), np.asarray(max_new, np.int64)))


def templates(n: int, rng, vocab: int = 32_000) -> tuple:
    k = 40
    lens = np.exp(rng.uniform(np.log(1000), np.log(6000), k)).astype(np.int64)
    temps = [rng.integers(0, vocab, m, dtype=np.uint32) for m in lens]
    pop = np.arange(1, k + 1, dtype=np.float64) ** -1.0
    pick = rng.choice(k, n, p=pop / pop.sum())
    caps = rng.choice(CAPS[:3], k)  # one cap a template's job
    prompts = [np.concatenate([temps[t], rng.integers(0, vocab, int(rng.integers(20, 300)), dtype=np.uint32)])
               for t in pick]
    real = np.exp(rng.uniform(0, np.log(400), n))
    return prompts, caps[pick], real, np.where(rng.random(n) < 0.5, lens[pick], 0)


def chains(n: int, rng, vocab: int = 32_000) -> tuple:
    live: list[np.ndarray] = []
    prompts, real = [], np.exp(rng.uniform(np.log(20), np.log(800), n))
    for _ in range(n):
        if live and rng.random() < 0.8:
            j = int(rng.integers(len(live)))
            step = np.concatenate([live[j], rng.integers(0, vocab, int(rng.integers(50, 900)), dtype=np.uint32)])
            if step.size > 24_000:
                live.pop(j)
                step = rng.integers(0, vocab, int(rng.integers(500, 3000)), dtype=np.uint32)
                live.append(step)
            else:
                live[j] = step
        else:
            step = rng.integers(0, vocab, int(rng.integers(500, 3000)), dtype=np.uint32)
            live.append(step)
            if len(live) > 200:
                live.pop(0)
        prompts.append(step)
    return prompts, np.full(n, 1024), real, np.zeros(n)


def oneoffs(n: int, rng, vocab: int = 32_000) -> tuple:
    lens = np.exp(rng.uniform(np.log(50), np.log(12_000), n)).astype(np.int64)
    prompts = [rng.integers(0, vocab, m, dtype=np.uint32) for m in lens]
    return prompts, rng.choice(CAPS, n), np.exp(rng.uniform(0, np.log(2048), n)), np.zeros(n)


def generate_family(name: str, num_items: int = 8000, seed: int = 0) -> Workload:
    if name not in FAMILIES:
        raise ValueError(f"a workload family is one of {', '.join(FAMILIES)}, got {name!r}")
    if name.startswith("spread"):
        return spread(num_items, seed, grouped=name == "spread-grouped").workload
    rng = np.random.default_rng(seed)
    if name != "mixed":
        prompts, max_new, real, prefixes = {"templates": templates, "chains": chains, "oneoffs": oneoffs}[name](num_items, rng)
        return _pack(prompts, max_new, real, prefixes, rng, f"{name}(seed={seed}, items={num_items})")
    parts = [f(-(-num_items // 3), rng) for f in (templates, chains, oneoffs)]
    kind = rng.permutation(np.repeat(np.arange(3), -(-num_items // 3)))[:num_items]
    at = [0, 0, 0]
    prompts, max_new, real, prefixes = [], [], [], []
    for k in kind.tolist():
        p, m, r, x = parts[k]
        prompts.append(p[at[k]])
        max_new.append(m[at[k]])
        real.append(r[at[k]])
        prefixes.append(x[at[k]])
        at[k] += 1
    return _pack(prompts, max_new, real, prefixes, rng, f"mixed(seed={seed}, items={num_items})")
