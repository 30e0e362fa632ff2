"""Draft trees (issue 36): shaping, the one-batch verify in the real libllama, and greedy output equal to plain decoding."""

from __future__ import annotations

from collections import Counter

import llama_cpp
import numpy as np
import pytest

from chi_square import chi_square_p_value
from dflash_gguf import Session
from dflash_gguf.sampling import SamplingParams, adjusted_logits, probabilities
from dflash_gguf.target import Target
from dflash_gguf.tree import (
    AcceptanceModel, CalibratedAcceptance, TreeShaper, best_rows, build_tree, keep_path, share_prefix, target_ranks,
    walk_greedy, walk_sampled,
)

ALPHA = 1e-3

N_CTX = 512
WORDS = (" the", " a", " it", " he")


def _leaves_below(tree, row):
    return {j for j, leaf in enumerate(tree.leaves) if row in tree.path(leaf)}


def test_a_tree_keeps_the_likeliest_paths_in_depth_first_rows():
    ids = np.arange(24).reshape(6, 4) + 100
    accept = np.tile([0.6, 0.25, 0.1, 0.04], (6, 1))
    tree = build_tree(7, ids, accept, 16)
    assert len(tree) == 16 and tree.tokens[0] == 7 and tree.parents[0] == -1
    # the likeliest chain comes first: rows 0..first_leaf are the top-1 candidates of slots 1..first_leaf
    assert list(tree.tokens[1 : tree.first_leaf + 1]) == [int(ids[d, 0]) for d in range(tree.first_leaf)]
    for i in range(1, len(tree)):
        p = tree.parents[i]
        assert p < i and tree.depths[i] == tree.depths[p] + 1
        assert tree.tokens[i] == ids[tree.depths[i] - 1, tree.ranks[i]]
        assert set(tree.seq_ids(i)) == _leaves_below(tree, i)  # each row carries the ids of every leaf below it
    # best first: no node left out is likelier than the least likely node kept
    prob = {0: 1.0}
    for i in range(1, len(tree)):
        prob[i] = prob[tree.parents[i]] * accept[tree.depths[i] - 1, tree.ranks[i]]
    kept = min(prob[i] for i in range(1, len(tree)))
    for i in range(len(tree)):
        d = tree.depths[i]
        taken = {tree.ranks[c] for c in tree.children(i)}
        if d < 6:
            missing = [r for r in range(4) if r not in taken]
            if missing:
                assert prob[i] * accept[d, missing[0]] <= kept + 1e-12


def test_a_tree_of_top1_candidates_only_is_the_linear_block():
    ids = np.arange(30).reshape(15, 2)
    accept = np.zeros((15, 2))
    accept[:, 0] = 0.9
    tree = build_tree(5, ids, accept, 16)
    assert tree.is_path and tree.tokens == (5, *ids[:, 0].tolist())
    assert tree.seq_ranges == ((0, 1),) * 16


def test_the_rows_that_pay_follow_the_verify_cost_curve():
    """Where a verify costs about the same at any size (a GPU) the whole tree pays; where it grows with the rows
    (this CPU: 16 rows cost ~11.5 single steps) only its likeliest nodes do; the expected tokens decide between."""
    ids = np.arange(60).reshape(15, 4)
    tree = build_tree(1, ids, np.tile([0.5, 0.2, 0.1, 0.05], (15, 1)), 32)
    assert abs(tree.expected_tokens - (1 + sum(tree.probs[1:]))) < 1e-12 and tree.probs[0] == 1.0
    flat = lambda n: 1.0 + 1e-4 * n  # noqa: E731
    steep = lambda n: 1.0 + 0.7 * (n - 1)  # noqa: E731
    assert best_rows(tree, flat) == 32
    rows = best_rows(tree, steep)
    assert 2 <= rows < 8
    top = sorted(tree.probs[1:], reverse=True)
    rate = lambda n: (1 + sum(top[: n - 1])) / steep(n)  # noqa: E731
    assert all(rate(rows) >= rate(n) for n in range(2, 33))


def test_the_greedy_walk_follows_the_targets_tokens_down_the_tree():
    ids = np.array([[10, 11, 12], [20, 21, 22], [30, 31, 32]])
    tree = build_tree(1, ids, np.tile([0.5, 0.3, 0.1], (3, 1)), 12)
    wanted = {0: 11, 1: 20}  # the target takes slot 1's second candidate, then slot 2's first
    by_depth = lambda row: wanted.get(tree.depths[row], 99)  # noqa: E731
    path, bonus = walk_greedy(tree, by_depth)
    assert [tree.tokens[r] for r in path] == [1, 11, 20] and bonus == 99
    path, bonus = walk_greedy(tree, lambda row: 13)  # nothing matches: the anchor alone, the target's token
    assert path == [0] and bonus == 13


