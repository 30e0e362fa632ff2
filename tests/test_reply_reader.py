"""The one reply reader (chat/reply.py) reads a reply's stop strings, thought and text the same whether the
reply comes whole or in any chunks: the decode loop feeds it a token's text at a time, a route the Steps'."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_gguf.chat import ReplyReader
from dflash_gguf.chat.reasoning import Thinking

ALPHABET = "ab</> \n"  # small, so that stop strings and markers occur and half-occur often
THINK = Thinking("<a>", "</a>", opened=True)


def _chunks(draw, text: str) -> list[str]:
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=12)))
    return [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(reader: ReplyReader, chunks: list[str]) -> tuple[str, str, list[int]]:
    """(thought, answer text) given out over the chunks and finish(), and `settled` after each feed."""
    thought, text, settled = "", "", []
    for chunk in chunks:
        for piece in reader.feed(chunk):
            thought, text = (thought, text + piece) if isinstance(piece, str) else (thought + piece.text, text)
        settled.append(reader.settled)
    for piece in reader.finish():
        thought, text = (thought, text + piece) if isinstance(piece, str) else (thought + piece.text, text)
    return thought, text, settled


@st.composite
def replies(draw):
    text = draw(st.text(ALPHABET, max_size=40))
    stops = draw(st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3, unique=True))
    return text, stops, _chunks(draw, text)


@settings(max_examples=400, deadline=None)
@given(replies())
def test_any_chunking_gives_the_text_and_stop_of_the_whole(reply):
    text, stops, chunks = reply
    whole = ReplyReader(stops=stops)
    _, content, _ = whole.read(text)
    # the stop string that completes first (at one end, the one that starts first) cuts the reply: a stream
    # fed a character at a time can tell no other
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    first = min(found) if found else None
    assert content == (text if first is None else text[: first[1]])
    assert whole.stop_sequence == (None if first is None else first[2])

    streamed = ReplyReader(stops=stops)
    _, given_out, settled = _streamed(streamed, chunks)
    assert given_out == content and streamed.stop_sequence == whole.stop_sequence
    assert settled == sorted(settled) and streamed.settled == len(content)
    shown = "".join(chunks)
    for n in settled:  # what was settled was never taken back, and never held a whole stop string
        assert content.startswith(shown[:n]) and not any(s in shown[:n] for s in stops)


@settings(max_examples=300, deadline=None)
@given(replies())
def test_a_thought_is_read_apart_the_same_in_any_chunks(reply):
    text, stops, chunks = reply
    whole = ReplyReader(THINK, stops=stops)
    thought, content, _ = whole.read(text)
    streamed = ReplyReader(THINK, stops=stops)
    assert _streamed(streamed, chunks)[:2] == (thought, content)
    assert streamed.stop_sequence == whole.stop_sequence
    # the stop strings cut the reply before its thought is read: the same as reading the cut text alone
    cut = text if whole.stop_sequence is None else text[: text.find(whole.stop_sequence)]
    assert ReplyReader(THINK).read(cut)[:2] == (thought, content)
