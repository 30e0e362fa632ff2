"""The one statistics model's definitions: the speedup's rate, the like-for-like baseline, the confidence
calibration. Steps here are built by hand because these are definitions over Step values; the Session-fed
paths are covered in test_seams.py, the TUI's use of them in test_tui_app.py."""

from __future__ import annotations

import pytest

from dflash_gguf.stats import (
    MIN_BASELINE_CYCLES, Baseline, BaselineSource, Calibration, collect, generation_speedup, speedup,
)
from dflash_gguf.steps import Step, StepKind, TokenSource


def plain(cycle_s: float) -> Step:
    return Step(kind=StepKind.PLAIN, tokens=[1], text="a", provenance=(TokenSource.PLAIN,), cycle_s=cycle_s, block_size=1)


def drafted(n_drafted: int, n_accepted: int, cycle_s: float, *, kind: StepKind = StepKind.DRAFT,
            source: str = "dspark", confidences: tuple[float, ...] = ()) -> Step:
    n = n_accepted + 1
    return Step(
        kind=kind, tokens=[1] * n, text="a" * n, provenance=(TokenSource.DRAFT,) * n_accepted + (TokenSource.BONUS,),
        source=source, n_drafted=n_drafted, n_accepted=n_accepted, block_size=n_drafted + 1, cycle_s=cycle_s,
        confidences=confidences,
    )


PREFILL = Step(kind=StepKind.PREFILL, tokens=[1], text="a", provenance=(TokenSource.PREFILL,), verify_s=0.5)


def finished(steps: list[Step], wall_s: float):
    return collect(steps).stats(wall_s=wall_s, n_prompt_tokens=4, n_cached_tokens=0, block_size=None, speculative=True)


def test_the_baseline_is_the_replys_own_plain_cycles_first_then_the_same_uis_run_else_none():
    assert Baseline.choose(50.0, 40.0) == Baseline(50.0, BaselineSource.IN_REPLY)
    assert Baseline.choose(None, 40.0) == Baseline(40.0, BaselineSource.SAME_UI)
    none = Baseline.choose(None, None)
    assert none.source is BaselineSource.NONE and none.tokens_per_s is None
    assert none.speedup(100.0) is None, "no like-for-like baseline: no figure"
    assert Baseline.choose(None, 40.0).speedup(60.0) == pytest.approx(1.5)
    assert BaselineSource.NONE.value == "not measured yet"


def test_the_in_reply_baseline_needs_enough_plain_cycles_and_ignores_probes():
    # an adaptive reply whose controller chose plain: plain cycles with a probe among them
    steps = [PREFILL] + [plain(0.01)] * (MIN_BASELINE_CYCLES - 1) + [drafted(3, 0, 0.03, kind=StepKind.PROBE)]
    assert collect(steps).in_reply_plain_tokens_per_s is None, "too few plain cycles: no figure, not a guess"
    steps.append(plain(0.01))
    b = collect(steps)
    assert b.in_reply_plain_tokens_per_s == pytest.approx(100.0), "the probe's cycle is not part of the baseline"
    # the reply's speed counts the probe (it is part of what the reply cost): a little under 1.0x
    stats = finished(steps, wall_s=1.0)
    assert stats.in_reply_speedup == pytest.approx((MIN_BASELINE_CYCLES + 1) / (0.01 * MIN_BASELINE_CYCLES + 0.03) / 100.0)
    assert stats.in_reply_speedup < 1.0


def test_speedup_divides_loop_rates_never_wall_rates():
    fast = finished([PREFILL] + [drafted(3, 3, 0.02)] * 10, wall_s=5.0)  # a slow consumer: wall far above loop
    slow = finished([PREFILL] + [plain(0.01)] * 10, wall_s=0.6)
    assert fast.loop_tokens_per_s == pytest.approx(200.0) and slow.loop_tokens_per_s == pytest.approx(100.0)
    assert fast.decode_tokens_per_s < slow.decode_tokens_per_s  # the wall rates would say it was slower
    assert generation_speedup(fast, slow) == pytest.approx(2.0)
    assert speedup(None, 10.0) is None and speedup(20.0, 10.0) == 2.0


def test_calibration_counts_the_slots_the_target_judged():
    steps = [
        PREFILL,
        # slot 1 accepted, slot 2 rejected, slot 3 never judged
        drafted(3, 1, 0.02, confidences=(0.9, 0.8, 0.1)),
        # every slot accepted
        drafted(2, 2, 0.02, confidences=(0.7, 0.6)),
        # drafts without confidences (a DFlash drafter, lookup) and plain cycles do not count
        drafted(3, 1, 0.02, source="lookup"),
        plain(0.01),
    ]
    stats = finished(steps, wall_s=1.0)
    assert stats.confidence == Calibration(
        slots=4, predicted=pytest.approx((0.9 + 0.8 + 0.7 + 0.6) / 4), observed=pytest.approx(3 / 4)
    )
    assert stats.as_dict()["confidence"]["slots"] == 4
    assert finished([PREFILL, drafted(3, 1, 0.02), plain(0.01)], wall_s=1.0).confidence is None
