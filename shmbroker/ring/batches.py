"""A batch of items checked before any is pushed (`Producer.submit_many`): its offsets in one pass."""

from __future__ import annotations

from ..jit import kernel

BATCH_OK = 0
BATCH_EMPTY_ITEM = 1  # check_batch: an item has no tokens (or offsets decrease)
BATCH_TOO_LARGE = 2  # check_batch: an item exceeds the ring's limit
BATCH_BAD_BOUNDS = 3  # check_batch: offsets do not start at 0 and end at the flat size


@kernel
def check_batch(offsets, flat_size, max_tokens):
    """Validate a batch's offsets in one pass: (BATCH_* status, index of the first bad item)."""
    count = offsets.size - 1
    if count < 1 or offsets[0] != 0 or offsets[count] != flat_size:
        return BATCH_BAD_BOUNDS, 0
    for i in range(count):
        n = offsets[i + 1] - offsets[i]
        if n <= 0:
            return BATCH_EMPTY_ITEM, i
        if n > max_tokens:
            return BATCH_TOO_LARGE, i
    return BATCH_OK, 0
