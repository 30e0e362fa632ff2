"""A chat turn prepared in one place: (template, vocabulary, request, base config) -> (tokens, config, reader).

This is what llama.cpp's common_chat_templates_apply does, as one Python function: the tools checked against
the template's family, the conversation rendered, the prompt tokenized, the generation settings built and
checked, the grammar a tool call or a JSON schema brings (after a thought, under a thinking template), the
template's and the family's stop strings, and the reader that splits the reply into its thought, its text
and its calls. Session.chat / stream_chat / create_chat_completion, the server's engine, the terminal chat
and the benchmark all take their turns from prepare_turn; nothing else assembles one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from ..config import GenerationConfig
from .reasoning import Thinking, json_answer
from .reply import ReplyReader
from .request import ChatRequest
from .template import ChatTemplate
from .tool_calls import ToolError, ToolPlan


class Vocabulary(Protocol):
    """What a turn needs of the model's vocabulary (`Target.vocab` offers it; the chat floor never calls C itself)."""

    n_vocab: int

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]: ...


@dataclass(frozen=True)
class Turn:
    """A prepared turn: the prompt's tokens, the config its reply generates under, and how to read the reply."""

    tokens: list[int]
    config: GenerationConfig
    prompt: str  # the rendered text
    tools: ToolPlan | None  # the checked tools (None: none given)
    thinking: Thinking | None  # how the reply thinks under this template (None: no thought to split)
    split_thought: bool = True

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.parses

    def reader(self) -> ReplyReader | None:
        """A fresh reader of this reply's thought and calls; None when the reply is all answer text (no calls
        to read, and no thought, or a thought the request asked to leave in the text)."""
        thinking = self.thinking if self.split_thought else None
        if thinking is None and not self.parses_calls:
            return None
        return ReplyReader(thinking, self.tools)


def prepare_turn(template: ChatTemplate, vocab: Vocabulary, request: ChatRequest,
                 base: GenerationConfig | None = None) -> Turn:
    """The one assembly of a chat turn. Raises ToolError (a SettingError) naming a bad tool field, SettingError
    naming a bad setting or a text field that is not valid Unicode, and ValueError (jinja's TemplateError is
    one too) where the template refuses the messages. The caller checks the prompt against its context."""
    request.check_text()
    plan = template.plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
    prompt, stops = template.render(request.messages, None if plan is None else plan.tools, request.variables)
    tokens = vocab.tokenize(prompt, add_special=False, parse_special=True)
    config = GenerationConfig.build(base, **request.settings)
    config.sampling.check_vocab(vocab.n_vocab)
    thinking = template.thinking(prompt)
    config = turn_config(config, plan, thinking).with_stops(stops)
    return Turn(tokens, config, prompt, plan, thinking, request.split_thought)


def turn_config(config: GenerationConfig, plan: ToolPlan | None, thinking: Thinking | None = None) -> GenerationConfig:
    """The config a tool plan generates under: its grammar (tools and a caller's constraint exclude each other),
    and its family's end-of-turn strings among the stops. Under a thinking template (`thinking`), the tools'
    grammar or a JSON schema holds the reply after the thought, not instead of it; free text with a lazy call
    grammar (tool_choice "auto") takes the thought as text where the prompt left none open."""
    if plan is not None and plan.grammar is not None:
        if config.constraint is not None:
            kind = config.constraint.kind
            raise ToolError("tools", f"give tools or a {kind} constraint, not both (the tools bring their own grammar)")
        wrap = thinking is not None and (thinking.opened or plan.forced)
        config = GenerationConfig.build(config, grammar=thinking.constrain_after(plan.grammar) if wrap else plan.grammar)
    elif thinking is not None and config.json_schema is not None:
        config = GenerationConfig.build(config, json_schema=None,
                                        grammar=thinking.constrain_after(json_answer(config.json_schema)))
    return config if plan is None else config.with_stops(plan.family.stops)
