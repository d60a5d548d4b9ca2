"""Shapes of items: block hashes, family keys, length bands.

An item's tokens are cut into blocks of `block_tokens` (the last block may be
partial). Each block gets a 64-bit hash chained on the previous one, so two
items share their first k block hashes exactly when they share their first
k blocks of tokens (up to 2^-64 collisions). The chain is seeded with the
item's **family key**:

- declared prefix (`prefix_len` > 0): family key = hash(seed, model,
  tokens[:prefix_len]); blocks are cut from `prefix_len` on, so every item that
  declares the same prefix is in one family whatever the prefix's length;
- otherwise: family key = hash(seed, model, first block); blocks are cut from
  `block_tokens` on;
- an item shorter than one block without a declared prefix has no cacheable
  prefix: it joins its model's **pool**, family key = hash(seed, model), so
  short unrelated prompts batch together (by length band) instead of each
  being a family of one.

The family key names the trie's root; block hash i names the trie node at
depth i+1 below it. A **band** is a length class: exact below 256 tokens, then
256 bands per octave (a band's longest item is at most 1/256 longer than its
shortest), up to `LENGTH_MAX` tokens. An **output band** classes max_new_tokens
coarsely, two per octave (`out_band`; 0: an item that generates at most one
token), for the lanes of a padded engine's rectangles (`lanes.py`).

The hash is FNV-1a over 32-bit tokens with a murmur3 finaliser per block; it is
not cryptographic (a producer can only collide its own items into one family,
which costs it cache hits, not correctness: the engine recomputes).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel

FNV64_OFFSET = np.uint64(0xCBF29CE484222325)
FNV64_PRIME = np.uint64(0x100000001B3)
DEFAULT_SEED = 0x5EED_B10C
DEFAULT_BLOCK_TOKENS = 512

BAND_SUB_BITS = 8  # 256 bands per octave
BAND_SUB = 1 << BAND_SUB_BITS
LENGTH_BITS = 24
LENGTH_MAX = (1 << LENGTH_BITS) - 1  # 16,777,215 tokens
NUM_BANDS = BAND_SUB + (LENGTH_BITS - BAND_SUB_BITS) * BAND_SUB  # 4352
NUM_OUT_BANDS = 64  # output bands: 0, then two per octave of max_new_tokens up to 2^31 (one u64 of lanes a class)


@kernel
def fmix64(h):
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xFF51AFD7ED558CCD)
    h ^= h >> np.uint64(33)
    h *= np.uint64(0xC4CEB9FE1A85EC53)
    h ^= h >> np.uint64(33)
    if h == np.uint64(0):  # 0 means "empty" in the index's hash tables
        h = np.uint64(1)
    return h


@kernel
def hash_span(tokens, start, stop, h):
    """FNV-1a over tokens[start:stop] from state h, finalised."""
    h = h ^ FNV64_OFFSET
    for i in range(start, stop):
        h = (h ^ np.uint64(tokens[i])) * FNV64_PRIME
    return fmix64(h ^ np.uint64(stop - start))


@kernel
def band_of(n):
    """Length band of an n-token item (n >= 1): exact below 256, then 256 per octave."""
    if n < BAND_SUB:
        return np.int64(n)
    e = np.int64(0)
    m = np.uint64(n)
    while m > np.uint64(1):
        m >>= np.uint64(1)
        e += 1
    sub = (np.int64(n) >> (e - BAND_SUB_BITS)) & (BAND_SUB - 1)
    return (e - BAND_SUB_BITS + 1) * BAND_SUB + sub


@kernel
def out_band(max_new):
    """Output band of an item that generates up to max_new tokens: 0 for at most one, else
    1 + 2 x floor(log2 max_new) + (its second bit), so a band's longest is < 1.5 x its shortest."""
    if max_new <= 1:
        return np.int64(0)
    e = np.int64(0)
    m = np.uint64(max_new)
    while m > np.uint64(1):
        m >>= np.uint64(1)
        e += 1
    return 1 + 2 * e + ((np.int64(max_new) >> (e - 1)) & 1)