def _row(key: tuple[int, ...], vocab: int) -> np.ndarray:
    """A synthetic target's distribution after the tokens `key`: a function of them, as a model's is."""
    return np.random.default_rng(list(key)).dirichlet(np.full(vocab, 0.7))


@pytest.mark.parametrize("likely", [True, False], ids=["likely candidates", "unlikely candidates"])
def test_sampled_walks_commit_the_targets_distribution(likely):
    """Multi-candidate rejection: the first token follows the anchor row's p and, after a given first, the second
    follows that child's row; whether the tree holds the likeliest tokens or the least likely (then the
    residual after rejecting them does the work). χ² against the exact rows."""
    vocab = 9
    order = np.argsort(-_row((0,), vocab))
    gen = np.random.default_rng(5)
    ids = np.array([order[:4] if likely else order[-4:]] + [gen.permutation(vocab)[:4] for _ in range(2)])
    tree = build_tree(0, ids, np.tile([0.5, 0.3, 0.15, 0.05], (3, 1)), 12)
    probs = np.stack([_row(tuple(tree.tokens[r] for r in tree.path(i)), vocab) for i in range(len(tree))])
    rng = np.random.default_rng(100)
    first, second = [], {}
    for _ in range(4000):
        path, bonus = walk_sampled(tree, probs, rng)
        chosen = [tree.tokens[r] for r in path[1:]] + [bonus]
        first.append(chosen[0])
        if len(chosen) > 1:
            second.setdefault(path[1], []).append(chosen[1])
    assert chi_square_p_value(first, probs[0]) > ALPHA
    if likely:
        child = max(second, key=lambda c: len(second[c]))  # the child row taken most often
        assert len(second[child]) > 500
        assert chi_square_p_value(second[child], probs[child]) > ALPHA


def test_acceptance_models_learn_what_the_target_took():
    table = AcceptanceModel(3, 4)
    calibrated = CalibratedAcceptance(3)
    q = np.tile([0.5, 0.2, 0.1, 0.05], (3, 1))
    before = calibrated.accept(q)[0].copy()
    for _ in range(200):
        table.observe([1, 0])  # slot 1: always the second candidate; slot 2: the first
        calibrated.observe(q, [1, 0])
    t = table.table()
    assert t[0, 1] > 0.9 and t[0, 0] < 0.1 and t[1, 0] > 0.9
    after = calibrated.accept(q)[0]
    assert after[1] > before[1] and after[0] < before[0]
    assert target_ranks(np.array([[5, 6], [7, 8]]), [6, 9]) == [1, 2]


def test_the_shaper_learns_from_the_commits_that_follow_its_tree():
    shaper = TreeShaper(3, 8, k=2)
    logits = np.full((3, 50), -5.0)
    logits[:, 10], logits[:, 11] = 2.0, 1.0  # top-1 token 10, second 11, at every slot
    for i in range(300):
        n_past = 100 + 3 * i
        shaper.shape(1, n_past, logits)
        shaper.observe(n_past, [1, 11, 10])  # the target took the second candidate, then the first
        shaper.observe(n_past + 3, [12])  # the bonus (not a candidate) starts the next commit
    e = np.exp(logits[0] - logits[0].max())
    q = np.tile((e / e.sum())[[10, 11]], (3, 1))  # the drafter's probabilities of its two candidates
    acc = shaper.acceptance.accept(q)
    assert acc[0, 1] > 0.8 and acc[0, 0] < 0.2  # slot 1: the second candidate
    assert acc[2, 0] < 0.2  # slot 3: never the bonus's candidates


@pytest.fixture(scope="module")
def unified(embedded_target):
    with Target.open(embedded_target, n_ctx=N_CTX, n_seq_max=15, kv_unified=True, n_threads=1) as t:
        yield t


@pytest.fixture(scope="module")
def reference(embedded_target):
    with Target.open(embedded_target, n_ctx=N_CTX, n_threads=1) as t:
        yield t


def _word_tree(target, anchor):
    ids = np.array([[target.vocab.tokenize(w, add_special=False)[0] for w in WORDS]] * 6)
    return build_tree(anchor, ids, np.tile([0.5, 0.3, 0.1, 0.05], (6, 1)), 16)


