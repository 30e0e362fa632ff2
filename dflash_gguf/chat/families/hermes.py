"""The Hermes 2 Pro / Qwen2.5 / Qwen3 call syntax."""

from __future__ import annotations

import re
from typing import Any, Mapping

from .base import Family, args_after, lit, tool_json_rule


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
        return f"{lit(head)} {tool_json_rule(tool['parameters'])} {lit('}' + chr(10) + '</tool_call>')}"

    def calls(self, text: str, at: int, schemas: Mapping[str, Any]) -> list[tuple[str, str, bool]]:
        out = []
        while at >= 0:
            m = self._head.match(text, at + len(self.opener))
            if m is None:
                break
            args, done, end = args_after(text, m.end())
            out.append((m.group(1), args, done))
            at = text.find(self.opener, end) if done else -1
        return out
