"""The adaptive block controller on synthetic cost and acceptance profiles.

Costs are shaped like this machine's measurements (docs/BENCHMARKS.md); acceptance is simulated with a
seeded generator so each test replays the same cycles.
"""

from __future__ import annotations

import numpy as np
import pytest

from dflash_gguf.controller import BlockController, CostModel, CostTable

MAX_DRAFT = 15
# seconds for a target batch of n tokens: Q4_1-like (16 tokens ~ 8.8x one step) and Q4_0-like (~4.8x)
Q4_1_TARGET = {1: 0.011, 2: 0.015, 4: 0.024, 8: 0.050, 12: 0.075, 16: 0.097}
Q4_0_TARGET = {1: 0.010, 2: 0.012, 4: 0.017, 8: 0.028, 12: 0.038, 16: 0.048}
DRAFT = {16: 0.006}


def costs(target: dict[int, float] = Q4_1_TARGET) -> CostModel:
    return CostModel(dict(target), dict(DRAFT))


def run(controller: BlockController, accept_p: float, cycles: int, rng: np.random.Generator) -> list[int]:
    """Simulate `cycles` cycles where each draft passes with probability accept_p given the ones before did."""
    chosen = []
    for _ in range(cycles):
        n = controller.choose().n_draft
        accepted = 0
        while accepted < n and rng.random() < accept_p:
            accepted += 1
        controller.observe(n, accepted)
        chosen.append(n)
    return chosen


def simulated_tokens_per_s(model: CostModel, chosen: list[int], accept_p: float, rng: np.random.Generator) -> float:
    tokens = seconds = 0.0
    for n in chosen:
        accepted = 0
        while accepted < n and rng.random() < accept_p:
            accepted += 1
        tokens += accepted + 1
        seconds += model.verify_s(n + 1) + (model.draft_s(n + 1) if n else 0.0)
    return tokens / seconds


def test_plain_decoding_when_drafts_never_pass() -> None:
    model = costs()
    controller = BlockController(MAX_DRAFT, model)
    chosen = run(controller, 0.0, 300, np.random.default_rng(0))
    assert chosen[-1] == 0
    assert sum(n == 0 for n in chosen) / len(chosen) > 0.95
    # probing keeps the loss against plain decoding within the 0.95x goal
    rate = simulated_tokens_per_s(model, chosen, 0.0, np.random.default_rng(1))
    assert rate >= 0.95 / model.plain_s
    choice = controller.choose()
    assert choice.n_draft == 0 and choice.reason.startswith("plain: drafts rarely accepted")
    assert "< plain 91 tok/s" in choice.reason
    assert choice.expected_tokens_per_s == pytest.approx(1 / 0.011)


def test_probes_back_off_while_drafts_never_pass() -> None:
    """A probe rejected outright keeps drafting set aside and doubles the wait, even where the profile,
    faded over the plain streak, would again promise more than plain decoding (a cheap verify, as on the
    hybrid fixtures: on the old rule every probe was followed by a full draft and the wait never grew)."""
    model = CostModel({1: 0.003, 2: 0.0032, 16: 0.006}, {2: 0.0001, 16: 0.0002})
    controller = BlockController(MAX_DRAFT, model)
    chosen = run(controller, 0.0, 2000, np.random.default_rng(0))
    drafted = [i for i, n in enumerate(chosen) if n]
    probes = [i for i in drafted if i > 10]  # after the first cycles (the prior's), only probes draft
    assert len(drafted) - len(probes) <= 10 and all(chosen[i] == 1 for i in probes)
    assert list(np.diff(probes)) == [65, 129] + [257] * (len(probes) - 3)  # the wait doubles up to 256 cycles


def test_largest_block_when_drafts_always_pass() -> None:
    controller = BlockController(MAX_DRAFT, costs())
    chosen = run(controller, 1.0, 40, np.random.default_rng(0))
    assert chosen[-10:] == [MAX_DRAFT] * 10
    choice = controller.choose()
    assert choice.reason.startswith(f"draft {MAX_DRAFT}: E=")
    assert choice.expected_tokens_per_s > 1.5 / 0.011


