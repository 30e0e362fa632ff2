"""Confidence scheduling (issue 11): a DSpark proposal is verified only as far as its confidences make it pay.

Fixed blocks cut at the first draft whose predicted acceptance is below `confidence_threshold` (upstream's
--spec-draft-p-min); the adaptive controller picks the verify length with the most expected tokens per
second from the cumulative confidences and its measured verify costs. Either way the output is the
target's: greedy output equals plain decoding.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf import Session
from dflash_gguf.controller import AdaptivePolicy, CostModel, FixedPolicy
from dflash_gguf.sources import Candidate
from test_dspark import BLOCK, PROMPTS, plain_texts  # noqa: F401 - the fixture, shared

MAX_TOKENS = 24


def _steps(session: Session, prompt: str, **gen) -> list:
    return list(session.stream(prompt, max_tokens=MAX_TOKENS, temperature=0.0, **gen))


@pytest.mark.slow  # every prompt generated twice per DSpark drafter
@pytest.mark.parametrize("name", ["anchor", "bonus"])
def test_a_threshold_verifies_fewer_tokens_and_keeps_the_output(dspark, name, plain_texts):
    _, out = dspark(name)
    with Session(drafter=out, n_ctx=256, n_batch=64, n_threads=1, lookup=False) as s:
        uncut = {p: _steps(s, p, block_size=BLOCK) for p in PROMPTS}
        conf = np.concatenate([st.confidences for steps in uncut.values() for st in steps if st.confidences])
        threshold = float(np.median(conf))  # cuts about half of the drafts of these random weights
        cut_runs = []
        for prompt, plain in zip(PROMPTS, plain_texts):
            cut = _steps(s, prompt, block_size=BLOCK, confidence_threshold=threshold)
            assert [t for st in cut for t in st.tokens] == plain, prompt
            for st in cut:  # every draft verified was predicted at least as likely as the threshold
                assert all(c >= threshold for c in st.confidences), (prompt, st.confidences)
                assert len(st.confidences) == st.n_drafted
            cut_runs.append(cut)
        verified = lambda runs: sum(st.block_size for steps in runs for st in steps)  # noqa: E731
        assert verified(cut_runs) < verified(uncut.values())


@pytest.mark.slow  # adaptive generation: measures the verify costs first
def test_adaptive_scheduling_keeps_the_output(dspark, plain_texts):
    _, out = dspark("anchor")
    with Session(drafter=out, n_ctx=256, n_batch=64, n_threads=1, lookup=False) as s:
        for prompt, plain in zip(PROMPTS, plain_texts):
            assert s.generate(prompt, max_tokens=MAX_TOKENS).tokens == plain
            assert s.generate(prompt, max_tokens=MAX_TOKENS, confidence_threshold=0.9).tokens == plain


def test_an_anchor_first_block_drafts_all_its_slots(dspark):
    _, out = dspark("anchor")
    with Session(drafter=out, n_ctx=256, n_batch=64, n_threads=1, lookup=False) as s:
        steps = _steps(s, PROMPTS[0], block_size=4)
    assert max(st.n_drafted for st in steps) == 4  # slot 0 predicts: a block of 4 drafts 4 (bonus anchor: 3)


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan"), True, "0.5"])
def test_a_threshold_outside_zero_one_is_refused(bad):
    with Session(n_ctx=128, n_threads=1, lookup=False) as s:
        with pytest.raises(ValueError, match="threshold"):
            s.generate("hi", max_tokens=2, confidence_threshold=bad)


def _candidate(confidences) -> Candidate:
    return Candidate("dspark", np.arange(len(confidences)), confidences=np.asarray(confidences, dtype=np.float64))


def test_the_adaptive_cut_follows_the_cost_curve():
    """Where verifying more costs almost nothing (GPU-like), every draft that adds more than it costs is
    verified (not the 5th, at 0.05); where each token costs a full step (a compute-bound CPU), none pays."""
    conf = [0.9, 0.8, 0.6, 0.2, 0.05]
    flat = CostModel({1: 1.0, 2: 1.02, 4: 1.04, 8: 1.08}, {2: 0.1})
    steep = CostModel({1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}, {2: 0.1})
    assert AdaptivePolicy(flat).verify_length(_candidate(conf)) == 4
    assert AdaptivePolicy(steep).verify_length(_candidate(conf)) == 0
    threshold = AdaptivePolicy(flat, confidence_threshold=0.5)
    assert threshold.verify_length(_candidate(conf)) == 3
    assert FixedPolicy(6, confidence_threshold=0.7).verify_length(_candidate(conf)) == 2
    assert FixedPolicy(6).verify_length(_candidate(conf)) == 5
    assert FixedPolicy(6, confidence_threshold=0.7).verify_length(Candidate("lookup", np.arange(4))) == 4