@kernel
def band_floor(band):
    """The shortest length in `band`."""
    if band < BAND_SUB:
        return np.int64(band)
    e = band // BAND_SUB + BAND_SUB_BITS - 1
    sub = band % BAND_SUB
    return (np.int64(BAND_SUB) + sub) << (e - BAND_SUB_BITS)


@kernel
def num_blocks(n, prefix, block_tokens):
    """Trie depth of an item: blocks after its family root."""
    base = prefix if prefix > 0 else min(n, block_tokens)
    rest = n - base
    return (rest + block_tokens - 1) // block_tokens


@kernel
def deep_block(nb):
    """Which of an item's `nb` blocks past its family root is its deep block (0-based): the one at
    the largest power-of-two depth short of its last block, where its own tail usually starts. Items
    under one branch that share it share a long prefix (a document under a common system prompt):
    the trie gives it a node (`trie.end_node`) and the waiting groups a list (`groups.py`)."""
    depth = 1
    while depth * 2 <= nb - 1:
        depth *= 2
    return depth - 1


@kernel
def family_key(tokens, start, n, prefix, model, block_tokens, seed):
    """Family key of tokens[start:start+n]: the model and the declared prefix, else the first block;
    an item shorter than one block that declares no prefix has no prefix an engine could cache (a
    partial block is never reused): it joins its model's pool, keyed by the model alone."""
    base = prefix if prefix > 0 else (block_tokens if n >= block_tokens else 0)
    return hash_span(tokens, start, start + base, np.uint64(seed) ^ (np.uint64(model) * FNV64_PRIME))


@kernel
def chain_blocks(tokens, start, n, prefix, family, block_tokens, out, out_start):
    """Block hashes of tokens[start:start+n] below its family key, chained, into out[out_start:]."""
    k = out_start
    pos = prefix if prefix > 0 else min(n, block_tokens)
    h = family
    while pos < n:
        stop = min(pos + block_tokens, n)
        h = hash_span(tokens, start + pos, start + stop, h)
        out[k] = h
        k += 1
        pos = stop


@kernel
def item_hashes(tokens, start, n, prefix, model, block_tokens, seed, out, out_start):
    """Family key of tokens[start:start+n]; block hashes into out[out_start:]. Returns the key."""
    family = family_key(tokens, start, n, prefix, model, block_tokens, seed)
    chain_blocks(tokens, start, n, prefix, family, block_tokens, out, out_start)
    return family


@kernel
def chain_items(words, starts, lengths, prefixes, families, block_tokens, hash_offsets, hashes):
    """Block hashes of items whose family keys are known (item i: words[starts[i]:starts[i]+lengths[i]]):
    only the tokens past each family root are read."""
    for i in range(starts.size):
        chain_blocks(words, starts[i], lengths[i], prefixes[i], families[i], block_tokens, hashes, hash_offsets[i])


@kernel
def hash_items(tokens, offsets, prefixes, models, block_tokens, seed, families, hash_offsets, hashes):
    """Hash many items (flat tokens, offsets[i]:offsets[i+1]); hash_offsets from `count_blocks`."""
    for i in range(offsets.size - 1):
        n = offsets[i + 1] - offsets[i]
        families[i] = item_hashes(tokens, offsets[i], n, prefixes[i], models[i], block_tokens, seed,
                                  hashes, hash_offsets[i])


@kernel
def count_blocks(offsets, prefixes, block_tokens, hash_offsets):
    hash_offsets[0] = 0
    for i in range(offsets.size - 1):
        n = offsets[i + 1] - offsets[i]
        hash_offsets[i + 1] = hash_offsets[i] + num_blocks(n, prefixes[i], block_tokens)
    return hash_offsets[offsets.size - 1]


