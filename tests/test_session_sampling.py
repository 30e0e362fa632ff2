"""Speculative sampling reproduces the target's own distribution (chi-square tests on seeded samples).

The first token comes straight from the prefill logits; the second goes through a drafted block and
rejection sampling against the random drafter's q, so its conditional law is the real check.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from chi_square import chi_square_p_value

from dflash_gguf import SamplingParams, Session, Target
from dflash_gguf.sampling import probabilities

pytestmark = pytest.mark.slow  # hundreds of seeded generations for each chi-square test

PROMPT = "The capital of France is"
ALPHA = 1e-3


@pytest.fixture(scope="module")
def session(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def reference(embedded_target):
    """A separate plain Target: the exact next-token distribution to compare against."""
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as t:
        yield t


def next_token_probs(target: Target, tokens: list[int], params: SamplingParams) -> np.ndarray:
    target.clear()
    target.decode(tokens, 0)
    return probabilities(target.logits(len(tokens) - 1)[None], params)[0]


def two_token_samples(session: Session, params: SamplingParams, n: int) -> list[list[int]]:
    """n seeded generations of 2 tokens; block_size 2, so the second one is always drafted and verified."""
    return [
        session.generate(
            PROMPT, max_tokens=2, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
            seed=seed, block_size=2,
        ).tokens
        for seed in range(n)
    ]


T1 = SamplingParams(temperature=1.0)


@pytest.fixture(scope="module")
def t1_pairs(session):
    return two_token_samples(session, T1, 240)


@pytest.mark.parametrize("params", [T1, SamplingParams(temperature=0.7, top_k=20, top_p=0.9)])
def test_two_token_samples_follow_the_target_distribution(session, reference, t1_pairs, params):
    pairs = t1_pairs if params == T1 else two_token_samples(session, params, 120)
    n = len(pairs)
    assert all(len(p) == 2 for p in pairs)
    prompt = reference.vocab.tokenize(PROMPT)
    first = [p[0] for p in pairs]
    assert chi_square_p_value(first, next_token_probs(reference, prompt, params)) > ALPHA

    mode = Counter(first).most_common(1)[0][0]
    second = [p[1] for p in pairs if p[0] == mode]
    assert len(second) > n // 2
    assert chi_square_p_value(second, next_token_probs(reference, prompt + [mode], params)) > ALPHA


def test_the_chi_square_check_rejects_a_wrong_distribution(reference, t1_pairs):
    """The same check against the wrong row (the prompt's, not the one after the first token) must fail."""
    prompt = reference.vocab.tokenize(PROMPT)
    mode = Counter(p[0] for p in t1_pairs).most_common(1)[0][0]
    second = [p[1] for p in t1_pairs if p[0] == mode]
    assert chi_square_p_value(second, next_token_probs(reference, prompt, T1)) < ALPHA
