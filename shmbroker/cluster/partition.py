"""The partition of an item in a cluster: which `shmb.prompts.<partition>` subject a producer publishes it to.

The key starts from the broker's own family key (`pack.shapes.family_key`: the
model and the declared `prefix_len`, else the first block) and goes deeper: it
is the item's block hash at depth d = min(key_blocks, whole blocks past the
family root), the same chained hash the scheduler's trie names its nodes by
(`pack.shapes.chain_blocks`), so two items share a key exactly when they share
the family root and their first d blocks. The partition is the key modulo
`num_partitions`.

- `key_blocks` = 0 is the family key alone. On the Mooncake conversation trace
  every item shares its first block, so that key sends the whole trace to one
  partition (`bench cluster` shows it).
- An item with no whole block past its root (a declared prefix and a short
  question, or an item shorter than two blocks) shares nothing an engine could
  cache past that root, since a partial block is never reused. Its key is the hash of
  its remaining tokens, so such items spread over all partitions. That is the salt
  of a family whose items share only a system prompt: each node computes the
  prompt once, and no node takes the whole family.
- A key shared by more than its share of the load is not salted further. Its
  items share `key_blocks` blocks, so splitting it would cost exactly the hits a
  partition exists to keep. Measured on the Mooncake trace, it does not need to
  be. With key_blocks = 1 the heaviest key holds 0.95 % of the input tokens
  (7,373 keys), and the heaviest of 128 partitions holds 1.65 %. Bounded loads
  are guaranteed while every partition holds at most ε/N of the tokens
  (`cluster.placement`): 2.5 % for two nodes at ε = 0.05. They held, at most
  1.05 × the mean, up to the 16 nodes `bench cluster` tries. A workload that
  shares a longer undeclared prompt should declare it as `prefix_len`, since the
  key then starts past it, or raise `key_blocks`.

Default key_blocks = 1, from `bench cluster`'s sweep on the trace (two nodes,
128 partitions, ε = 0.05). The cluster's hit rate over one node's is 1.0005 at
key_blocks 1, then 0.9992, 0.9975, 0.9948 at 2, 3, 4 and 0.9819 at 8. The
balance is 1.10 at every depth, which is the bound's (1 + ε) / (1 − ε). A deeper
key splits a conversation whose first turn has fewer whole blocks than the key
from its later turns, and gains no balance.

`partition_of` is the per-item call a producer makes; `partitions_of` does many
items at once. The numba kernels are checked against `partition_reference`,
which derives the key from `pack.shapes.shape_items`, the broker's own hashes.
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..pack.shapes import DEFAULT_BLOCK_TOKENS, DEFAULT_SEED, family_key, hash_span, shape_items
from .subjects import ClusterNames

DEFAULT_KEY_BLOCKS = 1  # blocks past the family root in the key (the module docstring says why 1)


@kernel
def partition_key(tokens, start, n, prefix, model, key_blocks, block_tokens, seed):
    """Partition key of tokens[start:start+n] (the module docstring's rule)."""
    family = family_key(tokens, start, n, prefix, model, block_tokens, seed)
    if key_blocks == 0:
        return family
    base = prefix if prefix > 0 else (block_tokens if n >= block_tokens else 0)
    depth = min(key_blocks, (n - base) // block_tokens)
    if depth == 0:  # nothing cacheable past the root: spread by the item's own tokens
        return hash_span(tokens, start + base, start + n, family)
    h = family
    pos = start + base
    for _ in range(depth):
        h = hash_span(tokens, pos, pos + block_tokens, h)
        pos += block_tokens
    return h


@kernel
def _partition_one(tokens, prefix, model, num_partitions, key_blocks, block_tokens, seed):
    h = partition_key(tokens, 0, tokens.size, prefix, model, key_blocks, block_tokens, seed)
    return np.int64(h % np.uint64(num_partitions))


@kernel
def _partition_many(tokens, offsets, prefixes, models, num_partitions, key_blocks, block_tokens, seed, out):
    for i in range(offsets.size - 1):
        h = partition_key(tokens, offsets[i], offsets[i + 1] - offsets[i], prefixes[i], models[i], key_blocks,
                          block_tokens, seed)
        out[i] = np.int64(h % np.uint64(num_partitions))


def _check_params(num_partitions: int, key_blocks: int, block_tokens: int) -> None:
    if num_partitions < 1:
        raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
    if key_blocks < 0:
        raise ValueError(f"key_blocks must be >= 0, got {key_blocks}")
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")


def partition_of(tokens, prefix_len: int | None, model_id: int, num_partitions: int, *,
                 key_blocks: int = DEFAULT_KEY_BLOCKS, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                 seed: int = DEFAULT_SEED) -> int:
    """The partition (0..num_partitions-1) of one item: uint32 tokens, its declared prefix (None or 0: none)
    and its model's id (`ring.items.model_id`)."""
    _check_params(num_partitions, key_blocks, block_tokens)
    arr = np.ascontiguousarray(tokens, dtype=np.uint32)
    prefix = 0 if prefix_len is None else int(prefix_len)
    if arr.ndim != 1 or arr.size < 1:
        raise ValueError("tokens must be a non-empty 1-D sequence")
    if not 0 <= prefix <= arr.size:
        raise ValueError(f"prefix_len must be in 0..{arr.size}, got {prefix_len}")
    return int(_partition_one(arr, prefix, int(model_id), int(num_partitions), int(key_blocks), int(block_tokens),
                              int(seed)))


def partitions_of(flat, offsets, prefixes=None, models=None, num_partitions: int = ClusterNames.num_partitions, *,
                  key_blocks: int = DEFAULT_KEY_BLOCKS, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                  seed: int = DEFAULT_SEED) -> np.ndarray:
    """Partitions of many items: flat uint32 tokens, int64 offsets (items + 1), per-item prefix_len (0: none)
    and model ids (default 0). Returns int64 partitions."""
    _check_params(num_partitions, key_blocks, block_tokens)
    flat = np.ascontiguousarray(flat, dtype=np.uint32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    count = offsets.size - 1
    lengths = np.diff(offsets)
    if count < 0 or (count and (offsets[0] < 0 or offsets[-1] > flat.size or lengths.min() < 1)):
        raise ValueError("offsets must rise strictly from >= 0 to <= len(flat)")
    prefixes = np.zeros(count, np.int64) if prefixes is None else np.ascontiguousarray(prefixes, np.int64)
    models = np.zeros(count, np.int64) if models is None else np.ascontiguousarray(models, np.int64)
    if prefixes.shape != (count,) or models.shape != (count,):
        raise ValueError("prefixes and models need one value per item")
    if count and (prefixes.min() < 0 or (prefixes > lengths).any()):
        raise ValueError("prefix_len must be in 0..len(tokens)")
    out = np.empty(count, np.int64)
    _partition_many(flat, offsets, prefixes, models, int(num_partitions), int(key_blocks), int(block_tokens),
                    int(seed), out)
    return out


def partition_reference(tokens, prefix_len: int | None, model_id: int, num_partitions: int, *,
                        key_blocks: int = DEFAULT_KEY_BLOCKS, block_tokens: int = DEFAULT_BLOCK_TOKENS,
                        seed: int = DEFAULT_SEED) -> int:
    """`partition_of` from the broker's own shapes: the family key, else the trie node at the key's depth."""
    arr = np.ascontiguousarray(tokens, dtype=np.uint32)
    prefix = prefix_len or 0
    shapes = shape_items(arr, np.array([0, arr.size], np.int64), np.array([prefix], np.int64),
                         np.array([model_id], np.int64), block_tokens=block_tokens, seed=seed)
    family = int(shapes.families[0])
    base = int(shapes.bases[0]) if prefix or arr.size >= block_tokens else 0
    depth = min(key_blocks, (arr.size - base) // block_tokens)
    if key_blocks == 0:
        key = family
    elif depth == 0:
        key = int(hash_span(arr, base, arr.size, np.uint64(family)))
    else:
        key = int(shapes.blocks(0)[depth - 1])
    return key % num_partitions
