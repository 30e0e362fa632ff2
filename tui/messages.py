"""Messages the worker thread posts to the app: the only way generation results reach the UI."""

from __future__ import annotations

from textual.message import Message

from dflash_gguf.tui.provenance import Piece, StepLike


class StepArrived(Message):
    """One decoding cycle of reply `turn`: the Step, its text split by provenance, and the perf_counter
    time the worker received it."""

    def __init__(self, turn: int, step: StepLike, pieces: list[Piece], at: float) -> None:
        super().__init__()
        self.turn = turn
        self.step = step
        self.pieces = pieces
        self.at = at


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


class CalibrationFinished(Message):
    """The plain-decoding speed measured on this machine."""

    def __init__(self, tokens_per_s: float) -> None:
        super().__init__()
        self.tokens_per_s = tokens_per_s


class CalibrationFailed(Message):
    """The plain-decoding measurement could not be made."""

    def __init__(self, error: str) -> None:
        super().__init__()
        self.error = error
