"""How deep a consumer is fed: the in-flight window of its GPU process and what the scheduler keeps
queued behind it (docs/design.md "Feeding an engine"). Pure functions of the contract and the mode, so the
GPU process, the scheduler and the packing benchmark agree.

- A `packed` engine batches continuously: it runs up to max_batch_size sequences and admits the next
  the moment one finishes. The window holds that many plus an eighth (at least one), so a finished
  sequence's slot is taken at the engine's next step, not after the GPU process's next poll.
- A `padded` engine computes whole rectangles: two batches in it, one running and the next
  prepared behind it.

The scheduler keeps, per consumer, at least AHEAD batch records unreleased and, for a packed
consumer, at least the window plus one max_batch_size of items without results, so the window
refills from the ring without waiting for a decision. Items, not records: a record is released only
once all its items have results, so one long generation holds its record and every record behind
it; counted by records, the consumer would look full while its engine drains to that one item.
"""

from __future__ import annotations

from .contract import Mode

AHEAD = 3  # batch records queued or running per consumer, at least
PADDED_BATCHES_IN = 2  # rectangles in a padded engine at once


def window_items(max_batch_size: int, mode: Mode) -> int:
    """Items in the engine at once (padded: PADDED_BATCHES_IN batches of at most max_batch_size)."""
    if mode == Mode.PACKED:
        return max_batch_size + max(1, max_batch_size // 8)
    return PADDED_BATCHES_IN * max_batch_size


def queued_items(max_batch_size: int, mode: Mode) -> int:
    """Undone items the scheduler keeps in a consumer's ring (0: only the AHEAD records count)."""
    return window_items(max_batch_size, mode) + max_batch_size if mode == Mode.PACKED else 0
