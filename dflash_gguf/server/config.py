"""The server's settings: what the CLI parsed, handed to the app."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import GenerationConfig

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
DEFAULT_MODEL_ALIAS = "dflash"


@dataclass(frozen=True)
class ServerConfig:
    """How the app behaves; the Sessions themselves are opened by the caller (the CLI or a test)."""

    model_alias: str = DEFAULT_MODEL_ALIAS
    api_key: str | None = None
    max_queue: int = 16  # requests that may wait for a slot; one more gets 429
    max_body_bytes: int = 1 << 20
    # the server's own generation settings (block_size from --block-size); each request's fields apply over them
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    accept_any_model: bool = False  # answer whatever `model` a client names (agents send their own names)
    created: int = 0  # the model's `created` in /v1/models

    def __post_init__(self) -> None:
        if not self.model_alias:
            raise ValueError("model_alias must be a non-empty string")
        if self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when given")
