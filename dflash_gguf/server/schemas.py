"""What every protocol's translation shares: the Job a request becomes (the chat floor's request and its
generation settings, and where its messages came from), and the checks each translator makes alike.

Each protocol has its own module with its request model and its translation into a Job, named back in its
own terms (its errors.Terms): openai_api (chat and completions), anthropic_api, responses_api. A field the
protocols share is declared once in fields.FIELDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from ..chat import ChatRequest
from ..chat.reasoning import check_chat_template_kwargs
from ..chat.request import unencodable
from ..checks import SettingError
from ..config import GenerationConfig
from .errors import APIError, Terms
from .fields import settings_of


Message = dict[str, Any]


# the key under which a constraint's settings name the request field that carried it (popped by Job)
CONSTRAINT_FIELD = "constraint_field"


@dataclass
class Job:
    """One request, reduced to what a Session takes: chat messages or a raw prompt, and generation arguments
    (the request's stop strings among them, kept apart as `user_stops`: a reply they end names its stop)."""

    messages: list[Message] | None
    prompt: str | None
    gen: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    # OpenAI-shaped tools and tool_choice (the Anthropic route maps its own onto them), checked by the Session
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)  # the chat template's own variables
    split_thought: bool = True  # a thinking model's thought is given apart from the answer
    constraint_field: str | None = None  # the request's field that carried the grammar or schema
    # where each chat message (and call) came from in the request, where they do not map one for one
    # (errors.Terms: `messages.3` -> `input.5`); empty: the request's messages are the chat's
    origins: dict[str, str] = field(default_factory=dict)
    terms: Terms = field(default_factory=lambda: Terms("chat"))  # its protocol's: a refusal names its own field
    user_stops: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.gen = dict(self.gen)
        self.constraint_field = self.gen.pop(CONSTRAINT_FIELD, self.constraint_field)
        self.user_stops = list(self.gen.pop("stop", []))

    def chat_request(self, settings: dict[str, Any]) -> ChatRequest:
        """The chat floor's request for this job, generating with `settings`."""
        return ChatRequest(self.messages or [], self.tools, self.tool_choice, self.parallel_tool_calls,
                           self.chat_template_kwargs, split_thought=self.split_thought, settings=settings)


def settings(req: BaseModel, protocol: str) -> dict[str, Any]:
    """The generation settings a request gives through fields.FIELDS, a value a field refuses a 400 naming the
    request's field."""
    try:
        return settings_of(req, protocol)
    except SettingError as e:
        raise refuse(e.field, e.problem, "invalid_value") from None


def refuse_unencodable(body: BaseModel) -> None:
    """A 400 naming the first text field of the request that is not valid Unicode (a lone surrogate such as
    "\\ud800" is valid JSON, but no tokenizer can encode it)."""
    where = unencodable(body.model_dump(exclude_unset=True), "")
    if where is not None:
        raise refuse(where, "is not valid Unicode text (a lone surrogate such as \\ud800)", "invalid_value")


def refuse(param: str, why: str, code: str = "unsupported_parameter") -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code=code)


def check_neutral(req: BaseModel, neutral: dict[str, Any]) -> None:
    for name, value in neutral.items():
        got = getattr(req, name, None)
        if got not in (None, value) and not (isinstance(value, tuple) and got in value):
            raise refuse(name, f"not supported by dflash-serve (got {got!r}); leave it unset")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def template_variables(given: dict[str, Any] | None, effort: str | None, effort_param: str) -> dict[str, Any]:
    """The chat template's variables for a request: `chat_template_kwargs`, then OpenAI's reasoning effort over
    them, as upstream llama-server reads it ("none": enable_thinking false; another: the template's
    reasoning_effort)."""
    out = dict(given or {})
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise refuse(effort_param, f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", "invalid_value")
        if effort == "none":
            out["enable_thinking"] = False
        else:
            out["reasoning_effort"] = effort
    try:
        return check_chat_template_kwargs(out)
    except SettingError as e:
        raise refuse(e.field, e.problem, "invalid_value") from None


def constraint_setting(kind: str, source: Any, param: str) -> dict[str, Any]:
    """A grammar / json_schema setting, compiled here so that a bad one is a 400 naming the request's field."""
    try:
        GenerationConfig(**{kind: source})
    except SettingError as e:
        raise refuse(param, e.problem, "invalid_value") from None
    return {kind: source, CONSTRAINT_FIELD: param}