def test_a_tree_verify_computes_every_path_as_its_linear_block_would(unified):
    """Bit for bit: each root-to-leaf path of the tree batch against that path decoded alone."""
    t = unified
    prompt = t.vocab.tokenize("The quick brown fox jumps over the lazy dog. Then")
    n_past = len(prompt) - 1
    tree = _word_tree(t, prompt[-1])
    assert len(tree.leaves) > 4
    t.clear()
    t.decode(prompt[:-1], 0, logits=False)
    share_prefix(t, tree)
    t.decode_tree(tree.tokens, [n_past + d for d in tree.depths], tree.seq_ranges)
    rows = t.output_logits().copy()
    for leaf in tree.leaves:
        path = tree.path(leaf)
        t.clear()
        t.decode(prompt[:-1], 0, logits=False)
        t.decode([tree.tokens[r] for r in path], n_past, logits=True)
        assert np.array_equal(t.output_logits(), rows[path])


@pytest.mark.parametrize("leaf", range(8))
def test_keeping_any_accepted_path_leaves_the_memory_plain_decoding_would_hold(unified, reference, leaf):
    """After keep_path, the next token's logits are those of the committed sequence decoded from scratch,
    bit for bit: the kept cells are the path's, and in position order (flash attention sums in cell order)."""
    t = unified
    prompt = t.vocab.tokenize("The quick brown fox jumps over the lazy dog. Then")
    n_past = len(prompt) - 1
    tree = _word_tree(t, prompt[-1])
    for cut in (0, 1):
        path = tree.path(tree.leaves[leaf])
        path = path[: max(1, len(path) - cut)]
        t.clear()
        t.decode(prompt[:-1], 0, logits=False)
        share_prefix(t, tree)
        t.decode_tree(tree.tokens, [n_past + d for d in tree.depths], tree.seq_ranges)
        keep_path(t, tree, n_past, path)
        seq = prompt[:-1] + [tree.tokens[r] for r in path]
        assert t.pos_max(0) == len(seq) - 1 and all(t.pos_max(s) == -1 for s in range(1, len(tree.leaves)))
        t.decode([42], len(seq), logits=True)
        reference.clear()
        reference.decode(seq + [42], 0, logits="last")
        assert np.array_equal(t.output_logits()[-1], reference.output_logits()[-1])


def test_decode_tree_refuses_what_libllama_would_reject(unified, reference):
    tree = _word_tree(unified, 1)
    positions = list(tree.depths)
    with pytest.raises(ValueError, match="kv_unified"):
        reference.decode_tree(tree.tokens, positions, tree.seq_ranges)
    with pytest.raises(ValueError, match="outside"):
        unified.decode_tree([1, 2], [0, 1], [(0, 1), (0, 16)])
    with pytest.raises(ValueError, match="does not continue"):
        unified.decode_tree([1, 2, 3], [0, 1, 1], [(0, 2), (0, 1), (0, 1)])
    with pytest.raises(ValueError, match="sequence ranges"):
        unified.decode_tree([1, 2], [0, 1], [(0, 1)])


@pytest.fixture(scope="module")
def llama(embedded_target):
    llm = llama_cpp.Llama(str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1, flash_attn=True, verbose=False)
    yield llm
    llm.close()


def _llama_greedy(llm, tokens, n):
    llm.reset()
    out = []
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    for tok in llm.generate(tokens, temp=0.0):
        if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(out) == n:
            break
        out.append(tok)
    return out


CHAT = [
    "What is 17 * 23? Explain step by step.",
    "Write a Python function that checks whether a number is prime.",
    "Tell me a short story about a cat.",
    "List three uses of a paperclip.",
]


def _tree_equals_plain(llama, prompts, max_tokens):
    """Greedy decoding with 16-row trees against llama-cpp-python's plain greedy decoding, token for token;
    returns the accepted trees' branches (0: the likeliest chain)."""
    branches = []
    with Session(n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16, lookup=False) as s:
        assert s.tree_disabled_reason is None
        for prompt in prompts:
            text, _ = s.render_chat([{"role": "user", "content": prompt}])
            tokens = s.tokenize(text, add_special=False)
            s.reset()  # a reused chat-template prefix was decoded in other batches: a near tie may flip with it
            steps = list(s.stream_tokens(tokens, max_tokens=max_tokens, block_size=16))
            assert [t for st in steps for t in st.tokens] == _llama_greedy(llama, tokens, max_tokens), prompt
            trees = [st for st in steps if st.tree_nodes]
            assert trees and all(st.tree_nodes <= 16 and st.n_accepted <= st.n_drafted for st in trees)
            branches += [st.tree_branch for st in trees if st.n_accepted]
            t = s.last_stats.tree
            assert (t.cycles, t.nodes) == (len(trees), sum(st.tree_nodes for st in trees))
            assert t.off_chain == sum(st.tree_branch > 0 for st in trees) and t.mean_depth <= s.last_stats.acceptance_length
    return branches


