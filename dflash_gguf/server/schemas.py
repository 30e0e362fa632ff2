"""Request models: llama_cpp.server's OpenAI types, extended with what newer clients send, and the Anthropic Messages request.

What the Session cannot do is refused with a 400 naming the field, never dropped: n > 1 (one choice per
request) and the legacy `functions` / `function_call` (use tools / tool_choice). Tools are acted on where
the model's chat template takes them: the Session renders them, holds each call to its tool's schema and
the routes return the calls (OpenAI tool_calls, Anthropic tool_use blocks). The sampling fields are acted
on through the speculative loop: logprobs / top_logprobs (the target's log-softmax), presence_penalty,
frequency_penalty, logit_bias (token ids), and llama.cpp's repeat_penalty, repeat_last_n and min_p.
Structured output is acted on: `grammar` (GBNF), OpenAI `response_format` (json_object, json_schema) and
Anthropic `output_config.format` become the Session's grammar / json_schema constraint. Parameters left at their neutral value are accepted, since clients send the
defaults; output_config.effort, metadata, cache_control, service_tier and the like change nothing about a
local model's reply and are accepted as neutral. What Claude Code adds is accepted too: `thinking` (checked;
"disabled" turns the template's thinking off, the others leave it as the template has it), `context_management`
(checked, not applied), earlier turns' thinking blocks (given to the template as the turn's reasoning_content,
which thinking templates keep for the current tool loop only) and the billing header that opens its system
prompt (removed: its per-request stamp would end every cached prefix at the first line). Reasoning: OpenAI
`reasoning_effort` "none" and Anthropic thinking "disabled" set the template's enable_thinking to false,
`chat_template_kwargs` (llama-server's and vLLM's) sets template variables, `reasoning_format` "none" leaves a
thinking model's thought in the content instead of splitting it off.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Annotated, Any, List, Literal, Optional, Union

import llama_cpp
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import NotRequired, TypedDict

from ..chat import ChatRequest
from ..chat.reasoning import check_chat_template_kwargs
from ..chat.request import unencodable
from ..checks import SettingError
from ..config import GenerationConfig
from .errors import APIError
from .fields import declared, settings_of

Message = dict[str, Any]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SystemMessage(TypedDict):
    """A system or developer message (newer OpenAI clients send `developer`); its content may be text parts."""

    role: Literal["system", "developer"]
    content: Optional[Union[str, List[dict[str, Any]]]]
    name: NotRequired[str]


class _AssistantMessage(TypedDict):
    """An assistant turn as the openai SDK sends it back: content may be null (a turn of tool calls only)
    or text parts; llama_cpp's type takes a string only."""

    role: Literal["assistant"]
    content: NotRequired[Optional[Union[str, List[dict[str, Any]]]]]
    tool_calls: NotRequired[llama_cpp.ChatCompletionMessageToolCalls]
    function_call: NotRequired[llama_cpp.ChatCompletionRequestAssistantMessageFunctionCall]
    name: NotRequired[str]
    refusal: NotRequired[Optional[str]]
    reasoning_content: NotRequired[Optional[str]]  # the turn's thought, as this server (and llama-server) give it


_OpenAIMessage = Annotated[
    Union[
        _SystemMessage,
        llama_cpp.ChatCompletionRequestUserMessage,
        _AssistantMessage,
        llama_cpp.ChatCompletionRequestToolMessage,
        llama_cpp.ChatCompletionRequestFunctionMessage,
    ],
    Field(discriminator="role"),
]

_N_LOGPROBS = Field(default=None, ge=0, le=20)  # OpenAI's bound on alternatives per token


