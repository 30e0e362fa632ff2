"""SamplingParams validation, probabilities() against hand-computed cases and the z-lab reference, sample_token."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from dflash.model import _sampling_probs

from dflash_gguf.sampling import SamplingParams, probabilities, sample_token

# softmax of these logits at temperature 1 is exactly proportional to 1, 2, 3, 4
LOG_1234 = np.log(np.array([1.0, 2.0, 3.0, 4.0]))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "0.7"),
        ("temperature", None),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_p", math.inf),
        ("top_p", "0.9"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_k", "40"),
        ("seed", -1),
        ("seed", 1.5),
        ("seed", "7"),
        ("seed", False),
    ],
)
def test_bad_parameter_is_named_with_its_value(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert repr(value) in str(info.value)


def test_valid_parameters_accept_numpy_scalars() -> None:
    params = SamplingParams(temperature=np.float32(0.7), top_p=np.float64(0.9), top_k=np.int64(40), seed=np.uint32(3))
    params.validate()
    assert not params.greedy
    assert SamplingParams().greedy
    assert SamplingParams(temperature=0, top_k=5).greedy


def test_rng_is_reproducible_from_the_seed() -> None:
    a = SamplingParams(temperature=1.0, seed=11).rng().random(4)
    b = SamplingParams(temperature=1.0, seed=11).rng().random(4)
    c = SamplingParams(temperature=1.0, seed=12).rng().random(4)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k", "expected"),
    [
        (1.0, 1.0, 0, [1 / 10, 2 / 10, 3 / 10, 4 / 10]),
        (2.0, 1.0, 0, np.sqrt([1, 2, 3, 4]) / np.sqrt([1, 2, 3, 4]).sum()),
        (1.0, 1.0, 2, [0, 0, 3 / 7, 4 / 7]),
        (1.0, 1.0, 1, [0, 0, 0, 1]),
        (1.0, 1.0, 4, [1 / 10, 2 / 10, 3 / 10, 4 / 10]),  # top_k >= V is off
        (1.0, 1.0, 9, [1 / 10, 2 / 10, 3 / 10, 4 / 10]),
        # sorted 0.4, 0.3, 0.2, 0.1; mass before each: 0, 0.4, 0.7, 0.9
        (1.0, 0.35, 0, [0, 0, 0, 1]),
        (1.0, 0.5, 0, [0, 0, 3 / 7, 4 / 7]),
        (1.0, 0.75, 0, [0, 2 / 9, 3 / 9, 4 / 9]),
        (1.0, 0.95, 0, [1 / 10, 2 / 10, 3 / 10, 4 / 10]),
        # top-k first (2/9, 3/9, 4/9; mass before 0, 4/9, 7/9), then top-p on the renormalised rest
        (1.0, 0.6, 3, [0, 0, 3 / 7, 4 / 7]),
        (1.0, 0.4, 3, [0, 0, 0, 1]),
        # the nucleus is judged at temperature 1 (0.4, 0.3 reach 0.5), then the kept two are tempered
        (0.5, 0.5, 0, [0, 0, 9 / 25, 16 / 25]),
    ],
)
def test_hand_computed_distributions(temperature: float, top_p: float, top_k: int, expected: list[float]) -> None:
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
    probs = probabilities(LOG_1234, params)
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    ("min_p", "temperature", "expected"),
    [
        (0.5, 1.0, [0, 2 / 9, 3 / 9, 4 / 9]),  # p >= 0.5 * 0.4 keeps 0.2, 0.3, 0.4
        (0.76, 1.0, [0, 0, 0, 1]),  # 0.3 < 0.76 * 0.4
        (0.75, 2.0, [0, 0, math.sqrt(3) / (math.sqrt(3) + 2), 2 / (math.sqrt(3) + 2)]),  # judged untempered
        (0.0, 1.0, [0.1, 0.2, 0.3, 0.4]),
    ],
)
def test_min_p_keeps_tokens_near_the_likeliest(min_p: float, temperature: float, expected: list[float]) -> None:
    probs = probabilities(LOG_1234, SamplingParams(temperature=temperature, min_p=min_p))
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


def test_nucleus_always_keeps_the_most_likely_token() -> None:
    probs = probabilities(np.array([0.0, 5.0, 1.0]), SamplingParams(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0])


def test_banned_tokens_and_batch_shape() -> None:
    logits = np.array([[[-np.inf, 0.0, 0.0]], [[1.0, -np.inf, 1.0]]], dtype=np.float32)
    probs = probabilities(logits, SamplingParams(temperature=0.5))
    assert probs.shape == (2, 1, 3)
    np.testing.assert_allclose(probs, [[[0, 0.5, 0.5]], [[0.5, 0, 0.5]]])


@pytest.mark.parametrize("temperature", [1e-320, 1e-300])
def test_vanishing_temperature_concentrates_on_the_argmax(temperature: float) -> None:
    probs = probabilities(np.array([0.5, 2.0, -np.inf, 1.9]), SamplingParams(temperature=temperature))
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0, 0.0])


def test_large_logits_do_not_overflow() -> None:
    probs = probabilities(np.array([1e4, 1e4 - math.log(3.0)]), SamplingParams(temperature=1.0))
    np.testing.assert_allclose(probs, [0.75, 0.25])


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (np.array([0.0, np.nan]), "NaN"),
        (np.array([0.0, np.inf]), r"\+inf"),
        (np.array([[0.0, 1.0], [-np.inf, -np.inf]]), "-inf"),
        (np.float64(1.0), "shape"),
        (np.zeros((2, 0)), "shape"),
        (np.array(["a", "b"]), "dtype"),
    ],
)
def test_bad_logits_are_rejected(logits: np.ndarray, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        probabilities(logits, SamplingParams(temperature=1.0))


def test_greedy_params_have_no_distribution() -> None:
    with pytest.raises(ValueError, match="greedy"):
        probabilities(LOG_1234, SamplingParams())


@pytest.mark.parametrize(
    ("temperature", "top_p", "top_k"),
    [
        (1.0, 1.0, 0),
        (0.7, 1.0, 0),
        (1.0, 0.9, 0),
        (1.0, 0.5, 0),
        (1.0, 0.99, 0),  # nucleus of thousands of tokens: widens past the first candidate set
        (0.8, 1.0, 50),
        (1.0, 0.8, 40),
        (1.0, 0.95, 1000),
        (1.0, 0.9, 49151),
        (1.0, 1.0, 1),
    ],
)
def test_matches_reference_sampling_probs(temperature: float, top_p: float, top_k: int) -> None:
    """z-lab's reference tempers before its nucleus, llama.cpp after (test_sampling_llama.py checks that order):
    the two agree wherever the temperature is 1 or top_p is off, the cases here."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 49152, generator=generator) * 3.0
    expected = _sampling_probs(logits, temperature, top_p, top_k).double().numpy()
    got = probabilities(logits.numpy(), SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k))
    assert got.shape == expected.shape
    # The reference accumulates the nucleus mass in float32, so over thousands of tokens a token
    # sitting right at the top_p edge can fall the other way: allow at most that one token per row.
    edge = (got > 0) != (expected > 0)
    assert edge.sum(axis=-1).max() <= (1 if top_p < 1.0 else 0)
    assert np.maximum(got, expected)[edge].max(initial=0.0) < 1e-3
    np.testing.assert_allclose(np.where(edge, 0.0, got), np.where(edge, 0.0, expected), rtol=1e-4, atol=1e-9)
    np.testing.assert_allclose(got.sum(axis=-1), 1.0, rtol=1e-12)


