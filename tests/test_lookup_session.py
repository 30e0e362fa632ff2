"""Lookup drafts through the real loop on the real target: lossless greedy and sampled, drafter-free too."""

from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest

from dflash_gguf import SamplingParams, Session, Target
from dflash_gguf.defaults import embedded_drafter
from dflash_gguf.steps import TokenSource
from test_session_sampling import ALPHA, chi_square_p_value, next_token_probs

COPY = (
    "Repeat this paragraph exactly.\n\nDr. No is the sixth novel by the English author Ian Fleming to feature his "
    "British Secret Service agent James Bond. Written at Fleming's Goldeneye estate in Jamaica, it was first "
    "published in the United Kingdom by Jonathan Cape in 1958."
)
ORDINARY = "Josh makes 12 bracelets at $1 each and sells them for $1.5 each. How much profit does he make?"
N = 48


def _chat(session, prompt, **kw):
    session.reset()
    return session.chat([{"role": "user", "content": prompt}], max_tokens=N, **kw)


@pytest.fixture(scope="module")
def plain_outputs(embedded_target):
    with Session(embedded_target, n_ctx=1024, n_threads=1) as s, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return {p: _chat(s, p, speculative=False).tokens for p in (COPY, ORDINARY)}


@pytest.mark.slow  # adaptive: lookup's verify costs are measured first; two 48-token replies per prompt
@pytest.mark.parametrize("dflash", [False, True], ids=["lookup", "lookup+dflash"])
def test_greedy_output_is_plain_decoding(embedded_target, plain_outputs, dflash):
    """Without a drafter the Session speculates with lookup alone; lookup=True puts it next to the drafter.
    Adaptive blocks draft only where the measured costs say it pays (on a compute-bound CPU, rarely), so
    the drafting itself is checked in a fixed block: lookup where it has a match, the drafter elsewhere."""
    with Session(embedded_target, embedded_drafter() if dflash else None, n_ctx=1024, n_threads=1, lookup=True) as s:
        for prompt in (COPY, ORDINARY):
            assert _chat(s, prompt).tokens == plain_outputs[prompt]
        fixed = _chat(s, COPY, block_size=8)
    assert fixed.tokens == plain_outputs[COPY]
    assert fixed.stats.per_source["lookup"].n_accepted > 0  # the copy was drafted by lookup
    if dflash:
        assert fixed.stats.per_source["dflash"].n_drafted > 0


def test_steps_mark_lookup_tokens(embedded_target):
    with Session(embedded_target, n_ctx=1024, n_threads=1) as s:
        steps = list(s.stream_chat([{"role": "user", "content": COPY}], max_tokens=N, block_size=8))
    drafted = [st for st in steps if st.source == "lookup"]
    assert drafted and all(
        st.provenance[: st.n_accepted] == (TokenSource.LOOKUP,) * min(st.n_accepted, len(st.provenance)) for st in drafted
    )
    assert sum(p is TokenSource.LOOKUP for st in steps for p in st.provenance) > 0


def test_a_session_without_drafter_speculates(embedded_target):
    with Session(embedded_target, n_ctx=1024, n_threads=1) as s, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "decoding plainly" warning: lookup is its draft source
        r = _chat(s, COPY, block_size=8)
    assert r.stats.n_drafted > 0


@pytest.mark.slow  # a Llama of its own, two 48-token replies (test_session covers from_llama quick)
def test_a_wrapped_llama_without_drafter_speculates(embedded_target):
    import llama_cpp

    llm = llama_cpp.Llama(str(embedded_target), n_ctx=1024, n_threads=1, flash_attn=True, verbose=False)
    with Session.from_llama(llm) as s:
        r = _chat(s, COPY, block_size=8)  # a fixed block: whether lookup pays here is the controller's call
        assert r.stats.per_source["lookup"].n_accepted > 0
        assert r.tokens == _chat(s, COPY, speculative=False).tokens
    llm.close()


PROMPT = "The capital of France is Paris. The capital of France is"


@pytest.mark.slow  # 160 seeded generations
def test_sampled_lookup_tokens_follow_the_target_distribution(embedded_target):
    """Block 2: the token after the first is always a lookup draft (slot 1 of the first cycle) when the first token repeats the prompt's."""
    params = SamplingParams(temperature=1.0)
    with Session(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as s, \
            Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as reference:
        runs = [s.generate(PROMPT, max_tokens=3, temperature=1.0, seed=seed, block_size=2) for seed in range(160)]
        prompt = reference.vocab.tokenize(PROMPT)
        paris = reference.vocab.tokenize(" Paris", add_special=False)[0]
        after = [r.tokens[1] for r in runs if r.tokens[0] == paris and len(r.tokens) >= 2]
        assert all(r.stats.per_source["lookup"].n_drafted >= 1 for r in runs if r.tokens[0] == paris)
        assert len(after) > 40
        probs = next_token_probs(reference, prompt + [paris], params)
        drafted = prompt[prompt.index(paris) + 1]  # what lookup proposes: the token after the first " Paris"
        assert 0.05 < probs[drafted] < 0.95  # so both acceptance and rejection are exercised
        assert chi_square_p_value(after, probs) > ALPHA
        # and the same samples are told apart from a wrong law (the lookup token forced)
        forced = np.zeros_like(probs)
        forced[drafted] = 1.0
        assert chi_square_p_value(after, forced) < ALPHA
