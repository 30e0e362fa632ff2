"""What the chat was asked to do: its generation settings, system prompt and display switches.

Kept apart from the CLI so the app and its tests build the same object the CLI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_gguf.config import GenerationConfig

# a chat reply may run longer than a Session call's default
CHAT_GENERATION = GenerationConfig(max_tokens=512)


@dataclass(frozen=True)
class ChatOptions:
    """Generation settings plus the conversation's system prompt and display switches."""

    generation: GenerationConfig = field(default_factory=lambda: CHAT_GENERATION)
    system: str | None = None
    # replaces every live timing figure with a placeholder, so screenshots of a run are reproducible
    hide_timing: bool = False
    # tools the model may call (OpenAI-shaped function tools, --tools FILE), and stream_chat's tool_choice
    tools: tuple[dict[str, Any], ...] = ()
    tool_choice: str = "auto"

    @property
    def tool_arguments(self) -> dict[str, Any] | None:
        """What a reply passes to stream_chat for the tools (None without any)."""
        return {"tools": list(self.tools), "tool_choice": self.tool_choice} if self.tools else None
