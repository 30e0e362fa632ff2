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
import re
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Sequence

from ..checks import SettingError
from ..constraints import check_schema_depth, compile_grammar, schema_text

__all__ = [
    "FAMILIES", "CallDelta", "Family", "ToolCall", "ToolError", "ToolPlan", "ToolStream", "detect_family",
    "no_tools_reason", "openai_delta", "plan_tools", "prepare_messages",
]

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function name; no escaping needed anywhere
WS = r"/[ \t\n]*/"


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


@dataclass
class _Parsed:
    """A reply read so far: the text around the calls, and each call's name and arguments text (the JSON
    text as far as it is written; `done` once it is whole)."""

    content: str
    calls: list[tuple[str, str, bool]] = field(default_factory=list)


# -- the families -------------------------------------------------------------------------------------------
def _lit(text: str) -> str:
    return json.dumps(text)


# calls are written as the templates write them in the history (tojson: ", " and ": "), with no stray whitespace;
# lenient: a keyword llguidance does not implement (propertyNames, ...) is left unenforced instead of failing the
# request, since agents send the schemas they have (the arguments still parse, and follow what is enforced)
_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ", "lenient": True}


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object leaves it unsaid (upstream llama.cpp's
    default for grammars too): a small model otherwise invents keys after the ones it was given."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v) for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: _closed(s) for name, s in schema[k].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def _tool_schema(schema: Mapping[str, Any]) -> str:
    """A tool's parameters as the JSON text its calls are constrained with."""
    return schema_text({**_closed(dict(schema)), "x-guidance": _LAYOUT})


def _json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + _tool_schema(schema)


def _args_after(text: str, pos: int) -> tuple[str, bool, int]:
    """The JSON value starting at text[pos:] as far as it is written, whether it is whole, and where it ends."""
    rest = text[pos:]
    stripped = rest.lstrip()
    try:
        _, end = json.JSONDecoder().raw_decode(stripped)
    except json.JSONDecodeError:
        return stripped, False, len(text)
    start = pos + len(rest) - len(stripped)
    return stripped[:end], True, start + end


def hold_back(text: str, marker: str) -> int:
    """Where the text may stop being content: before a suffix that could be the start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return len(text) - n
    return len(text)


class Family:
    """One template family's call syntax. Subclasses set the markers and write the grammar of one call."""

    name: str = ""
    opener: str = ""  # what starts a call (the lazy grammar's trigger); "" where a call is the whole reply
    parallel: bool = True  # the syntax (and its template) take several calls in one reply
    stops: tuple[str, ...] = ()  # the family's end-of-turn text, stop strings beside the template's

    def detect(self, template: str) -> bool:
        raise NotImplementedError

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        """The Lark body of one call to `tool` (a checked function dict), after the opener; rules it refers
        to are appended to `extra`."""
        raise NotImplementedError

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> str:
        """Lark for the reply: free text, or calls, the first opened by the opener (lazily unless forced)."""
        extra: list[str] = []
        rules = [f"c{i}: {self.call(t, extra)}" for i, t in enumerate(tools)] + extra
        call = "(" + " | ".join(f"c{i}" for i in range(len(tools))) + ")"
        opener = _lit(self.opener)
        if forced:
            first = f"{WS} {opener} {call}"
            more = f"({WS} {opener} {call})*" if parallel else ""
            start = f"start: {first} {more} TAIL"
        else:
            # a lazy lexeme: it ends where the opener first appears, and from there only a call is admitted
            rules.append(f"trig[lazy]: TEXT {opener}")
            start = f"start: TEXT | trig {call} " + ("(trig " + call + ")* " if parallel else "") + "TAIL"
        return "\n".join(["%llguidance {}", start, *rules, "TEXT: /(.|\\n)*/", "TAIL: /[ \\t\\n]{0,2}/", ""])

    def parse(self, text: str, schemas: Mapping[str, Any]) -> _Parsed:
        """The reply so far as content and calls (`schemas`: each tool's parameters, by name); what could
        still become an opener is held back."""
        at = text.find(self.opener)
        if at < 0:
            return _Parsed(text[: hold_back(text, self.opener)])
        return _Parsed(text[:at], self.calls(text, at, schemas))

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        raise NotImplementedError

    def call_id(self) -> str:
        return "call_" + secrets.token_hex(12)


