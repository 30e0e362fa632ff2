"""A new draft source is one class: defined here, passed in Session(sources=[...]), priced by the one policy.

The toy below proposes a fixed continuation and learns from the commits how often its drafts pass; no line
of the loop, the policy or the Session knows it.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf import SamplingParams, Session, StepKind
from dflash_gguf.controller import AdaptivePolicy, BlockController, CostModel
from dflash_gguf.defaults import embedded_drafter
from dflash_gguf.sources import Candidate, Commit, DraftSource, Offer

PROMPT = "The capital of France is"
N = 40


class Continuation(DraftSource):
    """Proposes the tokens of a fixed reply to a fixed prompt, aligned to positions; its acceptance model is
    one decayed Beta count of how often its drafts passed, learnt from the commits."""

    name = "continuation"

    def __init__(self, n_prompt: int, reply: list[int], *, max_draft: int = 8, prior: float = 0.9) -> None:
        self.n_prompt = n_prompt
        self.reply = list(reply)  # the reply's first token is sampled from the prompt, the rest can be drafted
        self.max_draft = max_draft
        self.passed, self.tried = 2 * prior, 2.0
        self.n = 0
        self._proposed: tuple[int, list[int]] | None = None

    def cached(self) -> int:
        return self.n

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)
        self._proposed = None

    def _next(self, n_past: int) -> int:
        return n_past - self.n_prompt + 1  # the reply index of the token after the one at n_past

    def available(self, last: int, n_past: int) -> int:
        return max(0, min(self.max_draft, len(self.reply) - self._next(n_past)))

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        p = self.passed / self.tried
        expected = [1.0]
        for n in range(1, n_max + 1):
            expected.append(expected[-1] + p**n)
        return Offer(self.name, n_max, expected)

    def propose(self, last, n_past, n_draft, params, rng) -> Candidate:
        i = self._next(n_past)
        tokens = self.reply[i : i + n_draft]
        self._proposed = (n_past, tokens)
        return Candidate(self.name, np.asarray(tokens, dtype=np.int64), point_mass=True)

    def observe(self, commit: Commit) -> None:
        assert commit.start == self.n, "commits arrive in position order"
        if self._proposed is not None and self._proposed[0] == commit.start:
            drafted, got = self._proposed[1], list(commit.tokens[1:])
            passed = next((k for k, (d, g) in enumerate(zip(drafted, got)) if d != g), len(got))
            self.passed, self.tried = 0.9 * self.passed + passed, 0.9 * self.tried + min(passed + 1, len(drafted))
        self._proposed = None
        self.n += len(commit.tokens)


@pytest.fixture(scope="module")
def plain_reply(embedded_target):
    with Session(embedded_target, n_ctx=512, n_threads=1, lookup=False) as s:
        prompt = s.tokenize(PROMPT)
        return prompt, s.generate(PROMPT, max_tokens=N, speculative=False).tokens


def test_a_new_source_drafts_through_a_session_losslessly_where_it_pays(embedded_target, plain_reply):
    prompt, reply = plain_reply
    toy = Continuation(len(prompt), reply)
    with Session(embedded_target, n_ctx=512, n_threads=1, lookup=False, sources=[toy]) as s:
        steps = list(s.stream(PROMPT, max_tokens=N))
        costs = s._verify_costs()
        fixed = s.generate(PROMPT, max_tokens=N, block_size=4)
    assert [t for st in steps for t in st.tokens] == reply
    assert fixed.tokens == reply and fixed.stats.per_source["continuation"].n_accepted > 0
    # drafts of the true reply pass whole: a length pays where verifying it costs less than its tokens do plainly
    pays = any((n + 1) / costs.verify_s(n + 1) > 1 / costs.plain_s for n in range(1, toy.max_draft + 1))
    drafted = [st for st in steps if st.source == "continuation"]
    if pays:
        assert drafted and all(st.kind is StepKind.DRAFT and st.n_accepted == st.n_drafted for st in drafted)
        assert drafted[0].reason.startswith("continuation ")
    assert toy.passed / toy.tried > 0.9  # what it learnt of itself


def test_rejected_drafts_of_a_new_source_stay_lossless(embedded_target, plain_reply):
    prompt, reply = plain_reply
    wrong = [t if i % 3 else (t + 1) % 1000 for i, t in enumerate(reply)]  # every third token is not the reply's
    toy = Continuation(len(prompt), wrong)
    with Session(embedded_target, n_ctx=512, n_threads=1, lookup=False, sources=[toy]) as s:
        r = s.generate(PROMPT, max_tokens=N, block_size=6)
    assert r.tokens == reply
    stats = r.stats.per_source["continuation"]
    assert 0 < stats.n_accepted < stats.n_drafted
    assert toy.passed / toy.tried < 0.9  # it learnt that its drafts fail


def _peer(passes: bool) -> Offer:
    """The offer for 8 drafts of a toy that has seen 30 of its blocks pass whole (or fail at once)."""
    toy = Continuation(4, list(range(100, 400)))
    toy.observe(Commit(0, [1, 2, 3, 4]))  # the prompt
    last, rng = 100, np.random.default_rng(0)
    for _ in range(30):
        n_past = toy.n
        drafted = toy.propose(last, n_past, 8, SamplingParams(), rng).tokens.tolist()
        accepted = drafted if passes else []
        toy.observe(Commit(n_past, [last] + accepted))  # the target keeps last and the drafts that passed
        last = drafted[-1] + 1 if passes else 0
    return toy.offer(last, toy.n, 8)


def test_the_policy_chooses_a_new_source_when_it_pays_among_any_number_of_peers():
    flat = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.0108}  # GPU-like: a longer verify costs little
    steep = {1: 0.010, 2: 0.020, 4: 0.040, 8: 0.080, 16: 0.160}  # n tokens cost n steps: nothing pays
    good, bad = _peer(True), _peer(False)
    assert good.expected[8] > 8.5 and bad.expected[8] < 1.1  # what each learnt of itself
    assert AdaptivePolicy(CostModel(flat, {2: 0.001})).choose([good]).n_draft == 8
    assert AdaptivePolicy(CostModel(steep, {2: 0.001})).choose([good]).n_draft == 0
    mid = {1: 0.010, 2: 0.0125, 4: 0.016, 8: 0.024, 16: 0.0425}
    assert AdaptivePolicy(CostModel(mid, {2: 0.001})).choose([bad]).n_draft == 0  # its drafts fail: plain

    # next to a drafter whose blocks always pass (16 tokens for one draft pass): the better offer wins
    costs = CostModel(flat, {2: 0.001, 16: 0.002})
    drafter = BlockController(15, costs)
    for _ in range(60):
        drafter.observe(15, 15)
    peers = [bad, good, Offer("dflash", 15, schedule=drafter)]
    assert AdaptivePolicy(costs).choose(peers).source == "dflash"
    # a drafter set aside (its blocks never pass): the toy takes the cycle, whatever the faded profile says
    idle = BlockController(15, costs)
    for _ in range(20):
        idle.observe(15, 0)
    for _ in range(25):
        idle.choose()  # plain cycles: the failures fade and the profile drifts back to its prior
    assert idle.drafting_rate() is None
    choice = AdaptivePolicy(costs).choose([bad, good, Offer("dflash", 15, schedule=idle)])
    assert choice.source == "continuation" and choice.n_draft == 8 and choice.kind is StepKind.DRAFT


def _named(name: str) -> Continuation:
    toy = Continuation(1, [1, 2, 3])
    toy.name = name
    return toy


def test_bad_sources_are_refused(embedded_target, plain_reply):
    prompt, reply = plain_reply
    with pytest.raises(TypeError, match="DraftSource"):
        Session(embedded_target, n_ctx=256, n_threads=1, sources=["lookup"])
    with pytest.raises(TypeError, match="list of DraftSource"):
        Session(embedded_target, n_ctx=256, n_threads=1, sources=_named("one"))
    for names, drafter in ((["a", "a"], None), (["lookup"], None), (["dflash"], embedded_drafter())):
        with pytest.raises(ValueError, match="names must differ"):
            Session(embedded_target, drafter, n_ctx=256, n_threads=1, sources=[_named(n) for n in names])
    bad = _named("zero")
    bad.max_draft = 0
    with pytest.raises(ValueError, match="max_draft"):
        Session(embedded_target, n_ctx=256, n_threads=1, sources=[bad])
    with Session(embedded_target, n_ctx=256, n_threads=1, sources=[Continuation(len(prompt), reply)]) as s:
        with pytest.raises(ValueError, match="fork"):
            s.fork()
