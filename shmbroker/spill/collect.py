"""From ingest-ring records to a backlog append batch, in one kernel.

`collect` reads records zero-copy at `positions` in a producer's ring
(`ring/layout.py`, `ring/items.py`) and fills what `SegmentWriter.append_many`
takes: the tokens (flat + offsets) and one ITEM_DTYPE row per item. It also
derives each item's shape for clustering on disk:

- prefix_key: the item's family key as the packer computes it
  (`pack/shapes.py`: a seeded hash of the model and of its declared prefix,
  else of its first block), so records cluster on disk by the families the
  scheduler packs, and a restart knows each record's family from its header.
- shape_band: the length band, floor(log2(num_tokens)) (1, 2-3, 4-7, ...).
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..pack.shapes import DEFAULT_SEED, family_key
from ..ring.atomics import memcpy
from ..ring.items import NO_PREFIX, SEQ_BITS
from ..ring.layout import RECORD_HEADER_WORDS as RING_HEADER_WORDS


@kernel
def collect(words, words64, positions, count, producer_id, block_tokens, out_flat, out_offsets, items):
    """Fill out_flat/out_offsets/items[:count] from ring records; returns the token total."""
    used = 0
    out_offsets[0] = 0
    for r in range(count):
        pos = positions[r]
        n = words[pos + 1]
        memcpy(out_flat, used, words, pos + RING_HEADER_WORDS, n)
        prefix = words[pos + 5]
        declared = prefix if prefix != NO_PREFIX and prefix > 0 else 0
        it = items[r]
        it.item_id = (np.uint64(producer_id) << np.uint64(SEQ_BITS)) | words64[(pos >> 1) + 1]
        it.prefix_key = family_key(out_flat, used, n, declared, words[pos + 6], block_tokens, DEFAULT_SEED)
        it.producer = producer_id
        it.model = words[pos + 6]
        it.prefix_len = prefix
        it.max_new_tokens = words[pos + 4]
        band = 0
        while (np.uint32(1) << np.uint32(band + 1)) <= n and band < 31:
            band += 1
        it.shape_band = band
        it.flags = words[pos + 7]
        used += n
        out_offsets[r + 1] = used
    return used
