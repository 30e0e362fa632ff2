"""The Mistral Nemo / Small call syntax."""

from __future__ import annotations

import re
import secrets
import string
from typing import Any, Mapping, Sequence

from ..grammar import LarkGrammar
from .base import WS, Family, args_after, lit, tool_json_rule


class Mistral(Family):
    """Mistral Nemo / Small: `[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "<9 alphanumerics>"}, ...]`."""

    name = "mistral"
    opener = "[TOOL_CALLS]"
    _head = re.compile(r'\s*[\[,]\s*\{\s*"name"\s*:\s*"([^"]*)"\s*,\s*"arguments"\s*:')

    def detect(self, template: str) -> bool:
        return "[TOOL_CALLS]" in template and "[ARGS]" not in template  # [ARGS]: Mistral Small 3.2's newer syntax

    def call(self, tool: Mapping[str, Any], extra: list[str]) -> str:
        head = f'{{"name": "{tool["name"]}", "arguments": '
        return f'{lit(head)} {tool_json_rule(tool["parameters"])} {lit(", " + chr(34) + "id" + chr(34) + ": " + chr(34))} /[a-zA-Z0-9]{{9}}/ {lit(chr(34) + "}")}'

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: bool, parallel: bool) -> LarkGrammar:
        rules, call = self.call_rules(tools)
        array = f'"[" {call} ' + (f'(", " {call})* ' if parallel else "") + '"]"'
        if forced:
            start = f"{WS} {lit(self.opener)} {array} TAIL"
        else:
            rules.append(f"trig[lazy]: TEXT {lit(self.opener)}")
            start = f"TEXT | trig {array} TAIL"
        return LarkGrammar(start, [*rules, "TEXT: /(.|\\n)*/", "TAIL: /[ \\t\\n]{0,2}/"])

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        out, pos = [], at + len(self.opener)
        while True:
            m = self._head.match(text, pos)
            if m is None:
                return out
            args, done, end = args_after(text, m.end())
            out.append((m.group(1), args, done))
            if not done:
                return out
            close = text.find("}", end)
            if close < 0:
                return out
            pos = close + 1

    def call_id(self) -> str:
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))  # the template's rule
