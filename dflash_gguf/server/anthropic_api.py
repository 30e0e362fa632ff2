"""The Anthropic Messages request and its translation into a Job (`messages_job`), named back in its terms.

Every field the anthropic 2.x SDK sends is acted on, accepted as neutral or refused by name. Tools are
client tools (name, description, input_schema), their calls tool_use blocks; tool_result blocks become tool
messages. Structured output: `output_config.format` (and its earlier spelling `output_format`) becomes the
Session's json_schema constraint. output_config.effort, metadata, cache_control, service_tier and the like
change nothing about a local model's reply and are accepted as neutral. What Claude Code adds is accepted
too: `thinking` (checked; "disabled" turns the template's thinking off, the others leave it as the template
has it), `context_management` (checked, not applied), earlier turns' thinking blocks (given to the template
as the turn's reasoning_content, which thinking templates keep for the current tool loop only) and the
billing header that opens its system prompt (removed: its per-request stamp would end every cached prefix
at the first line).
"""

from __future__ import annotations

import re
from typing import Any, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from .errors import Terms
from .fields import declared
from .schemas import Job, Message, constraint_setting, refuse, refuse_unencodable, settings

# the chat request's paths in Anthropic's terms (a message's origin ends where \0 stands: errors.Terms)
TERMS = Terms("anthropic", (
    (r"^tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"),
    (r"^tools\.(\d+)\.function\.", r"tools.\1."),
    (r"^tool_choice\.function\.name", "tool_choice.name"),
    (r"\0(?:\.tool_calls\.\d+)?\.function\.arguments.*", ".input"),  # a tool_use block's
    (r"\0(?:\.tool_calls\.\d+)?\.function\.name", ".name"),
    (r"\0(?:\.tool_calls\.\d+)?\.id", ".id"),
    (r"\0\.tool_call_id", ".tool_use_id"),  # a tool_result block's
    (r"\0\..*", ""),
))


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
    """POST /v1/messages. Every field the anthropic 2.x SDK sends is acted on (max_tokens, stop_sequences and
    the sampling ones declared in fields.FIELDS), accepted as neutral or refused by name in messages_job; a field this model does not
    declare is a 400 naming it, never dropped."""

    model_config = ConfigDict(extra="forbid")
    model: str
    messages: List[AnthropicMessage] = Field(min_length=1)
    system: Optional[Union[str, List[AnthropicBlock]]] = None
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


def messages_job(req: MessagesRequest) -> Job:
    refuse_unencodable(req)
    tools = [_anthropic_tool(t, f"tools.{i}") for i, t in enumerate(req.tools)] if req.tools else None
    tool_choice, parallel = _anthropic_tool_choice(req.tool_choice)
    output = req.output_config or {}
    if set(output) - {"format", "effort"}:
        raise refuse(f"output_config.{sorted(set(output) - {'format', 'effort'})[0]}", "not supported")
    if output.get("format") is not None and req.output_format is not None:
        raise refuse("output_format", "give output_config.format or output_format, not both", "invalid_value")
    fmt, where = (output.get("format"), "output_config.format") if output.get("format") else (req.output_format, "output_format")
    constraint = _anthropic_format(fmt, where) if fmt is not None else {}
    _check_thinking(req.thinking)
    thinking_off = {"enable_thinking": False} if (req.thinking or {}).get("type") == "disabled" else {}
    _check_context_management(req.context_management)
    if req.container is not None:
        raise refuse("container", "code-execution containers are not supported")
    messages: list[Message] = []
    origins: dict[str, str] = {}
    if req.system:
        origins["messages.0"] = "system"
        messages.append({"role": "system", "content": _without_billing_header(_anthropic_text(req.system, "system"))})
    ids: set[str] = set()  # the tool_use ids so far: a tool_result answers one of them
    for i, m in enumerate(req.messages):
        messages += _anthropic_message(m, f"messages.{i}.content", ids, origins, len(messages))
    gen = settings(req, "anthropic") | constraint
    return Job(messages, None, gen, req.stream, True,
               tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel, chat_template_kwargs=thinking_off,
               origins=origins, terms=TERMS)


