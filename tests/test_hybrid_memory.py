"""HybridMemory on real hybrid targets: rollbacks and replays leave the state a single pass would have,
prefix reuse across turns, the guards, and the M-RoPE drafter conversion (issue 10)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from llama_cpp import llama_cpp as capi

from dflash_gguf import Session, Target
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.drafter import Drafter
from dflash_gguf.memory import HybridMemory, KVTruncation, memory_for, rs_seq_for
from dflash_gguf.target_gguf import drafter_verify_tokens, read_target_info

from hybrid_fixtures import DRAFT_BLOCK, build_drafter_checkpoint
from test_hybrid_session import open_session

pytestmark = pytest.mark.slow  # every test runs on the hybrid targets (tests/hybrid_fixtures.py builds them with upstream's converter)

LAYERS = [1, 3]
# batch variance of libllama's recurrent kernels on these fixtures is <= 0.02 (logits and features);
# a rollback that leaves wrong state is off by 1..10 (test_the_feature_check_sees_a_wrong_rollback)
TOL = 0.05


def open_target(path, n_rs_seq):
    t = Target.open(path, n_ctx=512, n_batch=64, n_threads=1, n_rs_seq=n_rs_seq)
    t.capture(LAYERS)
    return t


def single_pass(path, tokens):
    """Logits and features of `tokens` decoded in one batch on a fresh context."""
    with open_target(path, 0) as t:
        t.decode(tokens, 0, logits=True)
        return t.output_logits().copy(), t.features(len(tokens))


@pytest.mark.parametrize("arch,n_rs_seq", [("qwen35", 8), ("lfm2", 8), ("qwen35", 0), ("qwen3next", 8)])
def test_features_after_rollbacks_match_a_single_pass(hybrid_models, arch, n_rs_seq):
    """Random verify blocks (1..16 tokens) whose tail is junk, each kept to a random length: the features and
    logits of the kept rows, and of a batch decoded after, match a fresh single-pass capture of the sequence."""
    path = hybrid_models.target(arch)
    rng = np.random.default_rng(1)
    seq = [int(x) for x in rng.integers(100, 40000, 64)]
    ref_logits, ref_features = single_pass(path, seq)
    with open_target(path, n_rs_seq) as t:
        memory = memory_for(t)
        assert isinstance(memory, HybridMemory)
        assert memory.name == ("rs-snapshot" if t.n_rs_seq else "checkpoint")
        assert memory.truncate(0) == 0
        t.decode(seq[:6], 0, logits=True)
        n_past, worst = 6, 0.0
        while n_past < 56:
            n = min(int(rng.choice([1, 2, 4, 9, 16])), 56 - n_past)
            k = int(rng.integers(1, n + 1))
            block = seq[n_past : n_past + k] + [int(x) for x in rng.integers(100, 40000, n - k)]
            memory.before_verify(n_past, n)
            t.decode(block, n_past, logits=True)
            memory.keep(n_past, block, k)
            worst = max(worst, float(np.abs(t.features(k) - ref_features[n_past : n_past + k]).max()))
            n_past += k
        t.decode(seq[n_past:], n_past, logits=True)
        assert np.abs(t.output_logits() - ref_logits[n_past:]).max() < TOL
        assert np.abs(t.features(len(seq) - n_past) - ref_features[n_past:]).max() < TOL
        assert worst < TOL
        assert memory.rollbacks["checkpoint"] + memory.rollbacks["snapshot"] > 5
        if t.n_rs_seq:
            assert memory.rollbacks["snapshot"] > 0 and memory.rollbacks["checkpoint"] > 0  # 16 > 8 + 1
        else:
            assert memory.rollbacks["snapshot"] == 0 and memory.replayed_tokens > 0


def test_the_feature_check_sees_a_wrong_rollback(hybrid_models):
    """libllama accepts a snapshot rollback of a whole decode call, and gets it wrong: the tolerance above
    is far below the error it leaves."""
    path = hybrid_models.target("qwen35")
    seq = list(range(1000, 1020))
    ref_logits, _ = single_pass(path, seq)
    with open_target(path, 8) as t:
        t.decode(seq[:10], 0)
        t.decode(seq[10:14], 10, logits=True)
        t.remove(0, 10)  # returns True: the memory never does this (n_keep = 0 of a call it did not checkpoint)
        t.decode(seq[10:], 10, logits=True)
        assert np.abs(t.output_logits() - ref_logits[10:]).max() > 20 * TOL


def test_the_guards(hybrid_models):
    with open_target(hybrid_models.target("qwen35"), 4) as t:
        memory = memory_for(t)
        memory.truncate(0)
        t.decode([5, 6, 7], 0)
        with pytest.raises(RuntimeError, match="must directly follow the verify decode"):
            memory.keep(3, [8, 9], 1)  # no before_verify
        memory.before_verify(3, 3)
        with pytest.raises(RuntimeError, match="verify at 2, but the target holds 3 positions"):
            memory.before_verify(2, 3)
        memory.before_verify(3, 3)
        t.decode([8, 9, 10], 3, logits=True)
        memory.keep(3, [8, 9, 10], 1)
        assert t.pos_max() == 3
        with pytest.raises(RuntimeError, match="must directly follow"):
            memory.keep(3, [8, 9, 10], 1)  # a second rollback before the next decode
        memory.before_verify(4, 2)  # keep_min=1: snapshots, no checkpoint
        t.decode([11, 12], 4, logits=True)
        with pytest.raises(RuntimeError, match="no checkpoint was saved"):
            memory.keep(4, [11, 12], 0)
        with pytest.raises(ValueError, match="n_keep must be in"):
            memory.keep(4, [11, 12], 3)
    with pytest.raises(ValueError, match="max_block must be an integer >= 1"):
        rs_seq_for(0)
    with pytest.raises(ValueError, match="n_rs_seq must be an integer >= 0"):
        Target.open(hybrid_models.target("lfm2"), n_ctx=64, n_batch=8, n_rs_seq=-1)
    with pytest.raises(ValueError, match="n_rs_seq must be <= n_batch - 2 = 6"):
        Target.open(hybrid_models.target("lfm2"), n_ctx=64, n_batch=8, n_rs_seq=7)  # libllama would abort
    assert rs_seq_for(16) == 15 and rs_seq_for(16, 8) == 6 and rs_seq_for(1) == 0


def test_memory_for_picks_the_mechanism(hybrid_models, embedded_target):
    with Target.open(embedded_target, n_ctx=64, n_batch=32, n_rs_seq=15) as t:
        assert isinstance(memory_for(t), KVTruncation) and t.n_rs_seq == 0
        with pytest.raises(ValueError, match="HybridMemory is for targets with recurrent state"):
            HybridMemory(t)
    for arch, expect in (("qwen35", "rs-snapshot"), ("lfm2", "rs-snapshot"), ("qwen3next", "checkpoint")):
        with Target.open(hybrid_models.target(arch), n_ctx=64, n_batch=16, n_rs_seq=7) as t:
            memory = memory_for(t)
            assert memory.name == expect and memory.can_rollback
            state = memory.state_bytes
            assert state > 0
            assert memory.extra_bytes == (7 * state if expect == "rs-snapshot" else 0)


def test_prefix_reuse_from_turn_checkpoints(hybrid_models):
    """A prompt that extends the cache reuses all of it; one that shares only part resumes at the latest
    checkpoint inside the shared part (prompt end, end of turn); with none it re-prefills (kept = 0)."""
    path = hybrid_models.target("qwen35")
    seq = list(range(2000, 2040))
    ref_logits, _ = single_pass(path, seq)
    with open_target(path, 4) as t:
        memory = memory_for(t)
        memory.truncate(0)
        t.decode(seq[:10], 0)  # "prompt"
        n_past = 10
        for n in (3, 3, 3):  # "generation": verify blocks, the last 2 tokens of each rejected
            block = seq[n_past : n_past + n - 2] + [7, 7]
            memory.before_verify(n_past, n)
            t.decode(block, n_past, logits=True)
            memory.keep(n_past, block, n - 2)
            n_past += n - 2
        memory.end_of_turn(n_past)  # 13 positions, checkpoints at 10 (prompt end) and 13
        assert [c.pos for c in memory._turns] == [10, 13]
        assert memory.truncate(13) == 13  # extends: nothing rolled back
        assert memory.truncate(12) == 10  # inside the last call, but its snapshot rollback was spent
        t.decode(seq[10:20], 10, logits=True)
        assert np.abs(t.output_logits() - ref_logits[10:20]).max() < TOL
        assert memory.truncate(18) == 18  # snapshot: inside the last call, first rollback since it
        t.decode(seq[18:22], 18, logits=True)
        assert np.abs(t.output_logits() - ref_logits[18:22]).max() < TOL
        assert memory.truncate(5) == 0  # no checkpoint at or before 5: start over
        assert t.pos_max() == -1


def test_session_chat_reuses_the_prefix_on_a_hybrid_target(hybrid_models):
    target, drafter = hybrid_models.target("qwen35"), hybrid_models.drafter("qwen35")
    first = [{"role": "user", "content": "Hi there"}]
    with open_session(target, drafter, n_rs_seq=15) as s, open_session(target, drafter, n_rs_seq=15) as fresh:
        r1 = s.chat(first, max_tokens=12, block_size=4)
        n_prompt1 = len(s.tokenize(s.render_chat(first)[0], add_special=False))
        second = first + [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And then?"}]
        r2 = s.chat(second, max_tokens=12, block_size=4)
        assert r2.stats.n_cached_tokens >= n_prompt1  # at least the first prompt, from its checkpoint
        want = fresh.chat(second, max_tokens=12, block_size=4)
        assert want.stats.n_cached_tokens == 0
        assert r2.tokens == want.tokens
        # the same conversation again extends nothing cached beyond its own prompt: still correct
        r3 = s.chat(second, max_tokens=12, block_size=4)
        assert r3.tokens == want.tokens and r3.stats.n_cached_tokens > 0


def test_mrope_drafter_conversion(hybrid_models, tmp_path):
    """qwen35 ropes in sections: dflash-convert writes the degenerate [head_dim/2, 0, 0, 0], libllama then
    runs the drafter with M-RoPE (4 positions per embedding row), and it drafts what the same weights
    converted without the target (plain NeoX rope) draft."""
    target_path = hybrid_models.target("qwen35")
    assert read_target_info(target_path).mrope
    assert not read_target_info(hybrid_models.target("lfm2")).mrope
    ckpt = build_drafter_checkpoint(tmp_path / "ckpt", kind="dflash", seed=3)
    paired = convert_checkpoint(ckpt, tmp_path / "paired.gguf", target=target_path, progress=False)
    plain = convert_checkpoint(ckpt, tmp_path / "plain.gguf", progress=False)
    assert drafter_verify_tokens(paired) == DRAFT_BLOCK  # DFlash: the block holds the last token and B - 1 drafts
    with open_target(target_path, 0) as t:
        with Drafter(paired, t) as a, warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the unpaired file has no fingerprint: warned, not refused
            with Drafter(plain, t) as b:
                assert capi.llama_model_rope_type(a._model) == capi.LLAMA_ROPE_TYPE_MROPE
                assert capi.llama_model_rope_type(b._model) == capi.LLAMA_ROPE_TYPE_NEOX
                t.decode(list(range(300, 340)), 0, logits=True)
                features = t.features(40)
                outs = []
                for d in (a, b):
                    d.inject(features, 0)
                    outs.append(d.draft(345, 40, 7).copy())
                np.testing.assert_allclose(outs[0], outs[1], atol=1e-3)
                assert np.abs(outs[0]).max() > 0.1