def test_partial_acceptance_picks_an_intermediate_block() -> None:
    model = costs(Q4_0_TARGET)
    controller = BlockController(MAX_DRAFT, model)
    chosen = run(controller, 0.75, 400, np.random.default_rng(1))
    drafted = [n for n in chosen[-200:] if n]
    assert len(drafted) > 100
    assert 2 <= float(np.median(drafted)) <= 8, drafted
    assert simulated_tokens_per_s(model, chosen, 0.75, np.random.default_rng(2)) > 1.0 / model.plain_s
    # the profile says a position is accepted about 3 times in 4
    assert controller.acceptance()[0] == pytest.approx(0.75, abs=0.2)


def test_moves_to_plain_and_back_as_the_profile_changes() -> None:
    rng = np.random.default_rng(0)
    controller = BlockController(MAX_DRAFT, costs())
    good = run(controller, 1.0, 40, rng)
    assert good[-1] == MAX_DRAFT
    bad = run(controller, 0.0, 200, rng)
    assert bad.index(0) <= 8, bad[:10]  # steps aside within a few cycles
    assert bad[-1] == 0
    recovered = run(controller, 1.0, 150, rng)
    first_large = next(i for i, n in enumerate(recovered) if n == MAX_DRAFT)
    # back to the largest block once a probe sees drafts passing again (probe interval <= 256 cycles)
    assert first_large < 140, recovered
    assert recovered[-5:] == [MAX_DRAFT] * 5
    assert run(controller, 0.0, 20, rng)[-1] == 0


def test_cheaper_batched_kernels_favour_larger_blocks() -> None:
    slow = BlockController(MAX_DRAFT, costs(Q4_1_TARGET))
    fast = BlockController(MAX_DRAFT, costs(Q4_0_TARGET))
    for controller in (slow, fast):
        run(controller, 0.8, 200, np.random.default_rng(3))
    assert fast.choose().n_draft > slow.choose().n_draft


def test_plain_from_the_start_when_verification_is_too_costly() -> None:
    # batches cost like single steps times n: nothing a prior can expect pays for the draft
    linear = {n: 0.011 * n for n in (1, 2, 4, 8, 16)}
    choice = BlockController(MAX_DRAFT, CostModel(linear, dict(DRAFT))).choose()
    assert choice.n_draft == 0
    assert choice.reason.startswith("plain: verifying costs too much here (best draft")


def test_online_timing_updates_change_the_decision() -> None:
    controller = BlockController(MAX_DRAFT, costs())
    run(controller, 1.0, 20, np.random.default_rng(0))
    assert controller.choose().n_draft == MAX_DRAFT
    for _ in range(30):  # the drafter turns out far slower on this machine than calibrated
        controller.observe_timing("draft", MAX_DRAFT + 1, 2.0)
    assert controller.costs.draft_s(MAX_DRAFT + 1) > 1.0
    choice = controller.choose()
    assert choice.n_draft == 0 and choice.reason.startswith("plain")


def test_fixed_block_ignores_acceptance() -> None:
    controller = BlockController(7, costs(), adaptive=False)
    chosen = run(controller, 0.0, 30, np.random.default_rng(0))
    assert chosen == [7] * 30
    assert controller.choose().reason.startswith("fixed block 8: E=")


def test_expected_tokens_follow_the_acceptance_profile() -> None:
    controller = BlockController(4, costs(), prior_acceptance=0.5)
    expected = controller.expected_tokens()
    assert expected == pytest.approx([1.0, 1.5, 1.75, 1.875, 1.9375])
    for _ in range(50):
        controller.choose()
        controller.observe(4, 4)
    assert controller.expected_tokens()[4] > 4.5