def test_greedy_tree_decoding_equals_plain_decoding_token_for_token(llama):
    """The embedded pair: the output is plain decoding's, and trees were accepted both along the likeliest
    chain and off it (where a linear block would have stopped)."""
    branches = _tree_equals_plain(llama, CHAT[:2], 32)
    assert any(b > 0 for b in branches) and any(b == 0 for b in branches)


@pytest.mark.slow  # held-out prompts, one of each category, longer replies
def test_greedy_tree_decoding_equals_plain_decoding_on_held_out_prompts(llama):
    """The first benchmark prompt of math, code and chat, 96 tokens each. Every prompt of the three (18):
    `python scripts/measure_tree.py live --per-category 6 --max-tokens 96` prints how many replies are plain
    decoding's, with τ."""
    from dflash_gguf.bench.suite import load_suite

    prompts = [p.prompt for p in load_suite(categories=("math", "code", "chat"), limit=1)]
    branches = _tree_equals_plain(llama, prompts, 96)
    assert sum(b > 0 for b in branches) > 10


@pytest.mark.slow  # 300 sampled generations
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, min_p=0.02)],
                         ids=["t=1", "t=0.7,top_k,min_p"])
def test_sampled_tree_decoding_follows_the_target(reference, settings):
    """The embedded pair with 16-row trees, sampling: the first token follows the target's row, and the third,
    after the likeliest first two (drafted and verified in the same tree when they were accepted), its row."""
    no_eog = {0: -float("inf"), 2: -float("inf"), 4: -float("inf")}  # every reply has its 3 tokens
    settings = {**settings, "logit_bias": no_eog}
    params = SamplingParams(**settings)

    def exact(tokens):
        reference.clear()
        reference.decode(tokens, 0)
        return probabilities(adjusted_logits(reference.output_logits()[-1:], params), params)[0]

    runs, accepted_in_trees = [], 0
    with Session(n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16, lookup=False) as s:
        text, _ = s.render_chat([{"role": "user", "content": "Write a list of fruits."}])
        prompt = s.tokenize(text, add_special=False)
        for seed in range(300):
            # no reset: the prompt stays in the live context and each run decodes its last token alone, as a
            # cold prefill does, so a run is a fresh Session's bit for bit (tokens and trees, checked on 40
            # seeds) at 0.4 of the cost; 300 runs stay: at t=1 the head pair is seen 60 times, the least the χ² takes
            steps = list(s.stream_tokens(prompt, max_tokens=3, block_size=16, seed=seed, **settings))
            runs.append([t for st in steps for t in st.tokens])
            accepted_in_trees += sum(st.n_accepted for st in steps if st.tree_nodes)
    assert all(len(r) == 3 for r in runs) and accepted_in_trees > 30
    assert chi_square_p_value([r[0] for r in runs], exact(prompt)) > ALPHA
    head = Counter(tuple(r[:2]) for r in runs).most_common(1)[0][0]
    second = [r[1] for r in runs if r[0] == head[0]]  # the tree's first slot: an accepted child or the residual
    assert chi_square_p_value(second, exact(prompt + [head[0]])) > ALPHA
    third = [r[2] for r in runs if tuple(r[:2]) == head]
    assert len(third) >= 60, (head, len(third))
    assert chi_square_p_value(third, exact(prompt + list(head))) > ALPHA


@pytest.mark.slow  # builds a tiny hybrid target
def test_a_hybrid_target_verifies_linear_blocks_and_says_why(hybrid_models):
    """A recurrent state cannot branch without a copy per path: the drafter and lookup draft linear blocks there
    (the code the hybrid suite checks against plain decoding), and the Session, its stats and dflash-doctor say why."""
    from dflash_gguf.config import SessionOptions
    from dflash_gguf.doctor import diagnose, to_text

    target, drafter = hybrid_models.target("qwen35"), hybrid_models.drafter("qwen35", "dflash")
    with Session(target, drafter, n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16, lookup=True) as s:
        assert "recurrent state" in s.tree_disabled_reason
        prompt = "The capital of France is Paris. The capital of France is Paris. The capital of France is"
        r = s.generate(prompt, max_tokens=24, block_size=8)
        assert r.stats.tree is None and r.stats.tree_disabled_reason == s.tree_disabled_reason
        assert r.stats.n_drafted > 0
    report = diagnose(target, drafter, SessionOptions(n_ctx=N_CTX, n_threads=1))
    assert report["pair"]["trees_off_because"] == s.tree_disabled_reason
    assert f"trees      off: {s.tree_disabled_reason}" in to_text(report)


