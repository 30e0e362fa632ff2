"""Quantized KV cache (issue 23): type_k / type_v for target and drafter, validated before libllama sees them;
greedy speculative decoding equals plain decoding at the same KV type; a quantized cache is smaller."""

from __future__ import annotations

import pytest

from dflash_gguf import Session, Target
from dflash_gguf.config import SessionOptions, SettingError
from dflash_gguf.server.cli import main

PROMPT = "The three primary colors are"


def test_bad_kv_types_are_refused_before_anything_loads(embedded_target):
    with pytest.raises(SettingError, match="type_k: must be one of f32, f16, bf16, q8_0"):
        SessionOptions(type_k="q3_k")
    with pytest.raises(SettingError, match=r"type_v: a quantized V cache \(q4_0\) needs flash_attn=True"):
        SessionOptions(type_v="q4_0", flash_attn=False)
    with pytest.raises(SettingError, match="type_v_draft"):
        SessionOptions(type_v_draft="q8_0", flash_attn=False)
    SessionOptions(type_k="q4_0", flash_attn=False)  # a quantized K needs no flash attention
    with pytest.raises(ValueError, match="a quantized V cache needs flash attention"):
        Target.open(embedded_target, type_v="q8_0", flash_attn=False)
    with pytest.raises(ValueError, match="type_k must be one of"):
        Target.open(embedded_target, type_k="int8")


def test_the_cli_flags_are_llama_cpps(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--cache-type-v", "q4_0", "--cache-type-k", "bogus"])
    assert e.value.code == 2 and "argument --cache-type-k: must be one of" in capsys.readouterr().err


def test_a_quantized_state_is_smaller(embedded_target):
    """llama_state_seq bytes of one 64-token sequence, by KV type: q8_0 about half of f16, q4_0 about a quarter."""
    sizes = {}
    for kv in ("f16", "q8_0", "q4_0"):
        with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1, type_k=kv, type_v=kv) as t:
            assert (t.type_k, t.type_v) == (kv, kv)
            t.decode(t.vocab.tokenize(PROMPT * 8)[:64], 0, logits=False)
            sizes[kv] = len(t.save_sequence())
    assert 0.45 < sizes["q8_0"] / sizes["f16"] < 0.6 and 0.25 < sizes["q4_0"] / sizes["f16"] < 0.35


@pytest.mark.slow  # a Session of the embedded pair per KV type, each calibrating its drafter
@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_greedy_speculative_equals_plain_at_the_same_kv_type(kv):
    with Session(n_ctx=512, n_threads=1, type_k=kv, type_v=kv) as s:
        assert (s.target.type_k, s.drafter.type_k, s.drafter.type_v) == (kv, kv, kv)
        spec = s.generate(PROMPT, max_tokens=48, block_size=4)  # fixed: every cycle drafts
        s.reset()
        plain = s.generate(PROMPT, max_tokens=48, speculative=False)
    assert spec.stats.n_accepted > 0
    assert spec.tokens == plain.tokens
