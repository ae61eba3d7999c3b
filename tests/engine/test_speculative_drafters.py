"""Drafters propose continuations; the n-gram drafter copies what followed the longest earlier match."""

from __future__ import annotations

import pytest

from infernix_jax.engine.speculative.drafters import (
    CombinedDrafter,
    MtpDrafter,
    NgramDrafter,
    make_drafter,
    ngram_lookup,
)


def test_ngram_copies_the_continuation_of_the_longest_match():
    #         0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7] occurs at 1 and 6 (latest: 6 -> continues 3, 4); no longer suffix matches
    assert ngram_lookup(tokens, 3, min_match=2, max_match=4) == [3, 4, 6]
    # a longer match wins over a later shorter one: suffix [5, 6, 7] matches at 0 only
    assert ngram_lookup(tokens + [1, 5, 6, 7], 2, min_match=2, max_match=4) == [8, 9]


def test_ngram_proposes_nothing_without_a_match_of_min_length():
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 4, min_match=2, max_match=4) == []
    assert ngram_lookup([1, 2, 3, 4, 5, 3], 4, min_match=1, max_match=4) == [4, 5, 3]
    assert ngram_lookup([7], 4, min_match=1, max_match=4) == []
    assert ngram_lookup([1, 2, 1, 2], 0, min_match=1, max_match=2) == []


def test_ngram_respects_its_own_token_limit():
    tokens = list(range(20)) + list(range(5))
    assert NgramDrafter(min_match=2, max_match=3, max_tokens=4).propose(tokens, [], 10) == [5, 6, 7, 8]
    assert NgramDrafter(min_match=2, max_match=3, max_tokens=4).propose(tokens, [], 2) == [5, 6]


def test_combined_prefers_ngram_and_falls_back_to_the_mtp_chain():
    drafter = CombinedDrafter(NgramDrafter(min_match=2))
    assert drafter.propose([1, 2, 3, 1, 2], [9, 9, 9], 2) == [3, 1]
    assert drafter.propose([1, 2, 3, 4], [9, 8, 7], 2) == [9, 8]
    assert MtpDrafter().propose([1], [4, 5, 6], 2) == [4, 5]


def test_make_drafter_names():
    assert make_drafter("none") is None
    assert isinstance(make_drafter("ngram"), NgramDrafter)
    assert make_drafter("mtp").uses_mtp and make_drafter("mtp+ngram").uses_mtp
    assert not make_drafter("ngram").uses_mtp
    with pytest.raises(ValueError):
        make_drafter("eagle")