class Hermes(Family):
    """Hermes 2 Pro / Qwen2.5 / Qwen3: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`."""

    name = "hermes"
    opener = "<tool_call>"
    stops = ("<|im_end|>",)
    _head = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:arguments|parameters)"\s*:')

    def detect(self, template: str) -> bool:
        # JSON inside the tags; GLM, Ling and Laguna (<arg_key>), MiniMax (<invoke>), Spark (a bare name) differ
        json_call = '{"name": "' in template or '{\\"name\\": ' in template
        return "<tool_call>" in template and json_call and not any(m in template for m in ("<arg_key>", "<invoke"))

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        head = f'\n{{"name": "{tool["name"]}", "arguments": '
        return f"{_lit(head)} {_json_rule(tool['parameters'])} {_lit('}' + chr(10) + '</tool_call>')}"

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        out = []
        while at >= 0:
            m = self._head.match(text, at + len(self.opener))
            if m is None:
                break
            args, done, end = _args_after(text, m.end())
            out.append((m.group(1), args, done))
            at = text.find(self.opener, end) if done else -1
        return out


class Qwen3Coder(Family):
    """Qwen3-Coder / Qwen3.5 XML: `<tool_call>\\n<function=name>\\n<parameter=x>\\nvalue\\n</parameter>\\n...`.

    A string parameter's value is raw text up to `\\n</parameter>`; any other is JSON. The arguments come
    back as JSON once the call is whole (the XML is not a prefix of it)."""

    name = "qwen3-coder"
    opener = "<tool_call>"
    stops = ("<|im_end|>",)
    _function = re.compile(r"\s*<function=([^>\n]*)>\n(.*?)</function>", re.S)
    _param = re.compile(r"<parameter=([^>\n]*)>\n(.*?)\n</parameter>\n?", re.S)

    def detect(self, template: str) -> bool:
        return "<tool_call>" in template and "<function=" in template and "<parameter=" in template

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        schema = tool["parameters"]
        props = schema.get("properties") if isinstance(schema.get("properties"), dict) else None
        parts = [_lit(f"\n<function={tool['name']}>\n")]
        if props is None:
            parts.append(f"({_lit('<parameter=')} /[A-Za-z0-9_.-]+/ {_lit('>' + chr(10))} {self._value({}, extra)})*")
        required = set(schema.get("required") or ())
        for pname, pschema in props.items() if props else ():
            if not NAME.match(pname):
                raise ValueError(f"parameter name {pname!r} cannot be written in this template's XML")
            one = f"{_lit(f'<parameter={pname}>' + chr(10))} {self._value(pschema, extra)}"
            parts.append(one if pname in required else f"({one})?")
        parts.append(_lit("</function>\n</tool_call>"))
        return " ".join(parts)

    @staticmethod
    def _value(schema: Any, extra: list[str]) -> str:
        """A parameter's value and its closing tag: JSON under its schema, or raw text (a string parameter)."""
        close = _lit("\n</parameter>\n")
        if isinstance(schema, dict) and schema.get("type") == "string" and "enum" in schema:
            return "(" + " | ".join(_lit(str(v)) for v in schema["enum"]) + f") {close}"
        if isinstance(schema, dict) and schema and schema.get("type") != "string":
            return f"{_json_rule(schema)} {close}"
        n = schema.get("maxLength") if isinstance(schema, dict) else None
        body = f"(.|\\n){{0,{int(n)}}}" if isinstance(n, int) and n >= 0 else "(.|\\n)*"
        rule = f"raw{len(extra) // 2}"
        # lazy: the value ends where its closing tag first appears, and it never holds the tag itself
        extra += [f"{rule.upper()}: /{body}/ & ~/(.|\\n)*<\\/parameter>(.|\\n)*/", f"{rule}[lazy]: {rule.upper()} {close}"]
        return rule

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        out = []
        while at >= 0:
            body = text[at + len(self.opener):]
            m = self._function.match(body)
            if m is None:
                head = re.match(r"\s*<function=([^>\n]*)>\n", body)
                if head:
                    out.append((head.group(1), "", False))
                break
            props = (schemas.get(m.group(1)) or {}).get("properties") or {}
            args = {p.group(1): self._read(p.group(2), props.get(p.group(1))) for p in self._param.finditer(m.group(2))}
            out.append((m.group(1), json.dumps(args, ensure_ascii=False), True))
            at = text.find(self.opener, at + len(self.opener) + m.end())
        return out

    @staticmethod
    def _read(value: str, schema: Any) -> Any:
        """A parameter's text as its value: raw for a string parameter (as the grammar wrote it), else JSON."""
        if isinstance(schema, dict) and schema.get("type") == "string":
            return value
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value


