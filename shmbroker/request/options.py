"""An item's request options: the sampling, stop and sample-count fields of an OpenAI-style request.

`RequestOptions` holds them (None: not given, the engine's default); `parse_options` makes one from
a request body's fields with a clear error for anything wrong, before anything is written. The
broker never interprets them: they ride with the item, inside its backlog record, and only the
engine that runs the item reads them (docs/design.md "Request options").

Their wire form is uint32 words (`encode` / `decode`, bit-exact both ways): carried after the
prompt's tokens in the item's ingest-ring record and in its backlog record, so they are covered by
the record's CRC, survive a SIGKILL and a restart with it, and are reclaimed with it. An item
without options carries no word.

| word  | what                                                                        |
|-------|-----------------------------------------------------------------------------|
| 0     | WIRE_MAGIC (high 8 bits) and the presence mask (one bit per FIELDS entry)   |
| 1...  | each present field, in FIELDS order:                                        |
|       | float: an IEEE double (2 words, low first); int: int64 (2 words);           |
|       | bool: 1 word (0/1); stop_token_ids: a count, then the ids;                  |
|       | stop: a count, then per string its UTF-8 byte count and bytes (zero-padded) |
|       | structured: 5 words, a constraint's kind, switches and payload digest       |
|       | (request/structured.py: the payload itself is stored once, by digest)       |

`max_tokens` is not an option: it is the item's max_new_tokens, carried as ever.

An item asks for generated tokens (its task is `Task.GENERATE`) or, with the option `embed`, for
one vector of its prompt (`Task.EMBED`), optionally cut to `dimensions` (Matryoshka truncation,
where the engine's model declares it); an embedding takes no sampling option. A consumer serves one
task (its `engine_settings.task`): an item of the other fails alone there (gpu/requests.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from enum import StrEnum

import numpy as np

from .structured import WORDS as STRUCT_WORDS
from .structured import Structured, StructuredError, from_words, parse_structured, words_of

WIRE_MAGIC = 0xA5  # the first word's high byte: a stray word never decodes as options
MAX_WORDS = 1024  # the longest encoding a record may carry (4 KiB)
MAX_STOP = 16  # stop strings per item
MAX_STOP_BYTES = 256  # UTF-8 bytes per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_N = 128  # samples per item (the OpenAI API's limit)
MAX_TOP_LOGPROBS = 20
MAX_DIMENSIONS = 1 << 20  # the longest vector an item may ask for (a result record holds far more)
INT64 = (-(1 << 63), (1 << 63) - 1)

# Body fields the broker refuses by name: each asks for something no engine here does, and
# dropping it would run the request other than as written.
REFUSED = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
           "logit_bias", "stream", "stream_options", "suffix", "echo", "best_of", "prediction", "audio",
           "modalities", "reasoning_effort", "web_search_options", "guided_json", "guided_regex",
           "guided_choice", "guided_grammar")
# the body fields a constraint is read from (request/structured.py), carried as the `structured` option
STRUCTURED_FIELDS = ("response_format", "structured_outputs")


class OptionsError(ValueError):
    """An option that is wrong (its message names the field)."""


class Task(StrEnum):
    """What an item asks of its engine, and what a consumer serves (`engine_settings.task`)."""

    GENERATE = "generate"  # generated tokens
    EMBED = "embed"  # one vector of the prompt (a pooling model's)


@dataclass(frozen=True)
class RequestOptions:
    """One item's options; a field left None is not given (the engine's default applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: tuple[str, ...] | None = None
    stop_token_ids: tuple[int, ...] | None = None
    n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    structured: Structured | None = None  # a constraint on the output (request/structured.py)
    embed: bool | None = None  # True: the item asks for its prompt's vector, not generated tokens
    dimensions: int | None = None  # an embedding cut to this many values and renormalised (Matryoshka)

    @property
    def task(self) -> Task:
        return Task.EMBED if self.embed else Task.GENERATE

    def given(self) -> dict:
        """The fields given, by name (what an engine maps to its own parameters)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @property
    def samples(self) -> int:
        """How many samples the item asks for (n, 1 when not given)."""
        return 1 if self.n is None else self.n

    @property
    def greedy(self) -> bool:
        """Greedy decoding, the broker's default: no temperature, or 0 (one above 0 samples)."""
        return not self.temperature

    def __bool__(self) -> bool:
        return any(getattr(self, name) is not None for name in OPTION_NAMES)