def family_bases(prefixes, lengths, block_tokens: int) -> np.ndarray:
    """Tokens under each item's family key, which every item of its family shares: its declared
    prefix, else its first block; 0 for an item of its model's pool (shorter than a block)."""
    prefixes = np.asarray(prefixes, np.int64)
    return np.where(prefixes > 0, prefixes, np.where(np.asarray(lengths, np.int64) >= block_tokens, block_tokens, 0))


class ItemShapes:
    """Family keys and block hashes of a set of items (flat arrays, one row per item)."""

    __slots__ = ("bases", "block_tokens", "families", "hash_offsets", "hashes", "lengths", "models", "pooled")

    def __init__(self, families, hash_offsets, hashes, lengths, models, bases, block_tokens, pooled=None):
        self.block_tokens = block_tokens
        self.pooled = pooled  # per item: in its model's pool (no cacheable prefix); None: unknown
        self.bases = bases  # tokens under the family key (`family_bases`)
        self.families = families
        self.hash_offsets = hash_offsets
        self.hashes = hashes
        self.lengths = lengths
        self.models = models

    def __len__(self) -> int:
        return int(self.families.size)

    def blocks(self, i: int) -> np.ndarray:
        return self.hashes[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def sized_blocks(self, i: int) -> list[tuple[int, int]]:
        """[(hash, tokens)] of item i: its family root (the declared prefix or first block), then its blocks.
        A pooled item's whole input is one block no other item shares: a negative key, unique per item
        of this set, that a cache model never stores."""
        n = int(self.lengths[i])
        if self.pooled is not None and self.pooled[i]:
            return [(-(i + 1), n)]
        pos = int(self.bases[i])
        out = [(int(self.families[i]), pos)]
        for h in self.blocks(i).tolist():
            stop = min(pos + self.block_tokens, n)
            out.append((h, stop - pos))
            pos = stop
        return out


def shape_items(tokens: np.ndarray, offsets: np.ndarray, prefixes=None, models=None, *,
                block_tokens: int = DEFAULT_BLOCK_TOKENS, seed: int = DEFAULT_SEED) -> ItemShapes:
    """Hash items given as flat uint32 tokens and int64 offsets (len = items + 1)."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    tokens = np.ascontiguousarray(tokens, dtype=np.uint32)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    count = offsets.size - 1
    lengths = np.diff(offsets)
    if count and (lengths.min() < 1 or lengths.max() > LENGTH_MAX):
        raise ValueError(f"item lengths must be in 1..{LENGTH_MAX}")
    prefixes = np.zeros(count, np.int64) if prefixes is None else np.ascontiguousarray(prefixes, np.int64)
    if count and (prefixes.min() < 0 or (prefixes > lengths).any()):
        raise ValueError("prefix_len must be in 0..len(tokens)")
    models = np.zeros(count, np.int64) if models is None else np.ascontiguousarray(models, np.int64)
    hash_offsets = np.empty(count + 1, np.int64)
    total = count_blocks(offsets, prefixes, block_tokens, hash_offsets)
    hashes = np.empty(total, np.uint64)
    families = np.empty(count, np.uint64)
    hash_items(tokens, offsets, prefixes, models, block_tokens, seed, families, hash_offsets, hashes)
    bases = family_bases(prefixes, lengths, block_tokens)
    pooled = (prefixes == 0) & (lengths < block_tokens)
    return ItemShapes(families, hash_offsets, hashes, lengths, models, bases, block_tokens, pooled)


def distinct_blocks(shapes) -> tuple[int, int, int]:
    """(all blocks, distinct blocks, tokens of the distinct blocks), the family root counting as a block."""
    seen: dict[int, int] = {}
    total = 0
    for i in range(len(shapes)):
        blocks = shapes.sized_blocks(i)
        seen.update(blocks)  # equal hashes cover equal tokens
        total += len(blocks)
    return total, len(seen), sum(seen.values())
