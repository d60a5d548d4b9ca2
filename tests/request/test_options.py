"""Request options: checked at the producer with errors that name the field, and carried as words
that read back bit-exact (a flipped or missing word is an error, never other options)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.request.options import (
    GENERATE_OPTIONS,
    MAX_N,
    OptionsError,
    RequestOptions,
    decode,
    encode,
    parse_options,
    refused_fields,
)

FULL = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05, "seed": -12345678901234,
        "stop": ["\n\n", "Ünïcødé 🙂"], "stop_token_ids": [2, 0xFFFFFFFF], "n": 4, "presence_penalty": -1.5,
        "frequency_penalty": 0.25, "repetition_penalty": 1.1, "min_tokens": 3, "ignore_eos": False,
        "logprobs": True, "top_logprobs": 20,
        "structured_outputs": {"regex": "[a-z]+", "disable_any_whitespace": True}}


def test_every_option_parses_and_reads_back_exactly():
    opts = parse_options(FULL, max_tokens=16)
    # every generation option, the constraint (`structured`) read from its body field
    assert set(opts.given()) == set(GENERATE_OPTIONS) == set(FULL) - {"structured_outputs"} | {"structured"}
    assert opts.stop == ("\n\n", "Ünïcødé 🙂") and opts.stop_token_ids == (2, 0xFFFFFFFF)
    words = encode(opts)
    assert words.dtype == np.uint32
    assert decode(words) == opts
    assert decode(words.copy()).temperature == 0.8  # a double: bit-exact, not a float32's 0.800000011


def test_an_embeddings_options_read_back_exactly():
    opts = parse_options({"embed": True, "dimensions": 256})
    assert decode(encode(opts)) == opts and encode(opts).size == 4  # the mask, a bool, an int64
    words = encode(opts)
    words[1] = 0  # embed false: not the one encoding of any options
    with pytest.raises(OptionsError):
        decode(words)


def test_no_options_cost_no_words():
    assert encode(None).size == 0 and encode(RequestOptions()).size == 0
    assert not parse_options({"model": "m", "prompt": [1]}) and decode(np.zeros(0, np.uint32)) == RequestOptions()
    assert RequestOptions().samples == 1 and RequestOptions(n=3).samples == 3


def test_a_shared_set_is_small():
    """A job's usual set (temperature, top_p, a seed, a stop token) is a few words per item."""
    words = encode(parse_options({"temperature": 0.7, "top_p": 0.95, "seed": 7, "stop_token_ids": [2]}))
    assert words.size == 9


@pytest.mark.parametrize("body, field", [
    ({"temperature": -0.1}, "temperature"), ({"temperature": 2.5}, "temperature"),
    ({"temperature": "hot"}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"top_p": 0}, "top_p"), ({"top_p": 1.01}, "top_p"), ({"top_k": 1.5}, "top_k"), ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"), ({"seed": 1 << 63}, "seed"), ({"seed": "7"}, "seed"), ({"seed": True}, "seed"),
    ({"n": 0}, "n"), ({"n": MAX_N + 1}, "n"), ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": -1}, "min_tokens"), ({"ignore_eos": 1}, "ignore_eos"), ({"logprobs": "yes"}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": 2}, "top_logprobs"),
    ({"stop": 5}, "stop"), ({"stop": [""]}, "stop"), ({"stop": ["x"] * 17}, "stop"), ({"stop": ["é" * 200]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"stop_token_ids": "2"}, "stop_token_ids"),
    ({"stop_token_ids": [1] * 65}, "stop_token_ids"),
])
def test_a_wrong_option_is_a_clear_error_naming_it(body, field):
    with pytest.raises(OptionsError, match=f"'{field}'"):
        parse_options(body)


def test_min_tokens_past_max_tokens_is_refused():
    with pytest.raises(OptionsError, match="'min_tokens' \\(9\\) is more than 'max_tokens' \\(8\\)"):
        parse_options({"min_tokens": 9}, max_tokens=8)


def test_fields_no_engine_honours_are_named():
    assert refused_fields({"model": "m", "tools": [], "logit_bias": {}, "temperature": 1}) == ["tools", "logit_bias"]


def test_words_that_are_not_options_are_refused():
    words = encode(parse_options(FULL))
    for bad in (words[:-1], np.append(words, 0), np.array([0x12345678], np.uint32),
                np.array([(0xA5 << 24) | (1 << 23)], np.uint32), words[:3]):
        with pytest.raises(OptionsError):
            decode(bad)


floats = lambda lo, hi: st.floats(lo, hi, allow_nan=False)  # noqa: E731
option_sets = st.fixed_dictionaries({}, optional={
    "temperature": floats(0, 2), "top_p": floats(1e-9, 1), "top_k": st.integers(-1, 1000), "min_p": floats(0, 1),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1), "n": st.integers(1, MAX_N),
    "stop": st.lists(st.text(min_size=1, max_size=20), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 0xFFFFFFFF), max_size=8),
    "presence_penalty": floats(-2, 2), "frequency_penalty": floats(-2, 2), "repetition_penalty": floats(1e-6, 2),
    "min_tokens": st.integers(0, 100), "ignore_eos": st.booleans(), "logprobs": st.just(True),
    "top_logprobs": st.integers(0, 20),
}).map(lambda body: {**body, "logprobs": True} if "top_logprobs" in body else body)


@settings(max_examples=300, deadline=None)
@given(option_sets)
def test_any_option_set_reads_back_bit_exact(body):
    opts = parse_options(body)
    words = encode(opts)
    back = decode(words)
    assert back == opts
    assert np.array_equal(encode(back), words)


@settings(max_examples=300, deadline=None)
@given(option_sets, st.data())
def test_a_flipped_bit_never_reads_back_as_the_same_options(body, data):
    """The record's CRC is what catches damage; this checks the words themselves never alias: a
    flipped bit either fails to decode or decodes to different options."""
    words = encode(parse_options(body))
    if words.size == 0:
        return
    k = data.draw(st.integers(0, words.size - 1))
    bit = data.draw(st.integers(0, 31))
    bad = words.copy()
    bad[k] ^= np.uint32(1 << bit)
    try:
        back = decode(bad)
    except OptionsError:
        return
    assert back != parse_options(body)


def test_options_cross_hosts_in_a_header_read_back_bit_exact_or_refused():
    """A remote producer's options header: checked as a local submit checks them, its words read back
    exactly; a header that is not base64 of whole words is refused by name."""
    from shmbroker.cluster.remote import options_header
    from shmbroker.cluster.subjects import header_words

    assert options_header(None, 16) is None
    body = {"temperature": 0.5, "seed": 3, "stop": ["\n\n"], "n": 2}
    header = options_header(body, 16)
    assert decode(header_words(header, "options")) == parse_options(body)
    with pytest.raises(OptionsError, match="min_tokens"):
        options_header({"min_tokens": 20}, 16)
    for bad in ("not base64!", "", "AAA="):
        with pytest.raises(ValueError, match="options header"):
            header_words(bad, "options")
