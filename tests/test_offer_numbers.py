"""What an Offer carries (issue 34, item 6): expected tokens per length from the source's own AcceptanceProfile,
its draft time per length as the source timed it, and whether it is probing; the policy prices from these."""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.acceptance import AcceptanceProfile
from dflash_gguf.controller import CHEAP_DRAFT_S, AdaptivePolicy, BlockController, CostModel, CycleTiming, DraftTimes
from dflash_gguf.lookup import LookupSource, lookup_profile, match_bucket
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.sources import Commit, Offer
from dflash_gguf.steps import StepKind

MID = {1: 0.010, 2: 0.0125, 4: 0.016, 8: 0.024, 16: 0.0425}  # Q8_0 at two threads: t(16) = 4.25 steps
FLAT = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.0108}  # GPU-like


def _repeating_lookup() -> tuple[LookupSource, int, int]:
    source = LookupSource(max_draft=8)
    seq = list(range(100, 140))
    committed = seq + seq[:20]
    source.observe(Commit(0, committed, sequence=committed))
    return source, seq[20], len(committed)


def test_lookup_offers_the_draft_times_it_measured_itself():
    source, last, n_past = _repeating_lookup()
    before = source.offer(last, n_past, 8)
    assert before.draft_s is None and len(before.expected) == 9  # nothing timed yet: the policy's default
    source.propose(last, n_past, 8, SamplingParams(), np.random.default_rng(0))
    after = source.offer(last, n_past, 8)
    assert after.draft_s is not None and len(after.draft_s) == len(after.expected) == 9
    assert after.draft_s[0] == 0.0 and all(s > 0.0 for s in after.draft_s[1:])
    assert after.draft_s[8] == source.draft_times.table.seconds(9)  # as timed: a block of 8 drafts + 1
    assert after.probing is False


def test_the_policy_prices_an_offer_with_its_own_draft_times():
    expected = [1.0 + 0.9 * n for n in range(9)]  # drafts that nearly always pass
    cheap = Offer("toy", 8, expected)  # no draft times: priced as a draft that runs no model
    costly = Offer("toy", 8, expected, draft_s=[0.0] + [0.5] * 8)  # half a second per draft: never pays
    assert AdaptivePolicy(CostModel(MID, {1: 1e-5})).choose([cheap]).n_draft == 8
    assert AdaptivePolicy(CostModel(MID, {1: 1e-5})).choose([costly]).n_draft == 0


def test_the_policy_learns_draft_times_only_for_sources_that_do_not_time_their_own():
    costs = CostModel(FLAT, {1: 1e-5})
    policy = AdaptivePolicy(costs)
    expected = [1.0 + 0.9 * n for n in range(5)]
    timed = policy.choose([Offer("timed", 4, expected, draft_s=[0.0, 1e-5, 1e-5, 1e-5, 1e-5])])
    policy.observe(timed, 4, CycleTiming(5, 0.003, 0.0102, 0.0))
    untimed = policy.choose([Offer("untimed", 4, expected)])
    policy.observe(untimed, 4, CycleTiming(5, 0.003, 0.0102, 0.0))
    assert timed.source == "timed" and untimed.source == "untimed"
    assert "timed" not in costs.source_drafts  # its own times are the ones that count
    assert costs.source_drafts["untimed"].seconds(5) == 0.003  # the first timing, as measured


def test_draft_times_start_cheap_take_the_first_timing_and_ignore_a_timer_that_saw_nothing():
    times = DraftTimes()
    assert times.seconds(4) == CHEAP_DRAFT_S and times.per_length(3) is None
    times.observe(4, 0.0)
    assert times.table is None
    times.observe(4, 0.002)
    assert times.seconds(4) == 0.002 and times.per_length(3) == [0.0, 0.002, 0.002, 0.002]
    times.observe(4, 0.004)  # later timings are folded in (EMA), not taken as they come
    assert 0.002 < times.seconds(4) < 0.004
    times.observe(2, 0.001)  # a second point: lengths in between and beyond are interpolated as seconds() does
    assert times.per_length(5) == [0.0] + [times.seconds(n + 1) for n in range(1, 6)]
    assert times.per_length(5)[1] < times.per_length(5)[3] < times.per_length(5)[5]


