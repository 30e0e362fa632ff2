"""Lookup trees (issue 36): where the current n-gram was followed by different continuations, a cycle verifies
the trie of them in one batch; the output stays the target's."""

from __future__ import annotations

from itertools import islice

import pytest

from dflash_gguf import Session
from dflash_gguf.lookup import LookupSource, NgramIndex, continuation_tree
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.sources import Commit

ALPHA = 1e-3
N_CTX = 512
# the n-gram "I like" was followed by apples and by pears: a tree holds both where a block holds one
PROMPT = "Alice: I like apples.\nBob: I like pears.\nAlice: I like pears.\nBob: I like apples.\nAlice: I like"


def _index(tokens: list[int]) -> NgramIndex:
    index = NgramIndex(tokens, sizes=(2,), candidates=4, max_match=8)  # every occurrence of the bigram
    index.extend_to(len(tokens))
    return index


def test_a_continuation_tree_is_the_trie_of_what_followed_each_occurrence():
    #   occurrences of "5 6": followed by 1 2 3 (agreeing 3 back), by 1 2 4 and by 7 8 9
    seq = [9, 5, 6, 1, 2, 3, 0, 4, 5, 6, 1, 2, 4, 0, 3, 5, 6, 7, 8, 9, 0, 9, 5]
    index = _index(seq)
    found = index.matches(6)
    assert [m.length for m in found] == [3, 2, 2] and found[0] == index.match(6)
    tree = continuation_tree(index, 6, found, 3, 16, lambda length: 0.9)
    paths = {tuple(tree.tokens[r] for r in tree.path(leaf)) for leaf in tree.leaves}
    assert paths == {(6, 1, 2, 3), (6, 1, 2, 4), (6, 7, 8, 9)}  # the anchor, then each continuation once
    assert [tree.tokens[r] for r in range(tree.first_leaf + 1)] == [6, 1, 2, 3]  # the best match's first
    # a child's chance: the acceptance times its share of the occurrences through its parent (best: 3, others: 1)
    row = {tuple(tree.tokens[r] for r in tree.path(i)): i for i in range(len(tree))}
    assert tree.probs[row[(6, 1)]] == pytest.approx(0.9 * 4 / 5)
    assert tree.probs[row[(6, 7)]] == pytest.approx(0.9 / 5)
    assert tree.probs[row[(6, 1, 2, 4)]] == pytest.approx(0.9 * 4 / 5 * 0.9 * 0.9 / 4)
    small = continuation_tree(index, 6, found, 3, 4, lambda length: 0.9)  # the budget keeps the likeliest rows
    assert small.tokens == (6, 1, 2, 3)


def test_lookup_proposes_a_tree_only_where_continuations_part():
    seq = [9, 5, 6, 1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 0, 9, 5]  # "5 6" then 1 2 3 (agreeing 3 back), and 7 8 9
    for nodes, branches in ((0, False), (8, True)):
        source = LookupSource(max_draft=8, tree_nodes=nodes, index=NgramIndex(sizes=(2,), max_match=8))
        source.observe(Commit(0, list(seq), sequence=seq))
        c = source.propose(6, len(seq), 3, SamplingParams(), None)
        assert c.tokens.tolist() == [1, 2, 3]  # the linear draft: the best match's continuation
        assert (c.tree is not None) == branches
        if branches:
            assert len(c.tree) == 4 and len(c.tree.leaves) == 2  # n_draft + 1 rows: as many as the block priced
    one = [9, 5, 6, 1, 2, 3, 0, 5]  # a single occurrence: a path, verified as the linear block
    source = LookupSource(max_draft=8, tree_nodes=8, index=NgramIndex(sizes=(2,), max_match=8))
    source.observe(Commit(0, list(one), sequence=one))
    assert source.propose(6, len(one), 3, SamplingParams(), None).tree is None
    with pytest.raises(ValueError, match="tree_nodes"):
        LookupSource(tree_nodes=1)


@pytest.fixture(scope="module")
def plain_reply(embedded_target):
    with Session(str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        tokens = s.tokenize(PROMPT)
        return tokens, s.generate_tokens(tokens, max_tokens=64, temperature=0.0, speculative=False).tokens


def test_greedy_lookup_trees_equal_plain_decoding_and_win_off_the_chain(embedded_target, plain_reply):
    """No drafter, lookup with trees of up to 16 rows in blocks of 16: plain decoding's reply, and a tree was
    accepted along a continuation that was not the best match's (where a linear block would have stopped)."""
    tokens, reply = plain_reply
    with Session(str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16) as s:
        assert s.tree_disabled_reason is None
        steps = list(s.stream_tokens(tokens, max_tokens=64, temperature=0.0, block_size=16))
        assert [t for st in steps for t in st.tokens] == reply
        trees = [st for st in steps if st.tree_nodes]
        assert trees and all(st.source == "lookup" for st in trees)
        assert any(st.tree_branch > 0 and st.n_accepted > 0 for st in trees), [
            (st.tree_nodes, st.n_accepted, st.tree_branch) for st in trees]
        assert s.last_stats.tree.cycles == len(trees)


@pytest.mark.slow  # 100 sampled generations
def test_sampled_lookup_trees_follow_the_target(embedded_target):
    """Sampling at t=1: the prompt stops before " like", which the prefill samples most often; after it, the
    n-gram "I like" was followed by " apples" and " pears", a tree of both, whose walk (or residual) gives the
    second token."""
    from test_tree_kinds import _assert_follows_the_target

    params = SamplingParams(temperature=1.0, logit_bias={0: -float("inf"), 2: -float("inf")})
    runs, accepted = [], 0
    with Session(str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16) as s:
        prompt = s.tokenize(PROMPT.removesuffix(" like"))
        for seed in range(100):  # " like" is 0.84 of the prefill's tokens
            # room for 3 drafts after the prefill: a tree of up to 4 rows; the prefill and that first cycle are
            # all the test reads (the generation is closed there)
            steps = list(islice(s.stream_tokens(prompt, max_tokens=5, block_size=16, seed=seed, temperature=1.0,
                                                logit_bias=params.logit_bias), 2))
            runs.append([t for st in steps for t in st.tokens][:2])
            accepted += steps[1].n_accepted if steps[1].tree_nodes else 0
    assert all(len(r) == 2 for r in runs) and accepted > 15, accepted
    _assert_follows_the_target(embedded_target, prompt, runs, params)
