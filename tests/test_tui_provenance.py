"""The chat's provenance colouring comes from the decode loop's own spans: the TUI never detokenizes.

A real Session (embedded target, a converted drafter, fixed block 4) streams a reply; every Step's
coloured pieces must give back its text exactly, with the colour of the TokenSource the loop assigned.
"""

from __future__ import annotations

import pytest

from dflash_gguf.session import Session
from dflash_gguf.steps import StepKind, TokenSource
from dflash_gguf.tui.provenance import Provenance, display, pieces_of, pieces_of_steps


@pytest.fixture(scope="module")
def steps(dflash_gguf_path):
    with Session(None, dflash_gguf_path, n_ctx=512, n_threads=1) as session:
        return list(session.stream("Naïve café — tell me a story:", max_tokens=24, block_size=4))


def test_every_source_has_a_colour_and_lookup_its_own() -> None:
    assert display(TokenSource.DRAFT) is Provenance.DRAFT
    assert display(TokenSource.LOOKUP) is Provenance.LOOKUP
    assert display(TokenSource.MTP) is Provenance.MTP
    assert display(TokenSource.BONUS) is Provenance.BONUS
    assert display(TokenSource.PLAIN) is display(TokenSource.PREFILL) is Provenance.PLAIN
    assert {display(s) for s in TokenSource} == set(Provenance)


def test_pieces_give_back_each_steps_text_with_its_sources_colour(steps) -> None:
    assert steps[0].kind is StepKind.PREFILL
    for step in steps:
        pieces = pieces_of(step)
        assert "".join(text for text, _ in pieces) == step.text
        assert [kind for _, kind in pieces] == [display(s) for text, s in step.spans if text]
    # block 4: every drafted cycle ends with the target's bonus token
    kinds = {kind for step in steps for _, kind in pieces_of(step)}
    assert Provenance.BONUS in kinds and Provenance.PLAIN in kinds


def test_merged_pieces_keep_the_text_and_never_repeat_a_kind(steps) -> None:
    merged = pieces_of_steps(steps)
    assert "".join(text for text, _ in merged) == "".join(step.text for step in steps)
    assert all(a[1] is not b[1] for a, b in zip(merged, merged[1:]))