def test_a_probing_offer_bids_nothing_and_probes_only_where_nothing_pays():
    costs = CostModel(MID, {1: 1e-5})
    great = [1.0 + n for n in range(9)]  # would pay more than any rival, were it priced
    good = Offer("good", 8, [1.0 + 0.9 * n for n in range(9)])
    exploring = Offer("explorer", 3, great, probing=True)
    assert AdaptivePolicy(costs).choose([exploring, good]).source == "good"
    bad = Offer("bad", 8, [1.0] + [1.01] * 8)  # its drafts never pass: it does not pay
    probe = AdaptivePolicy(costs).choose([bad, exploring])
    assert probe.source == "explorer" and probe.n_draft == 3 and probe.kind is StepKind.PROBE


def test_the_drafters_offer_probes_while_its_controller_has_set_drafting_aside():
    costs = CostModel(MID, {2: 0.001, 16: 0.003})
    controller = BlockController(15, costs)
    assert not controller.set_aside
    for _ in range(20):
        controller.observe(15, 0)  # its blocks never pass...
    assert controller.choose().n_draft == 0 and controller.set_aside  # ...so it decodes plainly, and probes
    assert controller.drafting_rate() is None  # the bid a probing offer is not asked for


def test_the_drafters_source_offers_probing_while_its_controller_has_set_drafting_aside():
    from dflash_gguf import Session

    with Session(n_ctx=256, n_threads=1) as s:  # the embedded target and its drafter
        s.calibrate()
        native = next(x for x in s.sources if x.name == s.drafter.kind)
        controller = native.controller
        offer = native.offer(0, 0, 4)
        assert offer.schedule is controller and offer.n_max == 4 and not offer.probing
        for _ in range(20):
            controller.observe(controller.max_draft, 0)
        assert controller.choose().n_draft == 0  # set aside
        offer = native.offer(0, 0, 4)
        assert offer.probing and offer.schedule is controller


def test_one_acceptance_profile_learns_per_slot_pooled_or_per_bucket():
    drafter = AcceptanceProfile(4, prior=0.8, strength=4.0, memory=0.9, pooled=2.0)
    assert drafter.rates() == pytest.approx([0.8] * 4)
    for _ in range(20):
        drafter.observe(0, 4, 1)  # the first slot passes, the second fails: the others are never judged
    r = drafter.rates()
    assert r[0] > 0.8 > r[1] and r[2] == r[3]  # untried slots borrow the pooled rate
    assert drafter.expected_tokens(0, 4)[:2] == [1.0, 1.0 + r[0]]
    assert [drafter.acceptance(j) for j in range(4)] == r  # one slot at a time, the same numbers
    assert drafter.expected_tokens(1, 2) == [1.0, 1.0 + r[1], 1.0 + r[1] + r[1] * r[2]]
    faded = drafter.rates(at=70)  # observed at steps 1..20 (one per observation); 50 cycles later: towards the prior
    assert abs(faded[1] - 0.8) < abs(r[1] - 0.8)

    by_length = lookup_profile()
    assert by_length.slots == len(set(map(match_bucket, range(2, 40))))
    assert by_length.acceptance(32) > by_length.acceptance(2)  # a prior rising with the match length
    by_length.observe(2, 1, 0)
    assert [by_length.acceptance(n) for n in (2, 5, 20)] == [by_length.rates()[match_bucket(n)] for n in (2, 5, 20)]
    assert by_length.acceptance(2) < lookup_profile().acceptance(2)  # learnt in its bucket
    assert by_length.acceptance(32) == lookup_profile().acceptance(32)  # and nowhere else
    flat = lookup_profile(prior=0.6)
    assert flat.acceptance(2) == flat.acceptance(32) == 0.6


def test_bad_profiles_and_outcomes_are_refused():
    with pytest.raises(ValueError, match="slots"):
        AcceptanceProfile(0, prior=0.5, strength=1.0, memory=0.9)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceProfile(3, prior=[0.5, 0.5], strength=1.0, memory=0.9)
    with pytest.raises(ValueError, match="prior"):
        AcceptanceProfile(3, prior=1.0, strength=1.0, memory=0.9)
    with pytest.raises(ValueError, match="one prior"):
        AcceptanceProfile(2, prior=[0.5, 0.6], strength=1.0, memory=0.9, pooled=2.0)
    with pytest.raises(ValueError, match="memory"):
        AcceptanceProfile(2, prior=0.5, strength=1.0, memory=0.0)
    profile = AcceptanceProfile(2, prior=0.5, strength=1.0, memory=0.9)
    with pytest.raises(ValueError, match="n_accepted"):
        profile.observe(0, 1, 2)
    with pytest.raises(ValueError, match="outside"):
        profile.observe(0, 3, 3)
    with pytest.raises(ValueError, match="outside"):
        profile.expected_tokens(1, 2)