def test_observe_rejects_impossible_outcomes() -> None:
    controller = BlockController(4, costs())
    with pytest.raises(ValueError, match="n_accepted <= n_draft"):
        controller.observe(2, 3)
    with pytest.raises(ValueError, match="n_draft <= 4"):
        controller.observe(5, 0)
    with pytest.raises(ValueError, match="timing kind"):
        controller.observe_timing("prefill", 4, 0.01)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_draft"):
        BlockController(0, costs())


def test_cost_table_interpolates_and_smooths() -> None:
    table = CostTable({1: 0.010, 4: 0.016, 16: 0.064}, smoothing=0.5)
    assert table.seconds(2) == pytest.approx(0.012)
    assert table.seconds(10) == pytest.approx(0.040)
    assert table.seconds(20) == pytest.approx(0.080)  # last segment extended
    table.update(4, 0.020)
    assert table.seconds(4) == pytest.approx(0.018)
    table.update(4, 10.0)  # a wild outlier counts as twice the estimate at most
    assert table.seconds(4) == pytest.approx(0.5 * 0.018 + 0.5 * 0.036)
    table.update(8, 0.030)  # a new point starts from the interpolated estimate
    interpolated = 0.027 + (0.064 - 0.027) * 4 / 12
    assert table.points()[8] == pytest.approx(0.5 * interpolated + 0.5 * 0.030)
    with pytest.raises(ValueError, match="seconds must be"):
        table.update(2, float("nan"))
    with pytest.raises(ValueError, match="at least one"):
        CostTable({})


@pytest.mark.slow  # times verify batches of every size, target and drafter
def test_calibrate_measures_real_costs_and_leaves_caches_alone(embedded_target, dflash_gguf_path) -> None:
    from dflash_gguf.drafter import Drafter
    from dflash_gguf.target import Target
    from dflash_gguf.timing import calibrate

    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as target:
        with Drafter(dflash_gguf_path, target) as drafter:
            prompt = target.vocab.tokenize("The capital of France is")
            target.decode(prompt, 0, logits="last")
            drafter.inject(target.features(len(prompt)), 0)
            before = target.logits(len(prompt) - 1)
            model = calibrate(target, drafter, budget_s=0.05)
            assert target.pos_max(0) == len(prompt) - 1
            assert drafter.pos_max() == len(prompt) - 1
            assert sorted(model.target.points()) == [1, 2, 4, 8, 16]
            assert sorted(model.draft.points()) == [2, drafter.block_size]
            # real timings (a stalled sample on a busy machine may tie sizes, never invert them)
            assert all(0 < s < 10 for s in [*model.target.points().values(), *model.draft.points().values()])
            # the cache still continues the prompt: decoding its last token again gives the same logits
            target.remove(0, len(prompt) - 1)
            target.decode(prompt[-1:], len(prompt) - 1, logits=True)
            assert np.allclose(target.logits(0), before, atol=1e-4)
            controller = BlockController(drafter.block_size - 1, model)
            assert controller.choose().expected_tokens_per_s > 0


def test_probes_are_cheap_and_grow_while_they_pass() -> None:
    controller = BlockController(MAX_DRAFT, costs(), probe_after=4)
    run(controller, 0.0, 12, np.random.default_rng(0))  # aside by now
    choices = []
    for _ in range(12):
        choice = controller.choose()
        choices.append(choice)
        controller.observe(choice.n_draft, choice.n_draft)  # every draft passes from now on
        if not choice.reason.startswith(("plain", "probe")):
            break
    probes = [c for c in choices if c.reason.startswith("probe")]
    assert [c.n_draft for c in probes[:2]] == [1, 3]
    assert probes[1].reason.startswith("probe draft 3 (the last probe passed)")
    assert choices[-1].reason.startswith("draft ")  # back to speculating once the probes show drafts pass


def test_calibration_tables_are_non_decreasing() -> None:
    from dflash_gguf.timing import _non_decreasing

    # a stalled 1-token sample (2 s) cannot make plain decoding look slower than a 16-token batch
    assert _non_decreasing({1: 2.0, 2: 0.015, 4: 0.03, 16: 0.02}) == {1: 0.015, 2: 0.015, 4: 0.02, 16: 0.02}


