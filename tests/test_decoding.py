"""The loop's text handling on the real tokenizer: incremental UTF-8 and stop strings held back."""

from __future__ import annotations

import pytest

from dflash_gguf.decoding import GenerationConfig, TextStream
from dflash_gguf.target import Target


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=256, n_batch=32, n_threads=2) as t:
        yield t


def feed_all(stream: TextStream, tokens: list[int]) -> tuple[list[str], bool]:
    pieces, stopped = [], False
    for tok in tokens:
        piece, stopped = stream.feed(tok)
        pieces.append(piece)
        if stopped:
            break
    return pieces, stopped


def test_multibyte_characters_split_across_tokens_come_out_whole(target):
    text = "naïve café 🌍🚀 日本語"
    tokens = target.tokenize(text, add_special=False)
    assert any(not target.token_bytes(t).decode("utf-8", errors="ignore") for t in tokens)  # partial bytes exist
    stream = TextStream(target, ())
    pieces, _ = feed_all(stream, tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + stream.flush() == text


def test_stop_string_ends_the_text_before_it(target):
    tokens = target.tokenize("alpha beta gamma delta", add_special=False)
    stream = TextStream(target, ("gamma",))
    pieces, stopped = feed_all(stream, tokens)
    assert stopped and "".join(pieces) == "alpha beta "


def test_text_that_may_begin_a_stop_string_waits_for_the_next_token(target):
    tokens = target.tokenize("alpha beta gamma", add_special=False)
    stream = TextStream(target, (" beta!",))
    pieces, stopped = feed_all(stream, tokens)
    assert not stopped
    i = next(i for i, t in enumerate(tokens) if target.token_bytes(t) == b" beta")
    assert pieces[i] == ""  # " beta" could start " beta!" so it is held back ...
    assert pieces[i + 1] == " beta gamma"  # ... and released once " gamma" rules that out
    assert "".join(pieces) + stream.flush() == "alpha beta gamma"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=2.5), "block_size"),
    ],
)
def test_generation_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)
