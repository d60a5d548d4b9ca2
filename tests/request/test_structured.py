"""Constraints (structured outputs): read from `response_format` and `structured_outputs` with errors
that name the field, carried as five option words that read back exactly, and stored by digest."""

from __future__ import annotations

import json

import numpy as np
import pytest

from shmbroker.request.options import OptionsError, decode, encode, parse_options
from shmbroker.request.structured import NO_DIGEST, Constraint, Switch, digest_of

SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"enum": ["x", "y"]}}, "required": ["b"]}


def test_each_constraint_reads_back_exactly_and_names_its_payload_by_digest():
    bodies = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}},
         Constraint.JSON),
        ({"response_format": {"type": "json_object"}}, Constraint.JSON_OBJECT),
        ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, Constraint.JSON),
        ({"structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}}, Constraint.REGEX),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, Constraint.CHOICE),
        ({"structured_outputs": {"grammar": "root ::= \"a\""}}, Constraint.GRAMMAR),
        ({"structured_outputs": {"json_object": True}}, Constraint.JSON_OBJECT),
    ]
    for body, kind in bodies:
        opts = parse_options(body)
        s = opts.structured
        assert s.kind == kind
        assert (s.digest == NO_DIGEST) == (kind == Constraint.JSON_OBJECT)
        if s.payload is not None:
            assert digest_of(s.payload) == s.digest
        back = decode(encode(opts))
        assert back == opts and back.structured.payload is None  # the payload itself is not on the wire
    # a schema's payload keeps its property order (the order the engine generates them in)
    s = parse_options(bodies[0][0]).structured
    assert list(json.loads(s.payload)["properties"]) == ["b", "a"]
    assert parse_options(bodies[2][0]).structured.digest == s.digest  # the same schema, given as text: one payload
    assert parse_options(bodies[3][0]).structured.has(Switch.DISABLE_ANY_WHITESPACE)
    assert parse_options({"response_format": {"type": "text"}}).structured is None


@pytest.mark.parametrize("body, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": []}}}, "json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "x": 1}}}, "unknown"),
    ({"response_format": {"type": "structural_tag"}}, "not served"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "one constraint"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"choice": ["a", 3]}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "whitespace_pattern"),
    ({"structured_outputs": {"disable_any_whitespace": True}}, "no constraint"),
    ({"structured_outputs": {"regex": "a", "disable_any_whitespace": "yes"}}, "disable_any_whitespace"),
    ({"structured_outputs": {"bogus": 1}}, "bogus"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "one constraint"),
])
def test_a_wrong_constraint_is_refused_naming_its_field(body, words):
    with pytest.raises(OptionsError, match=words):
        parse_options(body)


def test_a_garbled_constraint_word_never_reads_as_another_constraint():
    words = encode(parse_options({"temperature": 0.5, "structured_outputs": {"choice": ["a", "b"]}}))
    start = words.size - 5  # the constraint is the last field: kind word, then the digest
    for k, bad in [(0, 0), (0, 9), (0, 0xFF00 | 4), (1, 0)]:
        w = words.copy()
        w[start + k] = bad
        if k == 1:  # the digest all zero: only json_object has none
            w[start + 1 : start + 5] = 0
        with pytest.raises(OptionsError):
            decode(w)
    with pytest.raises(OptionsError):
        decode(words[:-1])
    json_object = encode(parse_options({"response_format": {"type": "json_object"}}))
    w = json_object.copy()
    w[-1] = 7  # json_object with a digest
    with pytest.raises(OptionsError):
        decode(w)
    assert decode(np.asarray(words)).structured.kind == Constraint.CHOICE
