"""A cached prompt's greedy reply equals the cold one (issue 35, probe item 2).

A restore keeps the prompt's first n - 1 positions and decodes the last alone; a cold prefill decodes the
last prompt token alone too (decoding.decode_steps), so both compute the same rows: with flash attention a
row decoded in a batch of 64 or more (tiled) differs from the same row decoded alone, by up to 0.6 in a
logit on the embedded target, and greedy replies used to part. Prompts of 100-400 tokens, several kinds,
start with distinct words; the embedded pair (real libllama, the shipped drafter), speculative decoding.
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Iterable

import numpy as np
import pytest

from dflash_gguf import Session
from dflash_gguf.prompt_cache import PromptCache

MAX_TOKENS = 16
N_PROMPTS = 24  # prompts the module can make (scripts/measure_cold_warm.py sweeps them all)
N_CHECKED = 8  # prompts the slow test checks: two of each kind
WORDS = ("report forest copper window inventory river city market science history music garden ocean machine "
         "station letter winter bridge harvest engine library signal mountain lantern").split()
OPENERS = ("Summarize", "Translate", "Explain", "Describe", "Review", "Continue", "Rewrite", "Analyze", "List",
           "Compare", "Outline", "Draft", "Critique", "Classify", "Extract", "Answer", "Evaluate", "Plan",
           "Imagine", "Debug", "Document", "Refactor", "Predict", "Count")


def prompt_tokens(session: Session, i: int) -> list[int]:
    """Prompt i: 100-400 tokens of prose, code, a list or a dialogue, opening with its own word."""
    rng = np.random.default_rng(i)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    kind = i % 4
    if kind == 0:
        body = ". ".join(words(int(rng.integers(5, 14))).capitalize() for _ in range(60))
    elif kind == 1:
        body = "\n".join(f"def {w}_{j}(x):\n    return x * {j} + len('{w}')" for j, w in enumerate(rng.choice(WORDS, 40)))
    elif kind == 2:
        body = "\n".join(f"{j + 1}. {words(int(rng.integers(3, 9)))}" for j in range(60))
    else:
        body = "\n".join(f"{'User' if j % 2 == 0 else 'Assistant'}: {words(int(rng.integers(4, 12)))}?" for j in range(40))
    tokens = session.tokenize(f"{OPENERS[i]} the following.\n\n{body}")
    return tokens[: int(rng.integers(100, 401))]


def reply(session: Session, tokens: list[int], block_size: int | None, max_tokens: int) -> tuple[list[int], object]:
    session.reset()  # nothing from the live context: only the prompt cache may serve the prompt
    out = [t for step in session.stream_tokens(tokens, max_tokens=max_tokens, block_size=block_size) for t in step.tokens]
    return out, session.last_stats


def check_cold_equals_warm(tmp_path, prompts: Iterable[int], block_size: int | None, *, ram: bool = True,
                           max_tokens: int = MAX_TOKENS) -> None:
    """For each prompt: a cold run (an empty cache) stores it; a fork (the RAM tier) and a Session with a
    cache of its own on the same directory (the disk tier, as after a restart) give the same reply.
    ram=False: the cold Session's cache has no RAM tier, and the fork restores from the disk (one model load)."""
    kw = dict(n_ctx=1024, n_threads=1)
    cache = PromptCache(ram_bytes=(1 << 30) if ram else 0, directory=tmp_path)
    with ExitStack() as stack:
        cold_session = stack.enter_context(Session(prompt_cache=cache, **kw))
        warm = [(stack.enter_context(cold_session.fork()), "ram" if ram else "disk")]
        if ram:
            warm.append((stack.enter_context(Session(prompt_cache=PromptCache(directory=tmp_path), **kw)), "disk"))
        for i in prompts:
            tokens = prompt_tokens(cold_session, i)
            cache.clear()
            cold, stats = reply(cold_session, tokens, block_size, max_tokens)
            assert stats.prompt_cache.tier is None and stats.prompt_cache.stored and stats.n_cached_tokens == 0
            cache.flush()
            for session, tier in warm:
                out, stats = reply(session, tokens, block_size, max_tokens)
                assert stats.prompt_cache.tier == tier and stats.prompt_cache.n_restored == len(tokens) - 1
                assert out == cold, f"prompt {i} ({len(tokens)} tokens) from the {tier} tier"


def test_a_cached_prompt_replies_as_a_cold_one(tmp_path):
    """Prompts 4 and 10 (230 and 137 tokens), from the disk: their warm replies parted from the cold ones at
    tokens 4 and 5 while a cold prefill decoded the last prompt token inside the batch
    (scripts/measure_cold_warm.py)."""
    check_cold_equals_warm(tmp_path, (4, 10), 4, ram=False, max_tokens=8)


@pytest.mark.slow  # 8 prompts x 3 runs x 2 block modes, each Session calibrating its drafter once
@pytest.mark.parametrize("block_size", [4, None], ids=["fixed", "adaptive"])
def test_many_cached_prompts_reply_as_cold_ones(tmp_path, block_size):
    """Two prompts of each kind, from both tiers. The sweep over all 24 prompts, which prints how many warm
    replies part from their cold ones and where, is scripts/measure_cold_warm.py (--prompts 24)."""
    check_cold_equals_warm(tmp_path, range(N_CHECKED), block_size)
