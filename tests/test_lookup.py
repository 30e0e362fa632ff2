"""The n-gram lookup index: what it finds, what it does not, and what a cycle costs it (counted, not timed)."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.lookup import DEFAULT_MAX_MATCH, NgramIndex, lookup_profile, match_bucket


def indexed(tokens: list[int], **kw) -> NgramIndex:
    """An index over `tokens`, a list the caller owns and appends to (as the loop's CacheState does)."""
    index = NgramIndex(tokens, **kw)
    index.extend_to(len(tokens))
    return index


def test_a_planted_repeat_is_found_and_its_continuation_copied():
    rng = np.random.default_rng(0)
    planted = rng.integers(0, 50_000, 40).tolist()
    text = rng.integers(0, 50_000, 300).tolist() + planted + rng.integers(0, 50_000, 200).tolist()
    index = indexed(text + planted[:9])  # the repeat has started again: 9 tokens in, the 10th is `last`
    m = index.match(planted[9])
    assert m is not None
    assert m.pos == 300 + 10  # the token after planted[9] in its first occurrence
    assert m.length == 10  # the random token before the planted block differs (almost surely)
    assert index.continuation(m, planted[9], 20) == planted[10:30]


def test_random_text_has_no_matches():
    rng = np.random.default_rng(1)
    seq = rng.integers(0, 50_000, 3000).tolist()
    index = indexed(seq)
    hits = 0
    for last in rng.integers(0, 50_000, 300).tolist():
        hits += index.match(last) is not None
        seq.append(last)
        index.extend_to(len(seq))
    assert hits == 0


def test_a_repeating_pattern_drafts_past_the_end_of_the_text():
    index = indexed([7, 8, 9, 7, 8])
    m = index.match(9)  # "... 7 8 [9]": seen at position 0..2
    assert m is not None and m.length == 3
    assert index.continuation(m, 9, 7) == [7, 8, 9, 7, 8, 9, 7]


def test_the_longest_agreement_wins_among_recent_occurrences():
    a = [1, 2, 3, 4, 5, 6]
    index = indexed([9, 9, 1, 2, 3, 4, 5, 6, 10] + [0, 0, 5, 6, 11] + [1, 2, 3, 4, 5], sizes=(2,), candidates=4, max_match=8)
    m = index.match(6)  # suffix "1 2 3 4 5 [6]": the first occurrence agrees 6 back, the second only 2
    assert m is not None and m.length == 6
    assert index.continuation(m, 6, 1) == [10]
    assert a  # the planted run


def _cycle_ops(n_context: int) -> int:
    """The most ops any of 200 cycles costs after n_context tokens of a text that repeats (every query hits)."""
    pattern = list(range(1000, 1100))
    seq = (pattern * (n_context // len(pattern) + 1))[:n_context]
    index = indexed(seq)
    worst = 0
    pos = n_context
    for _ in range(200):
        before = index.ops
        last = pattern[pos % len(pattern)]
        m = index.match(last)
        assert m is not None and m.length == DEFAULT_MAX_MATCH
        draft = index.continuation(m, last, 16)
        seq += [last] + draft[:5]  # a cycle commits last + 5 accepted tokens
        index.extend_to(len(seq))
        pos += 6
        worst = max(worst, index.ops - before)
    return worst


def test_a_cycle_costs_the_same_at_any_context_length():
    small, large = _cycle_ops(1_000), _cycle_ops(50_000)
    assert small == large
    # a constant: one insertion per size per committed token, one read per size, candidates x max_match compares
    index = NgramIndex()
    bound = 6 * len(index.sizes) + len(index.sizes) + index.candidates * (DEFAULT_MAX_MATCH + 1) + 16
    assert large <= bound


def test_truncate_undoes_exactly_the_dropped_tokens():
    rng = np.random.default_rng(2)
    text = rng.integers(0, 20, 400).tolist()  # small vocabulary: many repeated n-grams
    seq = list(text)
    a, b = indexed(seq), indexed(text[:250])
    a.truncate(250)  # the index first: undoing reads the n-grams the dropped tokens closed
    del seq[250:]
    assert a.tokens is seq and len(a) == len(b) == 250 and a._tables == b._tables
    for last in range(20):
        assert a.match(last) == b.match(last)
    a.truncate(0)  # reads nothing: the owner may already have emptied the sequence
    seq.clear()
    assert len(a) == 0 and not any(a._tables.values())


def test_the_index_holds_no_tokens_of_its_own():
    """It reads its owner's list: what the owner appends is indexed in place, and a tail the owner dropped
    first cannot be undone (a clear error, not wrong tables)."""
    seq = [5, 6, 7]
    index = indexed(seq)
    seq += [5, 6]
    index.extend_to(len(seq))
    assert index.tokens is seq and len(index) == 5
    assert index.match(7) is not None and index.continuation(index.match(7), 7, 2) == [5, 6]
    with pytest.raises(ValueError):
        index.extend_to(6)  # the owner holds 5
    del seq[3:]
    with pytest.raises(RuntimeError, match="truncate the index before the sequence"):
        index.truncate(3)
    with pytest.raises(RuntimeError, match="another sequence"):
        index.attach([1, 2])


def test_acceptance_is_learnt_per_match_length():
    stats = lookup_profile()
    short, long_ = stats.acceptance(2), stats.acceptance(32)
    assert long_ > short  # the prior trusts long matches more
    for _ in range(30):
        stats.observe(2, 4, 0)  # short matches: the first token always fails
        stats.observe(20, 8, 8)  # long matches: all pass
    assert stats.acceptance(2) < 0.25 < short
    assert stats.acceptance(20) > 0.9
    assert match_bucket(20) != match_bucket(2)
    e = stats.expected_tokens(20, 8)
    assert len(e) == 9 and e[0] == 1.0 and e[8] > 6


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError):
        NgramIndex(sizes=(0, 2))
    with pytest.raises(ValueError):
        NgramIndex(candidates=0)
    with pytest.raises(ValueError):
        NgramIndex(sizes=(2, 40), max_match=32)
    with pytest.raises(ValueError):
        lookup_profile().observe(2, 1, 2)
