"""The dflash-chat App: composes the transcript, prompt and stats panel, and drives the worker.

All Session work happens on worker threads (SessionWorker); cycles arrive as StepArrived messages,
are buffered, and are flushed to the widgets on a short timer, so the UI repaints in batches however
fast tokens come and typing stays responsive.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input

from dflash_gguf.session import Session
from dflash_gguf.tui.commands import ChatCommands
from dflash_gguf.tui.messages import (
    CalibrationFailed,
    CalibrationFinished,
    ReplyFailed,
    ReplyFinished,
    StepArrived,
)
from dflash_gguf.tui.options import ChatOptions
from dflash_gguf.tui.provenance import Piece
from dflash_gguf.tui.stats import ReplyStats
from dflash_gguf.tui.widgets import (
    AssistantMessage,
    PromptInput,
    StatsPanel,
    TokenChunk,
    Transcript,
    UserMessage,
)
from dflash_gguf.tui.worker import SessionWorker

# how often buffered cycles are drawn: fast enough to look live, slow enough to batch many cycles
FLUSH_INTERVAL_S = 1 / 20
BUSY_HINT = "Still generating — Esc cancels it."
MEASURING = "measuring…"


@dataclass
class Reply:
    """The reply being generated: its widget, counters and the cycles not drawn yet."""

    turn: int
    widget: AssistantMessage
    speculative: bool
    cancel: threading.Event = field(default_factory=threading.Event)
    stats: ReplyStats = field(default_factory=ReplyStats)
    parts: list[str] = field(default_factory=list)
    # why the Session stopped, when it says so in a closing Step that decoded nothing (block_size 0:
    # the context is full)
    closing_note: str = ""
    pending: list[Piece] = field(default_factory=list)
    # cycles arrived since the last draw (a cycle may add stats but no text yet)
    dirty: bool = False

    @property
    def text(self) -> str:
        return "".join(self.parts)


class ChatApp(App[None]):
    """A terminal chat that shows speculative decoding live: provenance colours, τ, speedup."""

    CSS_PATH = "app.tcss"
    TITLE = "dflash-chat"
    COMMANDS = App.COMMANDS | {ChatCommands}
    BINDINGS = [
        # not priority bindings: the command palette and other screens keep their own Esc
        Binding("escape", "cancel", "Cancel"),
        Binding("ctrl+n", "new_chat", "New chat"),
        Binding("ctrl+r", "regenerate", "Regenerate"),
        Binding("ctrl+t", "toggle_colours", "Colours"),
        Binding("ctrl+s", "toggle_stats", "Stats"),
        Binding("ctrl+g", "compare", "Compare"),
        Binding("f5", "recalibrate", "Calibrate"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, session: Session, options: ChatOptions | None = None) -> None:
        super().__init__()
        self.options = options or ChatOptions()
        self.session_worker = SessionWorker(session, self.post_message)
        self.history: list[dict[str, str]] = []
        self.reply: Reply | None = None
        # a reply running, or one whose worker has not answered yet
        self.busy = False
        # what the panel shows when no reply runs: the last speculative reply's figures
        self.last_stats = ReplyStats()
        self.last_reply_speed: float | None = None
        self.last_reply_text: str | None = None
        self.plain_tokens_per_s: float | None = None
        self.plain_note = MEASURING if self.options.calibrate_on_start else "not measured (F5)"
        self._turns = 0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield PromptInput(placeholder="Ask something — Enter sends, ↑ recalls", id="prompt")
            yield StatsPanel(hide_timing=self.options.hide_timing, id="stats")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.sub_title = self._subtitle()
        self.set_interval(FLUSH_INTERVAL_S, self._flush)
        self._refresh_stats()
        self.query_one(PromptInput).focus()
        if self.options.calibrate_on_start:
            self._calibrate()

    def on_unmount(self) -> None:
        self.session_worker.closing.set()

    @property
    def stats_panel(self) -> StatsPanel:
        return self.query_one(StatsPanel)

    @property
    def transcript(self) -> Transcript:
        return self.query_one(Transcript)

    def _subtitle(self) -> str:
        gen = self.options.generation
        block = "adaptive" if gen.block_size is None else str(gen.block_size)
        sampling = "greedy" if gen.temperature == 0 else f"T={gen.temperature:g}"
        return f"block {block} · {sampling} · max {gen.max_tokens} tokens"

    # ---- sending and generating -------------------------------------------------------------

    @on(Input.Submitted, "#prompt")
    def _send(self, event: Input.Submitted) -> None:
        prompt = event.value.strip()
        if not prompt:
            return
        if self.busy:
            self.notify(BUSY_HINT, severity="warning")
            return
        prompt_input = self.query_one(PromptInput)
        prompt_input.remember(prompt)
        prompt_input.value = ""
        self.history.append({"role": "user", "content": prompt})
        self.transcript.mount(UserMessage(prompt))
        self._start_reply(self._conversation(), speculative=True)

    def _conversation(self) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return system + self.history

    def _start_reply(self, messages: list[dict[str, str]], *, speculative: bool) -> None:
        self._turns += 1
        role = "assistant" if speculative else "assistant · plain decoding (compare)"
        widget = AssistantMessage(role)
        if not speculative:
            widget.add_class("-compare")
        self.reply = Reply(self._turns, widget, speculative)
        self.transcript.mount(widget)
        if self.plain_note == MEASURING:  # the Session is busy with the calibration: say why nothing comes yet
            widget.wait("waiting for the plain-decoding calibration…")
        self.busy = True
        self.stats_panel.show(self.reply.stats, self.plain_tokens_per_s, self.plain_note)
        gen = self.options.generation.session_kwargs(speculative=speculative)
        self._generate(self.reply.turn, messages, gen, self.reply.cancel)

    @work(thread=True, group="session")
    def _generate(
        self, turn: int, messages: list[dict[str, str]], gen: dict[str, Any], cancel: threading.Event
    ) -> None:
        self.session_worker.reply(turn, messages, gen, cancel)

    @work(thread=True, group="session")
    def _calibrate(self) -> None:
        self.session_worker.calibrate(self.options.generation.session_kwargs(speculative=False))

    def _current(self, turn: int) -> Reply | None:
        """The reply a worker message belongs to, or None if that reply was discarded (new chat)."""
        return self.reply if self.reply is not None and self.reply.turn == turn else None

    def on_step_arrived(self, message: StepArrived) -> None:
        reply = self._current(message.turn)
        if reply is None:
            return
        step = message.step
        if reply.stats.tokens == 0:
            reply.widget.wait(None)
        reply.stats.observe(step, message.at)
        if step.finish_reason is not None and step.block_size == 0:
            reply.closing_note = step.reason
        reply.parts.append(step.text)
        reply.pending.extend(message.pieces)
        reply.dirty = True

    def _flush(self) -> None:
        reply = self.reply
        if reply is None or not reply.dirty:
            return
        pieces, reply.pending, reply.dirty = reply.pending, [], False
        if pieces:
            reply.widget.append(pieces)
        self.stats_panel.show(reply.stats, self.plain_tokens_per_s, self.plain_note)

    def on_reply_finished(self, message: ReplyFinished) -> None:
        reply = self._current(message.turn)
        if reply is None:
            return
        self._flush()
        text = reply.text
        if message.cancelled:
            status = f"cancelled after {reply.stats.tokens} tokens"
        else:
            status = f"{reply.stats.tokens} tokens · finished: {message.finish_reason}"
            if reply.closing_note:
                status += f" ({reply.closing_note})"
                self.notify(f"{reply.closing_note} — Ctrl+N starts a new chat", severity="warning")
            if message.cached_tokens is not None:
                status += f" · prompt {message.prompt_tokens} tokens, {message.cached_tokens} cached"
        reply.widget.finish(text, status)
        if reply.speculative:
            self.last_stats = reply.stats
            # a cancelled reply is kept, partial as it is, so the next turn continues from it
            self.history.append({"role": "assistant", "content": text})
            self.last_reply_speed = reply.stats.tokens_per_s
            self.last_reply_text = text
        else:
            same = text == self.last_reply_text if self.options.generation.temperature == 0 else None
            self.stats_panel.show_compare(self.last_reply_speed, reply.stats.tokens_per_s, same)
            if reply.stats.tokens_per_s is not None and not message.cancelled:
                # a plain run streamed to the screen like a reply: a fairer baseline than the start-up runs,
                # which had the cores to themselves while a reply shares them with rendering
                self.plain_tokens_per_s = reply.stats.tokens_per_s
                self.plain_note = "measured"
        self.reply = None
        self.busy = False
        # after a compare run the figures go back to the reply it was compared with
        self._refresh_stats()

    def on_reply_failed(self, message: ReplyFailed) -> None:
        reply = self._current(message.turn)
        if reply is None:
            return
        self._flush()
        reply.widget.fail(message.error)
        if reply.speculative and self.history and self.history[-1]["role"] == "user":
            # the prompt that failed (e.g. context full) leaves the conversation, so the next one can run
            self.history.pop()
        self.notify(message.error, title="generation failed", severity="error")
        self.reply = None
        self.busy = False
        self._refresh_stats()

    def on_calibration_finished(self, message: CalibrationFinished) -> None:
        self.plain_tokens_per_s = message.tokens_per_s
        self.plain_note = "measured"
        self._refresh_stats()

    def on_calibration_failed(self, message: CalibrationFailed) -> None:
        self.plain_tokens_per_s = None
        self.plain_note = "unmeasured (F5)"
        self.notify(message.error, title="plain-decoding calibration failed", severity="error")
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        stats = self.reply.stats if self.reply is not None else self.last_stats
        self.stats_panel.show(stats, self.plain_tokens_per_s, self.plain_note)

    # ---- actions ----------------------------------------------------------------------------

    def action_cancel(self) -> None:
        """Stop the running reply at its next cycle; what it has produced is kept."""
        if self.reply is not None:
            self.reply.cancel.set()

    def action_new_chat(self) -> None:
        """Forget the conversation and clear the view (a running reply is cancelled and discarded)."""
        if self.reply is not None:
            self.reply.cancel.set()
            self.reply = None
            self.busy = False
        self.history.clear()
        self.last_stats = ReplyStats()
        self.last_reply_speed = None
        self.last_reply_text = None
        self.transcript.remove_children()
        self._refresh_stats()
        self.stats_panel.show_compare(None, None, None)
        self.query_one(PromptInput).focus()

    def _can_rerun(self, nothing_yet: str) -> bool:
        """Whether the last prompt has a reply and nothing runs; if not, says why."""
        if self.busy:
            self.notify(BUSY_HINT, severity="warning")
            return False
        if not self.history or self.history[-1]["role"] != "assistant":
            self.notify(nothing_yet, severity="warning")
            return False
        return True

    def action_regenerate(self) -> None:
        """Drop the last reply and generate it again."""
        if not self._can_rerun("Nothing to regenerate yet."):
            return
        self.history.pop()
        replies = [
            w for w in self.transcript.query(AssistantMessage) if not (w.has_class("-compare") or w.has_class("-failed"))
        ]
        if replies:
            for widget in self.transcript.children[self.transcript.children.index(replies[-1]) :]:
                widget.remove()
        self._start_reply(self._conversation(), speculative=True)

    def action_compare(self) -> None:
        """Rerun the last prompt with plain decoding and put both speeds side by side."""
        if not self._can_rerun("Send a prompt first; compare reruns it with plain decoding."):
            return
        self._start_reply(self._conversation()[:-1], speculative=False)

    def action_toggle_colours(self) -> None:
        """Switch provenance colouring of tokens on or off."""
        self.screen.toggle_class("-monochrome")
        for chunk in self.screen.query(TokenChunk):
            chunk.refresh()

    def action_toggle_stats(self) -> None:
        self.stats_panel.display = not self.stats_panel.display

    def action_recalibrate(self) -> None:
        """Measure plain decoding again (after a queued reply, if one is running)."""
        self.plain_note = MEASURING
        self._refresh_stats()
        self._calibrate()

    async def action_quit(self) -> None:
        self.session_worker.closing.set()
        if self.reply is not None:
            self.reply.cancel.set()
        self.exit()

    def chat_commands(self) -> list[tuple[str, str, Any]]:
        """(name, help, callback) of every chat action, for the command palette."""
        return [
            ("New chat", "Clear the conversation and start over", self.action_new_chat),
            ("Regenerate", "Generate the last reply again", self.action_regenerate),
            ("Cancel generation", "Stop the running reply, keep what it produced", self.action_cancel),
            ("Compare with plain decoding", "Rerun the last prompt without drafts; both speeds side by side", self.action_compare),
            ("Toggle provenance colours", "Colour tokens by draft / bonus / plain", self.action_toggle_colours),
            ("Toggle stats panel", "Show or hide the live statistics", self.action_toggle_stats),
            ("Recalibrate plain decoding", "Measure the target's plain decoding speed again", self.action_recalibrate),
        ]
