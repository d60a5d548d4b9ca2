"""Seeded workloads for the packing benchmark and the demo.

A `Workload` is flat token ids plus one row per item: offsets, arrival
seconds, max_new_tokens, declared prefix_len (0: none), model.

`generate` builds one from a seed alone:
- prefix families (system prompts of log-normal length) with Zipf popularity;
  half of them declare their prefix (`prefix_len`), half leave it to be found;
- multi-turn chains: a request continues an earlier conversation of its
  family (its whole prompt plus the reply plus a new user turn) with
  probability `p_continue`, else starts a new one;
- log-normal user-turn and reply lengths; Poisson arrivals; several models
  (each family belongs to one).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Workload:
    tokens: np.ndarray  # uint32, flat
    offsets: np.ndarray  # int64, items + 1
    arrivals: np.ndarray  # float64 seconds, non-decreasing
    max_new_tokens: np.ndarray  # int64
    prefix_lens: np.ndarray  # int64, 0 = not declared
    models: np.ndarray  # int64
    name: str = "workload"
    # each item's real output length (it stops there, at most its max_new_tokens: an EOS), when the
    # workload says; None: every item generates its max_new_tokens. A feeder never reads it.
    real_new: np.ndarray | None = None

    @property
    def outputs(self) -> np.ndarray:
        """The tokens each item really generates (`real_new`, else max_new_tokens)."""
        return self.max_new_tokens if self.real_new is None else np.minimum(self.real_new, self.max_new_tokens)

    def __len__(self) -> int:
        return int(self.offsets.size - 1)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def item(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def head(self, n: int) -> "Workload":
        n = min(n, len(self))
        return Workload(self.tokens[: self.offsets[n]], self.offsets[: n + 1], self.arrivals[:n],
                        self.max_new_tokens[:n], self.prefix_lens[:n], self.models[:n], f"{self.name}[:{n}]",
                        None if self.real_new is None else self.real_new[:n])


def generate(num_items: int = 20_000, *, seed: int = 0, num_families: int = 200, zipf_s: float = 1.1,
             num_models: int = 1, p_continue: float = 0.45, system_tokens_median: int = 1200,
             turn_tokens_median: int = 700, reply_tokens_median: int = 250, max_len: int = 120_000,
             rate_per_second: float = 50.0, vocab: int = 32_000) -> Workload:
    if num_items < 1 or num_families < 1 or num_models < 1:
        raise ValueError("num_items, num_families and num_models must be positive")
    rng = np.random.default_rng(seed)
    ranks = np.arange(1, num_families + 1, dtype=np.float64)
    popularity = ranks ** -zipf_s
    popularity /= popularity.sum()
    sys_len = np.maximum(16, rng.lognormal(np.log(system_tokens_median), 0.6, num_families)).astype(np.int64)
    systems = [rng.integers(0, vocab, n, dtype=np.uint32) for n in sys_len]
    declares = rng.random(num_families) < 0.5
    fam_model = rng.integers(0, num_models, num_families)
    open_convs: list[list] = [[] for _ in range(num_families)]  # per family: prompts of open conversations
    items: list[np.ndarray] = []
    prefixes = np.zeros(num_items, np.int64)
    models = np.zeros(num_items, np.int64)
    for i in range(num_items):
        f = int(rng.choice(num_families, p=popularity))
        convs = open_convs[f]
        turn = rng.integers(0, vocab, int(max(8, rng.lognormal(np.log(turn_tokens_median), 0.8))), dtype=np.uint32)
        if convs and rng.random() < p_continue:
            k = int(rng.integers(len(convs)))
            reply = rng.integers(0, vocab, int(max(4, rng.lognormal(np.log(reply_tokens_median), 0.7))),
                                 dtype=np.uint32)
            prompt = np.concatenate([convs[k], reply, turn])
            if prompt.size > max_len:
                convs.pop(k)
                prompt = np.concatenate([systems[f], turn])[:max_len]
                convs.append(prompt)
            else:
                convs[k] = prompt
        else:
            prompt = np.concatenate([systems[f], turn])[:max_len]
            convs.append(prompt)
            if len(convs) > 64:
                convs.pop(0)
        items.append(prompt)
        prefixes[i] = min(int(sys_len[f]), prompt.size) if declares[f] else 0
        models[i] = fam_model[f]
    offsets = np.zeros(num_items + 1, np.int64)
    np.cumsum([p.size for p in items], out=offsets[1:])
    arrivals = np.cumsum(rng.exponential(1.0 / rate_per_second, num_items))
    max_new = np.maximum(1, rng.lognormal(np.log(reply_tokens_median), 0.7, num_items)).astype(np.int64)
    return Workload(np.concatenate(items), offsets, arrivals, max_new, prefixes, models,
                    f"generator(seed={seed}, items={num_items})")
