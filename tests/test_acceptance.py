"""accept_greedy exhaustively; accept_sampled statistically (chi-square against the target's law) and on edge cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from dflash.model import _rejection_sample

from dflash_gguf.acceptance import accept_greedy, accept_sampled

TRIALS = 20_000
# Standard-normal quantile for a false-alarm rate of 1e-4: the seeds are fixed, so a pass is
# deterministic, and a correct sampler would only fail for one seed in ~10,000.
Z_1E4 = 3.719016485455709


def chi2_critical(df: int) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df) at 1e-4 (within 30% of 1e-4 in tail mass for df >= 3)."""
    return df * (1 - 2 / (9 * df) + Z_1E4 * math.sqrt(2 / (9 * df))) ** 3


def chi2_statistic(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom over the cells the law gives mass to."""
    counts, probs = counts.ravel(), probs.ravel()
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome occurred"
    expected = counts.sum() * probs[probs > 0]
    assert expected.min() >= 5, "test construction: too few expected counts for chi-square"
    observed = counts[probs > 0]
    return float(((observed - expected) ** 2 / expected).sum()), int(expected.size - 1)


def assert_follows(counts: np.ndarray, probs: np.ndarray) -> None:
    stat, df = chi2_statistic(counts, probs)
    assert stat < chi2_critical(df), f"chi-square {stat:.1f} >= {chi2_critical(df):.1f} (df={df})"


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float = 4.0) -> np.ndarray:
    return rng.dirichlet(np.full(shape[-1], alpha), size=shape[:-1])


def draw_rows(rng: np.random.Generator, rows: np.ndarray, trials: int) -> np.ndarray:
    """(trials, n) tokens, column i drawn from rows[i], by inverting each row's CDF."""
    cdf = np.cumsum(rows, axis=-1)
    u = rng.random((trials, rows.shape[0])) * cdf[:, -1]
    return np.stack([np.searchsorted(cdf[i], u[:, i], side="right") for i in range(rows.shape[0])], axis=1)


def emitted(draft: np.ndarray, result: tuple[int, int]) -> list[int]:
    n_accepted, token = result
    return [*draft[:n_accepted].tolist(), token]


# ---- greedy -------------------------------------------------------------------------------------


def greedy_oracle(draft: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, int]:
    n = 0
    while n < len(draft) and draft[n] == target[n]:
        n += 1
    return n, target[n]


@pytest.mark.parametrize("n", range(5))
def test_accept_greedy_exhaustive(n: int) -> None:
    for draft in itertools.product(range(2), repeat=n):
        for target in itertools.product(range(2), repeat=n + 1):
            got = accept_greedy(np.array(draft, dtype=np.int32), np.array(target, dtype=np.int64))
            assert got == greedy_oracle(draft, target)
            assert all(type(v) is int for v in got)


@pytest.mark.parametrize(
    ("draft", "target", "expected"),
    [
        ([5, 6, 7], [5, 6, 7, 8], (3, 8)),  # all match: bonus is the target's token after the block
        ([5, 6, 7], [1, 6, 7, 8], (0, 1)),  # first differs: the target's token replaces it
        ([5, 6, 7], [5, 6, 9, 8], (2, 9)),  # later matches after a mismatch do not count
        ([5, 6, 7], [5, 2, 7, 8], (1, 2)),
        ([], [42], (0, 42)),
    ],
)
def test_accept_greedy_cases(draft: list[int], target: list[int], expected: tuple[int, int]) -> None:
    assert accept_greedy(np.array(draft, dtype=np.int64), np.array(target, dtype=np.int64)) == expected


@pytest.mark.parametrize(
    ("draft", "target", "message"),
    [
        (np.array([1, 2]), np.array([1, 2]), "len"),
        (np.array([1, 2]), np.array([1, 2, 3, 4]), "len"),
        (np.array([1.0, 2.0]), np.array([1, 2, 3]), "integer"),
        (np.array([[1, 2]]), np.array([1, 2, 3]), "dimension"),
    ],
)
def test_accept_greedy_rejects_bad_input(draft: np.ndarray, target: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        accept_greedy(draft, target)


# ---- sampled: distribution ----------------------------------------------------------------------


def test_first_token_follows_the_target() -> None:
    """Independent per-slot p and q: the first committed token must be distributed as p_0."""
    rng = np.random.default_rng(1)
    n, vocab = 3, 6
    p, q = dirichlet(rng, (n + 1, vocab)), dirichlet(rng, (n, vocab))
    drafts = draw_rows(rng, q, TRIALS)
    first = np.array([emitted(d, accept_sampled(d, q, p, rng))[0] for d in drafts])
    assert_follows(np.bincount(first, minlength=vocab), p[0])


def test_chi_square_detects_the_draft_law() -> None:
    """The check has power: the draft's own tokens, taken unverified, fail it."""
    rng = np.random.default_rng(1)
    p, q = dirichlet(rng, (1, 6))[0], dirichlet(rng, (1, 6))[0]
    drafts = draw_rows(rng, q[None], TRIALS)[:, 0]
    stat, df = chi2_statistic(np.bincount(drafts, minlength=6), p)
    assert stat > chi2_critical(df)


def test_two_token_joint_follows_a_markov_target() -> None:
    """Target and draft are first-order Markov chains, so slot i's p and q depend on the drafted prefix.

    Decoding cycles with blocks of 2 drafts until two tokens are committed; their joint law must be
    start[a] * P[a, b] whatever the draft chain Q proposes.
    """
    rng = np.random.default_rng(2)
    vocab = 5
    start_p, start_q = dirichlet(rng, (vocab,)), dirichlet(rng, (vocab,))
    P, Q = dirichlet(rng, (vocab, vocab)), dirichlet(rng, (vocab, vocab))
    q_cdf, uniforms = np.cumsum(Q, axis=-1), rng.random((TRIALS, 4))

    counts = np.zeros((vocab, vocab), dtype=np.int64)
    for trial in range(TRIALS):
        out: list[int] = []
        u = iter(uniforms[trial])
        while len(out) < 2:
            p0, q0 = (start_p, start_q) if not out else (P[out[-1]], Q[out[-1]])
            x0 = int(np.searchsorted(np.cumsum(q0), next(u), side="right"))
            x1 = int(np.searchsorted(q_cdf[x0], next(u), side="right"))
            draft = np.array([x0, x1])
            result = accept_sampled(draft, np.stack([q0, Q[x0]]), np.stack([p0, P[x0], P[x1]]), rng)
            out += emitted(draft, result)
        counts[out[0], out[1]] += 1
    assert_follows(counts, start_p[:, None] * P)


def test_sparse_draft_first_token_follows_the_target() -> None:
    """DFlash2 form: q over k candidate ids per slot, stored in arbitrary order."""
    rng = np.random.default_rng(3)
    n, vocab, k = 2, 8, 3
    p = dirichlet(rng, (n + 1, vocab))
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n)])
    q = dirichlet(rng, (n, k))
    picks = draw_rows(rng, q, TRIALS)
    drafts = np.take_along_axis(ids, picks.T, axis=1).T
    first = np.array([emitted(d, accept_sampled(d, q, p, rng, draft_indices=ids))[0] for d in drafts])
    assert_follows(np.bincount(first, minlength=vocab), p[0])


