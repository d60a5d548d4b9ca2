"""A result's extras words (request/extras.py): samples, finish reasons, cached tokens and logprobs
read back exactly; words that are not extras, or too many of them, are refused with a reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shmbroker.request.extras import EXTRAS_MAX_WORDS, ExtrasError, Logprobs, decode_extras, encode_extras


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(0, 30), min_size=1, max_size=6), k=st.one_of(st.none(), st.integers(0, 20)),
       cached=st.one_of(st.none(), st.integers(0, 1 << 20)), seed=st.integers(0, 1 << 30))
def test_extras_read_back_exactly(lengths, k, cached, seed):
    rng = np.random.default_rng(seed)
    stopped = [bool(x) for x in rng.integers(0, 2, len(lengths))]
    logprobs = None if k is None else [
        Logprobs(-rng.random(n).astype(np.float32), rng.integers(0, 1 << 32, (n, k), dtype=np.uint32),
                 -rng.random((n, k)).astype(np.float32)) for n in lengths]
    words = encode_extras(lengths, stopped, cached, logprobs)
    back = decode_extras(words, sum(lengths))
    assert (back.lengths, back.stopped, back.cached_tokens) == (tuple(lengths), tuple(stopped), cached)
    if k is None:
        assert back.logprobs is None
    else:
        for a, b in zip(back.logprobs, logprobs):
            assert np.array_equal(a.token, b.token) and np.array_equal(a.top_ids, b.top_ids)
            assert np.array_equal(a.top, b.top) and a.top_ids.shape == (b.token.size, k)
    with pytest.raises(ExtrasError):
        decode_extras(words, sum(lengths) + 1)


def test_logprobs_past_what_a_result_carries_are_refused_by_size():
    n = EXTRAS_MAX_WORDS // 41 + 1  # 41 words a token with top_logprobs 20
    lp = Logprobs(np.zeros(n, np.float32), np.zeros((n, 20), np.uint32), np.zeros((n, 20), np.float32))
    with pytest.raises(ExtrasError, match="more than a result carries"):
        encode_extras([n], [False], None, [lp])
    assert encode_extras([n], [False]).size == 3  # without logprobs the same result is three words


def test_a_vector_and_logprobs_are_written_back_as_they_were_read():
    """`words_of` (what a cluster node forwards) gives back the very words: a vector's mark and
    cached count, samples with their logprobs."""
    from shmbroker.request.extras import vector_extras, vector_words, words_of

    v = np.linspace(-1, 1, 37, dtype=np.float32)
    words = vector_extras(12)
    got = decode_extras(words, vector_words(v).size)
    assert got.vector and got.cached_tokens == 12 and got.lengths == (37,)
    assert np.array_equal(words_of(got), words)
    lp = Logprobs(np.array([-0.5, -1.25], np.float32), np.array([[3, 4], [5, 6]], np.uint32),
                  np.array([[-0.5, -2.0], [-1.25, -3.0]], np.float32))
    words = encode_extras([2], [True], None, [lp])
    assert np.array_equal(words_of(decode_extras(words, 2)), words)
