"""From ingest-ring records to a backlog append batch, in one kernel.

`collect` reads records zero-copy at `positions` in a producer's ring
(`ring/layout.py`; their words decoded by `ring.items.ingest_meta`) and fills what `SegmentWriter.append_many`
takes: the payloads (flat + offsets: each item's tokens, then its option words) and one ITEM_DTYPE
row per item (`flags`: its option words). It also
derives each item's shape for clustering on disk:

- prefix_key: the item's family key as the packer computes it
  (`pack/shapes.py`: a seeded hash of the model and of its declared prefix,
  else of its first block), so records cluster on disk by the families the
  scheduler packs, and a restart knows each record's family from its header.
- shape_band: the length band, floor(log2(num_tokens)) (1, 2-3, 4-7, ...).

The producer wrote every word of a record, and it can still write them while
they are read: each is read once, then checked, and a record that fails is
refused alone (it does not reach the backlog; `refused[reason]` counts it; the
records around it go on). A record is refused (REFUSALS) when

| reason | what the producer wrote                                               |
|--------|-----------------------------------------------------------------------|
| key    | a key word above SEQ_MASK: not a seq (the item id is the              |
|        | producer's id over its sequence number, so such a key would name      |
|        | another producer's item and route its result into that stream)        |
| prefix | a declared prefix_len longer than the item                           |
| model  | a model id above MODEL_ID_MAX (ids are 31-bit: `items.model_id`)      |
| flags  | an option word count (the flags word) above MAX_WORDS, or one that    |
|        | leaves no token (the backlog's own flag bits must not come from a     |
|        | producer; the options themselves are read only by the engine)         |
| frame  | a length word that changed since the record was checked (`spsc`):     |
|        | the tokens would run past the record's ring or the batch's buffer     |
"""

from __future__ import annotations

import numpy as np

from ..jit import kernel
from ..pack.shapes import DEFAULT_SEED, family_key
from ..ring.atomics import memcpy
from ..ring.items import NO_PREFIX, REFUSALS, SEQ_BITS, ingest_meta
from ..ring.layout import RECORD_HEADER_WORDS as RING_HEADER_WORDS
from ..request.options import MAX_WORDS as MAX_OPTION_WORDS
from .layout import OPTION_WORDS_MASK

REFUSED_KEY, REFUSED_PREFIX, REFUSED_MODEL, REFUSED_FLAGS, REFUSED_FRAME = range(len(REFUSALS))
MODEL_ID_MAX = 0x7FFFFFFF
assert MAX_OPTION_WORDS <= OPTION_WORDS_MASK, "a record's flags hold its option word count"


@kernel
def collect(words, words64, positions, count, producer_id, block_tokens, out_flat, out_offsets, items, refused):
    """Fill out_flat/out_offsets/items[:kept] from the ring records at positions[:count], refusing
    (refused[reason] += 1) the records that fail their checks; returns (kept, token total)."""
    cap = words.size
    used = 0
    kept = 0
    out_offsets[0] = 0
    for r in range(count):
        pos = positions[r]
        n, seq, max_new, prefix, model, flags = ingest_meta(words, words64, pos)
        if pos + RING_HEADER_WORDS + n > cap or used + n > out_flat.size:
            refused[REFUSED_FRAME] += 1
            continue
        if seq >> np.uint64(SEQ_BITS) != np.uint64(0):
            refused[REFUSED_KEY] += 1
            continue
        if flags > MAX_OPTION_WORDS or flags >= n:
            refused[REFUSED_FLAGS] += 1
            continue
        n_tok = n - flags  # the tokens; the option words follow them
        if prefix != NO_PREFIX and prefix > n_tok:
            refused[REFUSED_PREFIX] += 1
            continue
        if model > MODEL_ID_MAX:
            refused[REFUSED_MODEL] += 1
            continue
        memcpy(out_flat, used, words, pos + RING_HEADER_WORDS, n)
        declared = prefix if prefix != NO_PREFIX and prefix > 0 else 0
        it = items[kept]
        it.item_id = (np.uint64(producer_id) << np.uint64(SEQ_BITS)) | seq
        it.prefix_key = family_key(out_flat, used, n_tok, declared, model, block_tokens, DEFAULT_SEED)
        it.producer = producer_id
        it.model = model
        it.prefix_len = prefix
        it.max_new_tokens = max_new
        band = 0
        while (np.uint32(1) << np.uint32(band + 1)) <= n_tok and band < 31:
            band += 1
        it.shape_band = band
        it.flags = flags
        used += n
        kept += 1
        out_offsets[kept] = used
    return kept, used