# -- lookup among other sources (AdaptivePolicy) ---------------------------------------------------


def _lookup_with_a_match(accepted_fraction: float):
    """A LookupSource whose index holds a repeat (so the last token has a long match) and which has learnt
    that `accepted_fraction` of its drafts pass at that match length."""
    from dflash_gguf.lookup import LookupSource
    from dflash_gguf.sources import Commit

    source = LookupSource(max_draft=8)
    seq = list(range(100, 140))
    committed = seq + seq[:20]  # the last token, seq[20], follows seq[:20] as it did before
    source.observe(Commit(0, committed, sequence=committed))
    last, n_past = seq[20], 60
    for _ in range(40):
        m = source.match(last, n_past)
        source.stats.observe(m.length, 8, round(8 * accepted_fraction))
    return source.offer(last, n_past, source.available(last, n_past))


FLAT = {1: 0.010, 2: 0.0101, 4: 0.0102, 8: 0.0104, 16: 0.0108}  # a GPU-like verify cost curve
MID = {1: 0.010, 2: 0.0125, 4: 0.016, 8: 0.024, 16: 0.0425}  # Q8_0 at two threads here: t(16) = 4.25 steps
STEEP = {1: 0.010, 2: 0.020, 4: 0.040, 8: 0.080, 16: 0.160}  # n tokens cost n steps


def test_lookup_drafts_where_the_match_pays_for_its_verify() -> None:
    from dflash_gguf.controller import AdaptivePolicy

    offer = _lookup_with_a_match(1.0)
    choice = AdaptivePolicy(CostModel(MID, {1: 1e-5})).choose([offer])
    assert choice.source == "lookup" and choice.n_draft == 8
    assert AdaptivePolicy(CostModel(STEEP, {1: 1e-5})).choose([offer]).n_draft == 0  # never pays there
    unreliable = _lookup_with_a_match(0.0)
    assert AdaptivePolicy(CostModel(MID, {1: 1e-5})).choose([unreliable]).n_draft == 0
    assert AdaptivePolicy(CostModel(FLAT, {1: 1e-5})).choose([unreliable]).n_draft > 0  # on a GPU a draft is free


def test_lookup_leaves_the_cycle_to_a_better_drafter() -> None:
    from dflash_gguf.controller import AdaptivePolicy
    from dflash_gguf.sources import Offer

    lookup = _lookup_with_a_match(0.5)
    model = CostModel(FLAT, {2: 0.001, 16: 0.002})
    drafter = BlockController(15, model)
    for _ in range(60):
        drafter.observe(15, 15)  # the drafter's blocks always pass
    policy = AdaptivePolicy(model)
    choice = policy.choose([lookup, Offer("dflash", 15, schedule=drafter)])
    assert choice.source == "dflash" and choice.n_draft == 15
    # without the drafter on offer, the same lookup draft is worth verifying
    assert policy.choose([lookup]).source == "lookup"


def test_lookup_drafts_while_the_drafter_is_set_aside() -> None:
    """A drafter set aside for plain decoding must not outbid lookup with a profile faded back to its prior
    (on CI, lookup never drafted a copy-heavy reply: the idle drafter's faded profile always 'won')."""
    from dflash_gguf.controller import AdaptivePolicy
    from dflash_gguf.sources import Offer

    lookup = _lookup_with_a_match(0.0)  # few drafts pass, but on a flat cost curve they pay
    model = CostModel(FLAT, {2: 0.001, 16: 0.002})
    drafter = BlockController(15, model)
    for _ in range(20):
        drafter.observe(15, 0)  # the drafter's blocks never pass...
    assert drafter.choose().n_draft == 0 and drafter.drafting_rate() is None  # ...so it decodes plainly
    for _ in range(25):
        drafter.choose()  # plain cycles: the failures fade and the profile drifts back to the prior
    expected = drafter.expected_tokens()
    faded_best = max(expected[n] / (model.draft_s(n + 1) + model.verify_s(n + 1)) for n in range(1, 16))
    lookup_alone = AdaptivePolicy(model).choose([lookup])
    assert lookup_alone.source == "lookup"
    lookup_rate = lookup.expected[lookup_alone.n_draft] / model.verify_s(lookup_alone.n_draft + 1)
    assert faded_best > lookup_rate  # the case that matters: the faded profile looks better than lookup
    assert drafter.drafting_rate() is None
    choice = AdaptivePolicy(model).choose([lookup, Offer("dflash", 15, schedule=drafter)])
    assert choice.source == "lookup" and choice.n_draft == lookup_alone.n_draft


