"""Session end to end on the real embedded target with converted random-weight drafters.

A random drafter is almost never right, so every cycle rejects and rolls both caches back:
greedy output equal to llama_cpp.Llama's token for token is the losslessness check.
"""

from __future__ import annotations

import llama_cpp
import pytest

from dflash_gguf import Session, Step
from dflash_gguf.drafter import PairingError

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    "The three primary colors are",
]
N_CTX = 512
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def session(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def llama(embedded_target):
    llm = llama_cpp.Llama(
        str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1, flash_attn=True, verbose=False
    )
    yield llm
    llm.close()


def llama_greedy(llm: llama_cpp.Llama, prompt: str, n: int) -> list[int]:
    """Plain greedy decoding by llama-cpp-python itself, one token per llama_decode."""
    llm.reset()
    out = []
    for tok in llm.generate(llm.tokenize(prompt.encode(), special=True), temp=0.0):
        if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), tok) or len(out) == n:
            break
        out.append(tok)
    return out


@pytest.mark.parametrize("prompt", [*PROMPTS[:2], *(pytest.param(p, marks=pytest.mark.slow) for p in PROMPTS[2:])])
def test_greedy_equals_plain_llama_token_for_token(session, llama, prompt):
    r = session.generate(prompt, max_tokens=MAX_TOKENS, block_size=16 if prompt == PROMPTS[0] else 6)
    assert r.tokens == llama_greedy(llama, prompt, MAX_TOKENS)
    assert r.stats.n_drafted > r.stats.n_accepted  # drafts were rejected and rolled back
    assert r.stats.cycles == len(r.tokens) - 1 - r.stats.n_accepted


def test_greedy_with_dflash2_equals_plain_llama(dflash2_gguf_path, llama):
    with Session(drafter=dflash2_gguf_path, n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        for prompt in PROMPTS[:2]:
            r = s.generate(prompt, max_tokens=16, block_size=8)
            assert r.tokens == llama_greedy(llama, prompt, 16)
            assert r.stats.n_drafted > 0


def test_adaptive_block_size_is_lossless(session, llama):
    r = session.generate(PROMPTS[1], max_tokens=16)
    assert r.tokens == llama_greedy(llama, PROMPTS[1], 16)
    assert r.stats.block_size is None and r.stats.cycles > 0


def test_plain_mode_is_the_same_target(session, llama):
    r = session.generate(PROMPTS[2], max_tokens=16, speculative=False)
    assert r.tokens == llama_greedy(llama, PROMPTS[2], 16)
    assert not r.stats.speculative and r.stats.n_drafted == 0
    assert r.stats.acceptance_length == 1.0 and r.stats.cycles == 15


def test_stream_events_add_up_to_generate(session):
    steps = list(session.stream(PROMPTS[0], max_tokens=12, block_size=4))
    r = session.generate(PROMPTS[0], max_tokens=12, block_size=4)
    assert all(isinstance(s, Step) for s in steps)
    assert [t for s in steps for t in s.tokens] == r.tokens
    assert "".join(s.text for s in steps) == r.text
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)
    assert steps[-1].finish_reason == "length"
    assert steps[0].reason == "prefill"
    for s in steps[1:]:
        assert s.block_size == s.n_drafted + 1 <= 4
        assert s.tokens[-1] == s.bonus_token and len(s.tokens) == s.n_accepted + 1


def test_max_tokens_is_exact(session):
    for n in (1, 2, 5):
        r = session.generate(PROMPTS[0], max_tokens=n, block_size=16)
        assert len(r.tokens) == n and r.finish_reason == "length"


def test_stop_string_is_cut_and_never_streamed(session):
    full = session.generate(PROMPTS[0], max_tokens=MAX_TOKENS, block_size=4).text
    stop = full[10:16]
    assert stop in full
    steps = list(session.stream(PROMPTS[0], max_tokens=MAX_TOKENS, block_size=4, stop=[stop]))
    text = "".join(s.text for s in steps)
    assert text == full[: full.index(stop)]
    assert steps[-1].finish_reason == "stop"


def test_a_possible_stop_prefix_is_held_back_then_released(session):
    full = session.generate(PROMPTS[0], max_tokens=12, block_size=4)
    word = full.text.split()[2]
    r = session.generate(PROMPTS[0], max_tokens=12, block_size=4, stop=[word + "\x00never"])
    assert r.text == full.text and r.finish_reason == "length"


def test_end_of_generation_token_stops_without_text(session):
    r = session.chat([{"role": "user", "content": "What is 2+2?"}], max_tokens=64, block_size=4)
    assert r.finish_reason == "stop" and len(r.tokens) < 64
    assert "<|im_end|>" not in r.text and r.text.strip()


