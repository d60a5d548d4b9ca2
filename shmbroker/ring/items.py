"""Item and result records on the rings: what the four meta words mean, and the submit kernel.

Ingest ring record (producer -> broker), see `layout.py` for the record frame:

| field   | meaning                                                   |
|---------|-----------------------------------------------------------|
| key     | seq: the item's sequence number within its producer       |
| meta[0] | max_new_tokens                                            |
| meta[1] | declared prefix_len, or NO_PREFIX                         |
| meta[2] | model id (`model_id(name)`; 0 = the broker's default)     |
| meta[3] | flags (0)                                                 |
| tokens  | the prompt's token ids                                    |

Result ring record (broker -> producer):

| field   | meaning                                                   |
|---------|-----------------------------------------------------------|
| key     | the item's id (see below; `wire.push_results`)            |
| meta[0] | status code (Status)                                      |
| meta[1] | reserved (0)                                              |
| meta[2] | model id                                                  |
| meta[3] | flags (0)                                                 |
| tokens  | generated token ids                                       |

`ingest_meta` decodes an ingest record's words (the only reader of them: `spill/collect.py`).
The result record's words are `wire.push_results`'s (meta[1] generated tokens, meta[3] error bytes).

An item id is `producer_id << SEQ_BITS | seq`: unique per broker, and the
producer is readable from it.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np
from numba.core import types

from ..jit import kernel
from .layout import OK, RECORD_HEADER_WORDS, RW64_KEY, RW_META, RW_NUM_TOKENS
from .spsc import push

NO_PREFIX = 0xFFFFFFFF
U32_MAX = 0xFFFFFFFF
SEQ_BITS = 40
SEQ_MASK = (1 << SEQ_BITS) - 1
MAX_PRODUCER_ID = (1 << (64 - SEQ_BITS)) - 1

# Why ingest refuses a record a producer wrote (`spill.collect` checks them; its docstring has the
# table; the ingest statistics count each, `control.stats`).
REFUSALS = ("key", "prefix", "model", "flags", "frame")

# push_item's extra return values (beside layout.OK/OK_WAKE/FULL/TOO_LARGE).
ITEM_EMPTY = 10
ITEM_BAD_MAX_NEW = 11



class Status(IntEnum):
    """An item's outcome: the one table of status codes (a result record's status word, `wire.py`).

    Two owners fail an item: the scheduler at admission (TOO_LONG for every consumer of its model,
    INVALID, CORRUPT when its backlog record cannot be read back, CANCELLED when its job was) and the GPU process against its
    consumer's contract and its engine (TOO_LONG, INVALID, ENGINE_ERROR, CORRUPT). A status is a
    string (`label`) only where a person, a script or an engine adapter reads it: the client's
    `Result`, the CLI's JSONL and the engines' `ItemResult` (STATUS_CODES, STATUS_NAMES)."""

    OK = 0
    TOO_LONG = 1
    INVALID = 2  # no tokens, or fields no consumer can run
    ENGINE_ERROR = 3  # the engine refused or failed the item (or died on it POISON_ATTEMPTS times)
    CORRUPT = 4  # its backlog record failed its CRC (or its frame was broken) where read back: not run
    CANCELLED = 5  # its job was cancelled before the item was dispatched (`jobs/`): not run

    @property
    def label(self) -> str:
        return self.name.lower()


STATUS_CODES = {s.label: int(s) for s in Status}  # label -> code, for the string boundaries above
STATUS_NAMES = {int(s): s.label for s in Status}

assert OK == 0 and RECORD_HEADER_WORDS == 8


def _push_item(buf, tokens, seq, max_new_tokens, prefix_len, model):
    """Validate and push one item record: layout codes, or ITEM_EMPTY / ITEM_BAD_MAX_NEW."""
    if tokens.size == 0:
        return ITEM_EMPTY
    if max_new_tokens < 0 or max_new_tokens > U32_MAX:
        return ITEM_BAD_MAX_NEW
    return push(buf, tokens, seq, max_new_tokens, prefix_len, model, 0)


@kernel
def ingest_meta(words, words64, pos):
    """(num_tokens, seq, max_new_tokens, prefix_len, model, flags) of the ingest record at word
    `pos` of a ring's data words (`words64`: the same words as uint64). Each word is read once: the
    producer may still write them, so a caller checks these values, never the words again."""
    m = pos + RW_META
    return words[pos + RW_NUM_TOKENS], words64[(pos >> 1) + RW64_KEY], words[m], words[m + 1], words[m + 2], words[m + 3]


def _signature(readonly: bool):
    tokens = types.Array(types.uint32, 1, "C", readonly=readonly)
    return [types.int64(types.Array(types.uint8, 1, "C"), tokens, *(types.int64,) * 4)]


# One signature per dispatcher: numba resolves a single overload ~80 ns faster
# per call than a choice of two, and this is the producer's per-item cost.
push_item = kernel(signature=_signature(readonly=False))(_push_item)
# Read-only token arrays (np.frombuffer of bytes, a read-only mmap): the slow path.
push_item_readonly = kernel(signature=_signature(readonly=True))(_push_item)


DEFAULT_MODEL = "default"  # the name of the default model (that of consumers declaring none)


def model_id(name: str | None) -> int:
    """Stable 31-bit id of a model name (FNV-1a folded to 31 bits, never 0: the packing index keeps
    model ids in 0..2^31-1); None, or DEFAULT_MODEL by name, is the default model, 0."""
    if name is None or name == DEFAULT_MODEL:
        return 0
    if not isinstance(name, str) or not name:
        raise TypeError(f"model must be a non-empty str or None, got {name!r}")
    h = 0x811C9DC5
    for byte in name.encode():
        h = ((h ^ byte) * 0x01000193) & U32_MAX
    return (h & 0x7FFFFFFF) or 1


def item_id(producer_id: int, seq: int) -> int:
    return producer_id << SEQ_BITS | seq


def split_item_id(item: int) -> tuple[int, int]:
    """(producer_id, seq) of an item id."""
    return item >> SEQ_BITS, item & SEQ_MASK


def as_tokens(tokens, what: str = "tokens") -> np.ndarray:
    """Coerce token ids to a C-contiguous 1-D uint32 array, or raise a clear TypeError/ValueError."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
    else:
        try:
            arr = np.asarray(tokens)
        except (ValueError, TypeError) as exc:
            raise TypeError(f"{what} must be 1-D integer data, got {type(tokens).__name__}: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got {arr.ndim}-D with shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty: an item needs at least one token")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers in uint32 range, got dtype {arr.dtype}")
    if arr.dtype != np.uint32:
        if arr.dtype.kind == "i" and int(arr.min()) < 0:
            raise ValueError(f"{what} holds a negative token id ({int(arr.min())})")
        if int(arr.max()) > U32_MAX:
            raise ValueError(f"{what} holds a token id above uint32 ({int(arr.max())})")
        arr = arr.astype(np.uint32)
    return np.ascontiguousarray(arr)