class ChatCompletionRequest(CreateChatCompletionRequest):
    """POST /v1/chat/completions: llama_cpp.server's request plus what the openai SDK sends, and the sampling
    fields of fields.FIELDS; an undeclared field is a 400 naming it, never dropped."""

    model_config = ConfigDict(extra="forbid")

    messages: List[_OpenAIMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    max_tokens: Optional[int] = Field(default=None, ge=0)
    stream_options: Optional[StreamOptions] = None
    top_logprobs: Optional[int] = _N_LOGPROBS
    parallel_tool_calls: Optional[bool] = None
    # checked by the Session against the model's template (dflash_gguf.tool_calls), which names the bad field;
    # wider than llama_cpp's type, which lacks `strict` (sent by OpenAI agents; every call follows its schema)
    tools: Optional[List[dict[str, Any]]] = None
    # OpenAI's shapes: text, json_object (with llama-cpp-python's optional `schema`), json_schema
    response_format: Optional[dict[str, Any]] = None
    # reasoning (dflash_gguf.reasoning): template variables, the thought split off or not, OpenAI's effort
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_format: Optional[Literal["auto", "deepseek", "none"]] = None
    reasoning_effort: Optional[str] = None
    # neutral for a local model: nothing about the reply changes (prefixes are cached whatever the key says;
    # a prediction only ever speeds a reply up, never changes it)
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    verbosity: Optional[str] = None
    prediction: Optional[dict[str, Any]] = None
    # accepted only at their neutral value (chat_job)
    store: Optional[bool] = None
    modalities: Optional[List[str]] = None
    audio: Optional[dict[str, Any]] = None
    web_search_options: Optional[dict[str, Any]] = None


ChatCompletionRequest = declared(ChatCompletionRequest, "chat")  # type: ignore[misc]


class CompletionRequest(CreateCompletionRequest):
    """POST /v1/completions: llama_cpp.server's request plus stream_options and the sampling fields of
    fields.FIELDS; an undeclared field is a 400."""

    model_config = ConfigDict(extra="forbid")

    prompt: Union[str, List[str]] = Field(description="The prompt to complete (one).")
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = _N_LOGPROBS


CompletionRequest = declared(CompletionRequest, "completions")  # type: ignore[misc]


# -- Anthropic Messages ------------------------------------------------------------------------
class AnthropicBlock(BaseModel):
    """A content block; only text is accepted, the others are refused by name."""

    model_config = ConfigDict(extra="allow")  # cache_control, citations...
    type: str
    text: Optional[str] = None


class AnthropicMessage(BaseModel):
    """A turn; `system` inside `messages` is Claude Code's mid-conversation system message (its
    mid-conversation-system beta), rendered where it stands or, where the template refuses that, joined to the
    leading system message (chat.template.place_system_messages)."""

    role: Literal["user", "assistant", "system"]
    content: Union[str, List[AnthropicBlock]]


class MessagesRequest(BaseModel):
    """POST /v1/messages. Every field the anthropic 2.x SDK sends is acted on (the sampling ones declared in
    fields.FIELDS), accepted as neutral or refused by name in messages_job; a field this model does not
    declare is a 400 naming it, never dropped."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: List[AnthropicMessage] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: Optional[Union[str, List[AnthropicBlock]]] = None
    stop_sequences: Optional[List[str]] = None
    stream: bool = False
    tools: Optional[List[dict[str, Any]]] = None
    tool_choice: Optional[dict[str, Any]] = None
    thinking: Optional[dict[str, Any]] = None
    output_config: Optional[dict[str, Any]] = None
    context_management: Optional[dict[str, Any]] = None  # Claude Code sends it; checked in messages_job
    output_format: Optional[dict[str, Any]] = None  # the structured-output beta's earlier spelling
    container: Optional[Any] = None
    # neutral for a local model: none of them changes the reply (prefixes are cached whatever cache_control says)
    metadata: Optional[dict[str, Any]] = None
    cache_control: Optional[dict[str, Any]] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    speed: Optional[Literal["standard", "fast"]] = None
    inference_geo: Optional[str] = None
    diagnostics: Optional[dict[str, Any]] = None


MessagesRequest = declared(MessagesRequest, "anthropic")  # type: ignore[misc]


class CountTokensRequest(MessagesRequest):
    """POST /v1/messages/count_tokens: a Messages request without the generation's own fields."""

    max_tokens: int = Field(default=1, ge=1)


# -- what the Session is asked ------------------------------------------------------------------
# the key under which a constraint's settings name the request field that carried it (popped by Job)
CONSTRAINT_FIELD = "constraint_field"


@dataclass
class Job:
    """One request, reduced to what a Session takes: chat messages or a raw prompt, and generation arguments."""

    messages: list[Message] | None
    prompt: str | None
    gen: dict[str, Any]
    user_stops: list[str] = field(default_factory=list)
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
    protocol: str = "chat"  # whose terms a refusal is named in (errors.TERMS)

    def __post_init__(self) -> None:
        self.gen = dict(self.gen)
        self.constraint_field = self.gen.pop(CONSTRAINT_FIELD, self.constraint_field)

    def chat_request(self, settings: dict[str, Any]) -> ChatRequest:
        """The chat floor's request for this job, generating with `settings`."""
        return ChatRequest(self.messages or [], self.tools, self.tool_choice, self.parallel_tool_calls,
                           self.chat_template_kwargs, split_thought=self.split_thought, settings=settings)


def refuse_unencodable(body: BaseModel) -> None:
    """A 400 naming the first text field of the request that is not valid Unicode (a lone surrogate such as
    "\\ud800" is valid JSON, but no tokenizer can encode it)."""
    where = unencodable(body.model_dump(exclude_unset=True), "")
    if where is not None:
        raise _refuse(where, "is not valid Unicode text (a lone surrogate such as \\ud800)", "invalid_value")


def _refuse(param: str, why: str, code: str = "unsupported_parameter") -> APIError:
    return APIError(400, f"{param}: {why}", param=param, code=code)


def _check_neutral(req: BaseModel, neutral: dict[str, Any]) -> None:
    for name, value in neutral.items():
        got = getattr(req, name, None)
        if got not in (None, value) and not (isinstance(value, tuple) and got in value):
            raise _refuse(name, f"not supported by dflash-serve (got {got!r}); leave it unset")


def _stops(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise _refuse(param, "stop strings must be non-empty", "invalid_value")
    return stops


def _text_parts(content: Any, param: str) -> str:
    """An OpenAI message content: a string, or a list of text parts (joined); images are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text":
            raise _refuse(f"{param}.{i}.type", f"content part {part.get('type')!r} is not supported: text only")
        texts.append(part.get("text", ""))
    return "".join(texts)


def chat_job(req: ChatCompletionRequest) -> Job:
    refuse_unencodable(req)
    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise _refuse(legacy, f"the legacy function-calling field is not supported: use {instead}")
    _check_choices(req)
    _check_neutral(req, {
        "mirostat_mode": 0, "min_tokens": 0,
        "store": False, "modalities": (["text"],), "audio": None, "web_search_options": None,
    })
    if req.top_logprobs is not None and not req.logprobs:
        raise _refuse("top_logprobs", "needs logprobs: true", "invalid_value")
    constraint = _response_format(req.response_format)
    if req.grammar is not None:
        if constraint:
            raise _refuse("grammar", "give either grammar or a JSON response_format, not both", "invalid_value")
        constraint = _constraint("grammar", req.grammar, "grammar")
    messages: list[Message] = []
    for i, m in enumerate(req.messages):
        role = m["role"]
        if role == "function" or m.get("function_call"):
            raise _refuse(f"messages.{i}", "legacy function messages are not supported: use tool_calls and tool "
                          "messages")
        message: Message = {"role": "system" if role == "developer" else role,
                            "content": _text_parts(m.get("content"), f"messages.{i}.content")}
        if m.get("tool_calls"):
            message["tool_calls"] = [dict(c) for c in m["tool_calls"]]
        if role == "assistant" and m.get("reasoning_content"):
            message["reasoning_content"] = m["reasoning_content"]
        if role == "tool":
            message["tool_call_id"] = m.get("tool_call_id")
        messages.append(message)
    gen = settings_of(req, "chat") | _penalties(req) | constraint
    gen["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    gen |= _max_tokens(req.max_completion_tokens or req.max_tokens)
    stops = _stops(req.stop)
    return Job(messages, None, gen, stops, req.stream, bool(req.stream_options and req.stream_options.include_usage),
               tools=[dict(t) for t in req.tools] if req.tools else None, tool_choice=req.tool_choice,
               parallel_tool_calls=req.parallel_tool_calls,
               chat_template_kwargs=template_variables(req.chat_template_kwargs, req.reasoning_effort, "reasoning_effort"),
               split_thought=req.reasoning_format != "none")


def completion_job(req: CompletionRequest) -> Job:
    refuse_unencodable(req)
    _check_choices(req)
    _check_neutral(req, {"mirostat_mode": 0, "min_tokens": 0, "echo": False, "suffix": None})
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise _refuse("prompt", f"one prompt per request (got {len(prompt)})")
        prompt = prompt[0]
    if not prompt:
        raise _refuse("prompt", "the prompt is empty", "invalid_value")
    gen = settings_of(req, "completions") | _penalties(req)
    gen["logprobs"] = req.logprobs
    if req.grammar is not None:
        gen |= _constraint("grammar", req.grammar, "grammar")
    gen |= _max_tokens(req.max_tokens)
    return Job(None, prompt, gen, _stops(req.stop), req.stream,
               bool(req.stream_options and req.stream_options.include_usage), protocol="completions")


def messages_job(req: MessagesRequest) -> Job:
    refuse_unencodable(req)
    tools = [_anthropic_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)] if req.tools else None
    tool_choice, parallel = _anthropic_tool_choice(req.tool_choice)
    output = req.output_config or {}
    if set(output) - {"format", "effort"}:
        raise _refuse(f"output_config.{sorted(set(output) - {'format', 'effort'})[0]}", "not supported")
    if output.get("format") is not None and req.output_format is not None:
        raise _refuse("output_format", "give output_config.format or output_format, not both", "invalid_value")
    fmt, where = (output.get("format"), "output_config.format") if output.get("format") else (req.output_format, "output_format")
    constraint = _anthropic_format(fmt, where) if fmt is not None else {}
    _check_thinking(req.thinking)
    thinking_off = {"enable_thinking": False} if (req.thinking or {}).get("type") == "disabled" else {}
    _check_context_management(req.context_management)
    if req.container is not None:
        raise _refuse("container", "code-execution containers are not supported")
    messages: list[Message] = []
    origins: dict[str, str] = {}
    if req.system:
        origins["messages.0"] = "system"
        messages.append({"role": "system", "content": _without_billing_header(_anthropic_text(req.system, "system"))})
    ids: set[str] = set()  # the tool_use ids so far: a tool_result answers one of them
    for i, m in enumerate(req.messages):
        messages += _anthropic_message(m, f"messages.{i}.content", ids, origins, len(messages))
    gen = settings_of(req, "anthropic") | constraint
    gen["max_tokens"] = req.max_tokens
    return Job(messages, None, gen, _stops(req.stop_sequences, "stop_sequences"), req.stream, True,
               tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel, chat_template_kwargs=thinking_off,
               origins=origins, protocol="anthropic")


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    """Extended thinking as Anthropic checks it (with interleaved thinking, which Claude Code asks for, the budget
    may exceed max_tokens). A thinking model thinks where its template makes it: "disabled" turns that off, the
    others leave it on, and the budget is not enforced (the reply's max_tokens bounds the thought)."""
    if not thinking:
        return
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise _refuse("thinking.type", f"must be enabled, disabled or adaptive, got {kind!r}", "invalid_value")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise _refuse("thinking.budget_tokens", f"must be an integer >= 1024, got {budget!r}", "invalid_value")


CONTEXT_EDITS = ("clear_tool_uses_20250919", "clear_thinking_20251015")


def _check_context_management(management: dict[str, Any] | None) -> None:
    """Context editing (Claude Code sends it): the known edits are accepted and none is applied. Earlier turns'
    thinking reaches the prompt only where the template keeps it (the current tool loop), and old tool results
    are kept, since the whole history is bounded by the context (a longer one is a 400) and the prompt cache
    makes resending it cheap."""
    if management is None:
        return
    edits = management.get("edits", [])
    if set(management) - {"edits"} or not isinstance(edits, list):
        raise _refuse("context_management", "must be {\"edits\": [...]}", "invalid_value")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in CONTEXT_EDITS:
            raise _refuse(f"context_management.edits.{i}.type", f"must be one of {', '.join(CONTEXT_EDITS)}, got {kind!r}",
                          "invalid_value")


# Claude Code's first system line: "x-anthropic-billing-header: cc_version=...; cc_entrypoint=cli; cch=a5145;"
# Its cch changes on every request, so left in the prompt it would end every cached prefix at the first line.
_BILLING_HEADER = re.compile(r"^x-anthropic-billing-header:(?:\s*[\w.-]+=[^;\n]*;)*[ \t]*\n?")


def _without_billing_header(system: str) -> str:
    """The system prompt without Claude Code's billing header, which is for Anthropic's accounting, not the model."""
    return _BILLING_HEADER.sub("", system, count=1)


def _anthropic_text(content: str | list[AnthropicBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if block.type != "text":
            raise _refuse(f"{param}.{i}.type", f"content block {block.type!r} is not supported here: text only")
        texts.append(block.text or "")
    return "".join(texts)


def _anthropic_message(m: AnthropicMessage, param: str, ids: set[str], origins: dict[str, str], at: int,
                       ) -> list[Message]:
    """One Anthropic message as chat messages (the first of them the chat's message `at`, each one's origin
    noted in `origins`): an assistant's tool_use blocks become its tool_calls, a user's tool_result blocks
    become tool messages (before the user's own text, as they answer the previous turn)."""
    origins[f"messages.{at}"] = param
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    if m.role == "system":
        return [{"role": "system", "content": _anthropic_text(m.content, param)}]
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[Message] = []
    for i, block in enumerate(m.content):
        where = f"{param}.{i}"
        data = block.model_dump()
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "tool_use" and m.role == "assistant":
            if not isinstance(data.get("input"), dict):
                raise _refuse(f"{where}.input", "a tool_use block needs its input object", "invalid_value")
            if not isinstance(data.get("id"), str) or not data["id"]:
                raise _refuse(f"{where}.id", "a tool_use block needs its id", "invalid_value")
            if not isinstance(data.get("name"), str) or not data["name"]:
                raise _refuse(f"{where}.name", "a tool_use block needs the tool's name", "invalid_value")
            ids.add(data["id"])
            origins[f"messages.{at}.tool_calls.{len(calls)}"] = where  # the message's index is fixed below
            calls.append({"id": data["id"], "type": "function",
                          "function": {"name": data.get("name"), "arguments": data["input"]}})
        elif block.type == "thinking" and m.role == "assistant":
            if not isinstance(data.get("thinking"), str):
                raise _refuse(f"{where}.thinking", "a thinking block needs its thinking text", "invalid_value")
            thoughts.append(data["thinking"])  # the template decides whether it is rendered
        elif block.type == "redacted_thinking" and m.role == "assistant":
            continue  # Anthropic's encrypted thinking: nothing a local model could read
        elif block.type == "tool_result" and m.role == "user":
            if data.get("tool_use_id") not in ids:
                raise _refuse(f"{where}.tool_use_id", f"no earlier tool_use block has the id {data.get('tool_use_id')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(results)}"] = where
            results.append({"role": "tool", "tool_call_id": data.get("tool_use_id"),
                            "content": _tool_result_text(data.get("content"), f"{where}.content")})
        else:
            raise _refuse(f"{where}.type", f"content block {block.type!r} is not supported in a {m.role} message: "
                          "text, tool_use and thinking (assistant) and tool_result (user) are")
    out, text = results, "".join(texts)
    if results:  # the message itself comes after its tool results
        for j in range(len(calls)):
            origins[f"messages.{at + len(results)}.tool_calls.{j}"] = origins.pop(f"messages.{at}.tool_calls.{j}")
        origins[f"messages.{at + len(results)}"] = param
    thought = {"reasoning_content": "\n".join(thoughts)} if any(thoughts) else {}
    if calls:
        out.append({"role": "assistant", "content": text, "tool_calls": calls, **thought})
    elif texts or thought or not results:
        out.append({"role": m.role, "content": text, **thought})
    return out


def _tool_result_text(content: Any, param: str) -> str:
    """A tool_result's content: a string, or text blocks (joined); images are refused."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _refuse(param, "must be a string or a list of text blocks", "invalid_value")
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise _refuse(f"{param}.{i}.type", "tool results are text only here")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _anthropic_tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """An Anthropic client tool ({name, description, input_schema}) in the OpenAI shape the Session takes."""
    if tool.get("type") not in (None, "custom"):
        raise _refuse(f"{param}.type", f"server and built-in tools ({tool.get('type')!r}) are not supported: "
                      "client tools with an input_schema are")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
    if unknown:
        raise _refuse(f"{param}.{sorted(unknown)[0]}", "not supported")
    if not isinstance(tool.get("input_schema"), dict):
        raise _refuse(f"{param}.input_schema", "a client tool needs its input_schema object", "invalid_value")
    function = {"name": tool.get("name"), "parameters": tool["input_schema"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    return {"type": "function", "function": function}


def _anthropic_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as the OpenAI one, and whether parallel calls are allowed."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    parallel = False if choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise _refuse("tool_choice.name", "a 'tool' tool_choice needs the tool's name", "invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _refuse("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}", "invalid_value")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")  # OpenAI's


def template_variables(given: dict[str, Any] | None, effort: str | None, effort_param: str) -> dict[str, Any]:
    """The chat template's variables for a request: `chat_template_kwargs`, then OpenAI's reasoning effort over
    them, as upstream llama-server reads it ("none": enable_thinking false; another: the template's
    reasoning_effort)."""
    out = dict(given or {})
    if effort is not None:
        if effort not in REASONING_EFFORTS:
            raise _refuse(effort_param, f"must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}", "invalid_value")
        if effort == "none":
            out["enable_thinking"] = False
        else:
            out["reasoning_effort"] = effort
    try:
        return check_chat_template_kwargs(out)
    except SettingError as e:
        raise _refuse(e.field, e.problem, "invalid_value") from None


def _constraint(kind: str, source: Any, param: str) -> dict[str, Any]:
    """A grammar / json_schema setting, compiled here so that a bad one is a 400 naming the request's field."""
    try:
        GenerationConfig(**{kind: source})
    except SettingError as e:
        raise _refuse(param, e.problem, "invalid_value") from None
    return {kind: source, CONSTRAINT_FIELD: param}


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's response_format as a constraint; json_schema is enforced whether or not `strict` is set."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return _constraint("json_schema", fmt.get("schema") or {"type": "object"}, "response_format.schema")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise _refuse("response_format.json_schema.schema", "a json_schema response_format needs its 'schema' object",
                          "invalid_value")
        return _constraint("json_schema", spec["schema"], "response_format.json_schema.schema")
    raise _refuse("response_format.type", f"must be text, json_object or json_schema, got {kind!r}", "invalid_value")


def _anthropic_format(fmt: dict[str, Any], param: str) -> dict[str, Any]:
    """Anthropic's output format ({"type": "json_schema", "schema": {...}}) as a constraint."""
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise _refuse(f"{param}.type", "must be {'type': 'json_schema', 'schema': {...}}", "invalid_value")
    return _constraint("json_schema", fmt["schema"], f"{param}.schema")


def _check_choices(req: ChatCompletionRequest | CompletionRequest) -> None:
    """n and best_of: one choice per request, said why."""
    for name in ("n", "best_of"):
        got = getattr(req, name, None)
        if got not in (None, 1):
            raise _refuse(name, f"one choice per request (got {got}): each choice is a whole generation on a slot "
                          "of its own; send separate requests, which reuse the cached prompt")


def _penalties(req: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The OpenAI penalties and logit_bias (token ids as strings) as GenerationConfig settings (checked there, a
    bad one a 400 naming it)."""
    if req.logit_bias_type not in (None, "input_ids"):
        raise _refuse("logit_bias_type", "only token ids are supported as logit_bias keys ('input_ids')")
    return {
        "presence_penalty": float(req.presence_penalty or 0.0), "frequency_penalty": float(req.frequency_penalty or 0.0),
        "logit_bias": dict(req.logit_bias or {}),
    }


def _max_tokens(n: int | None) -> dict[str, Any]:
    """A request's reply length; none named (or 0, llama_cpp's "no limit") leaves the server's --max-tokens.
    The engine clamps it to what the context has left."""
    return {"max_tokens": n} if n else {}
