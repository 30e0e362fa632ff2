"""The chat's provenance colouring: which characters of the streamed text came from which kind of token.

Steps are built from the embedded target's real tokens and their text comes from the decode loop's own
TextStream, so multi-byte characters split across tokens surface late exactly as they do in a real reply.
"""

from __future__ import annotations

import pytest

from dflash_gguf.decoding import Step, TextStream
from dflash_gguf.target import Target
from dflash_gguf.tui.provenance import Provenance, ProvenanceSplitter, token_provenance

TEXT = "naïve 😀 café — ok"


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=64, n_threads=1) as t:
        yield t


def cycles_of(target: Target, sizes: list[tuple[int, int]], stop: tuple[str, ...] = ()) -> list[Step]:
    """Cut TEXT's tokens into cycles of (n_drafted, n_accepted); texts as the decode loop streams them."""
    tokens = target.tokenize(TEXT, add_special=False)
    stream = TextStream(target, stop)
    steps, i = [], 0
    for k, (n_drafted, n_accepted) in enumerate(sizes):
        n = n_accepted + 1
        chunk = tokens[i : i + n]
        i += n
        text = "".join(stream.feed(t)[0] for t in chunk)
        last = k == len(sizes) - 1
        if last:
            text += stream.flush()
        steps.append(Step(chunk, text, n_drafted, n_accepted, chunk[-1], n_drafted + 1, "test", 0.0, 0.0,
                          "length" if last else None))
    assert i == len(tokens), "the cycles must cover every token"
    return steps


def expected_chars(target: Target, steps: list[Step]) -> list[Provenance]:
    """Each character of TEXT with the provenance of the token whose bytes completed it."""
    chars: list[Provenance] = []
    pending = b""
    for step in steps:
        for token, provenance in zip(step.tokens, token_provenance(step)):
            pending += target.token_bytes(token)
            try:
                decoded = pending.decode("utf-8")
            except UnicodeDecodeError:
                continue
            chars += [provenance] * len(decoded)
            pending = b""
    return chars


def test_token_provenance_of_a_cycle() -> None:
    step = Step([1, 2, 3], "abc", 4, 2, 3, 5, "r", 0.0, 0.0)
    assert token_provenance(step) == [Provenance.DRAFT, Provenance.DRAFT, Provenance.BONUS]
    plain = Step([7], "x", 0, 0, 7, 1, "plain decoding", 0.0, 0.0)
    assert token_provenance(plain) == [Provenance.PLAIN]
    # cut short by a stop rule: only the committed tokens count
    cut = Step([1], "a", 4, 2, None, 5, "r", 0.0, 0.0, "stop")
    assert token_provenance(cut) == [Provenance.DRAFT]


def test_split_text_keeps_every_character_in_order_with_its_tokens_provenance(target) -> None:
    # 7 tokens; the emoji's bytes span tokens 3 and 4, which fall in different cycles
    steps = cycles_of(target, [(0, 0), (3, 1), (3, 0), (3, 1), (0, 0)])
    assert steps[2].text == "😀", "the emoji surfaces with its second token"
    splitter = ProvenanceSplitter(target.token_bytes)
    shown: list[tuple[str, Provenance]] = []
    for step in steps:
        pieces = splitter.split(step)
        assert "".join(text for text, _ in pieces) == step.text
        shown += [(c, p) for text, p in pieces for c in text]
    assert "".join(c for c, _ in shown) == TEXT
    assert [p for _, p in shown] == expected_chars(target, steps)
    assert {p for _, p in shown} == {Provenance.PLAIN, Provenance.DRAFT, Provenance.BONUS}


def test_text_held_back_for_a_stop_string_keeps_its_provenance(target) -> None:
    # "caf" could begin the stop string "café!", so it is held back and surfaces a cycle late
    steps = cycles_of(target, [(0, 0), (3, 3), (3, 1)], stop=("café!",))
    assert "caf" not in steps[1].text and steps[2].text.startswith("café")
    splitter = ProvenanceSplitter(target.token_bytes)
    shown = [(c, p) for step in steps for text, p in splitter.split(step) for c in text]
    assert "".join(c for c, _ in shown) == TEXT
    assert [p for _, p in shown] == expected_chars(target, steps)
