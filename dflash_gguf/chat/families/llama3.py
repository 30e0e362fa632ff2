"""The Llama 3.1 / 3.2 / 3.3 call syntax: the whole reply is one JSON call."""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ..grammar import LarkGrammar
from .base import WS, Family, Parsed, args_after, lit, tool_json_rule


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
        return f"{lit(head)} {tool_json_rule(tool['parameters'])} \"}}\""

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> LarkGrammar:
        rules, call = self.call_rules(tools)
        # a call is the whole reply: it is one as soon as its first non-blank character is "{"
        start = f"{WS} {call} TAIL" + ("" if forced else " | PLAIN")
        return LarkGrammar(start, [*rules, "PLAIN: /[ \\t\\n]*([^{ \\t\\n](.|\\n)*)?/",
                                   "TAIL: /[ \\t\\n]{0,2}/"])

    def parse(self, text: str, schemas: Mapping[str, Any]) -> Parsed:
        lead = text.lstrip()
        if not lead or "<|python_tag|>".startswith(lead) or lead.startswith(("{", "<|python_tag|>")):
            m = self._head.match(text)
            if m is None:
                return Parsed("")
            args, done, _ = args_after(text, m.end())
            return Parsed("", [(m.group(1), args, done)])
        return Parsed(text)