def test_sparse_and_dense_draft_give_identical_results() -> None:
    rng = np.random.default_rng(4)
    n, vocab, k = 4, 10, 4
    p = dirichlet(rng, (n + 1, vocab))
    ids = np.stack([rng.permutation(vocab)[:k] for _ in range(n)])
    q = dirichlet(rng, (n, k), alpha=1.0)
    dense = np.zeros((n, vocab))
    np.put_along_axis(dense, ids, q, axis=1)
    for seed in range(300):
        draft = ids[np.arange(n), rng.integers(0, k, n)]
        sparse_result = accept_sampled(draft, q, p, np.random.default_rng(seed), draft_indices=ids)
        assert sparse_result == accept_sampled(draft, dense, p, np.random.default_rng(seed))


def outcome_law(draft: np.ndarray, q: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Exact law of (n_accepted, next_token) for a fixed draft, a (n+1, V) table: the acceptance test's oracle."""
    n, vocab = draft.shape[0], p.shape[1]
    law = np.zeros((n + 1, vocab))
    reach = 1.0
    for i, x in enumerate(draft):
        accept = min(1.0, p[i, x] / q[i, x]) if q[i, x] > 0 else float(p[i, x] > 0)
        residual = np.maximum(p[i] - q[i], 0)
        residual = residual / residual.sum() if residual.sum() > 0 else p[i]
        law[i] = reach * (1 - accept) * residual
        reach *= accept
    law[n] = reach * p[n]
    return law


def test_outcomes_match_the_exact_law_and_the_reference() -> None:
    """For one fixed draft, both ours and z-lab's _rejection_sample produce (n_accepted, token) with the exact law."""
    rng = np.random.default_rng(5)
    n, vocab = 2, 5
    p, q = dirichlet(rng, (n + 1, vocab)), dirichlet(rng, (n, vocab))
    draft = np.array([int(np.argmax(q[0] / p[0])), int(np.argmax(p[1] / q[1]))])  # a likely reject, a sure accept
    law = outcome_law(draft, q, p)

    ours = np.zeros_like(law, dtype=np.int64)
    for _ in range(TRIALS):
        n_accepted, token = accept_sampled(draft, q, p, rng)
        ours[n_accepted, token] += 1
    assert_follows(ours, law)

    torch.manual_seed(0)
    tokens, target, drafted = torch.tensor(draft)[None], torch.tensor(p)[None], torch.tensor(q)[None]
    reference = np.zeros_like(ours)
    for _ in range(TRIALS // 2):
        n_accepted, token = _rejection_sample(tokens, target, drafted)
        reference[n_accepted, int(token)] += 1
    assert_follows(reference, law)


# ---- sampled: degenerate cases ------------------------------------------------------------------


def test_draft_equal_to_target_is_always_accepted() -> None:
    rng = np.random.default_rng(6)
    p = dirichlet(rng, (5, 7))
    for _ in range(500):
        draft = draw_rows(rng, p[:4], 1)[0]
        assert accept_sampled(draft, p[:4], p, rng)[0] == 4


def test_disjoint_draft_is_rejected_and_the_target_sampled() -> None:
    rng = np.random.default_rng(7)
    q = np.array([[0.5, 0.5, 0, 0, 0, 0]] * 3)
    p = np.array([[0, 0, 0.2, 0.3, 0.5, 0]] * 4)
    tokens = []
    for draft in draw_rows(rng, q, 5000):
        n_accepted, token = accept_sampled(draft, q, p, rng)
        assert n_accepted == 0
        tokens.append(token)
    counts = np.bincount(tokens, minlength=6)
    assert counts[[0, 1, 5]].sum() == 0
    np.testing.assert_allclose(counts / counts.sum(), p[0], atol=0.03)


def test_zero_draft_mass_accepts_exactly_when_the_target_has_mass() -> None:
    p = np.array([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
    q = np.array([[1.0, 0.0, 0.0]])
    for seed in range(50):
        assert accept_sampled(np.array([1]), q, p, np.random.default_rng(seed))[0] == 1  # q=0, p>0: kept
        n_accepted, token = accept_sampled(np.array([2]), q, p, np.random.default_rng(seed))  # q=0, p=0
        assert n_accepted == 0 and token == 1  # residual max(p - q, 0) is all on token 1


def test_empty_residual_falls_back_to_the_target() -> None:
    p = np.array([[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
    for seed in range(50):
        n_accepted, token = accept_sampled(np.array([3]), p[:1].copy(), p, np.random.default_rng(seed))
        assert n_accepted == 0 and token in (0, 1)


def test_empty_draft_samples_the_bonus_from_the_target() -> None:
    rng = np.random.default_rng(8)
    p = np.array([[0.0, 0.25, 0.75]])
    tokens = [accept_sampled(np.array([], dtype=np.int64), np.zeros((0, 3)), p, rng) for _ in range(TRIALS // 4)]
    assert {n for n, _ in tokens} == {0}
    assert_follows(np.bincount([t for _, t in tokens], minlength=3), p[0])


def test_seeded_generator_reproduces_the_outcome() -> None:
    rng = np.random.default_rng(9)
    p, q = dirichlet(rng, (4, 6)), dirichlet(rng, (3, 6))
    draft = np.array([0, 1, 2])
    a = [accept_sampled(draft, q, p, np.random.default_rng(s)) for s in range(40)]
    assert a == [accept_sampled(draft, q, p, np.random.default_rng(s)) for s in range(40)]
    assert len(set(a)) > 1


# ---- sampled: bad input -------------------------------------------------------------------------

P3 = np.full((3, 4), 0.25)
Q2 = np.full((2, 4), 0.25)
D2 = np.array([0, 1])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_probs": P3[:2]}, r"target_probs must have shape \(3, V\)"),
        ({"draft_probs": Q2[:1]}, r"draft_probs must have shape \(2, V\)"),
        ({"draft_probs": np.full((2, 5), 0.2)}, "columns"),
        ({"draft": np.array([0, 4])}, "ids in"),
        ({"draft": np.array([-1, 0])}, "ids in"),
        ({"draft": np.array([0.0, 1.0])}, "integer"),
        ({"draft_probs": np.ones((2, 4), dtype=np.int64)}, "floating"),
        ({"target_probs": np.where(np.eye(3, 4, dtype=bool), np.nan, 0.25)}, "finite"),
        ({"draft_probs": np.where(np.eye(2, 4, dtype=bool), -0.5, 0.25)}, "non-negative"),
        ({"draft_probs": np.full((2, 2), 0.5), "draft_indices": np.array([[0, 1], [1, 2], [2, 3]])}, r"\(2, k\)"),
        ({"draft_probs": np.full((2, 2), 0.5), "draft_indices": np.array([[0, 1], [1, 9]])}, "draft_indices"),
        ({"draft_probs": np.full((2, 2), 0.5), "draft_indices": np.array([[0.0, 1.0], [1.0, 2.0]])}, "integer"),
    ],
)
def test_accept_sampled_rejects_bad_input(kwargs: dict, message: str) -> None:
    args = {"draft": D2, "draft_probs": Q2, "target_probs": P3, "rng": np.random.default_rng(0)} | kwargs
    with pytest.raises(ValueError, match=message):
        accept_sampled(**args)
