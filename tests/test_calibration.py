"""Calibration measures what the loop will pay, and never stands in the way of a valid call (issues 10, 15)."""

from __future__ import annotations

import warnings

import pytest

from dflash_gguf import Session

N_CTX, N_BATCH = 512, 64


@pytest.mark.slow  # on the hybrid targets, which upstream's converter builds first
@pytest.mark.parametrize("arch,mechanism", [("qwen35", "snapshot"), ("qwen3next", "checkpoint")])
def test_calibration_rolls_back_with_the_loops_mechanism(hybrid_models, arch, mechanism):
    """At position 0 a hybrid memory rolls back by clearing, which no verify in the loop does: calibration
    times its batches after a one-token prefix, so the rollback it prices is the snapshot or the
    checkpoint restore the loop will use, and the cost model has a rollback table."""
    with Session(hybrid_models.target(arch), hybrid_models.drafter(arch, "dflash"), n_ctx=N_CTX, n_batch=N_BATCH,
                 n_threads=1, lookup=False) as s:
        # n_rs_seq sized from the drafter's block without being asked (libllama clamps it for qwen3next)
        assert s.target.n_rs_seq == (15 if mechanism == "snapshot" else 0)
        before = dict(s.memory.rollbacks)
        controller = s._controller()
        done = {k: s.memory.rollbacks[k] - before[k] for k in before}
        if mechanism == "snapshot":  # every verify batch; timing a draft pass drops its one token by checkpoint
            assert done["snapshot"] > 0, done
        else:
            assert done["checkpoint"] > 0 and done["snapshot"] == 0, done
        assert controller.costs.rollback is not None and set(controller.costs.rollback.points()) >= {2, 16}
        assert s.target.pos_max(0) == -1  # the prefix is gone again
        r = s.generate("Good morning!", max_tokens=12)
        assert r.stats.memory == ("rs-snapshot" if mechanism == "snapshot" else "checkpoint")


@pytest.mark.slow  # on the hybrid targets, which upstream's converter builds first
def test_lookup_calibration_on_a_hybrid_target_prices_its_rollback(hybrid_models):
    with Session(hybrid_models.target("qwen35"), n_ctx=N_CTX, n_batch=N_BATCH, n_threads=1) as s:
        costs = s._verify_costs()
        assert costs.rollback is not None and max(costs.rollback.points()) == s._lookup.max_draft + 1
        assert s.memory.rollbacks["checkpoint"] > 0  # lookup alone: no snapshots, as upstream sizes n_rs_seq


def test_a_batch_of_one_token_decodes_plainly_and_says_so_once(embedded_target, dflash_gguf_path):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Session(embedded_target, dflash_gguf_path, n_ctx=256, n_batch=1, n_threads=1) as s:
            first = s.generate("The capital of France is", max_tokens=6)
            second = s.generate("The capital of France is", max_tokens=6)
    said = [w for w in caught if "n_batch=1" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in caught]
    for r in (first, second):
        assert not r.stats.speculative and r.stats.n_drafted == 0
        assert "n_batch=1" in r.stats.speculative_disabled_reason
    assert first.tokens == second.tokens and len(first.tokens) == 6


@pytest.mark.slow  # adaptive generation: measures the verify costs first
def test_the_first_adaptive_generation_after_plain_ones_calibrates(dflash_gguf_path):
    """Plain generations advance the target but not the drafter: calibrating then at the target's position
    made the drafter inject out of order (libllama refused the batch)."""
    m = [{"role": "user", "content": "Count from 1 to 100, separated by commas."}]
    with Session(drafter=dflash_gguf_path, n_ctx=1024, n_threads=1, lookup=False) as s:
        s.chat(m, max_tokens=8, block_size=4)
        plain = s.chat(m, max_tokens=30, speculative=False)
        again = s.chat(m, max_tokens=30)
    assert again.tokens == plain.tokens and again.stats.speculative
