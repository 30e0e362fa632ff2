"""Draft trees with every drafter kind (issue 36): DFlash 2's selector pair scores and DSpark's Markov head shape
trees whose children depend on their parent; verified in one batch, the output stays the target's.

The live DSpark tests use a drafter whose Markov head is a bigram table of the target's own greedy reply (W1 of a
token points at the rank dimensions of the tokens that followed it, W2 maps each dimension to its token): its
drafts are right wherever that table is, and a token followed by two different ones puts both among the
candidates, so its trees are accepted deep and off the likeliest chain.
"""

from __future__ import annotations

from collections import Counter
from itertools import islice
from pathlib import Path

import numpy as np
import pytest

from chi_square import chi_square_p_value
from dflash_gguf import Session
from dflash_gguf.sampling import SamplingParams, adjusted_logits, probabilities
from dflash_gguf.target import Target
from dflash_gguf.kinds.dflash2.head import PairCandidates
from dflash_gguf.kinds.dspark.head import MarkovCandidates, MarkovHead
from dflash_gguf.kinds.head import SlotCandidates, candidates, top
from dflash_gguf.tree import TreeShaper, grow_tree, walk_greedy

ALPHA = 1e-3
N_CTX = 512
V = 50


# --- the candidates of each kind -------------------------------------------------------------------


def _lattice(rng: np.random.Generator, slots: int, k: int, dim: int = 40) -> np.ndarray:
    """A DFlash 2 selector lattice: per slot k candidate ids (distinct), then k x k pair scores."""
    rows = np.zeros((slots, dim), np.float32)
    for i in range(slots):
        rows[i, :k] = rng.choice(V, size=k, replace=False)
        rows[i, k : k + k * k] = rng.normal(0, 2, k * k)
    return rows


def test_dflash2_children_are_ranked_by_the_pair_scores_given_the_parents_candidate():
    k = 4
    lattice = _lattice(np.random.default_rng(0), 6, k)
    c = PairCandidates(lattice, k)
    scores = lattice[:, k : k + k * k].astype(np.float64).reshape(6, k, k)
    for depth in range(6):
        parents = [(0, -1)] if depth == 0 else [(j, int(lattice[depth - 1, j])) for j in range(k)]
        for j, token in parents:  # the anchor is candidate 0, where the selector's decode starts
            ids, q = c.after(depth, token)
            z = np.exp(scores[depth, max(j, 0)] - scores[depth, max(j, 0)].max())
            order = np.argsort(-z, kind="stable")
            assert ids.tolist() == lattice[depth, :k][order].astype(int).tolist()
            np.testing.assert_allclose(q, (z / z.sum())[order])
    # the likeliest chain of a tree is the selector's greedy decode (Drafter._walk_lattice): each slot's best
    # candidate given the previous pick
    tree = grow_tree(7, lambda path: c.after(len(path) - 1, path[-1]), 6, 40)
    prev, chain = 0, []
    for i in range(6):
        prev = int(scores[i, prev].argmax())
        chain.append(int(lattice[i, prev]))
    assert list(tree.tokens[1 : tree.first_leaf + 1]) == chain
    assert len({tuple(c.after(1, int(lattice[0, j]))[0]) for j in range(k)}) > 1  # children differ by parent


def test_dflash_candidates_are_the_whole_rows_top_k_and_softmax(embedded_session):
    """The shipped drafter's vocabulary is reduced (d2t): most of each slot's logits are -inf. Its candidates, read
    over the finite columns and slot by slot as a tree asks, are the top k of the whole row, and their
    probabilities its softmax computed over every column in float64."""
    drafter = embedded_session.drafter
    rows = np.array(drafter.draft(1, drafter.pos_max() + 1, 6))  # past what it holds, which it keeps
    assert np.isneginf(rows).sum() > rows.size // 2  # what makes the finite columns worth reading alone
    z = rows.astype(np.float64) - rows.max(axis=1, keepdims=True)
    want_q = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    k = 8
    lazy = SlotCandidates.from_logits(rows, k)
    ids, q = top(rows, k)
    for d in (3, 0, 5):  # in any order
        got_ids, got_q = lazy.after(d, 0)
        assert got_ids.tolist() == ids[d].tolist() == np.argsort(-rows[d], kind="stable")[:k].tolist()
        np.testing.assert_allclose(got_q, want_q[d, got_ids], rtol=1e-12)
        assert lazy.after(d, 123)[0].tolist() == got_ids.tolist()  # a slot's candidates are the same after any parent
    few = np.full((2, 10), -np.inf, np.float32)
    few[:, 4] = 1.0
    few[:, 7] = 0.0  # fewer finite columns than k: those first, the rest at probability 0
    ids, q = top(few, 3)
    assert ids[:, :2].tolist() == [[4, 7], [4, 7]]
    np.testing.assert_allclose(q, [[np.e / (np.e + 1), 1 / (np.e + 1), 0.0]] * 2)


def _head(rng: np.random.Generator, rank: int = 6) -> MarkovHead:
    return MarkovHead(rng.normal(0, 1, (V, rank)).astype(np.float32), rng.normal(0, 1, (V, rank)).astype(np.float32),
                      None, None)


