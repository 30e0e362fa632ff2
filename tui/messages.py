"""Messages a reply worker posts to the app when a reply ends (its Steps go through the reply's inbox)."""

from __future__ import annotations

from textual.message import Message

from dflash_gguf.chat.reasoning import Thinking
from dflash_gguf.stats import GenerationStats


class ReplyFinished(Message):
    """Reply `ticket` ended: the Session's finish reason, or cancelled by the user.

    `stats`: the Session's own figures of a reply that ran to its end (prompt length, how much of it
    was found in the KV cache, the decode rates measured where the Session runs). `thinking`: how the reply
    thought under the chat template (None: no thought to split off).
    """

    def __init__(
        self, ticket: int, finish_reason: str | None, cancelled: bool, stats: GenerationStats | None = None,
        thinking: Thinking | None = None,
    ) -> None:
        super().__init__()
        self.thinking = thinking
        self.ticket = ticket
        self.finish_reason = finish_reason
        self.cancelled = cancelled
        self.stats = stats


class ReplyFailed(Message):
    """Reply `ticket` raised, or its worker died; `error` is the one-line message to show."""

    def __init__(self, ticket: int, error: str) -> None:
        super().__init__()
        self.ticket = ticket
        self.error = error
