"""What every tool-call family shares: the Family protocol (recognise a template, write the Lark grammar of a
call, read calls back out of a reply) and the helpers its members write grammars and read JSON with.

A family is one module of this package and one line in its FAMILIES (chat/families/__init__.py).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from ...constraints import schema_text
from ..grammar import LarkGrammar

NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for a function name; no escaping needed anywhere
WS = r"/[ \t\n]*/"


@dataclass
class Parsed:
    """A reply read so far: the text around the calls, and each call's name and arguments text (the JSON
    text as far as it is written; `done` once it is whole)."""

    content: str
    calls: list[tuple[str, str, bool]] = field(default_factory=list)


# -- writing a call's grammar, reading its JSON back ---------------------------------------------------------
def lit(text: str) -> str:
    return json.dumps(text)


# calls are written as the templates write them in the history (tojson: ", " and ": "), with no stray whitespace;
# lenient: a keyword llguidance does not implement (propertyNames, ...) is left unenforced instead of failing the
# request, since agents send the schemas they have (the arguments still parse, and follow what is enforced)
LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", ", "lenient": True}


def closed_schema(schema: Any) -> Any:
    """The schema with additionalProperties false wherever an object leaves it unsaid (upstream llama.cpp's
    default for grammars too): a small model otherwise invents keys after the ones it was given."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (closed_schema(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems") else v) for k, v in schema.items()}
    for k in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(k), dict):
            out[k] = {name: closed_schema(s) for name, s in schema[k].items()}
    if isinstance(out.get("properties"), dict) and "additionalProperties" not in out and "patternProperties" not in out:
        out["additionalProperties"] = False
    return out


def tool_schema(schema: Mapping[str, Any]) -> str:
    """A tool's parameters as the JSON text its calls are constrained with."""
    return schema_text({**closed_schema(dict(schema)), "x-guidance": LAYOUT})


def tool_json_rule(schema: Mapping[str, Any]) -> str:
    return "%json " + tool_schema(schema)


def args_after(text: str, pos: int) -> tuple[str, bool, int]:
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
    """Where the text may stop being content: before its longest suffix that could be the start of `marker`
    (only where the marker's first character stands is one looked for: the loop asks once per token)."""
    i = text.find(marker[:1], max(0, len(text) - len(marker) + 1))
    while i >= 0:
        if marker.startswith(text[i:]):
            return i
        i = text.find(marker[:1], i + 1)
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

    def call_rules(self, tools: Sequence[Mapping[str, Any]]) -> tuple[list[str], str]:
        """One rule per tool's call (c0, c1, ...) with the rules they refer to, and the rule of any one call."""
        extra: list[str] = []
        rules = [f"c{i}: {self.call(t, extra)}" for i, t in enumerate(tools)] + extra
        return rules, "(" + " | ".join(f"c{i}" for i in range(len(tools))) + ")"

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> LarkGrammar:
        """Lark for the reply: free text, or calls, the first opened by the opener (lazily unless forced)."""
        rules, call = self.call_rules(tools)
        opener = lit(self.opener)
        if forced:
            first = f"{WS} {opener} {call}"
            more = f"({WS} {opener} {call})*" if parallel else ""
            start = f"{first} {more} TAIL"
        else:
            # a lazy lexeme: it ends where the opener first appears, and from there only a call is admitted
            rules.append(f"trig[lazy]: TEXT {opener}")
            start = f"TEXT | trig {call} " + ("(trig " + call + ")* " if parallel else "") + "TAIL"
        return LarkGrammar(start, [*rules, "TEXT: /(.|\\n)*/", "TAIL: /[ \\t\\n]{0,2}/"])

    def parse(self, text: str, schemas: Mapping[str, Any]) -> Parsed:
        """The reply so far as content and calls (`schemas`: each tool's parameters, by name); what could
        still become an opener is held back."""
        at = text.find(self.opener)
        if at < 0:
            return Parsed(text[: hold_back(text, self.opener)])
        return Parsed(text[:at], self.calls(text, at, schemas))

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        raise NotImplementedError

    def call_id(self) -> str:
        return "call_" + secrets.token_hex(12)
