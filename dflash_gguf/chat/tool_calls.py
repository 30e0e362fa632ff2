"""Tool calling: the tool definitions rendered by the GGUF's own chat template, the calls constrained and parsed.

Each template family that takes tools writes its calls in its own syntax (upstream llama.cpp's common/chat.cpp
tells them apart by the same markers). A family here knows three things: how to recognise its template, the
grammar of a call (each tool's arguments held to that tool's JSON schema), and how to read calls back out of
the reply, whole or as it streams. With tool_choice "auto" the grammar is lazy: free text until the model
writes the family's opener, then the call is constrained (llguidance's lazy lexemes); "required" or a named
tool constrains from the first token. The grammar goes through GenerationConfig.grammar, so speculation stays
on: the decode loop masks verify rows and cuts drafts the grammar forbids, and forced tokens are free drafts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..checks import SettingError
from ..constraints import check_schema_depth, compile_grammar
from .families import FAMILIES, detect_family, no_tools_reason
from .families.base import NAME, Family, tool_schema

__all__ = [
    "FAMILIES", "CallDelta", "Family", "ToolCall", "ToolError", "ToolPlan", "call_arguments", "detect_family",
    "no_tools_reason", "openai_delta", "plan_tools", "prepare_messages",
]



class ToolError(SettingError):
    """Bad tools, tool_choice or tool messages, naming the field (`tools[0].function.name`, ...)."""


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its id, the tool's name and the arguments (valid under the tool's schema)."""

    id: str
    name: str
    arguments: dict[str, Any]

    @property
    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def openai(self) -> dict[str, Any]:
        """llama_cpp / OpenAI's `message.tool_calls` item."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments_json}}


@dataclass
class CallDelta:
    """A streamed piece of a call: its start (id and name) and/or a fragment of its arguments' JSON text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


# -- a request's tools ---------------------------------------------------------------------------------------
# strict: every call follows its tool's schema here, strict or not
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