def test_sample_token_follows_the_distribution() -> None:
    p = np.array([0.1, 0.2, 0.0, 0.7])
    rng = np.random.default_rng(5)
    n = 20_000
    counts = np.bincount([sample_token(p, rng) for _ in range(n)], minlength=p.size)
    assert counts[2] == 0
    # each count is Binomial(n, p_i): 5 standard deviations is a false-alarm rate below 1e-6 per cell
    np.testing.assert_array_less(np.abs(counts - n * p), 5 * np.sqrt(n * p * (1 - p)) + 1e-9)


def test_sample_token_never_returns_a_token_without_mass() -> None:
    p = np.zeros(50)
    p[[0, 7]] = [0.25, 0.75]
    rng = np.random.default_rng(1)
    assert {sample_token(p, rng) for _ in range(500)} == {0, 7}


class FixedUniform:
    """A randomness source pinned to one draw, to reach the ends of [0, 1) deterministically."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize(("u", "expected"), [(0.0, 1), (np.nextafter(1.0, 0.0), 2)])
def test_sample_token_at_the_ends_of_the_unit_interval(u: float, expected: int) -> None:
    p = np.array([0.0, 0.3, 0.7, 0.0])
    assert sample_token(p, FixedUniform(u)) == expected
    assert sample_token(p * 3.0, FixedUniform(u)) == expected  # unnormalised mass


def test_sample_token_is_reproducible() -> None:
    p = np.full(10, 0.1)
    a, b = np.random.default_rng(9), np.random.default_rng(9)
    draws = [sample_token(p, a) for _ in range(20)]
    assert draws == [sample_token(p, b) for _ in range(20)]
    assert len(set(draws)) > 1


@pytest.mark.parametrize(
    "probs",
    [np.array([0.5, -0.1, 0.6]), np.array([np.nan, 1.0]), np.zeros(3), np.ones((2, 2)) / 2, np.array([])],
)
def test_sample_token_rejects_bad_distributions(probs: np.ndarray) -> None:
    with pytest.raises(ValueError, match="probs"):
        sample_token(probs, np.random.default_rng(0))
