"""Boundary types of the packer: Contract, Shape, Batch.

A consumer declares a `Contract` and nothing else; the packer derives every
bound from it. The engine's mode (`padded` or `packed`, DESIGN.md "Words")
belongs to the engine adapter the consumer runs; the policy asks for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .shapes import LENGTH_MAX

MODES = ("padded", "packed")


@dataclass(frozen=True)
class Contract:
    """What one consumer (one GPU process) accepts.

    - max_batch_size: items per batch;
    - max_batch_tokens: bound on count x longest input of a batch;
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
        return 0 < count <= self.max_batch_size and longest <= self.max_input_len \
            and count * longest <= self.max_batch_tokens


@dataclass(frozen=True)
class Shape:
    """(model, family, length band). A packed engine's band is its whole contract range."""

    model: int
    family: int  # the family key (see shapes.py)
    length_min: int
    length_max: int


@dataclass
class Batch:
    """One shape-pure batch for one consumer.

    keys: the caller's handle per item (backlog sequence number, workload row).
    lengths: input tokens per item. failed: keys failed back instead, with reasons.
    """

    consumer: int
    shape: Shape
    keys: np.ndarray
    lengths: np.ndarray
    max_new_tokens: np.ndarray
    arrivals: np.ndarray
    failed: list = field(default_factory=list)  # [(key, reason)]

    def __len__(self) -> int:
        return int(self.keys.size)

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def longest(self) -> int:
        return int(self.lengths.max()) if self.keys.size else 0