def _function(tool: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool ({"type": "function", "function": {...}}) as its checked function dict."""
    if not isinstance(tool, Mapping):
        raise ToolError(where, f"must be an object, got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise ToolError(f"{where}.type", f"only function tools are supported, got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, Mapping):
        raise ToolError(f"{where}.function", "a function tool needs its 'function' object")
    unknown = sorted(set(tool) - {"type", "function"}) + [f"function.{k}" for k in sorted(set(fn) - _FUNCTION_KEYS)]
    if unknown:
        raise ToolError(f"{where}.{unknown[0]}", "not a tool field this library knows")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ToolError(f"{where}.function.name", "a tool needs a non-empty name")
    if not NAME.match(name):
        raise ToolError(f"{where}.function.name", f"must be 1-64 letters, digits, '_', '.' or '-', got {name!r}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, Mapping):
        raise ToolError(f"{where}.function.parameters", "must be a JSON schema object")
    try:
        check_schema_depth(params)
        compile_grammar("json_schema", tool_schema(params))
    except (ValueError, TypeError) as e:
        raise ToolError(f"{where}.function.parameters", f"the schema does not compile: {e}") from None
    out = {"name": name, "parameters": dict(params)}
    if isinstance(fn.get("description"), str):
        out["description"] = fn["description"]
    return out


@dataclass(frozen=True)
class ToolPlan:
    """One generation's tools: what the template renders, the grammar the reply follows (None: unconstrained,
    tool_choice "none") and the family that reads the calls back."""

    family: Family
    tools: list[dict[str, Any]]  # OpenAI-shaped, as templates expect them
    grammar: str | None
    parallel: bool
    forced: bool = False  # the reply is calls from its first token ("required" or a named tool), not free text

    @property
    def parses(self) -> bool:
        return self.grammar is not None

    @property
    def schemas(self) -> dict[str, Any]:
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}


def plan_tools(template: str | None, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
               ) -> ToolPlan | None:
    """Check a request's tools against the model's template; None when it brings no tools (and chooses none).

    tool_choice: "auto" (default), "none", "required", or {"type": "function", "function": {"name": ...}}.
    """
    if tools is None or (isinstance(tools, Sequence) and not isinstance(tools, (str, bytes)) and not tools):
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice", "a tool_choice needs tools")
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ToolError("tools", "must be a list of tools")
    family = detect_family(template)
    if family is None:
        raise ToolError("tools", no_tools_reason(template))
    functions = [_function(t, f"tools[{i}]") for i, t in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) < len(names):
        raise ToolError("tools", f"tool names must differ, got {names}")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError("parallel_tool_calls", f"must be true or false, got {parallel_tool_calls!r}")
    parallel = family.parallel and parallel_tool_calls is not False
    choice = "auto" if tool_choice is None else tool_choice
    rendered = [{"type": "function", "function": f} for f in functions]
    if choice == "none":
        return ToolPlan(family, rendered, None, parallel)
    chosen = functions
    if isinstance(choice, Mapping):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise ToolError("tool_choice", "must be 'auto', 'none', 'required' or "
                                           "{'type': 'function', 'function': {'name': ...}}")
        chosen = [f for f in functions if f["name"] == name]
        if not chosen:
            raise ToolError("tool_choice.function.name", f"no tool is named {name!r} (tools: {', '.join(names)})")
    elif choice not in ("auto", "required"):
        raise ToolError("tool_choice", f"must be 'auto', 'none', 'required' or a named function, got {choice!r}")
    try:
        grammar = family.grammar(chosen, forced=choice != "auto", parallel=parallel)
        compile_grammar("grammar", grammar)
    except ValueError as e:
        raise ToolError("tools", f"the tools' call grammar does not compile: {e}") from None
    return ToolPlan(family, rendered, grammar, parallel, forced=choice != "auto")


def prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Messages as chat templates read them: an assistant's tool calls with their arguments as objects (the
    templates write them with tojson or iterate them), each tool result after the call it answers."""
    out: list[dict[str, Any]] = []
    ids: set[str] = set()
    for i, m in enumerate(messages):
        m = dict(m)
        calls = m.get("tool_calls")
        if calls:
            if not isinstance(calls, Sequence) or isinstance(calls, (str, bytes)):
                raise ToolError(f"messages[{i}].tool_calls", "must be a list of tool calls")
            m["tool_calls"] = [_history_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
            ids.update(c["id"] for c in m["tool_calls"])
            if m.get("content") is None:
                m["content"] = ""
        elif "tool_calls" in m:
            del m["tool_calls"]  # templates test for the key: an empty list means no calls
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str) or not call_id:
                raise ToolError(f"messages[{i}].tool_call_id", "a tool message needs the id of the call it answers")
            if call_id not in ids:
                raise ToolError(f"messages[{i}].tool_call_id", f"no earlier assistant tool call has the id {call_id!r}")
            if m.get("content") is None:
                m["content"] = ""
        out.append(m)
    return out


def _history_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ToolError(where, "a tool call needs its 'function' object")
    fn = call["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ToolError(f"{where}.function.name", "a tool call needs the tool's name")
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise ToolError(f"{where}.id", "a tool call needs an id (its result refers to it)")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolError(f"{where}.function.arguments", f"not valid JSON: {e}") from None
    if not isinstance(args, Mapping):
        raise ToolError(f"{where}.function.arguments", "must be a JSON object")
    return {"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": dict(args)}}


def call_arguments(text: str) -> dict[str, Any]:
    """A finished call's arguments (their JSON text, held to the tool's schema by the grammar) as a dict."""
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


def openai_delta(piece: str | CallDelta) -> dict[str, Any]:
    """A reply reader's answer piece as an OpenAI chat chunk's delta: content text, or one `tool_calls` entry (its
    first carries the id, type and name; the later ones fragments of the arguments' JSON)."""
    if isinstance(piece, str):
        return {"content": piece}
    entry: dict[str, Any] = {"index": piece.index}
    if piece.id is not None:
        entry |= {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": piece.arguments}}
    else:
        entry["function"] = {"arguments": piece.arguments}
    return {"tool_calls": [entry]}
