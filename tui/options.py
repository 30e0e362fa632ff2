"""What the chat was asked to do: how generation is configured, gathered from the command line.

Kept apart from the CLI so the app and its tests build the same object the CLI does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class GenerationOptions:
    """Keyword arguments for every Session call the chat makes (None = the Session's own default)."""

    max_tokens: int = 512
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    block_size: int | None = None

    def session_kwargs(self, *, speculative: bool = True) -> dict[str, Any]:
        """The gen kwargs Session.stream / stream_chat take."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "block_size": self.block_size,
            "speculative": speculative,
        }


@dataclass(frozen=True)
class ChatOptions:
    """Generation settings plus the conversation's system prompt and display switches."""

    generation: GenerationOptions = field(default_factory=GenerationOptions)
    system: str | None = None
    # replaces every live timing figure with a placeholder, so screenshots of a run are reproducible
    hide_timing: bool = False
