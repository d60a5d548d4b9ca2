"""Structured outputs: an item's constraint on what its engine may generate (a JSON schema, any JSON
object, a regular expression, a choice of strings or a grammar).

A constraint is read from a request body's `response_format` (OpenAI: `json_schema` or
`json_object`) or `structured_outputs` (vLLM's extension: `json`, `json_object`, `regex`, `choice`,
`grammar`, and its `disable_any_whitespace` / `disable_additional_properties` switches) by
`parse_structured`, with an error naming the field. The broker never interprets a constraint: its
engine compiles it.

A constraint's text (the schema, the pattern, the choices) is a **payload**: kilobytes that a job's
items usually share. It is stored once, durably, in the broker's payload store (`disk/payloads.py`)
under its digest, and an item carries only the reference: the kind, the switches and the digest
(the first 16 bytes of the payload's SHA-256), five words of its request options
(`request/options.py`). The engine's side reads the payload back by digest and checks that it hashes
to it: a payload that does not is `corrupt`, never run unconstrained.

The payload's bytes: a JSON schema or the choices as compact JSON (keys in the order given: a schema's
property order is the order generated), a regex or a grammar as its UTF-8 text; `json_object` has
none (its digest is all zero).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from enum import IntEnum

DIGEST_BYTES = 16  # of the payload's SHA-256: the reference an item carries
NO_DIGEST = bytes(DIGEST_BYTES)  # json_object: no payload
MAX_CHOICES = 4096


class Constraint(IntEnum):
    """What a constraint is; its value is the wire's kind word (never 0)."""

    JSON = 1  # a JSON schema
    JSON_OBJECT = 2  # any JSON object
    REGEX = 3
    CHOICE = 4  # one of a list of strings
    GRAMMAR = 5  # an EBNF / GBNF / Lark grammar, as the engine's backend reads it


# vLLM's `StructuredOutputsParams` field of each kind (the body's `structured_outputs` key too)
FIELD_OF = {Constraint.JSON: "json", Constraint.JSON_OBJECT: "json_object", Constraint.REGEX: "regex",
            Constraint.CHOICE: "choice", Constraint.GRAMMAR: "grammar"}
KIND_OF = {name: kind for kind, name in FIELD_OF.items()}


class Switch(IntEnum):
    """The switches of a constraint, bits of the wire's kind word above its low byte."""

    DISABLE_ANY_WHITESPACE = 1  # JSON without free whitespace between tokens
    DISABLE_ADDITIONAL_PROPERTIES = 2  # objects hold only the properties their schema names


SWITCH_OF = {"disable_any_whitespace": Switch.DISABLE_ANY_WHITESPACE,
             "disable_additional_properties": Switch.DISABLE_ADDITIONAL_PROPERTIES}
SWITCHES_ALL = sum(SWITCH_OF.values())
# fields of the two body objects the broker refuses by name: no engine here carries them through
REFUSED_KEYS = ("whitespace_pattern", "structural_tag")


class StructuredError(ValueError):
    """A constraint that is wrong (its message names the field)."""


@dataclass(frozen=True)
class Structured:
    """One constraint: its kind, switches and payload digest; `payload` holds its bytes once known
    (the producer's side, and an engine's once read from the store), None on the wire."""

    kind: Constraint
    digest: bytes
    switches: int = 0
    payload: bytes | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, kind: Constraint, payload: bytes | None, switches: int = 0) -> Structured:
        return cls(kind, digest_of(payload) if payload is not None else NO_DIGEST, switches, payload)

    def has(self, switch: Switch) -> bool:
        return bool(self.switches & switch)

    def value(self):
        """The constraint as vLLM's `StructuredOutputsParams` field takes it: the schema's JSON text,
        the choices as a list, the regex or grammar text, True for json_object."""
        if self.kind == Constraint.JSON_OBJECT:
            return True
        if self.payload is None:
            raise StructuredError("the constraint's payload has not been read")
        text = self.payload.decode()
        return json.loads(text) if self.kind == Constraint.CHOICE else text

    def with_payload(self, payload: bytes) -> Structured:
        """This constraint with its payload read back; StructuredError when it is not this digest's."""
        if digest_of(payload) != self.digest:
            raise StructuredError(f"payload {self.digest.hex()} does not hash to its digest")
        return Structured(self.kind, self.digest, self.switches, payload)


def digest_of(payload: bytes) -> bytes:
    """A payload's reference: the first DIGEST_BYTES bytes of its SHA-256."""
    return hashlib.sha256(payload).digest()[:DIGEST_BYTES]