def test_chat_uses_the_gguf_template_and_reuses_the_prefix(session, llama):
    turn1 = [{"role": "user", "content": "Name a fruit."}]
    a1 = session.chat(turn1, max_tokens=20, block_size=4)
    expected = llama.create_chat_completion(turn1, max_tokens=20, temperature=0.0)
    assert a1.text == expected["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": a1.text}, {"role": "user", "content": "Another one?"}]
    a2 = session.chat(turn2, max_tokens=20, block_size=4)
    assert a2.stats.n_cached_tokens > a1.stats.n_prompt_tokens // 2
    assert session.drafter.pos_max() + 1 >= a2.stats.n_cached_tokens
    expected = llama.create_chat_completion(turn2, max_tokens=20, temperature=0.0)
    assert a2.text == expected["choices"][0]["message"]["content"]


def test_render_chat_and_tokenize_match_llama_cpp(session, llama):
    messages = [{"role": "user", "content": "Name a fruit."}]
    text, stops = session.render_chat(messages)
    assert text.rstrip().endswith("<|im_start|>assistant") and "Name a fruit." in text
    assert stops == ["<|im_end|>"]
    assert session.tokenize(text, add_special=False) == llama.tokenize(text.encode(), add_bos=False, special=True)


def _shape(value):
    """The key structure and value types of a llama_cpp response, ignoring the values themselves."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_shape(v) for v in value]
    return type(value).__name__


def test_create_completion_has_llama_cpp_shapes(session, llama):
    ours = session.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0)
    llama.reset()
    theirs = llama.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0)
    assert _shape(ours) == _shape(theirs)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours["usage"] == theirs["usage"]
    chunks = list(session.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0, stream=True))
    llama.reset()
    their_chunks = list(llama.create_completion(PROMPTS[0], max_tokens=8, temperature=0.0, stream=True))
    assert _shape(chunks[0]) == _shape(their_chunks[0]) and _shape(chunks[-1]) == _shape(their_chunks[-1])
    assert "".join(c["choices"][0]["text"] for c in chunks) == theirs["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_create_chat_completion_has_llama_cpp_shapes(session, llama):
    messages = [{"role": "user", "content": "Say hello."}]
    ours = session.create_chat_completion(messages, max_tokens=8, temperature=0.0)
    theirs = llama.create_chat_completion(messages, max_tokens=8, temperature=0.0)
    assert _shape(ours) == _shape(theirs)
    assert ours["choices"][0]["message"] == theirs["choices"][0]["message"]
    chunks = list(session.create_chat_completion(messages, max_tokens=8, temperature=0.0, stream=True))
    their_chunks = list(llama.create_chat_completion(messages, max_tokens=8, temperature=0.0, stream=True))
    assert [_shape(c) for c in (chunks[0], chunks[1], chunks[-1])] == [
        _shape(c) for c in (their_chunks[0], their_chunks[1], their_chunks[-1])
    ]
    # both streams keep the prompt from their first call (its last token decoded alone): like for like, since a
    # prompt prefilled whole and one kept can part at a near tie (on Vulkan: "Hello! I'm" / "Hello there,")
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert content == "".join(c["choices"][0]["delta"].get("content", "") for c in their_chunks)


def test_from_llama_wraps_an_existing_llama(embedded_target, dflash_gguf_path):
    llm = llama_cpp.Llama(str(embedded_target), n_ctx=N_CTX, n_batch=64, n_threads=1, flash_attn=True, verbose=False)
    try:
        before = llm.create_completion(PROMPTS[3], max_tokens=12, temperature=0.0)["choices"][0]["text"]
        with Session.from_llama(llm, drafter=dflash_gguf_path) as s:
            assert s.generate(PROMPTS[3], max_tokens=12, block_size=8).text == before
            llm.create_completion(PROMPTS[1], max_tokens=4, temperature=0.0)  # the Llama decodes in between
            assert s.generate(PROMPTS[3], max_tokens=12, block_size=8).text == before
        after = llm.create_completion(PROMPTS[3], max_tokens=12, temperature=0.0)["choices"][0]["text"]
        assert after == before
    finally:
        llm.close()


def test_seeded_sampling_is_reproducible(session):
    a = session.generate(PROMPTS[2], max_tokens=10, temperature=1.0, seed=7, block_size=4)
    b = session.generate(PROMPTS[2], max_tokens=10, temperature=1.0, seed=7, block_size=4)
    c = session.generate(PROMPTS[2], max_tokens=10, temperature=1.0, seed=8, block_size=4)
    assert a.tokens == b.tokens
    assert a.tokens != c.tokens


def test_context_limit_ends_with_length_and_never_overflows(embedded_target, dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=256, n_batch=64, n_threads=1) as s:
        prompt = "one two three four " * 60
        n_prompt = len(s.target.vocab.tokenize(prompt))
        assert 230 < n_prompt < 256
        r = s.generate(prompt, max_tokens=100, block_size=16)
        assert r.finish_reason == "length"
        # every committed token but the last went through the target; the last one needs no slot
        assert len(r.tokens) == 256 - n_prompt + 1
        assert s.target.pos_max() == 255
        with pytest.raises(ValueError, match="longer than the context of 256"):
            s.generate(prompt * 2, max_tokens=4)
        assert len(s.generate(PROMPTS[0], max_tokens=4, block_size=4).tokens) == 4  # still usable


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(temperature=float("nan")), ValueError, "temperature"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(top_p=1.5), ValueError, "top_p"),
        (dict(top_k=-1), ValueError, "top_k"),
        (dict(seed=-3), ValueError, "seed"),
        (dict(max_tokens=0), ValueError, "max_tokens"),
        (dict(block_size=0), ValueError, "block_size"),
        (dict(stop=[""]), ValueError, "stop"),
        (dict(repeat_penalty=0.0), ValueError, "repeat_penalty"),
        (dict(mirostat_mode=2), TypeError, "mirostat_mode"),
    ],
)
def test_invalid_generation_arguments_raise_clearly(session, kwargs, error, message):
    with pytest.raises(error, match=message):
        session.generate(PROMPTS[0], **kwargs)
    with pytest.raises(error, match=message):
        session.chat([{"role": "user", "content": "hi"}], **kwargs)


def test_bad_prompts_and_messages(session):
    with pytest.raises(ValueError, match="empty"):
        session.generate("", max_tokens=4)
    with pytest.raises(TypeError, match="str"):
        session.generate(b"bytes", max_tokens=4)
    with pytest.raises(ValueError, match="messages"):
        session.chat([], max_tokens=4)
    with pytest.raises(ValueError, match="messages"):
        session.chat([{"content": "no role"}], max_tokens=4)


def test_bad_files_raise_before_anything_runs(tmp_path, embedded_target):
    with pytest.raises(FileNotFoundError):
        Session(target=tmp_path / "missing.gguf", n_ctx=256, n_threads=1)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    with pytest.raises(ValueError, match="could not load"):
        Session(target=junk, n_ctx=256, n_threads=1)
    with pytest.raises(PairingError, match="not a 'dflash' drafter"):
        Session(target=embedded_target, drafter=embedded_target, n_ctx=256, n_threads=1)


def test_a_session_without_drafter_decodes_plainly_with_a_warning(embedded_target, llama):
    """With lookup off (without a drafter it is on by default: tests/test_lookup_session.py)."""
    with Session(target=embedded_target, n_ctx=N_CTX, n_batch=64, n_threads=1, lookup=False) as s:
        with pytest.warns(UserWarning, match="no drafter"):
            r = s.generate(PROMPTS[0], max_tokens=8)
        assert r.tokens == llama_greedy(llama, PROMPTS[0], 8) and not r.stats.speculative


def test_an_abandoned_stream_leaves_a_usable_cache(session, llama):
    steps = session.stream(PROMPTS[3], max_tokens=20, block_size=4)
    next(steps)
    next(steps)
    steps.close()
    r = session.generate(PROMPTS[3], max_tokens=12, block_size=4)
    assert r.tokens == llama_greedy(llama, PROMPTS[3], 12)
    assert r.stats.n_cached_tokens == r.stats.n_prompt_tokens - 1


def test_the_drafter_goes_where_the_target_goes_unless_told_otherwise(embedded_target):
    """n_gpu_layers_draft (upstream's -ngld): by default the drafter is offloaded as far as the target, forks too."""
    from dflash_gguf.defaults import embedded_drafter

    with Session(embedded_target, embedded_drafter(), n_ctx=256, n_threads=1, n_gpu_layers=3) as s:
        with s.fork() as other:
            assert s.drafter.n_gpu_layers == 3 == other.drafter.n_gpu_layers
    with Session(embedded_target, embedded_drafter(), n_ctx=256, n_threads=1, n_gpu_layers=3,
                 n_gpu_layers_draft=0) as s:
        assert s.drafter.n_gpu_layers == 0 and s.target.n_gpu_layers == 3
