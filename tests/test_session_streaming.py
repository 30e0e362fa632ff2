"""stream_chat, reset and last_stats: the streaming face the chat UI, the benchmark and dflash-generate use."""

from __future__ import annotations

import pytest

from dflash_gguf import Session

N_CTX = 512
TURN = [{"role": "user", "content": "Name three colours."}]


@pytest.fixture(scope="module")
def session(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        yield s


def test_stream_chat_yields_what_chat_returns(session):
    session.reset()
    steps = list(session.stream_chat(TURN, max_tokens=16, block_size=4))
    streamed = session.last_stats
    session.reset()
    whole = session.chat(TURN, max_tokens=16, block_size=4)
    assert [t for s in steps for t in s.tokens] == whole.tokens
    assert "".join(s.text for s in steps) == whole.text
    assert steps[-1].finish_reason == whole.finish_reason
    assert streamed.cycles == whole.stats.cycles and streamed.n_drafted == whole.stats.n_drafted > 0


def test_reset_makes_the_next_turn_prefill_everything(session):
    session.chat(TURN, max_tokens=4, block_size=4)
    again = session.chat(TURN, max_tokens=4, block_size=4)
    assert again.stats.n_cached_tokens == again.stats.n_prompt_tokens - 1
    session.reset()
    cold = session.chat(TURN, max_tokens=4, block_size=4)
    assert cold.stats.n_cached_tokens == 0
    assert cold.tokens == again.tokens


def test_plain_cycles_reach_the_drafter_before_it_drafts(session):
    """Features of cycles decoded plainly are injected in one batch before the next draft, and at the end."""
    session.reset()
    session.chat(TURN, max_tokens=12, speculative=True, block_size=1)  # block 1: every cycle plain
    n = session.last_stats.n_prompt_tokens + session.last_stats.n_tokens - 1
    assert session.drafter.pos_max() + 1 == n  # the backlog was flushed when the generation ended
    follow = TURN + [{"role": "assistant", "content": "Red."}, {"role": "user", "content": "More?"}]
    r = session.chat(follow, max_tokens=8, block_size=4)
    assert r.stats.n_cached_tokens > 0 and r.stats.n_drafted > 0


def test_stream_chat_refuses_unknown_arguments(session):
    with pytest.raises(TypeError, match="unknown generation argument"):
        session.stream_chat(TURN, max_token=4)
