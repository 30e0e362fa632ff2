"""A chat request, typed: what every API's request becomes before a turn is prepared from it.

Each API's route translates its own request into one ChatRequest (server/*_routes.py: `to_chat`); the
Session's chat methods build one from their arguments. The field names here are the chat floor's; each
protocol's rename table says what its own request calls them, so a refusal names the request's field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..checks import SettingError


@dataclass(frozen=True)
class ChatRequest:
    """A conversation to answer and how: tools and the choice among them, the template's variables, whether a
    thinking model's thought is given apart, and generation settings (GenerationConfig fields by name,
    stops and a constraint among them) over a base config."""

    messages: Sequence[Mapping[str, Any]]
    tools: Any = None  # OpenAI-shaped function tools, checked against the template (tool_calls.plan_tools)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    variables: Mapping[str, Any] | None = None  # the template's own (chat_template_kwargs)
    split_thought: bool = True
    settings: Mapping[str, Any] = field(default_factory=dict)

    def check_text(self) -> None:
        """SettingError naming the first text field that is not valid Unicode (a lone surrogate, which JSON
        can carry as \\ud800 but no tokenizer can encode)."""
        for name in ("messages", "tools", "variables", "settings"):
            where = unencodable(getattr(self, name), name)
            if where is not None:
                raise SettingError(where, "is not valid Unicode text (a lone surrogate such as \\ud800)")


def unencodable(value: Any, path: str) -> str | None:
    """The dotted path of the first string in `value` (nested dicts and lists) that UTF-8 cannot encode."""
    for where, text in _strings(value, path):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return where
    return None


def _strings(value: Any, path: str) -> Iterator[tuple[str, str]]:
    stack: list[tuple[str, Any]] = [(path, value)]  # no recursion: a request may nest deeper than Python allows
    while stack:
        where, v = stack.pop()
        if isinstance(v, str):
            yield where, v
        elif isinstance(v, Mapping):
            for k, item in reversed(list(v.items())):
                if isinstance(k, str):
                    stack.append((f"{where}.{k}" if where else k, k))
                stack.append((f"{where}.{k}" if where else str(k), item))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{where}.{i}", item) for i, item in reversed(list(enumerate(v))))