class Mistral(Family):
    """Mistral Nemo / Small: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 alphanumerics>"}, ...]`."""

    name = "mistral"
    opener = "[TOOL_CALLS]"
    _head = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:')

    def detect(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" not in template  # [ARGS]: Mistral Small 3.2's newer syntax

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        head = f'{{"name": "{tool["name"]}", "arguments": '
        return f'{_lit(head)} {_json_rule(tool["parameters"])} {_lit(", " + chr(34) + "id" + chr(34) + ": " + chr(34))} /[a-zA-Z0-9]{{9}}/ {_lit(chr(34) + "}")}'

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> str:
        extra: list[str] = []
        rules = [f"c{i}: {self.call(t, extra)}" for i, t in enumerate(tools)] + extra
        call = "(" + " | ".join(f"c{i}" for i in range(len(tools))) + ")"
        array = f'"[" {call} ' + (f'(", " {call})* ' if parallel else "") + '"]"'
        if forced:
            start = f"start: {WS} {_lit(self.opener)} {array} TAIL"
        else:
            rules.append(f"trig[lazy]: TEXT {_lit(self.opener)}")
            start = f"start: TEXT | trig {array} TAIL"
        return "\n".join(["%llguidance {}", start, *rules, "TEXT: /(.|\\n)*/", "TAIL: /[ \\t\\n]{0,2}/", ""])

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        out, pos = [], at + len(self.opener)
        while True:
            m = self._head.match(text, pos)
            if m is None:
                return out
            args, done, end = _args_after(text, m.end())
            out.append((m.group(1), args, done))
            if not done:
                return out
            close = text.find("}", end)
            if close < 0:
                return out
            pos = close + 1

    def call_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))  # the template's rule


class Llama3(Family):
    """Llama 3.1 / 3.2 / 3.3: the whole reply is `{"name": ..., "parameters": {...}}` (one call per turn)."""

    name = "llama3"
    opener = ""
    parallel = False
    stops = ("<|eot_id|>", "<|eom_id|>")
    _head = re.compile(r'\s*(?:<\|python_tag\|>)?\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"(?:parameters|arguments)"\s*:')

    def detect(self, template: str) -> bool:
        # Meta's templates answer tools in an ipython turn; Functionary (>>>, <function=) and Firefunction differ
        return "<|start_header_id|>" in template and "ipython" in template and not any(
            m in template for m in (">>>", "<function=", "functools"))

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        head = f'{{"name": "{tool["name"]}", "parameters": '
        return f"{_lit(head)} {_json_rule(tool['parameters'])} \"}}\""

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> str:
        extra: list[str] = []
        rules = [f"c{i}: {self.call(t, extra)}" for i, t in enumerate(tools)] + extra
        call = "(" + " | ".join(f"c{i}" for i in range(len(tools))) + ")"
        # a call is the whole reply: it is one as soon as its first non-blank character is "{"
        start = f"start: {WS} {call} TAIL" + ("" if forced else " | PLAIN")
        return "\n".join(["%llguidance {}", start, *rules, "PLAIN: /[ \\t\\n]*([^{ \\t\\n](.|\\n)*)?/",
                          "TAIL: /[ \\t\\n]{0,2}/", ""])

    def parse(self, text: str, schemas: Mapping[str, Any]) -> _Parsed:
        lead = text.lstrip()
        if not lead or "<|python_tag|>".startswith(lead) or lead.startswith(("{", "<|python_tag|>")):
            m = self._head.match(text)
            if m is None:
                return _Parsed("")
            args, done, _ = _args_after(text, m.end())
            return _Parsed("", [(m.group(1), args, done)])
        return _Parsed(text)


