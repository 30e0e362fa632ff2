"""The chat's actions as a command-palette provider (Ctrl+P)."""

from __future__ import annotations

from typing import Any, Callable, Protocol

from textual.command import DiscoveryHit, Hit, Hits, Provider


class HasCommands(Protocol):
    """The app the palette serves (the ChatApp): its commands as (name, help, callback)."""

    def chat_commands(self) -> list[tuple[str, str, Callable[[], Any]]]: ...


class ChatCommands(Provider):
    """New chat, regenerate, cancel, compare, colours, stats panel."""

    @property
    def _commands(self) -> list:
        app: HasCommands = self.app  # type: ignore[assignment]
        return app.chat_commands()

    async def discover(self) -> Hits:
        for name, help_text, callback in self._commands:
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for name, help_text, callback in self._commands:
            score = matcher.match(name)
            if score > 0:
                yield Hit(score, matcher.highlight(name), callback, help=help_text)
