"""Which characters of a streamed reply came from accepted drafts, bonus tokens or plain decoding.

A Step's text is not aligned with its tokens: the Session holds back incomplete UTF-8 and anything that
could begin a stop string, so text can surface one cycle after its token. Decoding the same token bytes
here gives every character the provenance of the token that produced it; each Step's text then takes
that many characters, in order, from the front of the queue.
"""

from __future__ import annotations

import codecs
from collections import deque
from enum import Enum
from typing import Callable, Protocol, Sequence


class Provenance(Enum):
    """Where a committed token came from."""

    DRAFT = "draft"  # proposed by the drafter and accepted by the target
    BONUS = "bonus"  # the target's own next token at the end of a verified block
    PLAIN = "plain"  # decoded by the target alone (the prefill's token, or a cycle without drafts)


Piece = tuple[str, Provenance]


class StepLike(Protocol):
    """The fields of a Session Step the UI reads."""

    tokens: Sequence[int]
    text: str
    n_drafted: int
    n_accepted: int
    block_size: int
    reason: str
    verify_s: float
    finish_reason: str | None


def token_provenance(step: StepLike) -> list[Provenance]:
    """One Provenance per committed token of a cycle: the accepted drafts, then the target's bonus.

    A cycle cut short (a stop string, max_tokens) commits fewer tokens than n_accepted + 1, so the list
    follows step.tokens.
    """
    if step.n_drafted == 0:
        return [Provenance.PLAIN] * len(step.tokens)
    return [Provenance.DRAFT if i < step.n_accepted else Provenance.BONUS for i in range(len(step.tokens))]


class ProvenanceSplitter:
    """Splits one reply's Step texts into pieces of equal provenance; one instance per reply.

    `token_bytes` is the Session's detokenizer for one token, the same bytes its text comes from.
    """

    def __init__(self, token_bytes: Callable[[int], bytes]) -> None:
        self._token_bytes = token_bytes
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._queue: deque[tuple[int, Provenance]] = deque()  # (characters left, provenance) runs

    def split(self, step: StepLike) -> list[Piece]:
        for token, provenance in zip(step.tokens, token_provenance(step)):
            self._push(self._decoder.decode(self._token_bytes(token)), provenance)
        if step.finish_reason is not None:
            self._push(self._decoder.decode(b"", final=True), Provenance.PLAIN)
        pieces: list[Piece] = []
        text = step.text
        while text:
            if not self._queue:  # text the tokens do not account for: shown, uncoloured
                pieces.append((text, Provenance.PLAIN))
                break
            n, provenance = self._queue[0]
            take = min(n, len(text))
            pieces.append((text[:take], provenance))
            text = text[take:]
            if take == n:
                self._queue.popleft()
            else:
                self._queue[0] = (n - take, provenance)
        return pieces

    def _push(self, chars: str, provenance: Provenance) -> None:
        if not chars:
            return
        if self._queue and self._queue[-1][1] is provenance:
            self._queue[-1] = (self._queue[-1][0] + len(chars), provenance)
        else:
            self._queue.append((len(chars), provenance))
