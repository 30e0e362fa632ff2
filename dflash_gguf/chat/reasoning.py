"""Reasoning: the thought a thinking model writes before its answer, told apart from the answer.

Thinking models (Qwen3 and 3.5, QwQ, DeepSeek-R1 and its distills, SmolLM3, Magistral, Seed-OSS) write
`<think> ... </think>` (or their family's markers) before the reply proper. Most of their templates end the
prompt inside the thought (`<think>\\n`), so the reply starts with reasoning and no opening marker; others let
the model open it. The APIs give the thought back apart from the answer (OpenAI `reasoning_content`, Anthropic
thinking blocks, Responses reasoning items), as upstream llama-server does, and a constrained reply (a forced
tool call, a JSON schema) is constrained after the thought, not instead of it.
"""

from __future__ import annotations

import bisect
import itertools
import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..checks import SettingError
from ..constraints import json_rule
from .families.base import hold_back
from .grammar import LarkGrammar

# (start, end) markers of each family's thought, told apart by the end marker in the chat template
MARKERS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("[THINK]", "[/THINK]"),
                                        ("<seed:think>", "</seed:think>"))


@dataclass(frozen=True)
class Thinking:
    """How one reply reasons: its markers, and whether the prompt left the thought open (the reply starts inside
    it) or the model may open one itself at the start of its reply."""

    start: str
    end: str
    opened: bool

    def split(self, reply: str, final: bool) -> tuple[str, str]:
        """(the thought, the answer) of a reply so far; unless it is `final`, what could still be a marker is
        held back until it is one or is not. Whitespace around the markers is the template's layout, not the
        model's words: the thought comes without the blank lines around it, the answer without those before it.
        A longer reply's split extends a shorter one's (chat.reply.ReplyReader gives out the difference)."""
        text = reply
        if not self.opened:
            lead = text.lstrip()
            if not final and self.start.startswith(lead):
                return "", ""  # the reply may still open a thought
            if not lead.startswith(self.start):
                return "", text  # it did not: all of it is the answer
            text = lead[len(self.start):]
        end = text.find(self.end)
        if end >= 0:
            return text[:end].strip(), text[end + len(self.end):].lstrip()
        thought = text.lstrip()
        return (thought if final else thought[:hold_back(thought, self.end)]).rstrip(), ""

    def constrain_after(self, reply: str) -> LarkGrammar:
        """A grammar for a reply whose thought comes first: the thought is free text up to the end marker, then
        `reply` (a LarkGrammar: a family's call grammar, json_answer's) holds the rest, its start rule renamed
        `answer`. Where the prompt did not open the thought, the model may open one (after blank space) or not;
        `reply` must then begin with something other than free text (a call's opener, JSON), which the optional
        thought cannot be told apart from."""
        if not isinstance(reply, LarkGrammar):
            raise ValueError("the grammar to follow a thought must be Lark with one start rule (a LarkGrammar)")
        thought = "thought" if self.opened else f"(/[ \\t\\n]{{0,8}}/ {json.dumps(self.start)} thought)?"
        # a lazy rule: the thought ends where the end marker first appears, and never holds the marker itself
        return reply.renamed_start("answer", f"{thought} answer", [
            f"thought[lazy]: THOUGHT {json.dumps(self.end)}", "THOUGHT: /(.|\\n)*/"])

    def tokens_in_thought(self, pieces: Sequence[str]) -> int:
        """How many of a reply's tokens (their texts, in order) the thought took: up to the one that completes
        its end marker, or all of them when the thought never ended (0 when the reply has no thought)."""
        text = "".join(pieces)
        if not self.opened and not text.lstrip().startswith(self.start):
            return 0
        end = text.find(self.end)
        if end < 0:
            return len(pieces)
        return bisect.bisect_left(list(itertools.accumulate(map(len, pieces))), end + len(self.end)) + 1


def thinking_for(template: str | None, prompt: str) -> Thinking | None:
    """The reply's thinking under this chat template and the prompt it rendered: inside a thought when the
    prompt ends with the start marker (`<think>\\n`); None for a template without reasoning markers, or a
    prompt whose template closed the thought before the reply (enable_thinking false: `<think>\\n\\n</think>`)."""
    if not template:
        return None
    for start, end in MARKERS:
        if end in template:
            tail = prompt.rstrip()
            return None if tail.endswith(end) else Thinking(start, end, tail.endswith(start))
    return None


# what the chat formatter passes itself: a template variable may not stand in for them
RESERVED_TEMPLATE_VARIABLES = frozenset({
    "messages", "tools", "tool_choice", "functions", "function_call", "add_generation_prompt", "bos_token",
    "eos_token", "raise_exception", "strftime_now"})


def check_chat_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A chat template's own variables (llama-server's and vLLM's `chat_template_kwargs`): `enable_thinking`
    (false: the templates that know it close the thought before the reply) and whatever else the template
    reads; SettingError naming the variable for one the formatter sets itself or an enable_thinking that is
    not a boolean."""
    out = dict(kwargs or {})
    for name, value in out.items():
        where = f"chat_template_kwargs.{name}"
        if not isinstance(name, str) or not name.isidentifier():
            raise SettingError(where, "must be a template variable name")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise SettingError(where, "is set by the server from the request itself, not a template variable to give")
        if name == "enable_thinking" and not isinstance(value, bool):
            raise SettingError(where, f"must be true or false, got {value!r}")
    return out


def json_answer(schema: str) -> LarkGrammar:
    """A JSON schema's text as a Lark grammar (its `start` rule), for Thinking.constrain_after."""
    return LarkGrammar(f"/[ \\t\\n]{{0,8}}/ {json_rule(schema)}")

