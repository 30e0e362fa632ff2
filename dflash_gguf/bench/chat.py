"""A benchmark's chat generation: its own module, so the kernel timings and the runner both import it from below."""

from __future__ import annotations

from dflash_gguf.config import GenerationConfig


def chat_steps(session, messages: list[dict], config: GenerationConfig):
    """Session.stream_chat from a clean cache, so every run prefills the whole prompt."""
    session.reset()
    return session.stream_chat(messages, config)
