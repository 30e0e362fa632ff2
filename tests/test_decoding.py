"""The loop's text handling on the real tokenizer: incremental UTF-8 and stop strings held back."""

from __future__ import annotations

import codecs

import pytest

from dflash_gguf.chat import ReplyReader
from dflash_gguf.config import GenerationConfig
from dflash_gguf.decoding import TextStream
from dflash_gguf.steps import TokenSource
from dflash_gguf.target import Target

SOURCES = (TokenSource.PLAIN, TokenSource.DRAFT, TokenSource.BONUS)


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=256, n_batch=32, n_threads=1) as t:
        yield t


def feed_all(stream: TextStream, tokens: list[int]) -> tuple[list[str], bool]:
    pieces, stopped = [], False
    for tok in tokens:
        released, stopped = stream.feed(tok, TokenSource.PLAIN)
        pieces.append("".join(t for t, _ in released))
        if stopped:
            break
    return pieces, stopped


def flushed(stream: TextStream) -> str:
    return "".join(t for t, _ in stream.flush(TokenSource.PLAIN))


def test_multibyte_characters_split_across_tokens_come_out_whole(target):
    text = "naïve café 🌍🚀 日本語"
    tokens = target.vocab.tokenize(text, add_special=False)
    assert any(not target.vocab.token_bytes(t).decode("utf-8", errors="ignore") for t in tokens)  # partial bytes exist
    stream = TextStream(target, None)
    pieces, _ = feed_all(stream, tokens)
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + flushed(stream) == text


def test_stop_string_ends_the_text_before_it(target):
    tokens = target.vocab.tokenize("alpha beta gamma delta", add_special=False)
    stream = TextStream(target, ReplyReader(stops=("gamma",)))
    pieces, stopped = feed_all(stream, tokens)
    assert stopped and "".join(pieces) == "alpha beta "


def test_text_that_may_begin_a_stop_string_waits_for_the_next_token(target):
    tokens = target.vocab.tokenize("alpha beta gamma", add_special=False)
    stream = TextStream(target, ReplyReader(stops=(" beta!",)))
    pieces, stopped = feed_all(stream, tokens)
    assert not stopped
    i = next(i for i, t in enumerate(tokens) if target.vocab.token_bytes(t) == b" beta")
    assert pieces[i] == ""  # " beta" could start " beta!" so it is held back ...
    assert pieces[i + 1] == " beta gamma"  # ... and released once " gamma" rules that out
    assert "".join(pieces) + flushed(stream) == "alpha beta gamma"


def test_every_character_keeps_the_source_of_the_token_that_produced_it(target):
    """Held-back text (a possible stop string, a character split across tokens) comes out later, but with
    its own token's source, not the source of the token that released it."""
    text = "naïve 😀 café — ok"
    tokens = target.vocab.tokenize(text, add_special=False)
    sources = [SOURCES[i % 3] for i in range(len(tokens))]
    want: list[tuple[str, TokenSource]] = []  # each character with the source of the token completing its bytes
    decoder = codecs.getincrementaldecoder("utf-8")()
    for tok, src in zip(tokens, sources):
        want += [(c, src) for c in decoder.decode(target.vocab.token_bytes(tok))]
    assert any(not target.vocab.token_bytes(t).decode("utf-8", errors="ignore").strip() for t in tokens)  # a split emoji
    stream = TextStream(target, ReplyReader(stops=("café!",)))  # "caf" may begin the stop string: held back, then released
    shown: list[tuple[str, TokenSource]] = []
    for tok, src in zip(tokens, sources):
        released, stopped = stream.feed(tok, src)
        assert not stopped
        shown += [(c, s) for piece, s in released for c in piece]
    shown += [(c, s) for piece, s in stream.flush(TokenSource.PLAIN) for c in piece]
    assert "".join(c for c, _ in shown) == text
    assert shown == want


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(stop=("",)), "stop"),
        (dict(block_size=0), "block_size"),
        (dict(block_size=2.5), "block_size"),
        (dict(confidence_threshold=1.5), "threshold"),
    ],
)
def test_generation_config_validates(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GenerationConfig(**kwargs)
