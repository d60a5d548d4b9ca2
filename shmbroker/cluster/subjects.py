"""The cluster's names, subjects and message formats: one declaration each, with their decoders.

Streams, subjects and consumers (defaults in `ClusterNames`, stream limits in `StreamSettings`):

| what | name | subjects / filter |
|---|---|---|
| prompts stream | SHMB_PROMPTS | `shmb.prompts.*` (an item on `shmb.prompts.<partition>`) |
| results stream | SHMB_RESULTS | `shmb.results.*` (a producer's on `shmb.results.<producer>`) |
| key-value bucket | SHMB_LEASES | leases, liveness, `seq.<producer>` sequence blocks |
| key-value bucket | SHMB_PAYLOADS | constraints' payloads, each under its digest's 32 hex digits (`payloads.py`) |
| consumer of a partition | `part-<partition>` | `shmb.prompts.<partition>` |
| consumer of a producer's results | `res-<producer>` | `shmb.results.<producer>` |

A prompt and its result both carry the message id (`Nats-Msg-Id`) `<producer>:<seq>`.
"""

from __future__ import annotations

import base64
import re
import struct
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..ring.items import NO_PREFIX, STATUS_CODES, STATUS_NAMES, U32_MAX

PRODUCER_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_TOKEN_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a subject token, a stream or bucket name


HEADER_MSG_ID = "Nats-Msg-Id"
HEADER_PRODUCER = "Shmb-Producer"
HEADER_MODEL = "Shmb-Model"  # absent: the default model
# a prompt's request options (request/options.py's words) and a result's extras (request/extras.py's
# words), each as base64 of the little-endian words; absent: none
HEADER_OPTIONS = "Shmb-Options"
HEADER_EXTRAS = "Shmb-Extras"


def check_producer_name(name) -> str:
    """A producer name is a subject token: [A-Za-z0-9_-]{1,64}; anything else is a ValueError."""
    if not isinstance(name, str) or PRODUCER_NAME_RE.fullmatch(name) is None:
        raise ValueError(f"a cluster producer name must match [A-Za-z0-9_-]{{1,64}} (it is a subject token), got {name!r}")
    return name


@dataclass(frozen=True)
class ClusterNames:
    """Where the cluster's things live: stream, bucket and subject names, and the partition count."""

    subject_prefix: str = field(default="shmb", metadata={"help": "the first tokens of every subject "
                                                                  "(`<prefix>.prompts.<partition>`)"})
    prompts_stream: str = field(default="SHMB_PROMPTS", metadata={"help": "the prompts stream (work-queue retention)"})
    results_stream: str = field(default="SHMB_RESULTS", metadata={"help": "the results stream"})
    leases_bucket: str = field(default="SHMB_LEASES", metadata={"help": "the key-value bucket of leases, liveness "
                                                                        "and producers' sequence blocks"})
    num_partitions: int = field(default=128, metadata={"help": "partitions the cluster's items spread over "
                                                               "(producers and nodes must agree)"})
    payloads_bucket: str = "SHMB_PAYLOADS"  # the key-value bucket of constraints' payloads (payloads.py)

    def __post_init__(self):
        for token in self.subject_prefix.split("."):
            if _TOKEN_RE.fullmatch(token) is None:
                raise ValueError(f"subject_prefix must be dot-separated [A-Za-z0-9_-] tokens, got {self.subject_prefix!r}")
        for what in ("prompts_stream", "results_stream", "leases_bucket", "payloads_bucket"):
            if _TOKEN_RE.fullmatch(getattr(self, what)) is None:
                raise ValueError(f"{what} must match [A-Za-z0-9_-]{{1,64}}, got {getattr(self, what)!r}")
        if isinstance(self.num_partitions, bool) or not isinstance(self.num_partitions, int) or not 1 <= self.num_partitions <= 1 << 20:
            raise ValueError(f"num_partitions must be an integer in 1..{1 << 20}, got {self.num_partitions!r}")

    @property
    def prompts_subjects(self) -> str:
        return f"{self.subject_prefix}.prompts.*"

    @property
    def results_subjects(self) -> str:
        return f"{self.subject_prefix}.results.*"

    def prompt_subject(self, partition: int) -> str:
        if not 0 <= partition < self.num_partitions:
            raise ValueError(f"partition must be in 0..{self.num_partitions - 1}, got {partition}")
        return f"{self.subject_prefix}.prompts.{partition}"

    def partition_of_subject(self, subject: str) -> int:
        """The partition of a prompt's subject; ValueError for a subject that is not one."""
        head = f"{self.subject_prefix}.prompts."
        tail = subject[len(head):] if subject.startswith(head) else ""
        if not tail.isdigit() or int(tail) >= self.num_partitions:
            raise ValueError(f"{subject!r} is not a prompt subject of partitions 0..{self.num_partitions - 1}")
        return int(tail)

    def result_subject(self, producer: str) -> str:
        return f"{self.subject_prefix}.results.{check_producer_name(producer)}"

    @staticmethod
    def partition_consumer(partition: int) -> str:
        return f"part-{partition}"

    @staticmethod
    def results_consumer(producer: str) -> str:
        return f"res-{check_producer_name(producer)}"

    @staticmethod
    def seq_key(producer: str) -> str:
        return f"seq.{check_producer_name(producer)}"

    def payload_subject(self, digest: bytes) -> str:
        """The subject of a payload's key in the payloads bucket: its digest's hex."""
        return f"$KV.{self.payloads_bucket}.{digest.hex()}"


