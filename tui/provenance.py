"""How the chat colours a token: the decode loop's TokenSource folded into the six kinds it draws.

Each Step carries `spans`, (text, TokenSource) pieces whose texts join to the Step's text, computed by
the loop itself from the bytes it detokenized; the UI only maps each source to a colour class.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from dflash_gguf.steps import Step, TokenSource


class Provenance(Enum):
    """What the chat colours a committed token as."""

    DRAFT = "draft"  # proposed by the drafter (DFlash, DFlash2, DSpark) and accepted by the target
    LOOKUP = "lookup"  # proposed by the n-gram lookup (copied from the context) and accepted by the target
    MTP = "mtp"  # proposed by the target's own multi-token-prediction heads and accepted by the target
    GRAMMAR = "grammar"  # the only continuation the reply's grammar or schema admitted, drafted for free
    BONUS = "bonus"  # the target's own next token at the end of a verified block
    PLAIN = "plain"  # decoded by the target alone (the prefill's token, or a cycle without drafts)


Piece = tuple[str, Provenance]

_DISPLAY = {
    TokenSource.PREFILL: Provenance.PLAIN,
    TokenSource.PLAIN: Provenance.PLAIN,
    TokenSource.DRAFT: Provenance.DRAFT,
    TokenSource.LOOKUP: Provenance.LOOKUP,
    TokenSource.MTP: Provenance.MTP,
    TokenSource.GRAMMAR: Provenance.GRAMMAR,
    TokenSource.BONUS: Provenance.BONUS,
}


def display(source: TokenSource) -> Provenance:
    return _DISPLAY[source]


def pieces_of(step: Step) -> list[Piece]:
    """The Step's text as coloured pieces, from its spans (the loop's own provenance of each character)."""
    return [(text, _DISPLAY[source]) for text, source in step.spans if text]


def pieces_of_steps(steps: Iterable[Step]) -> list[Piece]:
    """Pieces of several Steps, neighbours of one kind merged: fewer, longer runs to draw."""
    out: list[Piece] = []
    for step in steps:
        for text, source in step.spans:
            if not text:
                continue
            kind = _DISPLAY[source]
            if out and out[-1][1] is kind:
                out[-1] = (out[-1][0] + text, kind)
            else:
                out.append((text, kind))
    return out