# -- draft trees priced beside blocks (issue 36) ---------------------------------------------------------

def _curve(name: str) -> dict[int, float]:
    """A published verify cost curve from scripts/verify_curves (seconds per batch of n rows)."""
    import json
    from pathlib import Path

    spec = json.loads((Path(__file__).parent.parent / "scripts" / "verify_curves" / f"{name}.json").read_text())
    return {int(n): float(s) for n, s in spec["seconds"].items()}


def run_trees(model: CostModel, budget: int, cycles: int, rng: np.random.Generator,
              first: tuple[float, ...] = (0.4, 0.3, 0.1, 0.2), later: tuple[float, ...] | None = None,
              ) -> list[tuple[bool, int, float]]:
    """Simulate cycles of a block drafter whose candidates at every slot are tokens 10, 11, 12, 13 (best
    first), where the target's token is the drafter's first with probability 0.4, its second 0.3, its third
    0.1, else none of them (`first`; `later`: at slots 2 and after, where they differ): what the second
    candidates hold only a tree can take. budget 0: blocks only.
    Returns (a tree was verified, tokens committed, seconds as the model prices the cycle) per cycle; the
    shaper and the controller are the runtime's."""
    from dflash_gguf.tree import TreeShaper, walk_greedy

    controller = BlockController(MAX_DRAFT, model)
    shaper = TreeShaper(MAX_DRAFT, budget, k=4) if budget else None
    if shaper is not None:
        controller.attach_trees(shaper)
    logits = np.full((MAX_DRAFT, 20), -6.0)
    logits[:, 10:14] = [2.0, 1.6, 0.5, 0.0]
    out, pos, anchor = [], 100, 1
    for _ in range(cycles):
        cont = [int(rng.choice([10, 11, 12, 99], p=first if j == 0 or later is None else later))
                for j in range(MAX_DRAFT + 1)]
        n = controller.choose().n_draft
        rows = controller.tree_rows_now()
        tree = None
        if n == 0:
            tokens, seconds = [], model.plain_s
        elif rows:
            tree = shaper.shape(anchor, pos, logits[:n], rows, model if controller.sized_now() else None)
            path, _ = walk_greedy(tree, lambda row: cont[tree.depths[row]])
            tokens = [tree.tokens[r] for r in path[1:]]
            verified = tree.first_leaf + 1 if tree.is_path else len(tree)
            seconds = model.draft_s(n + 1) + (model.verify_s(verified) if tree.is_path else model.tree_verify_s(verified))
        else:
            a = 0
            while a < n and cont[a] == 10:
                a += 1
            tokens, verified, seconds = cont[:a], n + 1, model.draft_s(n + 1) + model.verify_s(n + 1)
        if shaper is not None:
            shaper.observe(pos, [anchor, *tokens])
        if n:
            controller.observe(n, len(tokens), verified)
        out.append((tree is not None and not tree.is_path, len(tokens) + 1, seconds))
        pos += len(tokens) + 1
        anchor = cont[len(tokens)]
    return out


def _rate(cycles: list[tuple[bool, int, float]]) -> float:
    return sum(c[1] for c in cycles) / sum(c[2] for c in cycles)


