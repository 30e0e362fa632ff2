"""A reply's text as the APIs give it back: where it ends (its first stop string), its thought, its answer
text and its tool calls, in pieces as it streams, read by one machine. The stop strings cut the reply first
(the decode loop is handed a reader as its stop check), then the thought is split off (Thinking.split), so a
call the model only thinks about is never read as one; the answer's calls are read by the template's tool
family."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .families.base import hold_back
from .reasoning import Thinking
from .tool_calls import CallDelta, ToolCall, ToolPlan, call_arguments
from .tool_calls import openai_delta as tool_delta


@dataclass
class Thought:
    """A piece of the reply's thought (OpenAI reasoning_content, an Anthropic thinking block)."""

    text: str


Piece = Thought | str | CallDelta  # str: answer text


class ReplyReader:
    """Feed the reply's text as it comes; get its pieces, each given once, in order.

    Each feed reads the whole reply again (replies are short next to the decode): where its first stop string
    cuts it, the thought and the answer the rest splits into, then the answer's content and calls as the
    family parses them; what is new since the last feed is given out, and what could still become a stop
    string, a marker or a call's opener is held back until it is one or is not. Without stop strings the
    reply runs to its end; without a thinking template all of it is answer; without tools to parse, all of
    the answer is content.

    The decode loop is handed a reader as its stop check (decoding.StopCheck): `settled` says how many of
    the reply's characters no stop string can take back any more, `stop_sequence` which stop string ended
    the reply, once one has (the earliest in the text; after it, what is fed is ignored).
    """

    def __init__(self, thinking: Thinking | None = None, tools: ToolPlan | None = None,
                 stops: Sequence[str] = ()) -> None:
        self._thinking = thinking
        self._plan = tools if tools is not None and tools.parses else None
        self._schemas = self._plan.schemas if self._plan is not None else {}
        self._stops = tuple(stops)
        self._longest = max(map(len, self._stops), default=0)
        self._text = ""  # the reply so far, up to its stop string once one has ended it
        self._searched = 0  # where the next search for a stop string begins
        self.settled = 0  # characters of the reply no stop string can take back
        self.stop_sequence: str | None = None
        self.thought = ""  # the thought given out
        self._answer = ""  # the answer the thought's split has released
        self._content = 0  # answer characters given out as content
        self._args: list[int] = []  # per call, argument characters given out
        self._ids: list[str] = []
        self.calls: list[ToolCall] = []  # the calls finished so far

    @property
    def content(self) -> str:
        """The answer text given out so far (after finish(): the reply's text around its calls)."""
        return self._answer[: self._content]

    def feed(self, text: str) -> list[Piece]:
        if self.stop_sequence is None:
            self._text += text
        return self._read(final=False)

    def finish(self) -> list[Piece]:
        """Whatever was held back, once the reply has ended."""
        return self._read(final=True)

    def _settle(self, final: bool) -> str:
        """The reply's text up to the stop string that completes first, less what could still begin one (all of it once final)."""
        if self.stop_sequence is None and self._stops:
            # a stop string is searched for where it could have been completed since the last search
            # the one that completes first ends the reply (at one end, the longer), however the text is chunked
            found = [(i + len(s), i, s) for s in self._stops if (i := self._text.find(s, self._searched)) >= 0]
            self._searched = max(0, len(self._text) - self._longest + 1)
            if found:
                _, i, self.stop_sequence = min(found)
                self._text = self._text[:i]
        if final or self.stop_sequence is not None:
            self.settled = len(self._text)
        else:
            self.settled = min((hold_back(self._text, s) for s in self._stops), default=len(self._text))
        return self._text if self.settled == len(self._text) else self._text[: self.settled]

    def read(self, text: str) -> tuple[str, str | None, list[ToolCall]]:
        """A whole reply as its thought, its answer text (None when the reply is only calls, as OpenAI gives
        it) and its calls."""
        self.feed(text)
        self.finish()
        return self.thought, self.content or (None if self.calls else ""), self.calls

    def _read(self, final: bool) -> list[Piece]:
        text = self._settle(final)
        thought, self._answer = ("", text) if self._thinking is None else self._thinking.split(text, final)
        out: list[Piece] = [Thought(thought[len(self.thought):])] if len(thought) > len(self.thought) else []
        self.thought = thought  # each split extends the one before
        out += self._answer_pieces(final=False)
        return out + self._answer_pieces(final=True) if final else out

    def _answer_pieces(self, final: bool) -> list[Piece]:
        """The answer's new content (str) and call pieces (CallDelta); trailing whitespace waits, as before a
        call it is the call's separator, not content."""
        if self._plan is None:
            new = self._answer[self._content:]
            self._content = len(self._answer)
            return [new] if new else []
        parsed = self._plan.family.parse(self._answer, self._schemas)
        content = self._answer if final and not parsed.calls else parsed.content.rstrip()
        out: list[Piece] = []
        if not self._args and len(content) > self._content:
            out.append(content[self._content:])
            self._content = len(content)
        for i, (name, args, done) in enumerate(parsed.calls):
            if i == len(self._args):
                self._ids.append(self._plan.family.call_id())
                self._args.append(0)
                out.append(CallDelta(i, id=self._ids[i], name=name))
            if len(args) > self._args[i]:
                if out and isinstance(out[-1], CallDelta) and out[-1].index == i:
                    out[-1].arguments += args[self._args[i]:]
                else:
                    out.append(CallDelta(i, arguments=args[self._args[i]:]))
                self._args[i] = len(args)
            if done and i == len(self.calls):
                self.calls.append(ToolCall(self._ids[i], name, call_arguments(args)))
        return out


def openai_delta(piece: Piece) -> dict[str, Any]:
    """A piece as an OpenAI chat chunk's delta: a thought as reasoning_content (llama-server's and DeepSeek's
    field), answer text and call pieces as tool_calls.openai_delta writes them."""
    if isinstance(piece, Thought):
        return {"reasoning_content": piece.text}
    return tool_delta(piece)
