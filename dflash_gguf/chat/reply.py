"""A reply's text as the APIs give it back: its thought, its answer text and its tool calls, in pieces as it
streams. The thought is split off first (reasoning.ThoughtStream); the answer then goes through the tool-call
reader (tool_calls.ToolStream), so a call the model only thinks about is never read as one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .reasoning import Thinking
from .tool_calls import CallDelta, ToolCall, ToolPlan
from .tool_calls import openai_delta as tool_delta


@dataclass
class Thought:
    """A piece of the reply's thought (OpenAI reasoning_content, an Anthropic thinking block)."""

    text: str


Piece = Thought | str | CallDelta  # str: answer text


class ReplyReader:
    """Feed the reply's text as it comes; get its pieces, each given once, in order."""

    def __init__(self, thinking: Thinking | None, tools: ToolPlan | None) -> None:
        self._thoughts = thinking.stream() if thinking is not None else None
        self._calls = tools.stream() if tools is not None and tools.parses else None
        self.thought = ""
        self._answer = ""

    @property
    def content(self) -> str:
        """The answer text given out so far (after finish(): the reply's text around its calls)."""
        return self._calls.content if self._calls is not None else self._answer

    @property
    def calls(self) -> list[ToolCall]:
        return self._calls.calls if self._calls is not None else []

    def feed(self, text: str) -> list[Piece]:
        if self._thoughts is None:
            return self._answer_pieces(text, final=False)
        thought, answer = self._thoughts.feed(text)
        return self._thought(thought) + self._answer_pieces(answer, final=False)

    def finish(self) -> list[Piece]:
        """Whatever was held back, once the reply has ended."""
        if self._thoughts is None:
            return self._answer_pieces("", final=True)
        thought, answer = self._thoughts.finish()
        return self._thought(thought) + self._answer_pieces(answer, final=True)

    def read(self, text: str) -> tuple[str, str | None, list[ToolCall]]:
        """A whole reply as its thought, its answer text (None when the reply is only calls, as OpenAI gives
        it) and its calls."""
        self.feed(text)
        self.finish()
        return self.thought, self.content or (None if self.calls else ""), self.calls

    def _thought(self, text: str) -> list[Piece]:
        self.thought += text
        return [Thought(text)] if text else []

    def _answer_pieces(self, text: str, final: bool) -> list[Piece]:
        if self._calls is None:
            self._answer += text
            return [text] if text else []
        pieces: list[Piece] = list(self._calls.feed(text))
        return pieces + self._calls.finish() if final else pieces


def openai_delta(piece: Piece) -> dict[str, Any]:
    """A piece as an OpenAI chat chunk's delta: a thought as reasoning_content (llama-server's and DeepSeek's
    field), answer text and call pieces as tool_calls.openai_delta writes them."""
    if isinstance(piece, Thought):
        return {"reasoning_content": piece.text}
    return tool_delta(piece)