# (name, kind) in wire order; a kind is how the field is checked and encoded
FIELDS = (("temperature", "float"), ("top_p", "float"), ("top_k", "int"), ("min_p", "float"), ("seed", "int"),
          ("stop", "strs"), ("stop_token_ids", "ids"), ("n", "int"), ("presence_penalty", "float"),
          ("frequency_penalty", "float"), ("repetition_penalty", "float"), ("min_tokens", "int"),
          ("ignore_eos", "bool"), ("logprobs", "bool"), ("top_logprobs", "int"), ("structured", "struct"),
          ("embed", "bool"), ("dimensions", "int"))
OPTION_NAMES = tuple(name for name, _ in FIELDS)
EMBED_OPTIONS = ("embed", "dimensions")  # what an embedding item may carry
GENERATE_OPTIONS = tuple(name for name in OPTION_NAMES if name not in EMBED_OPTIONS)
assert OPTION_NAMES == tuple(f.name for f in fields(RequestOptions)), "FIELDS follows RequestOptions"
assert len(FIELDS) <= 24, "the presence mask has 24 bits"

# the range of each number (inclusive unless said): what the OpenAI API and vLLM both accept
RANGES = {
    "temperature": (0.0, 2.0), "top_p": (0.0, 1.0), "min_p": (0.0, 1.0), "top_k": (-1, 1 << 31),
    "seed": INT64, "n": (1, MAX_N), "presence_penalty": (-2.0, 2.0), "frequency_penalty": (-2.0, 2.0),
    "repetition_penalty": (0.0, 2.0), "min_tokens": (0, 0xFFFFFFFF), "top_logprobs": (0, MAX_TOP_LOGPROBS),
    "dimensions": (1, MAX_DIMENSIONS),
}
OPEN_BELOW = {"top_p", "repetition_penalty"}  # these must be above their low end, not at it


def parse_options(body: dict, *, max_tokens: int | None = None) -> RequestOptions:
    """The options in a request body's fields (other keys are the caller's); OptionsError names a
    field that is wrong. `max_tokens`, when known, bounds min_tokens."""
    values = {}
    for name, kind in FIELDS:
        if kind != "struct" and name in body and body[name] is not None:
            values[name] = _checked(name, kind, body[name])
    try:
        structured = parse_structured(body)
    except StructuredError as exc:
        raise OptionsError(str(exc)) from None
    if structured is not None:
        values["structured"] = structured
    opts = RequestOptions(**values)
    _check_together(opts, max_tokens)
    return opts


def refused_fields(body: dict) -> list[str]:
    """The body's fields the broker refuses by name (REFUSED), in the body's order."""
    return [k for k in body if k in REFUSED]


def _checked(name: str, kind: str, value):
    if kind == "struct":
        if not isinstance(value, Structured):
            raise OptionsError(f"'{name}' must be a request.structured.Structured, got {type(value).__name__}")
        return value
    if kind == "bool":
        if type(value) is not bool:
            raise OptionsError(f"'{name}' must be true or false, got {value!r}")
        return value
    if kind == "strs":
        return _stop(value)
    if kind == "ids":
        return _stop_token_ids(value)
    if kind == "int":
        if type(value) is not int:
            raise OptionsError(f"'{name}' must be an integer, got {value!r}")
    elif type(value) not in (int, float) or not math.isfinite(value):
        raise OptionsError(f"'{name}' must be a finite number, got {value!r}")
    lo, hi = RANGES[name]
    if not lo <= value <= hi or (name in OPEN_BELOW and value == lo):
        low = f"above {lo}" if name in OPEN_BELOW else f"at least {lo}"
        raise OptionsError(f"'{name}' must be {low} and at most {hi}, got {value!r}")
    return float(value) + 0.0 if kind == "float" else value  # + 0.0: -0.0 is 0.0, one encoding