def test_a_tree_outcome_says_what_every_smaller_tree_and_its_chain_would_have_committed():
    """TreeOutcome.committed[m - 1] equals verifying the m-row tree itself against the same target tokens, for
    every m and many target continuations; the chain figures are the linear block of the tree's first chain."""
    from dflash_gguf.tree import follow, tree_outcome

    rng = np.random.default_rng(0)
    ids = np.arange(40).reshape(8, 5) + 100
    accept = np.sort(rng.uniform(0.05, 0.6, (8, 5)), axis=1)[:, ::-1]
    full = build_tree(1, ids, accept, 24)
    for _ in range(200):
        cont = [int(ids[d, r]) if r < 5 else 0 for d, r in enumerate(rng.choice(6, size=8, p=[0.35, 0.25, 0.15, 0.1, 0.05, 0.1]))] + [0]
        path, _ = walk_greedy(full, lambda row: cont[full.depths[row]])
        out = tree_outcome(full, follow(full, [full.tokens[r] for r in path]))
        for m in range(2, len(full) + 1):
            small = build_tree(1, ids, accept, m)
            p, _ = walk_greedy(small, lambda row: cont[small.depths[row]])
            assert out.committed[m - 1] == len(p), m
        chain = 0
        while chain < out.chain_drafts and cont[chain] == ids[chain, 0]:
            chain += 1
        assert out.chain_accepted == chain and out.chain_drafts == full.depths[full.first_leaf]
    assert follow(full, [1, 999]) is None and follow(full, [2]) is None  # no path of the tree: no outcome


def _price_with(session: Session, seconds: dict[int, float], draft_s: float) -> None:
    """The Session's drafter controller prices cycles with this verify curve (seconds per batch of n rows)
    instead of the one it measured on this CPU: a cost model whose smoothing keeps the curve (the loop's
    timings move it by a billionth each). The Session has no public seam for a foreign curve."""
    from dflash_gguf.controller import BlockController, CostModel

    costs = CostModel(seconds, {16: draft_s}, smoothing=1e-9)
    session._speculation.native.controller = BlockController(session.drafter.max_draft, costs)
    session._speculation.costs = None  # the next generation's policy takes the controller's


@pytest.mark.slow  # 25 s: the fast tier keeps under 5 minutes
def test_the_controller_turns_trees_on_under_a_gpu_curve_and_leaves_them_off_under_this_cpus(llama):
    """The embedded pair, adaptive, trees of up to 16 rows. Priced with a published GPU curve (llama.cpp PR 5625,
    34B Q8_0: 8 rows cost 1.7 single steps) the controller verifies trees in many cycles; priced with a curve of
    this CPU's shape (16 rows cost ~9 steps, the drafter's pass half a step) it keeps to blocks or plain, but for
    a rare tree that tries a size. The output is plain decoding's either way."""
    import json
    from pathlib import Path

    spec = json.loads((Path(__file__).parent.parent / "scripts/verify_curves/pr5625_llama34b_q8_0.json").read_text())
    gpu = {int(n): float(t) for n, t in spec["seconds"].items()}
    cpu = {1: 0.011, 2: 0.015, 4: 0.024, 8: 0.050, 12: 0.075, 16: 0.097}
    with Session(n_ctx=N_CTX, n_batch=64, n_threads=1, tree_nodes=16, lookup=False) as s:
        shares = {}
        for name, curve, draft_s in (("gpu", gpu, 0.1 * gpu[1]), ("cpu", cpu, 0.006)):
            _price_with(s, curve, draft_s)
            steps = []
            for prompt in CHAT[:2]:
                text, _ = s.render_chat([{"role": "user", "content": prompt}])
                tokens = s.tokenize(text, add_special=False)
                s.reset()
                run = list(s.stream_tokens(tokens, max_tokens=48))
                assert [t for st in run for t in st.tokens] == _llama_greedy(llama, tokens, 48), (name, prompt)
                steps += run[1:]
            trees = [st for st in steps if st.tree_nodes]
            assert all(st.reason.startswith("tree") for st in trees)
            shares[name] = len(trees) / len(steps)
    assert shares["gpu"] > 0.3 and shares["cpu"] <= 0.05, shares
