"""A GGUF's chat template as the chat floor reads it: its family learned once, and the prompt it renders.

A ChatTemplate knows, from its Jinja text and the model's BOS/EOS text (no C call): the tool-call family that
writes and reads its calls (tool_calls.detect_family), the thinking markers of its thought
(reasoning.thinking_for), and what it does with a system message that is not the first.

Claude Code sends system messages inside the conversation (its mid-conversation-system beta). Templates of
the ChatML family render them where they stand; others raise ("System message must be at the beginning")
or silently drop them. A template is asked once, with a probe conversation, and where it does not render a
late system message in place, such messages are joined to the leading system message instead: the model
still reads every instruction, and a conversation whose late system messages stay the same keeps one
prefix from turn to turn (the prompt cache's reuse).
"""

from __future__ import annotations

from functools import cached_property, lru_cache
from typing import Any, Mapping, Sequence

from llama_cpp import llama_chat_format

from .reasoning import Thinking, check_chat_template_kwargs, thinking_for
from .tool_calls import Family, ToolPlan, detect_family, plan_tools, prepare_messages

_PROBE = "dflash-probe-late-system"

@lru_cache(maxsize=16)
def renders_late_system(template: str, bos: str, eos: str) -> bool:
    """Whether the template renders a system message after the first turn, in place and with its text."""
    formatter = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "system", "content": _PROBE},
             {"role": "user", "content": "v"}]
    try:
        prompt = formatter(messages=probe).prompt
    except Exception:  # noqa: BLE001 - a template that raises on the probe refuses late system messages
        return False
    return _PROBE in prompt and prompt.index(_PROBE) > prompt.index("a")

def place_system_messages(messages: Sequence[Mapping[str, Any]], in_place: bool) -> list[dict[str, Any]]:
    """The messages as the template can take them: unchanged where late system messages render in place,
    else each late one's text joined (a blank line apart) to the leading system message, made if absent."""
    out = [dict(m) for m in messages]
    late = [i for i, m in enumerate(out) if m.get("role") == "system" and i > 0]
    if in_place or not late:
        return out
    texts = [_text(out[i].get("content")) for i in late]
    rest = [m for i, m in enumerate(out) if i not in set(late)]
    if rest and rest[0].get("role") == "system":
        lead = rest[0]
        lead["content"] = "\n\n".join([_text(lead.get("content")), *texts])
        return rest
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]

def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)


class ChatTemplate:
    """One model's chat template: its text, the BOS and EOS text it is given, and what it was learned to do."""

    def __init__(self, source: str | None, bos: str, eos: str, *, where: str = "the model") -> None:
        self.source, self.bos, self.eos, self.where = source, bos, eos, where

    @cached_property
    def family(self) -> Family | None:
        """The tool-call family of this template (None: it takes no tools this library reads)."""
        return detect_family(self.source)

    @cached_property
    def _formatter(self) -> llama_chat_format.Jinja2ChatFormatter:
        """The template compiled once: compiling it took ~6 ms of each request's render, on the server's event
        loop (rendering with it is stateless, so threads share it)."""
        return llama_chat_format.Jinja2ChatFormatter(template=self.source, eos_token=self.eos, bos_token=self.bos)

    @cached_property
    def late_system_in_place(self) -> bool:
        """Whether a system message after the first turn renders where it stands."""
        return self.source is not None and renders_late_system(self.source, self.bos, self.eos)

    def plan_tools(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolPlan | None:
        """A request's tools checked against this template (None without tools); ToolError names the field."""
        return plan_tools(self.source, tools, tool_choice, parallel_tool_calls)

    def thinking(self, prompt: str) -> Thinking | None:
        """How the reply to this rendered prompt thinks (None: no thought to split off)."""
        return thinking_for(self.source, prompt)

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]] | None = None,
               variables: Mapping[str, Any] | None = None) -> tuple[str, list[str]]:
        """The prompt text and the template's stop strings. `tools` (checked ones, a ToolPlan's) are passed as
        transformers and llama-cpp-python pass them; assistant tool calls and tool results in `messages` render
        through the template too; `variables` are the template's own (checked by check_chat_template_kwargs)."""
        if not messages or any(not isinstance(m, Mapping) or "role" not in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        messages = prepare_messages(messages)
        if self.source is None:
            raise ValueError(f"{self.where}: the GGUF has no chat template; use generate() with a raw prompt")
        messages = place_system_messages(messages, self.late_system_in_place)
        response = self._formatter(messages=messages, tools=list(tools) if tools else None,
                                   **check_chat_template_kwargs(variables))
        stops = [response.stop] if isinstance(response.stop, str) else list(response.stop or [])
        return response.prompt, [s for s in stops if s]
