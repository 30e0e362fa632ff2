"""Messages the worker thread posts to the app when a reply ends (its Steps go through the reply's inbox)."""

from __future__ import annotations

from textual.message import Message


class ReplyFinished(Message):
    """Reply `turn` ended: the Session's finish reason, or cancelled by the user.

    `prompt_tokens` / `cached_tokens`: the prompt's length and how much of it the Session found in its
    KV cache (prefix reuse), when the reply ran to its end.
    """

    def __init__(
        self,
        turn: int,
        finish_reason: str | None,
        cancelled: bool,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        super().__init__()
        self.turn = turn
        self.finish_reason = finish_reason
        self.cancelled = cancelled
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens


class ReplyFailed(Message):
    """Reply `turn` raised; `error` is the one-line message to show."""

    def __init__(self, turn: int, error: str) -> None:
        super().__init__()
        self.turn = turn
        self.error = error