def test_trees_turn_on_where_the_verify_curve_is_flat() -> None:
    """Under a published GPU curve (llama.cpp PR 5625, 34B Q8_0: t(8)/t(1) = 1.7), the controller learns that
    trees commit more than blocks and verifies trees in most cycles, for more tokens per priced second than
    the same controller with blocks only."""
    curve = _curve("pr5625_llama34b_q8_0")
    trees = run_trees(CostModel(curve, {16: 1e-4}), 16, 600, np.random.default_rng(0))[100:]
    blocks = run_trees(CostModel(curve, {16: 1e-4}), 0, 600, np.random.default_rng(0))[100:]
    assert sum(tree for tree, _, _ in trees) > 0.5 * len(trees)
    assert _rate(trees) > 1.05 * _rate(blocks)


def test_trees_stay_off_where_the_verify_cost_grows_with_rows() -> None:
    """Under this CPU's kind of curve (16 rows cost ~9 single steps) the same drafter's trees do not pay:
    at most the rare tree that tests a size is verified, and the rate is the blocks-only controller's."""
    trees = run_trees(CostModel(Q4_1_TARGET, dict(DRAFT)), 16, 600, np.random.default_rng(0))
    blocks = run_trees(CostModel(Q4_1_TARGET, dict(DRAFT)), 0, 600, np.random.default_rng(0))
    assert sum(tree for tree, _, _ in trees) <= 0.05 * len(trees)
    assert _rate(trees) >= 0.97 * _rate(blocks)


# this CPU's drafter pass (the embedded drafter, one thread): a block of 2 ~0.15 of a plain step, of 16 ~0.7
CPU_DRAFT = {2: 0.0016, 8: 0.0038, 16: 0.0081}


def test_where_only_the_first_slot_passes_the_tree_mode_drafts_as_blocks_would() -> None:
    """A drafter right at slot 1 70% of the time and rarely after, at this CPU's costs: one-draft blocks pay a
    little. Trees must cost nothing there: a tree size whose likeliest rows are a chain is evidence for that
    size (not retried every cycle as a size "not verified lately"), and a tree sized per cycle that commits less
    per second than plain decoding is not chosen over the block the estimates prefer."""
    first, later = (0.7, 0.1, 0.05, 0.15), (0.2, 0.1, 0.05, 0.65)
    for seed in range(4):
        trees = run_trees(CostModel(Q4_1_TARGET, dict(CPU_DRAFT)), 16, 800, np.random.default_rng(seed), first, later)
        blocks = run_trees(CostModel(Q4_1_TARGET, dict(CPU_DRAFT)), 0, 800, np.random.default_rng(seed), first, later)
        assert _rate(trees) >= 0.97 * _rate(blocks), seed


def test_a_tree_sized_per_cycle_drafts_the_slots_its_pass_can_afford() -> None:
    """A sized tree's drafter pass covers every slot where a pass costs the same whatever its length (a GPU's);
    where it grows with its length (this CPU's), as many as add at most a tenth of the best block's cycle
    to that block's own pass: trying one costs little more than the block."""
    from dflash_gguf.tree import TreeShaper

    for draft in ({16: 1e-4}, CPU_DRAFT):
        model = CostModel(Q4_1_TARGET, dict(draft))
        block = BlockController(MAX_DRAFT, model).choose().n_draft  # the best block, before any evidence
        controller = BlockController(MAX_DRAFT, model)
        controller.attach_trees(TreeShaper(MAX_DRAFT, 16))
        n = controller.choose().n_draft  # no tree sized per cycle verified yet: one is tried
        assert controller.sized_now() and block < n
        allowed = model.draft_s(block + 1) + 0.1 * (model.draft_s(block + 1) + model.verify_s(block + 1))
        if draft is CPU_DRAFT:
            assert model.draft_s(n + 1) <= allowed < model.draft_s(n + 2) and n < MAX_DRAFT
        else:
            assert n == MAX_DRAFT
