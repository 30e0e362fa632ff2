"""The chat's widgets: transcript messages, the provenance-coloured token stream, the stats panel.

Colours and layout come from app.tcss through component classes, so a theme or the colouring toggle
restyles everything without the widgets knowing a colour.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from rich.style import Style
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical, VerticalScroll
from textual.widget import Widget
from textual.widgets import Collapsible, Input, Label, Markdown, Sparkline, Static

from dflash_gguf.kinds import all_kinds
from dflash_gguf.prompt_cache import CacheEvent
from dflash_gguf.stats import Baseline, Calibration, SourceStats, TreeStats
from dflash_gguf.stats import speedup as speedup_of
from dflash_gguf.chat.tool_calls import ToolCall
from dflash_gguf.tui.provenance import COLOURS, Colour, Palette, Piece, Provenance, display
from dflash_gguf.tui.stats import ReplyStats
from dflash_gguf.tui.worker import SessionInfo

# a streamed reply is split into chunk widgets at a newline once a chunk holds this many characters,
# so each repaint re-renders one bounded chunk and a long reply costs linear, not quadratic, time
CHUNK_CHARS = 512
HIDDEN = "··"
LEGEND: tuple[Piece, ...] = (  # the colours of their own; legend() adds the Session's other sources
    ("drafter", Provenance.DRAFT),
    (" · ", Provenance.PLAIN),
    ("lookup", Provenance.LOOKUP),
    (" · ", Provenance.PLAIN),
    ("mtp", Provenance.MTP),
    (" · ", Provenance.PLAIN),
    ("grammar", Provenance.GRAMMAR),
    (" · ", Provenance.PLAIN),
    ("bonus", Provenance.BONUS),
    (" · plain", Provenance.PLAIN),
)
COMPARE_HINT = "^g reruns the last prompt\nwithout drafts"


def legend(sources: Iterable[str]) -> tuple[Piece, ...]:
    """The key to the colours: LEGEND, and before the target's own each of `sources` (Step.source names)
    drawn in a palette colour, by its name."""
    others: list[Piece] = []
    for name in sources:
        if isinstance(display(name), Palette):
            others += [(name, display(name)), (" · ", Provenance.PLAIN)]
    at = LEGEND.index(("bonus", Provenance.BONUS))
    return (*LEGEND[:at], *others, *LEGEND[at:])


class TokenChunk(Widget):
    """A run of committed tokens, each styled by where it came from.

    Streaming appends to one cached rich Text instead of rebuilding it, and asks for a layout pass only
    when the chunk's wrapped height changed: a repaint of one widget is cheap, a layout of the whole
    screen is not (it was most of the UI thread's time in the profile, docs/TUI.md).
    """

    COMPONENT_CLASSES = {f"token--{c.value}" for c in COLOURS}

    def __init__(self, pieces: Sequence[Piece] = (), **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self._pieces: list[Piece] = list(pieces)
        self.length = sum(len(text) for text, _ in pieces)
        self._styles: dict[Colour, Style] | None = None
        self._text: Text | None = None
        self._height: tuple[int, int] | None = None  # (width, wrapped lines) last laid out

    def append(self, pieces: Sequence[Piece]) -> None:
        if not pieces:
            return
        self._pieces.extend(pieces)
        self.length += sum(len(text) for text, _ in pieces)
        if self._text is not None and self._styles is not None:
            for piece, provenance in pieces:
                self._text.append(piece, self._styles[provenance])
        self.refresh(layout=self._height_changed())

    def _height_changed(self) -> bool:
        width = self.size.width
        if width <= 0 or self._height is None or self._height[0] != width:
            self._height = None
            return True
        lines = len(self._rich_text().wrap(self.app.console, width))
        if lines == self._height[1]:
            return False
        self._height = (width, lines)
        return True

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles = None
        self._text = None

    @property
    def pieces(self) -> tuple[Piece, ...]:
        return tuple(self._pieces)

    @property
    def text(self) -> str:
        return "".join(text for text, _ in self._pieces)

    def _rich_text(self) -> Text:
        if self._styles is None:
            self._styles = {c: self.get_component_rich_style(f"token--{c.value}") for c in COLOURS}
            self._text = None
        if self._text is None:
            text = Text(no_wrap=False, end="")
            for piece, provenance in self._pieces:
                text.append(piece, self._styles[provenance])
            self._text = text
        return self._text

    def render(self) -> Text:
        text = self._rich_text()
        width = self.size.width
        if width > 0 and self._height is None:
            self._height = (width, len(text.wrap(self.app.console, width)))
        return text

    def restyle(self) -> None:
        """Draw again with the current component styles (after the colouring toggle)."""
        self._styles = None
        self._text = None
        self.refresh()


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
    """A prompt the user sent (or, role "tool result · NAME", what the user answered for a call)."""

    def __init__(self, text: str, role: str = "you") -> None:
        super().__init__()
        self.text = text
        self.role = role

    def compose(self) -> ComposeResult:
        yield Label(self.role, classes="role")
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

    @property
    def ready(self) -> bool:
        """Whether its children are composed, so tokens can be drawn (a reply may start before that)."""
        return bool(self.query(TokenChunk))

    def append(self, pieces: Iterable[Piece]) -> None:
        self.tokens.append(pieces)

    def finish(self, text: str, status: str, *, thought: str = "") -> None:
        """Render the reply as Markdown (a thinking model's thought apart, above it) and fold the token view away."""
        self.finished = True
        self.remove_class("-streaming")
        self.add_class("-finished")
        collapsible = self.query_one(Collapsible)
        collapsible.collapsed = True
        if thought:
            self.mount(Static(f"💭 {thought}", markup=False, classes="thought"), before=collapsible)
        self.mount(Markdown(text or "*(no tokens)*"), before=collapsible)
        self.set_status(status)

    def show_calls(self, calls: Sequence[ToolCall]) -> None:
        """The tools the reply calls, one line each (name and arguments), under its text."""
        for call in calls:
            self.mount(Static(f"⚙ {call.name}({call.arguments_json})", markup=False, classes="tool-call"),
                       before=self.query_one(".status"))

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
        if rates == self.rates:
            return
        grew = len(rates) != len(self.rates)
        self.rates = rates
        self.refresh(layout=grew)

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


def source_name(source: str) -> str:
    """How the panel names a draft source (Step.source): a drafter kind's label, else the source's own name (lookup)."""
    return next((kind.label for kind in all_kinds() if kind.name == source), source)


def _block_row(stats: ReplyStats) -> str:
    """The latest cycle's verify: a block of n tokens, or a draft tree of n rows."""
    if stats.block_size is None:
        return "—"
    return f"tree of {stats.tree_nodes} rows" if stats.tree_nodes else str(stats.block_size)


def _tree_row(tree: TreeStats, cycles: int) -> str:
    """The cycles that verified draft trees: how many, their rows, the depth accepted, the wins off the chain."""
    return (f"{tree.cycles}/{cycles} cycles, {tree.mean_nodes:.1f} rows, depth {tree.mean_depth:.2f}, "
            f"{tree.off_chain} off the top-1 chain")


def _source_row(stats: SourceStats | None) -> str:
    if stats is None or not stats.n_drafted:
        return "no drafts yet"
    return f"{stats.n_accepted}/{stats.n_drafted} accepted ({stats.acceptance_rate:.0%})"


def _calibration_row(calibration: Calibration | None) -> str:
    if calibration is None:
        return "no confidences yet"
    return f"{calibration.predicted:.2f} predicted · {calibration.observed:.2f} seen"


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


def _prompt_cache_rows(event: CacheEvent | None, hide: bool) -> list[tuple[str, str]]:
    """The prompt cache's restore and store for the last reply, as the Session recorded them."""
    if event is None:
        return [("restored", "—"), ("stored", "—")]
    restored = "miss"
    if event.tier is not None:
        restored = f"{event.tier} {event.n_restored} tok · {_seconds(event.restore_ms / 1000, hide)}"
    stored = f"yes · {_seconds(event.store_ms / 1000, hide)}" if event.stored else "no"
    return [("restored", restored), ("stored", stored)]


class StatsPanel(VerticalScroll):
    """Live figures of the running (or last) reply, and the measured plain-decoding baseline."""

    def __init__(self, info: SessionInfo, *, hide_timing: bool, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.info = info
        self.hide_timing = hide_timing
        self._drawn: dict[str, tuple[str, int]] = {}  # selector -> (text, wrapped lines) last drawn

    def compose(self) -> ComposeResult:
        yield Label("speculative decoding", classes="heading")
        # the key to the transcript's colours, drawn by the same widget so it restyles with them
        yield TokenChunk(legend(self.info.sources()), id="legend")
        yield Static(id="figures", markup=False)
        yield Label("draft sources", classes="heading")
        yield Static(id="sources", markup=False)
        yield Label("acceptance by block slot", classes="heading")
        yield AcceptanceHistogram(id="histogram")
        yield Label("accepted tokens per cycle", classes="heading")
        yield Sparkline([], id="sparkline")
        if self.info.prompt_cache:
            yield Label("prompt cache", classes="heading")
            yield Static(id="prompt-cache", markup=False)
        yield Label("compare with plain decoding", classes="heading")
        yield Static(COMPARE_HINT, id="compare", markup=False)

    def show(self, stats: ReplyStats, baseline: Baseline) -> None:
        """Redraw from the current counters. `baseline`: plain decoding measured under the same conditions
        (dflash_gguf.stats.Baseline); without one, the rows say there is no speedup figure."""
        hide = self.hide_timing
        speed = stats.tokens_per_s
        note = baseline.source.value
        rows = [
            ("decode", _speed(speed, hide)),
            ("plain", note if baseline.tokens_per_s is None else f"{_speed(baseline.tokens_per_s, hide)} · {note}"),
            ("speedup", note if baseline.tokens_per_s is None else _ratio(baseline.speedup(speed), hide)),
            ("tokens", str(stats.tokens)),
            ("prefill", _seconds(stats.prefill_s, hide)),
            ("τ", "—" if stats.tau is None else f"{stats.tau:.2f} tok/cycle"),
            ("drafted", str(stats.drafted)),
            ("accepted", str(stats.accepted)),
            ("cycles", str(stats.cycles)),
            ("block", _block_row(stats)),
            *([] if stats.tree is None else [("trees", _tree_row(stats.tree, stats.cycles))]),
            ("reason", stats.reason or "—"),
        ]
        self._draw_rows("#figures", rows)
        self._show_sources(stats)
        if self.info.prompt_cache:
            self._draw_rows("#prompt-cache", _prompt_cache_rows(stats.prompt_cache, hide))
        self.query_one(AcceptanceHistogram).show(stats.slot_rates())
        recent = [float(n) for n in stats.recent_accepted]
        sparkline = self.query_one(Sparkline)
        if recent != sparkline.data:
            sparkline.data = recent

    def _show_sources(self, stats: ReplyStats) -> None:
        """The drafter's kind, lookup and MTP, each source's acceptance, and a confidence head's calibration."""
        info = self.info
        per_source = stats.per_source()
        configured = info.sources()
        rows = [(source_name(s), _source_row(per_source.get(s))) for s in configured + sorted(set(per_source) - set(configured))]
        if not rows:
            rows = [("none", "plain decoding only")]
        if info.has_confidence_head:
            rows.append(("conf.", _calibration_row(stats.calibration)))
        self._draw_rows("#sources", rows)

    def _draw_rows(self, selector: str, rows: list[tuple[str, str]]) -> None:
        """Update a table of (name, value) rows if it changed; a layout pass only if it wraps to other lines."""
        lines = [f"{name:<9}{value}" for name, value in rows]
        text = "\n".join(lines)
        widget = self.query_one(selector, Static)
        drawn_text, drawn_height = self._drawn.get(selector, ("", 0))
        if text == drawn_text:
            return
        width = max(widget.size.width, 1)
        height = sum(max(1, -(-len(line) // width)) for line in lines)
        widget.update(text, layout=height != drawn_height)
        self._drawn[selector] = (text, height)

    def show_compare(self, speculative: float | None, plain: float | None, same_text: bool | None) -> None:
        """Both speeds of the same prompt side by side."""
        if speculative is None and plain is None:
            self.query_one("#compare", Static).update(COMPARE_HINT)
            return
        hide = self.hide_timing
        speedup = speedup_of(speculative, plain)
        lines = [
            f"{'dflash':<9}{_speed(speculative, hide)}",
            f"{'plain':<9}{_speed(plain, hide)}",
            f"{'speedup':<9}{_ratio(speedup, hide)}",
        ]
        if same_text is not None:
            lines.append(f"{'text':<9}{'identical' if same_text else 'differs'}")
        self.query_one("#compare", Static).update("\n".join(lines))
