"""How the chat colours a token: the decode loop's provenance (its source's name) mapped to a colour class.

Each Step carries `spans`, (text, provenance) pieces whose texts join to the Step's text, computed by
the loop itself from the bytes it detokenized; the UI only maps each provenance to a colour class. The
target's own tokens, the grammar's and the shipped sources' keep colours of their own (every drafter kind
the drafter's); any other source, one module and a registry line away, is given the next colour of a
palette the first time its name is seen, so it needs no edit here.
"""

from __future__ import annotations

from enum import Enum
from typing import Iterable

from dflash_gguf.kinds import all_kinds
from dflash_gguf.steps import Step, TokenSource


class Provenance(Enum):
    """What the chat colours a committed token as, where its provenance has a colour of its own."""

    DRAFT = "draft"  # proposed by the drafter (DFlash, DFlash2, DSpark) and accepted by the target
    LOOKUP = "lookup"  # proposed by the n-gram lookup (copied from the context) and accepted by the target
    MTP = "mtp"  # proposed by the target's own multi-token-prediction heads and accepted by the target
    GRAMMAR = "grammar"  # the only continuation the reply's grammar or schema admitted, drafted for free
    BONUS = "bonus"  # the target's own next token at the end of a verified block
    PLAIN = "plain"  # decoded by the target alone (the prefill's token, or a cycle without drafts)


class Palette(Enum):
    """The colours other draft sources are given, in turn, by name (app.tcss styles each)."""

    SOURCE_1 = "source-1"
    SOURCE_2 = "source-2"
    SOURCE_3 = "source-3"
    SOURCE_4 = "source-4"
    SOURCE_5 = "source-5"
    SOURCE_6 = "source-6"


Colour = Provenance | Palette
COLOURS: tuple[Colour, ...] = (*Provenance, *Palette)  # every colour class a token may be drawn in
Piece = tuple[str, Colour]

_FIXED: dict[str, Colour] = {
    TokenSource.PREFILL: Provenance.PLAIN,
    TokenSource.PLAIN: Provenance.PLAIN,
    TokenSource.DRAFT: Provenance.DRAFT,
    TokenSource.LOOKUP: Provenance.LOOKUP,
    TokenSource.MTP: Provenance.MTP,
    TokenSource.GRAMMAR: Provenance.GRAMMAR,
    TokenSource.BONUS: Provenance.BONUS,
}
# every provenance seen so far and its colour; a new name takes the palette's next colour
_colours: dict[str, Colour] = dict(_FIXED)


def display(source: str) -> Colour:
    """The colour of a provenance: a fixed name's own, a drafter kind's the drafter's, else the colour of the
    palette this name was given when first seen (the palette's colours in turn, so up to six new sources
    each have one of their own)."""
    colour = _colours.get(source)
    if colour is None:
        if any(kind.name == source for kind in all_kinds()):
            colour = Provenance.DRAFT
        else:
            given = sum(isinstance(c, Palette) for c in _colours.values())
            colour = tuple(Palette)[given % len(Palette)]
        _colours[str(source)] = colour
    return colour


def pieces_of(step: Step) -> list[Piece]:
    """The Step's text as coloured pieces, from its spans (the loop's own provenance of each character)."""
    return [(text, display(source)) for text, source in step.spans if text]


def pieces_of_steps(steps: Iterable[Step]) -> list[Piece]:
    """Pieces of several Steps, neighbours of one colour merged: fewer, longer runs to draw."""
    out: list[Piece] = []
    for step in steps:
        for text, source in step.spans:
            if not text:
                continue
            kind = display(source)
            if out and out[-1][1] is kind:
                out[-1] = (out[-1][0] + text, kind)
            else:
                out.append((text, kind))
    return out
