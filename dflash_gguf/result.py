"""A finished generation as the Session returns it: the whole reply, its tokens and stats, and, from a chat
turn with a reply reader, its thought and tool calls read apart."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Sequence

from .chat import Turn
from .chat.tool_calls import ToolCall
from .stats import GenerationStats
from .steps import Step, TokenLogprob

__all__ = ["Result"]


@dataclass(frozen=True)
class Result:
    """A finished generation. With tools, `tool_calls` holds the calls the model made (finish_reason
    "tool_calls") and `content` the text around them; from a thinking template, `reasoning` holds the thought
    and `content` the answer after it; `text` is always the whole reply as generated."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None
    reasoning: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the config asked for logprobs

    @classmethod
    def of_steps(cls, steps: Sequence[Step], stats: GenerationStats) -> "Result":
        """The reply of a stream that ran to its end (its last Step has the finish_reason)."""
        return cls(
            text="".join(s.text for s in steps),
            tokens=[t for s in steps for t in s.tokens],
            finish_reason=steps[-1].finish_reason or "stop",
            stats=stats,
            logprobs=tuple(e for s in steps for e in s.logprobs),
        )

    def read_by(self, turn: Turn) -> "Result":
        """This reply of a prepared turn, its thought and calls read apart where the turn has a reader."""
        reader = turn.reader()
        if reader is None:
            return self
        thought, content, calls = reader.read(self.text)
        return replace(self, tool_calls=tuple(calls), content=content,
                       reasoning=thought if turn.thinking is not None else None,
                       finish_reason="tool_calls" if calls else self.finish_reason)
