"""The simulated engine's vectors, for a consumer that embeds (`task = "embed"`).

Each prompt's vector is a deterministic unit vector of its tokens (splitmix64 of the prompt's
crc32c and length, as float32), so equal prompts get equal vectors in any batch, on any consumer,
after any restart: a whole embedding job runs and is checked end to end without a model. With
`zero_cost` (a benchmark of the broker) the engine reads no prompt, and every vector is one shared
unit vector. An item's `dimensions` (where `matryoshka` says the modeled model declares them) keeps
the first values, renormalised, as a Matryoshka model's truncation does. The cost is the engine's
own mode's (`padded`: count x longest, the encoder's rectangle), with no decode step.
"""

from __future__ import annotations

import crc32c
import numpy as np

from ..request.extras import vector_extras, vector_words
from .base import BatchResults, truncated


def unit_vector(key: int, dims: int) -> np.ndarray:
    """A deterministic float32 unit vector of `dims` values from a 64-bit key."""
    z = np.uint64(key) + np.arange(1, dims + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    v = (z >> np.uint64(40)).astype(np.float64) / float(1 << 24) - 0.5
    return (v / np.linalg.norm(v)).astype(np.float32)



class SimEmbedder:
    """The vectors of a simulated embedding model of `embed_dimensions` values."""

    def __init__(self, settings):
        self.dims = int(settings.embed_dimensions)
        self.matryoshka = bool(settings.matryoshka)
        self.zero_cost = bool(settings.cost.zero_cost)
        self.shared = unit_vector(0, self.dims)  # zero cost: every vector (no prompt is read)
        self.extras = vector_extras()
        self._shared_words: dict = {}  # zero cost: the shared vector's words, by cut

    @property
    def unhonoured(self) -> tuple[str, ...]:
        """`dimensions` is refused by name unless the modeled model declares Matryoshka dimensions."""
        return () if self.matryoshka else ("dimensions",)

    def vector(self, tokens) -> np.ndarray:
        t = np.ascontiguousarray(tokens, np.uint32)
        return unit_vector(crc32c.crc32c(t) | (t.size << 32), self.dims)

    def batch(self, item_ids: np.ndarray, held: dict, in_flight) -> BatchResults:
        """The results of finished items, as columns, from `held` ({item id: its vector's words}, what
        `results` made at their add); each is forgotten unless a copy of it is still `in_flight`."""
        ids = item_ids.tolist()
        words = [held[i] if i in in_flight else held.pop(i) for i in ids] if in_flight else list(map(held.pop, ids))
        offsets = np.zeros(len(ids) + 1, np.int64)
        np.cumsum([w.size for w in words], out=offsets[1:])
        flat = np.concatenate(words) if words else np.zeros(0, np.uint32)
        return BatchResults(item_ids, np.zeros(len(ids), np.uint32), flat, offsets,
                            extras=dict.fromkeys(range(len(ids)), self.extras))

    def results(self, item_ids, batch) -> dict[int, np.ndarray]:
        """{item id: its vector's words} of every item of `batch` (an EngineBatch). With zero cost
        (a benchmark of the broker) each distinct cut of the shared vector is made once."""
        ids = np.asarray(item_ids).tolist()
        if not self.zero_cost:
            return {item: vector_words(truncated(self.vector(batch.tokens[k]), self._dims(batch, k)))
                    for k, item in enumerate(ids)}
        column = batch.options
        if column is not None and len(getattr(column, "sets", ())) == 1 and (column.index == 0).all():
            return dict.fromkeys(ids, self._shared_cut(column.sets[0].dimensions))  # one set: no Python per item
        return {item: self._shared_cut(self._dims(batch, k)) for k, item in enumerate(ids)}

    @staticmethod
    def _dims(batch, k: int) -> int | None:
        opts = batch.options_of(k)
        return None if opts is None else opts.dimensions

    def _shared_cut(self, dims: int | None) -> np.ndarray:
        words = self._shared_words.get(dims)
        if words is None:
            words = self._shared_words[dims] = vector_words(truncated(self.shared, dims))
        return words
