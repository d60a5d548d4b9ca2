"""Boundary types of the packer: Contract, Shape, Batch.

A consumer declares a `Contract` and nothing else; the packer derives every
bound from it. The engine's mode (`padded` or `packed`, docs/design.md "Words")
belongs to the engine adapter the consumer runs; the policy asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from .shapes import LENGTH_MAX


class Mode(StrEnum):
    """An engine's mode (docs/design.md "Words"): `padded` computes whole rectangles (count x longest
    input), `packed` batches continuously over a paged KV cache. A StrEnum, equal to its text, so
    TOML values, JSON output and comparisons with the text work as they did."""

    PADDED = "padded"
    PACKED = "packed"


def as_mode(value, what: str = "mode") -> Mode:
    """`value` (a Mode or its text) as a Mode; ValueError naming the modes otherwise (`what`: whose)."""
    try:
        return Mode(value)
    except ValueError:
        raise ValueError(f"{what} must be one of {', '.join(Mode)}, got {value!r}") from None


@dataclass(frozen=True)
class Contract:
    """What one consumer (one GPU process) accepts.

    - max_batch_size: items per batch (a packed engine: sequences running at once);
    - max_batch_tokens: bound on count x longest input of a padded engine's batch (a packed
      engine: tokens one engine step computes, prefill chunks plus one per decoding sequence);
    - max_input_len: bound on each item's input tokens;
    - model: the model id the consumer serves.
    """

    max_batch_size: int
    max_batch_tokens: int
    max_input_len: int
    model: int = 0

    def __post_init__(self):
        for name in ("max_batch_size", "max_batch_tokens", "max_input_len", "model"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise TypeError(f"Contract.{name} must be an integer, got {value!r}")
        for name in ("max_batch_size", "max_batch_tokens", "max_input_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"Contract.{name} must be positive, got {getattr(self, name)}")
        if self.model < 0 or self.model >= 1 << 32:
            raise ValueError(f"Contract.model must be a 32-bit model id, got {self.model}")
        if self.max_input_len > self.max_batch_tokens:
            raise ValueError(
                f"Contract.max_input_len ({self.max_input_len}) exceeds max_batch_tokens "
                f"({self.max_batch_tokens}): an item of that length could never be batched")
        if self.max_input_len > LENGTH_MAX:
            raise ValueError(f"Contract.max_input_len must be <= {LENGTH_MAX}, got {self.max_input_len}")

    def fits(self, count: int, longest: int) -> bool:
        """A padded engine's rectangle of count items, the longest `longest` tokens, fits."""
        return 0 < count <= self.max_batch_size and longest <= self.max_input_len \
            and count * longest <= self.max_batch_tokens


@dataclass(frozen=True)
class Shape:
    """(model, family, length band). A packed engine's band is its whole contract range. A padded
    engine's loose rectangle (`loose.py`) has family LOOSE_FAMILY: its rows are of any families."""

    model: int
    family: int  # the family key (see shapes.py), or LOOSE_FAMILY
    length_min: int
    length_max: int


LOOSE_FAMILY = 0  # no family key is 0 (`shapes.fmix64`)
# A padded engine's decode step costs about as much as prefilling this many tokens: the rate at which
# the padded policy weighs a shared prefix against decode padding (`loose.family_pays`); the simulated
# engine's default cost model has it (`engines/sim.py`, decode_step_seconds / prefill_token_seconds).
DEFAULT_STEP_TOKENS = 1600.0
BATCH_ROW = np.dtype([("handle", "u8"), ("num_tokens", "i8"), ("max_new_tokens", "i8"), ("arrival", "f8"),
                      ("prefix_key", "u8"), ("model", "i8")])


@dataclass
class Batch:
    """One shape-pure batch for one consumer.

    rows: one BATCH_ROW per item: handle (the caller's name for the item: the
    scheduler's index slot, the GPU process's item id, a workload row), num_tokens
    (input length), max_new_tokens, arrival seconds, prefix_key (the family key),
    model. failed: handles failed back instead, with reasons.
    """

    consumer: int
    shape: Shape
    rows: np.ndarray
    failed: list = field(default_factory=list)  # [(handle, reason)]

    @classmethod
    def of(cls, consumer: int, shape: Shape, handles, lengths, max_new_tokens, arrivals=None, families=None,
           models=None, failed=None) -> "Batch":
        rows = np.zeros(len(handles), BATCH_ROW)
        rows["handle"] = handles
        rows["num_tokens"] = lengths
        rows["max_new_tokens"] = max_new_tokens
        rows["arrival"] = 0.0 if arrivals is None else arrivals
        rows["prefix_key"] = shape.family if families is None else families
        rows["model"] = shape.model if models is None else models
        return cls(consumer, shape, rows, list(failed or []))

    def __len__(self) -> int:
        return int(self.rows.size)

    @property
    def handles(self) -> np.ndarray:
        return self.rows["handle"]

    @property
    def lengths(self) -> np.ndarray:
        return self.rows["num_tokens"]

    @property
    def max_new_tokens(self) -> np.ndarray:
        return self.rows["max_new_tokens"]

    @property
    def arrivals(self) -> np.ndarray:
        return self.rows["arrival"]
