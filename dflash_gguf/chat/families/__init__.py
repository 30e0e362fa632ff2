"""The tool-call template families: each one module (its markers, the grammar of a call, how calls are read
back), listed once in FAMILIES. A new family is a new module here and one line below (tests/test_chat_floor.py
adds one so)."""

from __future__ import annotations

from .base import Family
from .hermes import Hermes
from .llama3 import Llama3
from .mistral import Mistral
from .qwen3_coder import Qwen3Coder

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
