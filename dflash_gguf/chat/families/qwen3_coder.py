"""The Qwen3-Coder (and Qwen3.5) call syntax: XML-like function and parameter tags."""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from .base import NAME, Family, args_after, lit, tool_json_rule


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
        parts = [lit(f"\n<function={tool['name']}>\n")]
        if props is None:
            parts.append(f"({lit('<parameter=')} /[A-Za-z0-9_.-]+/ {lit('>' + chr(10))} {self._value({}, extra)})*")
        required = set(schema.get("required") or ())
        for pname, pschema in props.items() if props else ():
            if not NAME.match(pname):
                raise ValueError(f"parameter name {pname!r} cannot be written in this template's XML")
            one = f"{lit(f'<parameter={pname}>' + chr(10))} {self._value(pschema, extra)}"
            parts.append(one if pname in required else f"({one})?")
        parts.append(lit("</function>\n</tool_call>"))
        return " ".join(parts)

    @staticmethod
    def _value(schema: Any, extra: list[str]) -> str:
        """A parameter's value and its closing tag: JSON under its schema, or raw text (a string parameter)."""
        close = lit("\n</parameter>\n")
        if isinstance(schema, dict) and schema.get("type") == "string" and "enum" in schema:
            return "(" + " | ".join(lit(str(v)) for v in schema["enum"]) + f") {close}"
        if isinstance(schema, dict) and schema and schema.get("type") != "string":
            return f"{tool_json_rule(schema)} {close}"
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