@dataclass(frozen=True)
class StreamSettings:
    """The streams' limits and the consumers' windows (what `streams.ensure_*` creates)."""

    replicas: int = field(default=1, metadata={"help": "the streams' and the bucket's replicas: 1 on a single "
                                                       "server, 3 or 5 on a cluster"})
    prompts_max_bytes: int = field(default=8 << 30, metadata={"help": "a full prompts stream refuses new items: "
                                                                      "the producers' back-pressure"})
    results_max_bytes: int = field(default=8 << 30, metadata={"help": "the results stream's bound"})
    results_max_age_seconds: float = 7 * 24 * 3600.0
    duplicate_window_seconds: float = field(default=600.0, metadata={"help": "a result (or prompt) published again "
                                                                             "within this window is dropped"})
    ack_wait_seconds: float = field(default=30.0, metadata={"help": "a prompt pulled and not answered this long is "
                                                                    "delivered again"})
    max_ack_pending: int = field(default=4096, metadata={"help": "per partition: JetStream's bound on what a node "
                                                                 "stages"})
    results_max_ack_pending: int = 4096

    def __post_init__(self):
        if self.replicas not in (1, 3, 5):
            raise ValueError(f"replicas must be 1, 3 or 5, got {self.replicas!r}")
        for what in ("prompts_max_bytes", "results_max_bytes", "max_ack_pending", "results_max_ack_pending"):
            if getattr(self, what) < 1:
                raise ValueError(f"{what} must be at least 1, got {getattr(self, what)!r}")
        for what in ("results_max_age_seconds", "duplicate_window_seconds", "ack_wait_seconds"):
            if not getattr(self, what) > 0:
                raise ValueError(f"{what} must be positive, got {getattr(self, what)!r}")


def msg_id(producer: str, seq: int) -> str:
    return f"{producer}:{seq}"


def parse_msg_id(value: str) -> tuple[str, int]:
    """(producer, seq) of a message id `<producer>:<seq>`; ValueError for anything else."""
    producer, sep, seq = value.rpartition(":")
    if not sep or not seq.isdigit() or PRODUCER_NAME_RE.fullmatch(producer) is None:
        raise ValueError(f"not a message id <producer>:<seq>: {value!r}")
    return producer, int(seq)


def prompt_headers(producer: str, seq: int, model: str | None, options: str | None = None) -> dict[str, str]:
    headers = {HEADER_MSG_ID: msg_id(producer, seq), HEADER_PRODUCER: producer}
    if model is not None:
        headers[HEADER_MODEL] = model
    if options is not None:
        headers[HEADER_OPTIONS] = options
    return headers


def words_header(words) -> str:
    """Words (request options, result extras) as a header value: base64 of their little-endian bytes."""
    return base64.b64encode(np.ascontiguousarray(words, "<u4").tobytes()).decode("ascii")


def header_words(value, what: str) -> np.ndarray:
    """A header value's words (`words_header`'s); ValueError naming `what` when it holds none."""
    try:
        raw = base64.b64decode(value if isinstance(value, str) else "", validate=True)
    except (ValueError, TypeError):
        raise ValueError(f"the {what} header is not base64: {str(value)[:40]!r}") from None
    if not raw or len(raw) % 4:
        raise ValueError(f"the {what} header holds {len(raw)} bytes, not whole words")
    return np.frombuffer(raw, "<u4").astype(np.uint32)


def _read_header(payload: bytes, header: struct.Struct, fields, magic: bytes, what: str):
    """A payload's header as `fields` (its NamedTuple), or ValueError for a short or foreign one."""
    if len(payload) < header.size:
        raise ValueError(f"{what} payload of {len(payload)} bytes is shorter than its {header.size}-byte header")
    head = fields._make(header.unpack_from(payload))
    if head.magic != magic:
        raise ValueError(f"{what} payload has magic {head.magic!r}, not {magic!r}")
    return head


# Prompt payload (little-endian): a 24-byte header, then the tokens.
#
# | bytes  | field                                         |
# |--------|-----------------------------------------------|
# | 0..3   | magic b"SBP1"                                 |
# | 4..7   | max_new_tokens u32                            |
# | 8..11  | prefix_len u32 (0xFFFFFFFF: none declared)    |
# | 12..15 | num_tokens u32                                |
# | 16..23 | seq u64                                       |
# | 24..   | tokens u32 x num_tokens                       |
PROMPT_MAGIC = b"SBP1"
PROMPT_HEADER = struct.Struct("<4sIIIQ")
assert PROMPT_HEADER.size == 24


