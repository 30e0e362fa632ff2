"""The server's settings: what the CLI parsed, handed to the app."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..config import GenerationConfig

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_MODEL_ALIAS = "dflash"
# a reply's length when the request names none (Codex sends no max_output_tokens): a turn ends even where a
# model loops, and a request may ask for more, up to what the context has left
DEFAULT_MAX_TOKENS = 8192
# seconds of silence after which a stream sends its keep-alive (--keepalive): well inside any client's idle limit
DEFAULT_KEEPALIVE_S = 15.0
MiB = 1 << 20


def machine_memory() -> int:
    """This machine's physical memory in bytes (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def default_cache_ram(memory: int) -> int:
    """The prompt cache's RAM tier for an agent out of the box: an eighth of the machine, at most 8 GiB (a
    24 GB machine keeps 3 GiB: a 17k-token agent prompt of the embedded pair is about 0.4 GiB)."""
    return min(memory // 8, 8 << 30)


def default_max_body(memory: int) -> int:
    """The request body limit: a long agent conversation passes 1 MiB; a thousandth of the machine, 16-256 MiB."""
    return max(16 * MiB, min(memory // 1024, 256 * MiB))


@dataclass(frozen=True)
class ServerConfig:
    """How the app behaves; the Sessions themselves are opened by the caller (the CLI or a test)."""

    model_alias: str = DEFAULT_MODEL_ALIAS
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait for a slot; one more gets 429
    max_body_bytes: int = 16 * MiB
    # the server's own generation settings (--block-size); each request's fields apply over them
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    # a reply's length when the request names none (--max-tokens; None: up to the end of the context)
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    # answer whatever `model` a client names, as llama-server does with one model (Claude Code sends its own
    # names); False: any other name than model_alias is a 404
    accept_any_model: bool = True
    created: int = 0  # the model's `created` in /v1/models
    # seconds of silence after which a stream sends its keep-alive (Anthropic `ping`, an SSE comment, Responses'
    # in_progress again): while queued, during a long prefill, while a tool call is held back until it is whole
    keepalive_s: float = DEFAULT_KEEPALIVE_S

    def __post_init__(self) -> None:
        if not self.model_alias:
            raise ValueError("model_alias must be a non-empty string")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if not (math.isfinite(self.keepalive_s) and self.keepalive_s > 0):
            raise ValueError(f"keepalive_s must be a finite number > 0, got {self.keepalive_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