def compact_json(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()


def parse_structured(body: dict) -> Structured | None:
    """The constraint of a request body's `response_format` and `structured_outputs` (None: none);
    StructuredError names what is wrong. Both may be given as vLLM takes them: the constraint from
    one of them, the switches from `structured_outputs`."""
    from_format = _response_format(body.get("response_format"))
    so = body.get("structured_outputs")
    if so is None:
        return from_format
    if not isinstance(so, dict):
        raise StructuredError(f"'structured_outputs' must be an object, got {type(so).__name__}")
    refused = [k for k in so if k in REFUSED_KEYS and so[k] is not None]
    if refused:
        raise StructuredError(f"'structured_outputs.{refused[0]}' is not served: no engine here carries it")
    unknown = sorted(set(so) - set(KIND_OF) - set(SWITCH_OF) - set(REFUSED_KEYS))
    if unknown:
        raise StructuredError(f"'structured_outputs' has unknown field(s) {', '.join(unknown)}")
    switches = 0
    for name, bit in SWITCH_OF.items():
        value = so.get(name)
        if value is not None and type(value) is not bool:
            raise StructuredError(f"'structured_outputs.{name}' must be true or false, got {value!r}")
        switches |= bit if value else 0
    kinds = [k for k in KIND_OF if so.get(k) is not None and so.get(k) is not False]
    if len(kinds) > 1 or (kinds and from_format is not None):
        named = [*kinds, *(["response_format"] if from_format is not None else [])]
        raise StructuredError(f"one constraint per request; got {', '.join(named)}")
    if from_format is not None:
        return Structured(from_format.kind, from_format.digest, switches, from_format.payload)
    if not kinds:
        if switches:
            raise StructuredError("'structured_outputs' gives switches but no constraint")
        return None
    kind = KIND_OF[kinds[0]]
    return Structured.of(kind, _payload(kind, so[kinds[0]], f"structured_outputs.{kinds[0]}"), switches)


def _response_format(rf) -> Structured | None:
    if rf is None:
        return None
    if not isinstance(rf, dict):
        raise StructuredError(f"'response_format' must be an object, got {type(rf).__name__}")
    kind = rf.get("type")
    if kind == "text":
        _only(rf, {"type"}, "response_format")
        return None
    if kind == "json_object":
        _only(rf, {"type"}, "response_format")
        return Structured.of(Constraint.JSON_OBJECT, None)
    if kind == "json_schema":
        _only(rf, {"type", "json_schema"}, "response_format")
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise StructuredError("'response_format.json_schema' must be an object with 'name' and 'schema'")
        return Structured.of(Constraint.JSON, schema_payload(js, "response_format.json_schema"))
    if kind in ("structural_tag",):
        raise StructuredError(f"'response_format' of type {kind!r} is not served: no engine here carries it")
    raise StructuredError(f"'response_format.type' must be text, json_object or json_schema, got {kind!r}")


def schema_payload(js: dict, where: str) -> bytes:
    """The payload of an OpenAI `json_schema` object ({"name", "schema", "strict", "description"})."""
    _only(js, {"name", "schema", "strict", "description"}, where)
    name = js.get("name")
    if not isinstance(name, str) or not name or len(name) > 64:
        raise StructuredError(f"'{where}.name' must be a string of 1 to 64 characters, got {name!r}")
    if js.get("strict") is not None and type(js["strict"]) is not bool:
        raise StructuredError(f"'{where}.strict' must be true or false, got {js['strict']!r}")
    if "schema" not in js:
        raise StructuredError(f"'{where}.schema' is missing")
    return _payload(Constraint.JSON, js["schema"], f"{where}.schema")


def _payload(kind: Constraint, value, where: str) -> bytes | None:
    if kind == Constraint.JSON_OBJECT:
        if value is not True:
            raise StructuredError(f"'{where}' must be true, got {value!r}")
        return None
    if kind == Constraint.JSON:
        if isinstance(value, str):  # vLLM takes a schema as its JSON text too
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise StructuredError(f"'{where}' is not JSON ({exc})") from None
        if not isinstance(value, (dict, bool)):
            raise StructuredError(f"'{where}' must be a JSON schema (an object), got {type(value).__name__}")
        try:
            return compact_json(value)
        except ValueError as exc:
            raise StructuredError(f"'{where}' holds a number JSON cannot write ({exc})") from None
    if kind == Constraint.CHOICE:
        if (not isinstance(value, list) or not value or len(value) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in value)):
            raise StructuredError(f"'{where}' must be a list of 1 to {MAX_CHOICES} non-empty strings")
        return compact_json(value)
    if not isinstance(value, str) or not value:
        raise StructuredError(f"'{where}' must be a non-empty string")
    return value.encode()


def _only(obj: dict, allowed: set, where: str) -> None:
    extra = sorted(set(obj) - allowed)
    if extra:
        raise StructuredError(f"'{where}' has unknown field(s) {', '.join(extra)}")


def words_of(s: Structured) -> list[int]:
    """The wire words of a constraint: kind | switches << 8, then the digest (4 little-endian words)."""
    d = s.digest
    return [int(s.kind) | s.switches << 8, *(int.from_bytes(d[i : i + 4], "little") for i in range(0, DIGEST_BYTES, 4))]


WORDS = 1 + DIGEST_BYTES // 4


def from_words(words) -> Structured:
    """A constraint from its wire words (`words_of`); StructuredError when they are not one."""
    if len(words) != WORDS:
        raise StructuredError("a constraint is cut short")
    head = int(words[0])
    try:
        kind = Constraint(head & 0xFF)
    except ValueError:
        raise StructuredError(f"constraint kind {head & 0xFF} is not known") from None
    switches = head >> 8
    if switches & ~SWITCHES_ALL:
        raise StructuredError(f"constraint switches {switches:#x} are not known")
    digest = b"".join(int(w).to_bytes(4, "little") for w in words[1:])
    if (digest == NO_DIGEST) != (kind == Constraint.JSON_OBJECT):
        raise StructuredError("a constraint's digest does not fit its kind")
    return Structured(kind, digest, switches)