def test_dspark_children_re_run_the_markov_head_on_their_parents_token():
    rng = np.random.default_rng(1)
    head = _head(rng)
    anchor, k = 3, 5
    rows = rng.normal(0, 1, (5, V)).astype(np.float32)  # as the graph left them: chained on its own argmax
    scale = lambda x: 2.0 * x  # noqa: E731  (the drafter's output transforms)
    c = MarkovCandidates(rows, anchor, head, scale, k)
    graph_prev = [anchor] + [int(r.argmax()) for r in rows[:-1]]
    for depth in range(5):
        for token in (graph_prev[depth], 11, 29):
            want = 2.0 * (rows[depth] + head.w2 @ (head.w1[token] - head.w1[graph_prev[depth]]))
            ids, q = c.after(depth, token)
            assert ids.tolist() == candidates(want[None], k)[0].tolist()
            p = np.exp(want - want.max())
            np.testing.assert_allclose(q, (p / p.sum())[ids], rtol=1e-5)
    # the likeliest chain is the greedy draft (the graph's own argmax chain); off it, children follow their parent
    tree = grow_tree(anchor, lambda path: c.after(len(path) - 1, path[-1]), 5, 24)
    assert tree.first_leaf >= 2
    assert list(tree.tokens[1 : tree.first_leaf + 1]) == [int(r.argmax()) for r in rows][: tree.first_leaf]
    off = [r for r in range(1, len(tree)) if tree.ranks[r] > 0 and tree.children(r)]
    assert off
    for r in off:
        kid = tree.children(r)[0]
        assert tree.tokens[kid] == int(c.after(tree.depths[r], tree.tokens[r])[0][0])


def test_the_shaper_learns_from_the_candidates_its_accepted_path_offered():
    """A parent-dependent tree's calibration reads, at each slot of the accepted path, the candidates that path's
    node offered (not the chain's): the target always takes the second candidate, whose children differ."""

    class Offsets:  # after token t at depth d: candidates t+1, t+2, ... (a function of the parent)
        n_slots = 3

        def after(self, depth, token):
            return np.arange(token + 1, token + 5), np.array([0.5, 0.25, 0.15, 0.1])

    shaper = TreeShaper(3, 10, k=4)
    q = np.array([[0.5, 0.25, 0.15, 0.1]])
    before = shaper.acceptance.accept_at(1, q[0]).copy()
    n_past = 100
    for i in range(200):
        tree = shaper.shape_from(0, n_past, Offsets())
        if i == 0:
            assert tree.tokens[1:3] == (1, 2)  # the chain: 1, then 1's first candidate
        # the target takes each node's second candidate: 2, then 4, then 6 (the bonus, past the deepest slot)
        path, bonus = walk_greedy(tree, lambda row: tree.tokens[row] + 2)
        shaper.observe(n_past, [tree.tokens[r] for r in path])
        n_past += len(path)
        shaper.observe(n_past, [bonus])
    after = shaper.acceptance.accept_at(1, q[0])
    assert after[1] > before[1] + 0.2 and after[0] < before[0] - 0.2
    assert shaper.acceptance.accept_at(3, q[0])[1] > 0.6  # slot 3's too: the path reached it through its own nodes
    assert isinstance(SlotCandidates(np.zeros((2, 3)), np.ones((2, 3)) / 3).after(1, 0)[0], np.ndarray)


# --- live: Sessions on DFlash 2 and DSpark drafters ------------------------------------------------------


PROMPTS = ["The capital of France is", "List three uses of a paperclip."]


@pytest.fixture(scope="module")
def plain(embedded_target):
    """Plain greedy replies (48 tokens) of the raw prompts, and their token ids."""
    with Session(n_ctx=N_CTX, n_batch=64, n_threads=1, lookup=False) as s:
        out = []
        for p in PROMPTS:
            tokens = s.tokenize(p)
            out.append((tokens, s.generate_tokens(tokens, max_tokens=48, temperature=0.0, speculative=False).tokens))
        return out


def _bigram_dspark(root: Path, target: Path, replies: list[list[int]], rank: int) -> Path:
    """An anchor-first DSpark drafter whose Markov head drafts the bigrams of `replies` (see the module's doc)."""
    import torch
    from safetensors.torch import load_file, save_file

    from dflash_gguf.convert import convert_checkpoint
    from dspark_reference import make_dspark_checkpoint

    ck = make_dspark_checkpoint(root / "bigram", anchor_first=True, confidence=False, rank=rank)
    state = load_file(ck / "model.safetensors")
    w1 = torch.zeros_like(state["markov_head.markov_w1.weight"], dtype=torch.float32)
    w2 = torch.zeros_like(state["markov_head.markov_w2.weight"], dtype=torch.float32)
    dim: dict[int, int] = {}
    for reply in replies:
        for prev, nxt in zip(reply, reply[1:]):
            if nxt not in dim and len(dim) < rank:
                dim[nxt] = len(dim)
                w2[nxt, dim[nxt]] = 16.0
            if nxt in dim:
                w1[prev, dim[nxt]] = 16.0  # 256 over the base logits: the bigram's next token is the argmax
    state["markov_head.markov_w1.weight"] = w1.to(torch.bfloat16)
    state["markov_head.markov_w2.weight"] = w2.to(torch.bfloat16)
    save_file(state, ck / "model.safetensors")
    return convert_checkpoint(ck, root / "bigram.gguf", target=target, progress=False)


