"""The OpenAI chat and completions requests: llama_cpp.server's types extended with what newer clients send,
and their translation into a Job (`chat_job`, `completion_job`).

What the Session cannot do is refused with a 400 naming the field, never dropped: n > 1 (one choice per
request) and the legacy `functions` / `function_call` (use tools / tool_choice). Tools are acted on where
the model's chat template takes them: the Session renders them, holds each call to its tool's schema and
the route returns the calls as tool_calls. The fields of fields.FIELDS (sampling, the penalties, logit_bias
as token ids, stop, max_tokens) are acted on through the speculative loop, and so are logprobs /
top_logprobs (the target's log-softmax). Structured output is acted on: `grammar` (GBNF) and
`response_format` (json_object, json_schema) become the Session's grammar / json_schema constraint.
Parameters left at their neutral value are accepted, since clients send the defaults; metadata,
service_tier and the like change nothing about a local model's reply and are accepted as neutral.
Reasoning: `reasoning_effort` "none" sets the template's enable_thinking to false, `chat_template_kwargs`
(llama-server's and vLLM's) sets template variables, `reasoning_format` "none" leaves a thinking model's
thought in the content instead of splitting it off. OpenAI's field paths are the chat request's own.
"""

from __future__ import annotations

from typing import Annotated, Any, List, Literal, Optional, Union

import llama_cpp
from llama_cpp.server.types import CreateChatCompletionRequest, CreateCompletionRequest
from pydantic import BaseModel, ConfigDict, Field
from typing_extensions import NotRequired, TypedDict

from .errors import Terms
from .fields import declared
from .schemas import (Job, Message, check_neutral, constraint_setting, refuse, refuse_unencodable, settings,
                      template_variables)

CHAT_TERMS = Terms("chat")  # the chat request's message paths are OpenAI chat's
COMPLETION_TERMS = Terms("completions")


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
    """POST /v1/chat/completions: llama_cpp.server's request plus what the openai SDK sends, and the fields
    of fields.FIELDS; an undeclared field is a 400 naming it, never dropped."""

    model_config = ConfigDict(extra="forbid")

    messages: List[_OpenAIMessage] = Field(min_length=1)
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
    """POST /v1/completions: llama_cpp.server's request plus stream_options and the fields of fields.FIELDS;
    an undeclared field is a 400."""

    model_config = ConfigDict(extra="forbid")

    prompt: Union[str, List[str]] = Field(description="The prompt to complete (one).")
    stream_options: Optional[StreamOptions] = None
    logprobs: Optional[int] = _N_LOGPROBS


CompletionRequest = declared(CompletionRequest, "completions")  # type: ignore[misc]


def _text_parts(content: Any, param: str) -> str:
    """An OpenAI message content: a string, or a list of text parts (joined); images are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.get("type") != "text":
            raise refuse(f"{param}.{i}.type", f"content part {part.get('type')!r} is not supported: text only")
        texts.append(part.get("text", ""))
    return "".join(texts)


def chat_job(req: ChatCompletionRequest) -> Job:
    refuse_unencodable(req)
    for legacy, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, legacy) is not None:
            raise refuse(legacy, f"the legacy function-calling field is not supported: use {instead}")
    _check_choices(req)
    _check_bias_keys(req)
    check_neutral(req, {
        "mirostat_mode": 0, "min_tokens": 0,
        "store": False, "modalities": (["text"],), "audio": None, "web_search_options": None,
    })
    if req.top_logprobs is not None and not req.logprobs:
        raise refuse("top_logprobs", "needs logprobs: true", "invalid_value")
    constraint = _response_format(req.response_format)
    if req.grammar is not None:
        if constraint:
            raise refuse("grammar", "give either grammar or a JSON response_format, not both", "invalid_value")
        constraint = constraint_setting("grammar", req.grammar, "grammar")
    messages: list[Message] = []
    for i, m in enumerate(req.messages):
        role = m["role"]
        if role == "function" or m.get("function_call"):
            raise refuse(f"messages.{i}", "legacy function messages are not supported: use tool_calls and tool "
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
    gen = settings(req, "chat") | constraint
    gen["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return Job(messages, None, gen, req.stream, bool(req.stream_options and req.stream_options.include_usage),
               tools=[dict(t) for t in req.tools] if req.tools else None, tool_choice=req.tool_choice,
               parallel_tool_calls=req.parallel_tool_calls,
               chat_template_kwargs=template_variables(req.chat_template_kwargs, req.reasoning_effort, "reasoning_effort"),
               split_thought=req.reasoning_format != "none", terms=CHAT_TERMS)


def completion_job(req: CompletionRequest) -> Job:
    refuse_unencodable(req)
    _check_choices(req)
    _check_bias_keys(req)
    check_neutral(req, {"mirostat_mode": 0, "min_tokens": 0, "echo": False, "suffix": None})
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise refuse("prompt", f"one prompt per request (got {len(prompt)})")
        prompt = prompt[0]
    if not prompt:
        raise refuse("prompt", "the prompt is empty", "invalid_value")
    gen = settings(req, "completions")
    gen["logprobs"] = req.logprobs
    if req.grammar is not None:
        gen |= constraint_setting("grammar", req.grammar, "grammar")
    return Job(None, prompt, gen, req.stream,
               bool(req.stream_options and req.stream_options.include_usage), terms=COMPLETION_TERMS)


def _response_format(fmt: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's response_format as a constraint; json_schema is enforced whether or not `strict` is set."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text"):
        return {}
    if kind == "json_object":
        return constraint_setting("json_schema", fmt.get("schema") or {"type": "object"}, "response_format.schema")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise refuse("response_format.json_schema.schema", "a json_schema response_format needs its 'schema' object",
                          "invalid_value")
        return constraint_setting("json_schema", spec["schema"], "response_format.json_schema.schema")
    raise refuse("response_format.type", f"must be text, json_object or json_schema, got {kind!r}", "invalid_value")


def _check_choices(req: ChatCompletionRequest | CompletionRequest) -> None:
    """n and best_of: one choice per request, said why."""
    for name in ("n", "best_of"):
        got = getattr(req, name, None)
        if got not in (None, 1):
            raise refuse(name, f"one choice per request (got {got}): each choice is a whole generation on a slot "
                          "of its own; send separate requests, which reuse the cached prompt")


def _check_bias_keys(req: ChatCompletionRequest | CompletionRequest) -> None:
    """logit_bias keys are token ids (as strings), not token texts."""
    if req.logit_bias_type not in (None, "input_ids"):
        raise refuse("logit_bias_type", "only token ids are supported as logit_bias keys ('input_ids')")
