"""The producer client's argument checks: clear TypeError/ValueError before anything is written."""

from __future__ import annotations

import operator
from typing import NamedTuple

import numpy as np

from ..request.options import RequestOptions, encode, parse_options
from ..ring.items import U32_MAX
from ..ring.batches import BATCH_BAD_BOUNDS, BATCH_EMPTY_ITEM, BATCH_TOO_LARGE, check_batch


def as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise TypeError(f"{what} must be an integer, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} must be an integer, got {type(value).__name__}") from None


def check_u32(value, what: str) -> int:
    value = as_int(value, what)
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{what} must be in 0..{U32_MAX}, got {value}")
    return value


def is_one(value) -> bool:
    return value is None or isinstance(value, (int, np.integer))


def per_item(value, count: int, what: str, shared: bool) -> np.ndarray:
    """One value (shared) or `count` values per item as int64, range-checked."""
    if shared:
        arr = np.array([check_u32(value, what)], np.int64)
    else:
        raw = np.asarray(value)
        if raw.ndim == 0:
            raw = np.full(count, check_u32(value, what), np.int64)
        if raw.ndim != 1 or raw.size != count:
            raise ValueError(f"{what} must be one integer or {count} of them, got shape {raw.shape}")
        if raw.dtype.kind not in "iu":
            raise TypeError(f"{what} must be integers, got dtype {raw.dtype}")
        arr = raw.astype(np.int64)
    if arr.min() < 0 or arr.max() > U32_MAX:
        raise ValueError(f"{what} must be in 0..{U32_MAX}")
    return arr


def check_prefix_len(prefix_len, tokens) -> int:
    """A declared prefix_len of one item, checked against its tokens."""
    value = as_int(prefix_len, "prefix_len")
    try:
        size = len(tokens)
    except TypeError:
        raise TypeError(f"tokens must be 1-D integer data, got {type(tokens).__name__}") from None
    if not 0 <= value <= size:
        raise ValueError(f"prefix_len must be in 0..{size} (the item's length), got {value}")
    return value


class BatchFields(NamedTuple):
    """submit_many's per-item fields, checked: one value each when `shared` (the same for every
    item), else one per item."""

    max_new: np.ndarray  # max_new_tokens (int64)
    prefixes: np.ndarray | None  # prefix_len (int64), None when not declared
    shared: bool


def batch_fields(max_new_tokens, prefix_len, offs: np.ndarray) -> BatchFields:
    """The checked max_new_tokens and prefix_len of the items `offs` delimits (each argument one
    value for all or one per item)."""
    count = offs.size - 1
    shared = is_one(max_new_tokens) and is_one(prefix_len)
    max_new = per_item(max_new_tokens, count, "max_new_tokens", shared)
    if prefix_len is None:
        return BatchFields(max_new, None, shared)
    prefixes = per_item(prefix_len, count, "prefix_len", shared)
    if np.any(prefixes > np.diff(offs)):
        raise ValueError("prefix_len exceeds its item's length")
    return BatchFields(max_new, prefixes, shared)


def as_offsets(offsets, flat_size: int, max_tokens: int) -> np.ndarray:
    raw = offsets if isinstance(offsets, np.ndarray) else np.asarray(offsets)
    if raw.ndim != 1 or raw.size < 2:
        raise ValueError("offsets must be 1-D with at least two entries (item i is flat[offsets[i]:offsets[i+1]])")
    if raw.dtype.kind not in "iu":
        raise TypeError(f"offsets must be integers, got dtype {raw.dtype}")
    offs = raw if raw.dtype == np.int64 and raw.flags.c_contiguous else np.ascontiguousarray(raw, dtype=np.int64)
    status, index = check_batch(offs, flat_size, max_tokens)
    if status == BATCH_BAD_BOUNDS:
        raise ValueError(f"offsets must start at 0 and end at len(flat_tokens) = {flat_size}")
    if status == BATCH_EMPTY_ITEM:
        raise ValueError(f"item {index} is empty or offsets decrease")
    if status == BATCH_TOO_LARGE:
        raise ValueError(f"item {index} exceeds the ingest ring's limit of {max_tokens} tokens")
    return offs


def option_words(options, max_new_tokens) -> np.ndarray | None:
    """The words of a submit's request options (`checked_options`); None for none."""
    opts = checked_options(options, max_new_tokens)
    words = encode(opts) if opts is not None else None
    return words if words is not None and words.size else None


def checked_options(options, max_new_tokens) -> RequestOptions | None:
    """A submit's request options (a RequestOptions or a dict of request-body fields, checked:
    OptionsError names a wrong one); None for none. `max_new_tokens` (one value or one per item)
    bounds min_tokens."""
    if options is None:
        return None
    limit = int(np.min(max_new_tokens)) if not isinstance(max_new_tokens, (int, np.integer)) else int(max_new_tokens)
    if isinstance(options, dict):
        options = parse_options(options, max_tokens=limit)
    elif not isinstance(options, RequestOptions):
        raise TypeError(f"options must be a RequestOptions or a dict of request fields, got {type(options).__name__}")
    elif options.min_tokens is not None and options.min_tokens > limit:
        raise ValueError(f"options: 'min_tokens' ({options.min_tokens}) is more than max_new_tokens ({limit})")
    return options
