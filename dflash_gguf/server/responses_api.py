"""The Responses request (what Codex-style clients speak) and its translation into a Job (`job`), named back
in its terms; the stored responses a request may continue.

A request becomes the same chat Job as /v1/chat/completions: `instructions` is the system message,
`input` the turns (a string, or message / function_call / function_call_output / reasoning items),
`text.format` the structured-output constraint, `tools` (function tools, and those inside a namespace) the
Session's tools. A stored response (`store`, on by default as in OpenAI's API) keeps its conversation, so
`previous_response_id` continues it; the newest STORED_RESPONSES live in this process. A reasoning item sent
back in `input` is given to the template as the next assistant turn's reasoning_content; `reasoning.effort`
"none" turns the template's thinking off.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import APIError, Terms
from .fields import declared
from .schemas import Job, Message, constraint_setting, refuse, refuse_unencodable, settings, template_variables

# the chat request's paths in the Responses API's terms (an item's origin ends where \0 stands: errors.Terms)
TERMS = Terms("responses", (
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^tool_choice\.function\.name", "tool_choice.name"),
    (r"\0(?:\.tool_calls\.\d+)?\.function\.", "."),  # a function_call item's
    (r"\0(?:\.tool_calls\.\d+)?\.id", ".call_id"),
    (r"\0\.tool_call_id", ".call_id"),  # a function_call_output item's
    (r"\0\.content", ".content"),
    (r"\0\..*", ""),
    (r"^messages\b.*", "input"),  # the whole conversation (its length, the template's refusal)
))


STORED_RESPONSES = 1024  # the newest stored responses kept for previous_response_id / GET; older ones are forgotten


# `include` values that ask for nothing this server could add (a local model has no encrypted reasoning)
NEUTRAL_INCLUDES = frozenset({"reasoning.encrypted_content"})


REASONING_KEYS = frozenset({"effort", "summary", "generate_summary"})  # summary: accepted, none is written


_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(BaseModel):
    """POST /v1/responses. A field this model does not declare is a 400 naming it; declared ones are acted
    on, accepted as neutral (they change nothing about a local model's reply) or refused by name in job()."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    input: Union[str, List[dict[str, Any]]] = Field(min_length=1)
    instructions: Optional[str] = None
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    text: Optional[dict[str, Any]] = None
    tools: Optional[List[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    background: Optional[bool] = None
    include: Optional[List[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[dict[str, Any]] = None  # effort: "none" turns thinking off; summary: none is written
    # neutral: echoed or ignored, the reply is the same
    metadata: Optional[dict[str, str]] = None
    stream_options: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    user: Optional[str] = None
    client_metadata: Optional[dict[str, Any]] = None  # Codex's ids for its own logs


ResponsesRequest = declared(ResponsesRequest, "responses")  # type: ignore[misc]  # fields.FIELDS: sampling, max_output_tokens


class ResponseStore:
    """The stored responses of this process, newest last: each with the conversation it ended."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[Message]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[Message]) -> None:
        self._entries[response["id"]] = (response, conversation)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[Message]]:
        try:
            return self._entries[response_id]
        except KeyError:
            raise APIError(404, f"no stored response with id {response_id!r} (not stored, deleted, or from before "
                           "a restart)", param=param, code="response_not_found") from None

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


def job(req: ResponsesRequest, store: ResponseStore) -> tuple[Job, list[Message]]:
    """The chat Job for a request, and the conversation it continues (previous turns, then this input)."""
    refuse_unencodable(req)
    if req.background:
        raise refuse("background", "background responses are not supported: stream it or wait for it")
    if req.truncation == "auto":
        raise refuse("truncation", "'auto' would drop turns silently; a prompt over the context is a 400 instead")
    unknown = sorted(set(req.include or ()) - NEUTRAL_INCLUDES)
    if unknown:
        raise refuse("include", f"{unknown[0]!r} is not served here")
    conversation: list[Message] = []
    if req.previous_response_id is not None:
        _, conversation = store.get(req.previous_response_id, "previous_response_id")
        conversation = [m for m in conversation if m["role"] != "system"]  # instructions are not carried over
    if req.instructions:
        conversation = [{"role": "system", "content": req.instructions}, *conversation]
    origins = {f"messages.{k}": "previous_response_id" for k in range(len(conversation))}
    if req.instructions:
        origins["messages.0"] = "instructions"
    conversation += _input_messages(req.input, {c["id"] for m in conversation for c in m.get("tool_calls", ())},
                                    origins, len(conversation))
    gen = settings(req, "responses") | _text_format(req.text)
    reasoning = req.reasoning or {}
    unknown = sorted(set(reasoning) - REASONING_KEYS)
    if unknown:
        raise refuse(f"reasoning.{unknown[0]}", "not supported")
    return Job(conversation, None, gen, req.stream, True, tools=function_tools(req.tools)[0],
               tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
               chat_template_kwargs=template_variables(None, reasoning.get("effort"), "reasoning.effort"),
               origins=origins, terms=TERMS), conversation


# Hosted tools the client may list that this server does not run: the model is not offered them (OpenAI's own
# API runs them itself; Codex lists web_search by default). Any other hosted tool is refused by name.
NOT_OFFERED_TOOLS = frozenset({"web_search", "web_search_preview"})


def function_tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """Responses function tools ({type, name, parameters, ...}) in the chat shape the Session checks, and the
    namespace of each function that came inside a `namespace` tool (Codex groups its sub-agent tools so): the
    model sees them as plain functions, and a call of one names its namespace in the function_call item."""
    if not tools:
        return None, {}
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}

    def function(tool: dict[str, Any], where: str) -> None:
        if tool.get("type") != "function":
            raise refuse(f"{where}.type", f"only function tools are served here, got {tool.get('type')!r}")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})

    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in NOT_OFFERED_TOOLS:
            continue
        if kind != "namespace":
            function(tool, f"tools.{i}")
            continue
        name, inner = tool.get("name"), tool.get("tools")
        if not isinstance(name, str) or not name:
            raise refuse(f"tools.{i}.name", "a namespace tool needs its name", "invalid_value")
        if not isinstance(inner, list):
            raise refuse(f"tools.{i}.tools", "a namespace tool needs its list of function tools", "invalid_value")
        for j, t in enumerate(inner):
            function(t if isinstance(t, dict) else {}, f"tools.{i}.tools.{j}")
            namespaces[str(t.get("name"))] = name
    return out or None, namespaces


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise refuse("tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                  "invalid_value")


def _input_messages(items: str | list[dict[str, Any]], calls: set[str], origins: dict[str, str], at: int,
                    ) -> list[Message]:
    """Input items as chat messages (the first the chat's message `at`, the item each came from noted in
    `origins`): function_call items join the assistant turn before them as its tool calls, a
    function_call_output is the tool turn answering one of `calls` (those so far, theirs included), a
    reasoning item is the thought of the assistant turn after it."""
    if isinstance(items, str):
        origins[f"messages.{at}"] = "input"
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    thought: list[str] = []  # reasoning items waiting for their assistant turn
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise refuse(f"input.{i}.role", f"must be user, assistant, system or developer, got {item.get('role')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(out)}"] = f"input.{i}"
            out.append({"role": role, "content": _parts_text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = _history_call(item, f"input.{i}")
            calls.add(call["id"])
            if not (out and out[-1]["role"] == "assistant" and not any(thought)):
                origins[f"messages.{at + len(out)}"] = f"input.{i}"
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            origins[f"messages.{at + len(out) - 1}.tool_calls.{len(out[-1].setdefault('tool_calls', []))}"] = f"input.{i}"
            out[-1]["tool_calls"].append(call)
        elif kind == "reasoning":
            thought.append(_reasoning_text(item, f"input.{i}"))
            continue
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise refuse(f"input.{i}.call_id", f"no earlier function_call has the call_id {item.get('call_id')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(out)}"] = f"input.{i}"
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item.get("output"), f"input.{i}.output")})
        else:
            raise refuse(f"input.{i}.type", f"input item {kind!r} is not supported: messages, function calls and "
                          "reasoning are")
        text = "\n".join(t for t in thought if t)
        if text and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = text
        thought = []
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thought: its reasoning_text content (what this server returns); an item with only
    encrypted content or a summary (another provider's) has none a local model could read."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise refuse(f"{where}.content", "must be a list of reasoning_text parts", "invalid_value")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise refuse(f"{where}.content.{j}", "must be {'type': 'reasoning_text', 'text': ...}", "invalid_value")
    return "".join(part["text"] for part in content)


def _history_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or not item[name]:
            raise refuse(f"{where}.{name}", f"a function_call item needs its {name} (a string)", "invalid_value")
    try:
        json.loads(item["arguments"])
    except ValueError:
        raise refuse(f"{where}.arguments", "must be the call's arguments as JSON text", "invalid_value") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise refuse(param, "must be a string or a list of text parts", "invalid_value")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise refuse(f"{param}.{i}.type", f"content part {kind!r} is not supported: text only")
        texts.append(part.get("text") or "")
    return "".join(texts)


def _text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` as a constraint: json_schema (enforced, strict or not) or json_object."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return constraint_setting("json_schema", {"type": "object"}, "text.format")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise refuse("text.format.schema", "a json_schema format needs its 'schema' object", "invalid_value")
        return constraint_setting("json_schema", fmt["schema"], "text.format.schema")
    raise refuse("text.format.type", f"must be text, json_object or json_schema, got {kind!r}", "invalid_value")
