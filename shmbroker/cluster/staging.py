"""What a node's bridge stages: a pulled prompt message decoded and checked, a run of them as the
columns of one `submit_many`, the staged prompt waiting for its local result, and the answers
published for them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..request.options import decode as decode_options
from . import subjects


class Pulled(NamedTuple):
    """A pulled prompt message, decoded: its partition, the message, the prompt, its producer."""

    partition: int
    msg: object
    prompt: subjects.PromptMsg
    producer: str


class Decoded(NamedTuple):
    """A prompt message's prompt, producer, model (None: the default) and request options (the
    header's text, so that equal options group by it, and its RequestOptions; None: none)."""

    prompt: subjects.PromptMsg
    producer: str
    model: str | None
    options_header: str | None
    options: object


class Columns(NamedTuple):
    """A run of prompts as the columns of one `submit_many`: tokens (flat, prompt i at
    flat[offsets[i]:offsets[i + 1]]), max_new_tokens, and prefix_len (None: none declares one)."""

    flat: np.ndarray
    offsets: np.ndarray
    max_new: np.ndarray
    prefixes: np.ndarray | None


@dataclass
class Staged:
    """A prompt pulled from JetStream, waiting for its local result."""

    msg: object  # the JetStream message, acked once the result is stored
    producer: str
    seq: int
    partition: int
    num_tokens: int
    touched_at: float


@dataclass
class Answer:
    """A result to publish: a staged prompt's (`local_id`: its local item id, its message found in
    the staging at ack time) or a refused message's (`msg`: acked once the answer is stored)."""

    producer: str
    seq: int
    status: str
    tokens: object
    error: str | None
    local_id: int | None = None
    msg: object = None
    extras: object = None  # the result's extras words (request/extras.py), or None


def decode_message(msg) -> Decoded:
    """A pulled prompt message decoded; ValueError naming what is wrong (a torn payload, no
    producer, a message id that is not the payload's, request options that do not decode)."""
    headers = msg.headers or {}
    prompt = subjects.decode_prompt(msg.data)
    producer = subjects.check_producer_name(headers.get(subjects.HEADER_PRODUCER))
    ident = headers.get(subjects.HEADER_MSG_ID)
    if ident != subjects.msg_id(producer, prompt.seq):
        raise ValueError(f"message id {ident!r} is not its producer's and payload's {subjects.msg_id(producer, prompt.seq)!r}")
    header = headers.get(subjects.HEADER_OPTIONS)
    options = None if header is None else decode_options(subjects.header_words(header, "options"))
    return Decoded(prompt, producer, headers.get(subjects.HEADER_MODEL), header, options)


def columns(prompts: list) -> Columns:
    """The columns of decoded prompts that all declare a prefix or all declare none."""
    offsets = np.zeros(len(prompts) + 1, np.int64)
    np.cumsum([p.tokens.size for p in prompts], out=offsets[1:])
    flat = np.concatenate([p.tokens for p in prompts])
    max_new = np.array([p.max_new_tokens for p in prompts], np.uint32)
    prefixes = None if prompts[0].prefix_len is None else np.array([p.prefix_len for p in prompts], np.int64)
    return Columns(flat, offsets, max_new, prefixes)


def ranges(ps: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2,5" (for the log)."""
    out, start = [], None
    for i, p in enumerate(ps):
        if start is None:
            start = p
        if i + 1 == len(ps) or ps[i + 1] != p + 1:
            out.append(f"{start}-{p}" if p != start else str(p))
            start = None
    return ",".join(out) or "none"
