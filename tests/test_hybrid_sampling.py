"""Speculative sampling on hybrid targets follows the target's distribution (chi-square on seeded samples).

Three-token generations with block 2: the random drafter's token is nearly always rejected, so the third
token is sampled from a state that was rolled back (snapshot on qwen35, checkpoint and replay on qwen3next).
"""

from __future__ import annotations

from collections import Counter

import pytest

from dflash_gguf import SamplingParams, Target
from test_hybrid_session import open_session
from test_session_sampling import ALPHA, chi_square_p_value, next_token_probs

pytestmark = pytest.mark.slow  # statistical sampling on the hybrid targets, which upstream's converter builds first

PROMPT = "Good morning!"
PARAMS = SamplingParams(temperature=0.5, top_k=8)
N = 240


@pytest.mark.parametrize("arch,mechanism", [("qwen35", "rs-snapshot"), ("qwen3next", "checkpoint")])
def test_samples_after_rollbacks_follow_the_target_distribution(hybrid_models, arch, mechanism):
    target = hybrid_models.target(arch)
    with open_session(target, hybrid_models.drafter(arch), n_rs_seq=15) as s:
        assert s.memory.name == mechanism
        samples = [
            s.generate(PROMPT, max_tokens=3, temperature=PARAMS.temperature, top_k=PARAMS.top_k, seed=seed,
                       block_size=2).tokens
            for seed in range(N)
        ]
        assert sum(s.memory.rollbacks.values()) > 0.9 * N  # the drafted second token was nearly always rejected
    assert all(len(x) == 3 for x in samples)
    with Target.open(target, n_ctx=128, n_batch=32, n_threads=1) as ref:
        prompt = ref.vocab.tokenize(PROMPT)
        first = [x[0] for x in samples]
        assert chi_square_p_value(first, next_token_probs(ref, prompt, PARAMS)) > ALPHA
        m1 = Counter(first).most_common(1)[0][0]
        second = [x[1] for x in samples if x[0] == m1]
        assert chi_square_p_value(second, next_token_probs(ref, prompt + [m1], PARAMS)) > ALPHA
        m2 = Counter(second).most_common(1)[0][0]
        third = [x[2] for x in samples if x[:2] == [m1, m2]]
        assert len(third) > N // 8
        assert chi_square_p_value(third, next_token_probs(ref, prompt + [m1, m2], PARAMS)) > ALPHA
        # not vacuous: the same samples against the row before the last token fail
        assert chi_square_p_value(third, next_token_probs(ref, prompt + [m1], PARAMS)) < ALPHA