class PromptHeader(NamedTuple):
    """PROMPT_HEADER's fields, in the table's order."""

    magic: bytes
    max_new_tokens: int
    prefix_len: int
    num_tokens: int
    seq: int


@dataclass(frozen=True)
class PromptMsg:
    seq: int
    max_new_tokens: int
    prefix_len: int | None
    tokens: np.ndarray  # uint32, read-only view of the payload


def encode_prompt(tokens: np.ndarray, seq: int, max_new_tokens: int, prefix_len: int | None) -> bytes:
    """A prompt's payload; `tokens` is a checked 1-D uint32 array (client_checks, ring.items.as_tokens)."""
    prefix = NO_PREFIX if prefix_len is None else prefix_len
    return PROMPT_HEADER.pack(PROMPT_MAGIC, max_new_tokens, prefix, tokens.size, seq) + tokens.astype("<u4", copy=False).tobytes()


def decode_prompt(payload: bytes) -> PromptMsg:
    """Check a prompt payload right after reading it; ValueError naming what is wrong."""
    head = _read_header(payload, PROMPT_HEADER, PromptHeader, PROMPT_MAGIC, "prompt")
    num_tokens, prefix = head.num_tokens, head.prefix_len
    if len(payload) != PROMPT_HEADER.size + 4 * num_tokens:
        raise ValueError(f"prompt payload of {len(payload)} bytes does not hold its {num_tokens} tokens")
    if num_tokens == 0:
        raise ValueError("prompt payload has no tokens")
    if prefix != NO_PREFIX and prefix > num_tokens:
        raise ValueError(f"prompt prefix_len {prefix} exceeds its {num_tokens} tokens")
    tokens = np.frombuffer(payload, "<u4", num_tokens, PROMPT_HEADER.size)
    return PromptMsg(head.seq, head.max_new_tokens, None if prefix == NO_PREFIX else prefix, tokens)


# Result payload (little-endian): a 24-byte header, the generated tokens, the error text.
#
# | bytes  | field                                                         |
# |--------|---------------------------------------------------------------|
# | 0..3   | magic b"SBR1"                                                 |
# | 4..7   | status u32 (ring.items STATUS_CODES)                          |
# | 8..15  | seq u64                                                       |
# | 16..19 | num_tokens u32                                                |
# | 20..23 | error_len u32 (bytes of utf-8 error text)                     |
# | 24..   | tokens u32 x num_tokens, then error_len bytes of error text   |
RESULT_MAGIC = b"SBR1"
RESULT_HEADER = struct.Struct("<4sIQII")
assert RESULT_HEADER.size == 24


class ResultHeader(NamedTuple):
    """RESULT_HEADER's fields, in the table's order."""

    magic: bytes
    status: int
    seq: int
    num_tokens: int
    error_len: int


@dataclass(frozen=True)
class ResultMsg:
    seq: int
    status: str  # a ring.items.STATUS_CODES label
    tokens: np.ndarray  # uint32
    error: str | None


def encode_result(seq: int, status: str | int, tokens, error: str | None = None) -> bytes:
    """A result's payload; `status` a STATUS_CODES label or code."""
    code = STATUS_CODES[status] if isinstance(status, str) else int(status)
    if code not in STATUS_NAMES:
        raise ValueError(f"unknown status {status!r}")
    toks = np.ascontiguousarray(tokens, "<u4")
    text = b"" if error is None else error.encode("utf-8")
    if toks.ndim != 1 or toks.size > U32_MAX:
        raise ValueError("result tokens must be 1-D")
    return RESULT_HEADER.pack(RESULT_MAGIC, code, seq, toks.size, len(text)) + toks.tobytes() + text


def decode_result(payload: bytes) -> ResultMsg:
    """Check a result payload right after reading it; ValueError naming what is wrong."""
    head = _read_header(payload, RESULT_HEADER, ResultHeader, RESULT_MAGIC, "result")
    code, num_tokens, error_len = head.status, head.num_tokens, head.error_len
    if len(payload) != RESULT_HEADER.size + 4 * num_tokens + error_len:
        raise ValueError(f"result payload of {len(payload)} bytes does not hold {num_tokens} tokens and "
                         f"{error_len} bytes of error text")
    status = STATUS_NAMES.get(code)
    if status is None:
        raise ValueError(f"result status {code} is not in the status table")
    tokens = np.frombuffer(payload, "<u4", num_tokens, RESULT_HEADER.size).astype(np.uint32)
    end = RESULT_HEADER.size + 4 * num_tokens
    error = payload[end:].decode("utf-8", "replace") if error_len else None
    return ResultMsg(head.seq, status, tokens, error)
