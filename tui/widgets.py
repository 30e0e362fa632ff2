"""The chat's widgets: transcript messages, the provenance-coloured token stream, the stats panel.

Colours and layout come from app.tcss through component classes, so a theme or the colouring toggle
restyles everything without the widgets knowing a colour.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Input, Label, Markdown, Sparkline, Static

from dflash_gguf.tui.provenance import Piece, Provenance
from dflash_gguf.tui.stats import ReplyStats

# a streamed reply is split into chunk widgets at a newline once a chunk holds this many characters,
# so each repaint re-renders one bounded chunk and a long reply costs linear, not quadratic, time
CHUNK_CHARS = 1024
# the sparkline shows this many most recent cycles, one bar each
SPARKLINE_CYCLES = 48
HIDDEN = "··"
LEGEND: tuple[Piece, ...] = (
    ("accepted draft", Provenance.DRAFT),
    (" · ", Provenance.PLAIN),
    ("bonus", Provenance.BONUS),
    (" · plain", Provenance.PLAIN),
)
COMPARE_HINT = "^g reruns the last prompt\nwithout drafts"


class TokenChunk(Widget):
    """A run of committed tokens, each styled by where it came from."""

    COMPONENT_CLASSES = {f"token--{p.value}" for p in Provenance}

    def __init__(self, pieces: Sequence[Piece] = (), **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._pieces: list[Piece] = list(pieces)
        self.length = sum(len(text) for text, _ in pieces)

    def append(self, pieces: Sequence[Piece]) -> None:
        self._pieces.extend(pieces)
        self.length += sum(len(text) for text, _ in pieces)
        self.refresh(layout=True)

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(self._pieces)

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self._pieces)

    def render(self) -> Text:
        styles = {p: self.get_component_rich_style(f"token--{p.value}") for p in Provenance}
        text = Text(no_wrap=False, end="")
        for piece, provenance in self._pieces:
            text.append(piece, styles[provenance])
        return text


class TokenStream(Vertical):
    """The streamed reply as chunks of coloured tokens; only the last chunk ever changes."""

    def compose(self) -> ComposeResult:
        yield TokenChunk()

    def append(self, pieces: Iterable[Piece]) -> None:
        """Add pieces at the end, opening a new chunk at a newline once the last one is full."""
        chunk = self.query(TokenChunk).last()
        batch: list[Piece] = []
        length = chunk.length
        for text, provenance in pieces:
            if length >= CHUNK_CHARS and "\n" in text:
                head, _, tail = text.rpartition("\n")
                if head:
                    batch.append((head, provenance))
                chunk.append(batch)
                chunk, batch, length = TokenChunk(), [], 0
                self.mount(chunk)
                text = tail
            if text:
                batch.append((text, provenance))
                length += len(text)
        if batch:
            chunk.append(batch)

    @property
    def text(self) -> str:
        return "\n".join(chunk.text for chunk in self.query(TokenChunk))


class UserMessage(Vertical):
    """A prompt the user sent."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def compose(self) -> ComposeResult:
        yield Label("you", classes="role")
        yield Static(self.text, markup=False, classes="body")


class AssistantMessage(Vertical):
    """A reply: coloured tokens while it streams, Markdown once finished (tokens kept, collapsed)."""

    def __init__(self, role: str) -> None:
        super().__init__(classes="-streaming")
        self.role = role
        self.finished = False

    def compose(self) -> ComposeResult:
        yield Label(self.role, classes="role")
        with Collapsible(title="tokens by provenance", collapsed=False):
            yield TokenStream()
        yield Static("", classes="status", markup=False)

    @property
    def tokens(self) -> TokenStream:
        return self.query_one(TokenStream)

    def append(self, pieces: Iterable[Piece]) -> None:
        self.tokens.append(pieces)

    def finish(self, text: str, status: str) -> None:
        """Render the reply as Markdown and fold the token view away."""
        self.finished = True
        self.remove_class("-streaming")
        self.add_class("-finished")
        collapsible = self.query_one(Collapsible)
        collapsible.collapsed = True
        self.mount(Markdown(text or "*(no tokens)*"), before=collapsible)
        self.set_status(status)

    def fail(self, error: str) -> None:
        self.finished = True
        self.remove_class("-streaming")
        self.add_class("-failed")
        self.set_status(error)

    def wait(self, why: str | None) -> None:
        """Show why the reply has not started (None: it has)."""
        self.set_class(why is not None, "-waiting")
        self.set_status(why or "")

    def set_status(self, status: str) -> None:
        self.query_one(".status", Static).update(status)


class Transcript(VerticalScroll):
    """The conversation, kept scrolled to the newest message while it grows."""

    def on_mount(self) -> None:
        self.anchor()