@pytest.fixture(scope="module")
def bigram_dspark(tmp_path_factory, embedded_target, plain):
    return _bigram_dspark(tmp_path_factory.mktemp("bigram"), embedded_target, [r for _, r in plain], 32)


def _greedy_trees(drafter: Path, plain, tree_nodes: int = 16) -> list:
    """Greedy replies with trees of `tree_nodes` rows against plain decoding's, token for token; the tree steps."""
    trees = []
    with Session(drafter=str(drafter), n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=tree_nodes, lookup=False) as s:
        assert s.tree_disabled_reason is None
        for tokens, reply in plain:
            s.reset()
            steps = list(s.stream_tokens(tokens, max_tokens=48, block_size=8))
            assert [t for st in steps for t in st.tokens] == reply
            trees += [st for st in steps if st.tree_nodes]
    assert trees and all(st.tree_nodes <= tree_nodes for st in trees)
    return trees


@pytest.mark.slow  # builds a DSpark drafter; two Sessions
def test_dspark_trees_equal_plain_decoding_and_win_off_the_chain(bigram_dspark, plain):
    """Greedy output is plain decoding's; the trees' chains are accepted deep and trees won off the chain.
    (Here every off-chain win is the last token its cycle accepts, so these replies do not tell re-conditioned
    children from the graph's own: test_dspark_children_re_run_the_markov_head_on_their_parents_token does.)"""
    trees = _greedy_trees(bigram_dspark, plain)
    assert sum(st.n_accepted for st in trees) > 2 * len(trees)
    assert any(st.tree_branch > 0 and st.n_accepted > 0 for st in trees), [(st.n_accepted, st.tree_branch) for st in trees]


@pytest.mark.slow  # a DFlash 2 Session
def test_dflash2_trees_equal_plain_decoding(dflash2_gguf_path, plain):
    """A random-weight DFlash 2 drafter (nothing it drafts is the target's token): trees of its selector's
    candidates are verified, branches and all, and the output is plain decoding's."""
    trees = _greedy_trees(dflash2_gguf_path, plain)
    assert all(st.n_accepted == 0 for st in trees) and max(st.tree_nodes for st in trees) > 8


@pytest.mark.slow  # 90 sampled generations per kind
@pytest.mark.parametrize("kind", ["dspark", "dflash2"])
def test_sampled_trees_of_every_kind_follow_the_target(kind, request, embedded_target, plain):
    """Sampling at t=1 with 16-row trees: the first token (the prefill's) follows the target's row, and the
    second, the first tree cycle's after the likeliest first token (a child the walk accepted, or the residual),
    that token's row."""
    drafter = request.getfixturevalue("bigram_dspark" if kind == "dspark" else "dflash2_gguf_path")
    params = SamplingParams(temperature=1.0, logit_bias={0: -float("inf"), 2: -float("inf")})
    prompt = plain[0][0]
    runs, accepted = [], 0
    with Session(drafter=str(drafter), n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16, lookup=False) as s:
        for seed in range(90):  # the likeliest first token is ~0.9 of them
            # a third token leaves room for a draft: the first cycle's tree is the 1 slot's candidates, 16 wide;
            # the prefill and that cycle are all the test reads (the generation is closed there)
            steps = list(islice(s.stream_tokens(prompt, max_tokens=3, block_size=8, seed=seed, temperature=1.0,
                                                logit_bias=params.logit_bias), 2))
            assert steps[1].tree_nodes > 2  # the second token came from a tree's cycle
            runs.append([t for st in steps for t in st.tokens][:2])
            accepted += steps[1].n_accepted
    assert all(len(r) == 2 for r in runs)
    if kind == "dspark":
        assert accepted > 10  # the bigram drafts are accepted under sampling too
    _assert_follows_the_target(embedded_target, prompt, runs, params)


def _assert_follows_the_target(target: Path, prompt: list[int], runs: list[list[int]], params: SamplingParams) -> None:
    """χ²: each run's first token against the target's row after the prompt; the second, in the runs whose first
    was the likeliest, against the row after that token."""
    with Target.open(target, n_ctx=N_CTX, n_threads=1) as ref:
        def exact(tokens):
            ref.clear()
            ref.decode(tokens, 0)
            return probabilities(adjusted_logits(ref.output_logits()[-1:], params), params)[0]

        assert chi_square_p_value([r[0] for r in runs], exact(prompt)) > ALPHA
        head = Counter(r[0] for r in runs).most_common(1)[0][0]
        second = [r[1] for r in runs if r[0] == head]
        assert len(second) >= 50, len(second)
        assert chi_square_p_value(second, exact(prompt + [head])) > ALPHA
