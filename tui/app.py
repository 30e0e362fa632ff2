"""The dflash-chat App: composes the transcript, prompt and stats panel, and drives the reply worker.

All Session work happens in a reply worker (tui/worker.py: a thread; tui/process_worker.py: a process).
The worker appends each Step to the reply's inbox; a timer drains it 5 times a second, appends the new
text to the token view in one piece per provenance run, and redraws the stats panel at most twice a
second, only when a figure changed. The UI costs the decoder as little as it can (docs/TUI.md has the
profile and the figures).

The speedup shown is always like for like (dflash_gguf.stats.Baseline): the reply's loop speed over plain
decoding measured under the same conditions, either the reply's own plain cycles or a compare run
(Ctrl+G) streamed through this UI. Without one the panel says "not measured yet".
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field, replace
from typing import Any

from textual import on
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer, Header, Input

from dflash_gguf.session import Session
from dflash_gguf.stats import Baseline, BaselineSource, GenerationStats
from dflash_gguf.steps import Step, StepKind
from dflash_gguf.chat.reply import ReplyReader
from dflash_gguf.chat.tool_calls import ToolCall, ToolPlan, plan_tools
from dflash_gguf.tui.commands import ChatCommands
from dflash_gguf.tui.messages import ReplyFailed, ReplyFinished
from dflash_gguf.tui.options import ChatOptions
from dflash_gguf.tui.provenance import pieces_of_steps
from dflash_gguf.tui.stats import ReplyStats
from dflash_gguf.tui.widgets import (
    AssistantMessage,
    PromptInput,
    StatsPanel,
    TokenChunk,
    Transcript,
    UserMessage,
    source_name,
)
from dflash_gguf.tui.worker import ReplyWorker, ThreadWorker

# how often buffered cycles are drawn: fast enough to look live, slow enough to batch many cycles
FLUSH_INTERVAL_S = 1 / 5
# the stats panel is redrawn at most this often (and only when a figure changed)
STATS_INTERVAL_S = 1 / 2
# while the app runs, the interpreter hands the GIL over this often (CPython's default is 5 ms): a decode
# loop on a thread of this process returns from every C call needing the GIL back, and a UI thread busy
# drawing held it that long each time (docs/TUI.md measures the effect)
GIL_SWITCH_INTERVAL_S = 0.0005
BUSY_HINT = "Still generating — Esc cancels it."
PROMPT_HINT = "Ask something — Enter sends, ↑ recalls"
NOT_MEASURED = BaselineSource.NONE.value


@dataclass
class Reply:
    """The reply being generated: its widget, counters and the cycles not drawn yet."""

    ticket: int
    widget: AssistantMessage
    speculative: bool
    # Steps appended by the worker, drained by the UI timer
    inbox: list[Step]
    stats: ReplyStats = field(default_factory=ReplyStats)
    parts: list[str] = field(default_factory=list)
    # why the Session stopped, when it says so in a closing Step that decoded nothing (the context is full)
    closing_note: str = ""
    # the stats version last drawn on the panel
    drawn: tuple[int, int] | None = None

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
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    def __init__(self, worker: ReplyWorker | Session, options: ChatOptions | None = None) -> None:
        """`worker` runs the replies; a Session is run on a ThreadWorker that the app closes when it exits
        (a worker passed in is closed by whoever opened it)."""
        super().__init__()
        self.options = options or ChatOptions()
        self._owns_worker = isinstance(worker, Session)
        self.worker: ReplyWorker = ThreadWorker(worker) if isinstance(worker, Session) else worker
        self.history: list[dict[str, Any]] = []
        # the calls of the last reply that still wait for their results (what the user sends next)
        self.pending_calls: list[ToolCall] = []
        # the reply's calls are read with the template's family (None without --tools)
        self.tool_plan: ToolPlan | None = plan_tools(
            self.worker.info.chat_template, list(self.options.tools), self.options.tool_choice
        ) if self.options.tools else None
        self.reply: Reply | None = None
        # a reply running, or one whose worker has not answered yet
        self.busy = False
        # what the panel shows when no reply runs: the last speculative reply's figures
        self.last_stats = ReplyStats()
        self.last_reply_speed: float | None = None
        self.last_reply_text: str | None = None
        # the Session's own figures of the last reply that ran to its end (measured where the Session runs)
        self.last_generation: GenerationStats | None = None
        # the loop speed of the last compare run: plain decoding streamed through this UI
        self.compare_plain_tokens_per_s: float | None = None
        self._stats_drawn_at = 0.0

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="body"):
            with Vertical(id="chat"):
                yield Transcript(id="transcript")
                yield PromptInput(placeholder=PROMPT_HINT, id="prompt")
            yield StatsPanel(self.worker.info, hide_timing=self.options.hide_timing, id="stats")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, GIL_SWITCH_INTERVAL_S))
        self.title = f"{self.TITLE} · {self.worker.info.device}"  # where it runs: CPU unless layers are offloaded
        self.sub_title = self._subtitle()
        self.set_interval(FLUSH_INTERVAL_S, self._flush)
        self._refresh_stats()
        self.query_one(PromptInput).focus()

    def on_unmount(self) -> None:
        if self.reply is not None:
            self.worker.cancel(self.reply.ticket)
        if self._owns_worker:
            self.worker.close()
        sys.setswitchinterval(self._switch_interval)

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
        info = self.worker.info
        drafts = " + ".join(source_name(s) for s in info.sources()) or "no drafts"
        return f"{drafts} · block {block} · {sampling} · max {gen.max_tokens} tokens"

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
        if self.pending_calls:  # what was typed is the result of the first call still waiting for one
            call = self.pending_calls.pop(0)
            self.history.append({"role": "tool", "tool_call_id": call.id, "content": prompt})
            self.transcript.mount(UserMessage(prompt, role=f"tool result · {call.name}"))
            self._ask_for_results()
            if self.pending_calls:
                return
        else:
            self.history.append({"role": "user", "content": prompt})
            self.transcript.mount(UserMessage(prompt))
        self._start_reply(self._conversation(), speculative=True)

    def _ask_for_results(self) -> None:
        """The prompt box says which call's result it takes next (or, with none waiting, asks for a prompt)."""
        prompt = self.query_one(PromptInput)
        call = self.pending_calls[0] if self.pending_calls else None
        prompt.placeholder = PROMPT_HINT if call is None else f"The result of {call.name} — Enter sends it"

    def _conversation(self) -> list[dict[str, Any]]:
        system = [{"role": "system", "content": self.options.system}] if self.options.system else []
        return system + self.history

    def _start_reply(self, messages: list[dict[str, Any]], *, speculative: bool) -> None:
        role = "assistant" if speculative else "assistant · plain decoding (compare)"
        widget = AssistantMessage(role)
        if not speculative:
            widget.add_class("-compare")
        # the worker's messages are handled on this thread, after this method: the reply is set by then
        inbox: list[Step] = []
        config = replace(self.options.generation, speculative=speculative)
        ticket = self.worker.reply(messages, config, inbox, self.post_message, self.options.tool_arguments)
        self.reply = Reply(ticket, widget, speculative, inbox)
        self.transcript.mount(widget)
        self.busy = True
        self._show_stats(self.reply.stats)

    def _show_stats(self, stats: ReplyStats) -> None:
        baseline = Baseline.choose(stats.in_reply_plain_tokens_per_s, self.compare_plain_tokens_per_s)
        self.stats_panel.show(stats, baseline)

    def _current(self, ticket: int) -> Reply | None:
        """The reply a worker message belongs to, or None if that reply was discarded (new chat)."""
        return self.reply if self.reply is not None and self.reply.ticket == ticket else None

    def _flush(self, *, final: bool = False) -> None:
        """Draw what the worker committed since the last flush: text every time, the panel at a bounded rate."""
        reply = self.reply
        if reply is None or not reply.widget.ready:
            return
        n = len(reply.inbox)
        if n:
            steps = reply.inbox[:n]
            del reply.inbox[:n]  # the worker may be appending: only what was read goes
            for step in steps:
                reply.stats.observe(step)
                reply.parts.append(step.text)
                if step.kind is StepKind.CONTEXT_FULL:
                    reply.closing_note = step.reason
            if reply.widget.has_class("-waiting"):
                reply.widget.wait(None)
            pieces = pieces_of_steps(steps)
            if pieces:
                reply.widget.append(pieces)
        now = time.monotonic()
        version = reply.stats.version()
        if version != reply.drawn and (final or now - self._stats_drawn_at >= STATS_INTERVAL_S):
            reply.drawn = version
            self._stats_drawn_at = now
            self._show_stats(reply.stats)

    def on_reply_finished(self, message: ReplyFinished) -> None:
        reply = self._current(message.ticket)
        if reply is None:
            return
        if not reply.widget.ready:  # a reply that ended before its widget was composed
            self.set_timer(FLUSH_INTERVAL_S, lambda: self.on_reply_finished(message))
            return
        if message.stats is not None:
            reply.stats.prompt_cache = message.stats.prompt_cache
        self._flush(final=True)
        text = reply.text
        if message.cancelled:
            status = f"cancelled after {reply.stats.tokens} tokens"
        else:
            status = f"{reply.stats.tokens} tokens · finished: {message.finish_reason}"
            if reply.closing_note:
                status += f" ({reply.closing_note})"
                self.notify(f"{reply.closing_note} — Ctrl+N starts a new chat", severity="warning")
            if message.stats is not None:
                self.last_generation = message.stats
                status += f" · prompt {message.stats.n_prompt_tokens} tokens, {message.stats.n_cached_tokens} cached"
        # the chat floor's reader: a thinking model's thought apart from the answer, and the calls (not of a
        # cancelled reply, whose last call may be cut short)
        tools = None if message.cancelled else self.tool_plan
        thought, content, calls = "", text, []
        if message.thinking is not None or tools is not None:
            thought, content, calls = ReplyReader(message.thinking, tools).read(text)
        answer = content or "" if calls or message.thinking is not None else text
        reply.widget.finish(answer, status, thought=thought)
        reply.widget.show_calls(calls)
        if reply.speculative:
            self.last_stats = reply.stats
            # a cancelled reply is kept, partial as it is, so the next turn continues from it
            turn: dict[str, Any] = {"role": "assistant", "content": answer}
            if thought:
                turn["reasoning_content"] = thought
            if calls:
                turn["tool_calls"] = [c.openai() for c in calls]
            self.history.append(turn)
            self.pending_calls = list(calls)
            self._ask_for_results()
            self.last_reply_speed = reply.stats.tokens_per_s
            self.last_reply_text = text
        else:
            same = text == self.last_reply_text if self.options.generation.temperature == 0 else None
            self.stats_panel.show_compare(self.last_reply_speed, reply.stats.tokens_per_s, same)
            if reply.stats.tokens_per_s is not None and not message.cancelled:
                # plain decoding streamed through this UI, as a reply is: the baseline of later replies
                # that have too few plain cycles of their own
                self.compare_plain_tokens_per_s = reply.stats.tokens_per_s
        self.reply = None
        self.busy = False
        # after a compare run the figures go back to the reply it was compared with
        self._refresh_stats()

    def on_reply_failed(self, message: ReplyFailed) -> None:
        reply = self._current(message.ticket)
        if reply is None:
            return
        if not reply.widget.ready:
            self.set_timer(FLUSH_INTERVAL_S, lambda: self.on_reply_failed(message))
            return
        self._flush(final=True)
        reply.widget.fail(message.error)
        if reply.speculative and self.history and self.history[-1]["role"] == "user":
            # the prompt that failed (e.g. context full) leaves the conversation, so the next one can run
            self.history.pop()
        self.notify(message.error, title="generation failed", severity="error")
        self.reply = None
        self.busy = False
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        self._show_stats(self.reply.stats if self.reply is not None else self.last_stats)

    # ---- actions ----------------------------------------------------------------------------

    def action_cancel(self) -> None:
        """Stop the running reply at its next cycle; what it has produced is kept."""
        if self.reply is not None:
            self.worker.cancel(self.reply.ticket)

    def action_new_chat(self) -> None:
        """Forget the conversation and clear the view (a running reply is cancelled and discarded)."""
        if self.reply is not None:
            self.worker.cancel(self.reply.ticket)
            self.reply = None
            self.busy = False
        self.history.clear()
        self.pending_calls.clear()
        self._ask_for_results()
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
        self.pending_calls.clear()
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
            chunk.restyle()

    def action_toggle_stats(self) -> None:
        self.stats_panel.display = not self.stats_panel.display

    async def action_quit(self) -> None:
        if self.reply is not None:
            self.worker.cancel(self.reply.ticket)
        self.exit()

    def chat_commands(self) -> list[tuple[str, str, Any]]:
        """(name, help, callback) of every chat action, for the command palette."""
        return [
            ("New chat", "Clear the conversation and start over", self.action_new_chat),
            ("Regenerate", "Generate the last reply again", self.action_regenerate),
            ("Cancel generation", "Stop the running reply, keep what it produced", self.action_cancel),
            ("Compare with plain decoding", "Rerun the last prompt without drafts; both speeds side by side", self.action_compare),
            ("Toggle provenance colours", "Colour tokens by drafter / lookup / mtp / bonus / plain", self.action_toggle_colours),
            ("Toggle stats panel", "Show or hide the live statistics", self.action_toggle_stats),
        ]