def _stop(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise OptionsError(f"'stop' must be a string or a list of strings, got {value!r}")
    if len(stops) > MAX_STOP:
        raise OptionsError(f"'stop' holds {len(stops)} strings; at most {MAX_STOP}")
    for s in stops:
        if not s or len(s.encode()) > MAX_STOP_BYTES:
            raise OptionsError(f"each 'stop' string must be 1 to {MAX_STOP_BYTES} UTF-8 bytes, got {s!r}")
    return tuple(stops)


def _stop_token_ids(value) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(type(t) is int and 0 <= t <= 0xFFFFFFFF for t in value):
        raise OptionsError(f"'stop_token_ids' must be a list of token ids (0..2^32-1), got {value!r}")
    if len(value) > MAX_STOP_TOKEN_IDS:
        raise OptionsError(f"'stop_token_ids' holds {len(value)} ids; at most {MAX_STOP_TOKEN_IDS}")
    return tuple(value)


def _check_together(opts: RequestOptions, max_tokens: int | None) -> None:
    if opts.embed is False:
        raise OptionsError("'embed' is true or not given (an item generates by default)")
    if opts.embed:
        other = [name for name in opts.given() if name not in EMBED_OPTIONS]
        if other:
            raise OptionsError(f"an embedding takes no generation option: {', '.join(map(repr, other))}")
    elif opts.dimensions is not None:
        raise OptionsError("'dimensions' is an embedding's: it needs 'embed': true")
    if opts.top_logprobs is not None and not opts.logprobs:
        raise OptionsError("'top_logprobs' needs 'logprobs': true")
    if opts.min_tokens is not None and max_tokens is not None and opts.min_tokens > max_tokens:
        raise OptionsError(f"'min_tokens' ({opts.min_tokens}) is more than 'max_tokens' ({max_tokens})")


EMBED = RequestOptions(embed=True)


def embedding(dimensions: int | None = None) -> RequestOptions:
    """The options of an embedding item (cut to `dimensions` when given), checked."""
    return EMBED if dimensions is None else parse_options({"embed": True, "dimensions": dimensions})


# -- the wire form ---------------------------------------------------------------------------------

def encode(opts: RequestOptions | None) -> np.ndarray:
    """The options as uint32 words (none for no options)."""
    if opts is None or not opts:
        return np.zeros(0, np.uint32)
    mask = 0
    out: list[int] = [0]
    for bit, (name, kind) in enumerate(FIELDS):
        value = getattr(opts, name)
        if value is None:
            continue
        mask |= 1 << bit
        out.extend(_encode_value(kind, value))
    out[0] = (WIRE_MAGIC << 24) | mask
    if len(out) > MAX_WORDS:
        raise OptionsError(f"the options take {len(out)} words; at most {MAX_WORDS}")
    return np.array(out, np.uint32)


def _encode_value(kind: str, value) -> list[int]:
    if kind == "float":
        return np.array([value], "<f8").view("<u4").tolist()
    if kind == "int":
        return np.array([value], "<i8").view("<u4").tolist()
    if kind == "bool":
        return [int(value)]
    if kind == "ids":
        return [len(value), *value]
    if kind == "struct":
        return words_of(value)
    words = [len(value)]
    for s in value:
        raw = s.encode()
        words.append(len(raw))
        words.extend(np.frombuffer(raw + b"\0" * (-len(raw) % 4), "<u4").tolist())
    return words


def decode(words) -> RequestOptions:
    """RequestOptions from their words (`encode`'s); OptionsError when they are not options."""
    w = np.asarray(words, np.uint32)
    if w.size == 0:
        return RequestOptions()
    if int(w[0]) >> 24 != WIRE_MAGIC:
        raise OptionsError("these words are not request options (no magic)")
    mask = int(w[0]) & 0xFFFFFF
    if mask >> len(FIELDS):
        raise OptionsError("request options name a field this version does not know")
    values = {}
    pos = 1
    try:
        for bit, (name, kind) in enumerate(FIELDS):
            if mask >> bit & 1:
                values[name], pos = _decode_value(kind, w, pos)
    except (IndexError, UnicodeDecodeError) as exc:
        raise OptionsError(f"request options are cut short or garbled ({exc})") from None
    if pos != w.size:
        raise OptionsError(f"request options hold {w.size - pos} words past their fields")
    opts = RequestOptions(**{name: _checked(name, kind, _as_parsed(kind, values[name]))
                             for name, kind in FIELDS if name in values})
    _check_together(opts, None)
    if not np.array_equal(encode(opts), w):
        raise OptionsError("request options are not in their one encoding (a garbled word)")
    return opts


def _as_parsed(kind: str, value):
    """A decoded value as a request body holds it (so that decoding checks what parsing checks)."""
    if kind in ("strs", "ids"):
        return list(value)
    if kind == "bool":
        return {0: False, 1: True}.get(value, value)
    return value


def _decode_value(kind: str, w: np.ndarray, pos: int):
    if kind in ("float", "int"):
        if pos + 2 > w.size:
            raise IndexError("a number past the end")
        pair = w[pos : pos + 2].astype("<u4")
        value = float(pair.view("<f8")[0]) if kind == "float" else int(pair.view("<i8")[0])
        return value, pos + 2
    if kind == "bool":
        return int(w[pos]), pos + 1  # 0 or 1, checked as a bool by the caller
    if kind == "struct":
        if pos + STRUCT_WORDS > w.size:
            raise IndexError("a constraint past the end")
        try:
            return from_words(w[pos : pos + STRUCT_WORDS].tolist()), pos + STRUCT_WORDS
        except StructuredError as exc:
            raise OptionsError(f"request options hold a garbled constraint ({exc})") from None
    count = int(w[pos])
    pos += 1
    if kind == "ids":
        if pos + count > w.size:
            raise IndexError("token ids past the end")
        return tuple(int(t) for t in w[pos : pos + count]), pos + count
    strs = []
    for _ in range(count):
        nbytes = int(w[pos])
        nwords = (nbytes + 3) // 4
        if pos + 1 + nwords > w.size:
            raise IndexError("a stop string past the end")
        strs.append(w[pos + 1 : pos + 1 + nwords].astype("<u4").tobytes()[:nbytes].decode())
        pos += 1 + nwords
    return tuple(strs), pos


class OptionsColumn:
    """The request options of a batch's items as columns: the distinct sets, and each item's index
    into them (-1: none). A job's items share one set, so a batch costs one decode, not one per item."""

    __slots__ = ("sets", "index")

    def __init__(self, sets: list, index: np.ndarray):
        self.sets = sets
        self.index = index

    def __len__(self) -> int:
        return int(self.index.size)

    def __getitem__(self, k: int) -> RequestOptions | None:
        i = int(self.index[k])
        return None if i < 0 else self.sets[i]

    def samples(self) -> np.ndarray | None:
        """Each item's sample count (its n; 1 without options), or None when every item has one."""
        # a set that could not be read is None (its items fail); index -1 reads the last entry: 1
        per_set = np.array([(s.n or 1) if s is not None else 1 for s in self.sets] + [1], np.int64)
        return None if (per_set == 1).all() else per_set[self.index]

    def __iter__(self):
        return (None if i < 0 else self.sets[i] for i in self.index.tolist())