FAMILIES: tuple[Family, ...] = (Mistral(), Qwen3Coder(), Hermes(), Llama3())  # checked in this order


def detect_family(template: str | None) -> Family | None:
    """The family whose call syntax this chat template uses, or None (no tools, or a syntax not known here)."""
    if not template:
        return None
    return next((f for f in FAMILIES if f.detect(template)), None)


def no_tools_reason(template: str | None) -> str:
    """Why tools cannot be used with this template (for the error and the server's 400)."""
    if not template or "tools" not in template:
        return "this model's chat template has no tool support"
    names = ", ".join(f.name for f in FAMILIES)
    return f"this model's chat template takes tools, but its call syntax is none of the known families ({names})"


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
        compile_grammar("json_schema", _tool_schema(params))
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

    def stream(self) -> "ToolStream":
        return ToolStream(self)


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


# -- reading a reply as it streams ---------------------------------------------------------------------------
class ToolStream:
    """Feed the reply's text as it comes; get content text and call pieces, each emitted once, in order.

    The family reparses the whole reply on each feed (replies are short next to the decode), and the
    difference from what was already given out is the new content or the new argument text.
    """

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._schemas = plan.schemas
        self._text = ""
        self._content = 0  # content characters given out
        self._args: list[int] = []  # per call, argument characters given out
        self.calls: list[ToolCall] = []
        self._ids: list[str] = []

    @property
    def content(self) -> str:
        """The content given out so far (after finish(): the reply's text around its calls)."""
        return self._text[: self._content]

    def feed(self, text: str) -> Iterator[str | CallDelta]:
        """The new content (str) and call pieces (CallDelta) that `text` completes."""
        self._text += text
        return iter(self._emit(final=False))

    def finish(self) -> list[str | CallDelta]:
        """Whatever was held back (a partial opener that never became a call), once the reply has ended."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> list[str | CallDelta]:
        if not self.plan.parses:
            out = [self._text[self._content:]] if len(self._text) > self._content else []
            self._content = len(self._text)
            return out
        parsed = self.plan.family.parse(self._text, self._schemas)
        # trailing whitespace waits: before a call it is the call's separator, not content
        content = self._text if final and not parsed.calls else parsed.content.rstrip()
        out: list[str | CallDelta] = []
        if not self._args and len(content) > self._content:
            out.append(content[self._content:])
            self._content = len(content)
        for i, (name, args, done) in enumerate(parsed.calls):
            if i == len(self._args):
                self._ids.append(self.plan.family.call_id())
                self._args.append(0)
                out.append(CallDelta(i, id=self._ids[i], name=name))
            if len(args) > self._args[i]:
                if out and isinstance(out[-1], CallDelta) and out[-1].index == i:
                    out[-1].arguments += args[self._args[i]:]
                else:
                    out.append(CallDelta(i, arguments=args[self._args[i]:]))
                self._args[i] = len(args)
            if done and i == len(self.calls):
                self.calls.append(ToolCall(self._ids[i], name, _arguments(args)))
        return out


def _arguments(text: str) -> dict[str, Any]:
    value = json.loads(text)
    return value if isinstance(value, dict) else {}


def openai_delta(piece: str | CallDelta) -> dict[str, Any]:
    """A ToolStream piece as an OpenAI chat chunk's delta: content text, or one `tool_calls` entry (its
    first carries the id, type and name; the later ones fragments of the arguments' JSON)."""
    if isinstance(piece, str):
        return {"content": piece}
    entry: dict[str, Any] = {"index": piece.index}
    if piece.id is not None:
        entry |= {"id": piece.id, "type": "function", "function": {"name": piece.name, "arguments": piece.arguments}}
    else:
        entry["function"] = {"arguments": piece.arguments}
    return {"tool_calls": [entry]}