def _check_thinking(thinking: dict[str, Any] | None) -> None:
    """Extended thinking as Anthropic checks it (with interleaved thinking, which Claude Code asks for, the budget
    may exceed max_tokens). A thinking model thinks where its template makes it: "disabled" turns that off, the
    others leave it on, and the budget is not enforced (the reply's max_tokens bounds the thought)."""
    if not thinking:
        return
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled", "adaptive"):
        raise refuse("thinking.type", f"must be enabled, disabled or adaptive, got {kind!r}", "invalid_value")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < 1024:
            raise refuse("thinking.budget_tokens", f"must be an integer >= 1024, got {budget!r}", "invalid_value")


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
        raise refuse("context_management", "must be {\"edits\": [...]}", "invalid_value")
    for i, edit in enumerate(edits):
        kind = edit.get("type") if isinstance(edit, dict) else None
        if kind not in CONTEXT_EDITS:
            raise refuse(f"context_management.edits.{i}.type", f"must be one of {', '.join(CONTEXT_EDITS)}, got {kind!r}",
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
            raise refuse(f"{param}.{i}.type", f"content block {block.type!r} is not supported here: text only")
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
                raise refuse(f"{where}.input", "a tool_use block needs its input object", "invalid_value")
            if not isinstance(data.get("id"), str) or not data["id"]:
                raise refuse(f"{where}.id", "a tool_use block needs its id", "invalid_value")
            if not isinstance(data.get("name"), str) or not data["name"]:
                raise refuse(f"{where}.name", "a tool_use block needs the tool's name", "invalid_value")
            ids.add(data["id"])
            origins[f"messages.{at}.tool_calls.{len(calls)}"] = where  # the message's index is fixed below
            calls.append({"id": data["id"], "type": "function",
                          "function": {"name": data.get("name"), "arguments": data["input"]}})
        elif block.type == "thinking" and m.role == "assistant":
            if not isinstance(data.get("thinking"), str):
                raise refuse(f"{where}.thinking", "a thinking block needs its thinking text", "invalid_value")
            thoughts.append(data["thinking"])  # the template decides whether it is rendered
        elif block.type == "redacted_thinking" and m.role == "assistant":
            continue  # Anthropic's encrypted thinking: nothing a local model could read
        elif block.type == "tool_result" and m.role == "user":
            if data.get("tool_use_id") not in ids:
                raise refuse(f"{where}.tool_use_id", f"no earlier tool_use block has the id {data.get('tool_use_id')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(results)}"] = where
            results.append({"role": "tool", "tool_call_id": data.get("tool_use_id"),
                            "content": _tool_result_text(data.get("content"), f"{where}.content")})
        else:
            raise refuse(f"{where}.type", f"content block {block.type!r} is not supported in a {m.role} message: "
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
        raise refuse(param, "must be a string or a list of text blocks", "invalid_value")
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text":
            raise refuse(f"{param}.{i}.type", "tool results are text only here")
        texts.append(str(block.get("text", "")))
    return "".join(texts)


def _anthropic_tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    """An Anthropic client tool ({name, description, input_schema}) in the OpenAI shape the Session takes."""
    if tool.get("type") not in (None, "custom"):
        raise refuse(f"{param}.type", f"server and built-in tools ({tool.get('type')!r}) are not supported: "
                      "client tools with an input_schema are")
    unknown = set(tool) - {"type", "name", "description", "input_schema", "cache_control", "strict"}
    if unknown:
        raise refuse(f"{param}.{sorted(unknown)[0]}", "not supported")
    if not isinstance(tool.get("input_schema"), dict):
        raise refuse(f"{param}.input_schema", "a client tool needs its input_schema object", "invalid_value")
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
            raise refuse("tool_choice.name", "a 'tool' tool_choice needs the tool's name", "invalid_value")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise refuse("tool_choice.type", f"must be auto, any, tool or none, got {kind!r}", "invalid_value")


def _anthropic_format(fmt: dict[str, Any], param: str) -> dict[str, Any]:
    """Anthropic's output format ({"type": "json_schema", "schema": {...}}) as a constraint."""
    if fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise refuse(f"{param}.type", "must be {'type': 'json_schema', 'schema': {...}}", "invalid_value")
    return constraint_setting("json_schema", fmt["schema"], f"{param}.schema")