class PromptInput(Input):
    """The prompt box; ↑/↓ walk back and forth through the prompts already sent."""

    BINDINGS = [
        Binding("enter", "submit", "Send", key_display="⏎"),
        Binding("up", "history(-1)", "Previous prompt", show=False),
        Binding("down", "history(1)", "Next prompt", show=False),
    ]

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._history: list[str] = []
        self._position = 0

    def remember(self, prompt: str) -> None:
        if prompt and (not self._history or self._history[-1] != prompt):
            self._history.append(prompt)
        self._position = len(self._history)

    def action_history(self, direction: int) -> None:
        position = self._position + direction
        if not 0 <= position <= len(self._history):
            return
        self._position = position
        self.value = self._history[position] if position < len(self._history) else ""
        self.cursor_position = len(self.value)


class AcceptanceHistogram(Widget):
    """How often each block slot's draft token was accepted: one bar per slot."""

    COMPONENT_CLASSES = {"histogram--bar", "histogram--rest", "histogram--label"}
    BAR_WIDTH = 16

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.rates: list[float] = []

    def show(self, rates: list[float]) -> None:
        self.rates = rates
        self.refresh(layout=True)

    def render(self) -> Text:
        if not self.rates:
            return Text("no drafts yet", style=self.get_component_rich_style("histogram--label"))
        bar = self.get_component_rich_style("histogram--bar")
        rest = self.get_component_rich_style("histogram--rest")
        label = self.get_component_rich_style("histogram--label")
        text = Text(end="")
        for slot, rate in enumerate(self.rates, start=1):
            filled = round(rate * self.BAR_WIDTH)
            if slot > 1:
                text.append("\n")
            text.append(f"{slot:>2} ", label)
            text.append("█" * filled, bar)
            text.append("░" * (self.BAR_WIDTH - filled), rest)
            text.append(f" {rate:4.0%}", label)
        return text


def _speed(value: float | None, hide: bool) -> str:
    if value is None:
        return "—"
    return f"{HIDDEN} tok/s" if hide else f"{value:.1f} tok/s"


def _seconds(value: float | None, hide: bool) -> str:
    if value is None:
        return "—"
    return f"{HIDDEN} ms" if hide else f"{value * 1000:.0f} ms"


def _ratio(value: float | None, hide: bool) -> str:
    if value is None:
        return "—"
    return f"{HIDDEN}×" if hide else f"{value:.2f}×"


class StatsPanel(VerticalScroll):
    """Live figures of the running (or last) reply, and the measured plain-decoding baseline."""

    def __init__(self, *, hide_timing: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.hide_timing = hide_timing

    def compose(self) -> ComposeResult:
        yield Label("speculative decoding", classes="heading")
        # the key to the transcript's colours, drawn by the same widget so it restyles with them
        yield TokenChunk(LEGEND, id="legend")
        yield Static(id="figures", markup=False)
        yield Label("acceptance by block slot", classes="heading")
        yield AcceptanceHistogram(id="histogram")
        yield Label("accepted tokens per cycle", classes="heading")
        yield Sparkline([], id="sparkline")
        yield Label("compare with plain decoding", classes="heading")
        yield Static(COMPARE_HINT, id="compare", markup=False)

    def show(self, stats: ReplyStats, plain_tokens_per_s: float | None, plain_note: str) -> None:
        """Redraw from the current counters; `plain_note` says where the baseline stands."""
        hide = self.hide_timing
        speed = stats.tokens_per_s
        speedup = speed / plain_tokens_per_s if speed is not None and plain_tokens_per_s else None
        rows = [
            ("decode", _speed(speed, hide)),
            ("plain", plain_note if plain_tokens_per_s is None else _speed(plain_tokens_per_s, hide)),
            ("speedup", _ratio(speedup, hide)),
            ("tokens", str(stats.tokens)),
            ("prefill", _seconds(stats.prefill_s, hide)),
            ("τ", "—" if stats.tau is None else f"{stats.tau:.2f} tok/cycle"),
            ("drafted", str(stats.drafted)),
            ("accepted", str(stats.accepted)),
            ("cycles", str(stats.cycles)),
            ("block", "—" if stats.block_size is None else str(stats.block_size)),
            ("reason", stats.reason or "—"),
        ]
        self.query_one("#figures", Static).update("\n".join(f"{name:<9}{value}" for name, value in rows))
        self.query_one(AcceptanceHistogram).show(stats.slot_rates())
        self.query_one(Sparkline).data = [float(n) for n in stats.accepted_per_cycle[-SPARKLINE_CYCLES:]]

    def show_compare(self, speculative: float | None, plain: float | None, same_text: bool | None) -> None:
        """Both speeds of the same prompt side by side."""
        if speculative is None and plain is None:
            self.query_one("#compare", Static).update(COMPARE_HINT)
            return
        hide = self.hide_timing
        speedup = speculative / plain if speculative is not None and plain else None
        lines = [
            f"{'dflash':<9}{_speed(speculative, hide)}",
            f"{'plain':<9}{_speed(plain, hide)}",
            f"{'speedup':<9}{_ratio(speedup, hide)}",
        ]
        if same_text is not None:
            lines.append(f"{'text':<9}{'identical' if same_text else 'differs'}")
        self.query_one("#compare", Static).update("\n".join(lines))
