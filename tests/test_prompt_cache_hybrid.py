"""The prompt cache on hybrid targets (issue 23): the saved state includes the recurrent state, so a restored
prefix speculates exactly as a cold prefill, from RAM and from disk, with snapshots (qwen35) and with
checkpoints (qwen3next). A recurrent state cannot be cut back, so an entry serves prompts that extend it;
the state before a prompt's last token is stored too, so the same prompt resent is a hit as well.

The greedy comparison holds where the target's top two logits are further apart than the batch variance of
libllama's recurrent kernels (tests/test_hybrid_session.py); these seeded prompts keep clear of near ties.
"""

from __future__ import annotations

import pytest

from dflash_gguf import Session
from dflash_gguf.prompt_cache import PromptCache

pytestmark = pytest.mark.slow  # the hybrid fixtures are built with upstream's converter

PROMPT = "Good morning! " * 16
KW = dict(n_ctx=512, n_batch=64, n_threads=1)  # and fixed blocks: every cycle drafts, so every cycle rolls back


def run_tokens(session: Session, tokens: list[int], **gen) -> tuple[list[int], object]:
    out = [t for step in session.stream_tokens(tokens, **gen) for t in step.tokens]
    return out, session.last_stats


@pytest.mark.parametrize("arch, memory", [("qwen35", "rs-snapshot"), ("qwen3next", "checkpoint")])
def test_a_restored_hybrid_prefix_speculates_as_a_cold_prefill(hybrid_models, tmp_path, arch, memory):
    target, drafter = hybrid_models.target(arch), hybrid_models.drafter(arch)
    cache = PromptCache(ram_bytes=1 << 28, directory=tmp_path)
    with Session(target, drafter, prompt_cache=cache, **KW) as first:
        assert first.memory.name == memory
        prompt = first.tokenize(PROMPT)
        reply, stats = run_tokens(first, prompt, max_tokens=24, block_size=4)
        assert stats.prompt_cache.stored
        # the next turn: the stored prompt + reply, then new tokens (as an agent's next request)
        follow = prompt + reply + first.tokenize(" And then?", add_special=False)
        with first.fork() as other:
            same, again = run_tokens(other, prompt, max_tokens=24, block_size=4)
    # the same prompt resent resumes from the state stored before its last token
    assert again.prompt_cache.tier == "ram" and again.n_cached_tokens == len(prompt) - 1
    assert same == reply
    with Session(target, drafter, prompt_cache=PromptCache(directory=tmp_path), **KW) as restarted:
        same, again = run_tokens(restarted, prompt, max_tokens=24, block_size=4)
    assert again.prompt_cache.tier == "disk" and again.n_cached_tokens == len(prompt) - 1
    assert same == reply
    with Session(target, drafter, **KW) as cold:
        expected, cold_stats = run_tokens(cold, follow, max_tokens=24, block_size=4)
    assert cold_stats.n_drafted > 0
    with Session(target, drafter, prompt_cache=cache, **KW) as warm:
        got, stats = run_tokens(warm, follow, max_tokens=24, block_size=4)
    assert stats.prompt_cache.tier == "ram" and stats.n_cached_tokens >= len(prompt) + len(reply) - 1
    assert got == expected
    with Session(target, drafter, prompt_cache=PromptCache(directory=tmp_path), **KW) as restarted:
        got, stats = run_tokens(restarted, follow, max_tokens=24, block_size=4)
    assert stats.prompt_cache.tier == "disk" and stats.n_cached_tokens >= len(prompt) + len(reply) - 1
    assert got == expected
