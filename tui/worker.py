"""Where the chat's Session runs: what a reply worker promises the app, and the in-process (thread) worker.

The UI never touches the Session. It hands a worker a conversation, gets a ticket, and reads the reply's
Steps from an inbox (a list the worker appends to, drained by the app's timer); the end of the reply
arrives as one ReplyFinished or ReplyFailed message. A message per cycle made the UI thread wake for every
token, time the decode loop then waited for the interpreter. Cancellation is by ticket and checked
between cycles, so a cancelled reply keeps every token already committed. `ProcessWorker`
(tui/process_worker.py) keeps the same promises with the Session in another process.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from textual.message import Message

from dflash_gguf.chat import ChatRequest
from dflash_gguf.chat.reasoning import Thinking
from dflash_gguf.config import GenerationConfig
from dflash_gguf.session import Session
from dflash_gguf.stats import GenerationStats
from dflash_gguf.steps import Step
from dflash_gguf.tui.messages import ReplyFailed, ReplyFinished

Post = Callable[[Message], object]


def one_line(error: BaseException) -> str:
    """An exception as the single line the UI shows."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


@dataclass(frozen=True)
class SessionInfo:
    """What the chat shows about the Session it talks to (picklable: a worker process sends it)."""

    drafter_kind: str | None  # the drafter's source name (dflash, dflash2, dspark); None without one
    has_confidence_head: bool
    drafter_block_size: int | None
    lookup: bool  # whether n-gram lookup drafts (next to the drafter, or alone)
    device: str  # where the target's layers are: 'CPU', 'CUDA0 (NVIDIA GeForce RTX 4090)', ...
    chat_template: str | None = None  # the GGUF's: --tools is checked against it, a reply's calls read with it
    prompt_cache: bool = False  # whether the Session has a prompt cache (--cache-ram / --cache-dir)
    mtp: bool = False  # whether the target's own MTP heads draft (Session.mtp)
    source_names: tuple[str, ...] = ()  # every draft source of the Session, by name (a registry's too)

    def sources(self) -> list[str]:
        """The draft sources the Session was opened with, by their Step.source names: drafter, lookup, MTP,
        then any other it drafts with (a source of speculation.SOURCES)."""
        known = ([self.drafter_kind] if self.drafter_kind else []) + (["lookup"] if self.lookup else []) + \
            (["mtp"] if self.mtp else [])
        return known + [name for name in self.source_names if name not in known]

    @classmethod
    def of(cls, session: Session) -> "SessionInfo":
        d = session.drafter
        return cls(
            drafter_kind=None if d is None else d.kind,
            has_confidence_head=bool(d is not None and d.has_confidence_head),
            drafter_block_size=None if d is None else d.block_size,
            lookup=session.lookup,
            device=session.placement.device,
            chat_template=session.target.vocab.chat_template(),
            prompt_cache=session.prompt_cache is not None,
            mtp=session.mtp,
            source_names=tuple(s.name for s in session.sources),
        )


@dataclass(frozen=True)
class ReplyEnd:
    """How a reply ended: its finish reason, or cancelled, or failed with a one-line error."""

    ticket: int
    finish_reason: str | None = None
    cancelled: bool = False
    stats: GenerationStats | None = None  # the Session's stats of a reply that ran to its end
    error: str | None = None
    thinking: Thinking | None = None  # how the reply thought under the template (None: no thought to split)

    def message(self) -> Message:
        if self.error is not None:
            return ReplyFailed(self.ticket, self.error)
        return ReplyFinished(self.ticket, self.finish_reason, self.cancelled, self.stats, self.thinking)


def run_reply(
    session: Session,
    ticket: int,
    messages: Sequence[dict[str, str]],
    config: GenerationConfig,
    cancelled: Callable[[], bool],
    emit: Callable[[Step], object],
    tools: Mapping[str, Any] | None = None,
) -> ReplyEnd:
    """Stream one assistant reply to `messages` through the chat template (the chat floor's turn), emitting
    every Step as it is committed; the cached prefix of the last turn is reused. `tools`: the turn's tools and
    tool_choice. The end says how the reply thinks, so the app reads its thought apart from its answer.
    Never raises: a failure is the ReplyEnd's error."""
    if cancelled():
        return ReplyEnd(ticket, cancelled=True)
    finish_reason: str | None = None
    try:
        turn = session.prepare_chat(ChatRequest(list(messages), **(tools or {})), config)
        steps = session.stream_tokens(turn.tokens, turn.config)
        try:
            for step in steps:
                emit(step)
                finish_reason = step.finish_reason
                if finish_reason is None and cancelled():
                    return ReplyEnd(ticket, cancelled=True, thinking=turn.thinking)
        finally:
            steps.close()
    except Exception as error:  # any failure of the run is shown in the UI, which keeps running
        return ReplyEnd(ticket, error=one_line(error))
    return ReplyEnd(ticket, finish_reason, stats=session.last_stats, thinking=turn.thinking)


class ReplyWorker(ABC):
    """Runs the chat's replies, one at a time, away from the UI thread."""

    info: SessionInfo

    def __init__(self) -> None:
        self._tickets = 0
        self._cancelled_upto = 0  # every ticket <= this is cancelled

    def _ticket(self) -> int:
        self._tickets += 1
        return self._tickets

    def cancel(self, ticket: int) -> None:
        """Stop reply `ticket` at its next cycle (and every earlier one)."""
        self._cancelled_upto = max(self._cancelled_upto, ticket)

    @abstractmethod
    def reply(self, messages: Sequence[dict[str, Any]], config: GenerationConfig, inbox: list[Step], post: Post,
              tools: Mapping[str, Any] | None = None) -> int:
        """Start a reply; its Steps go to `inbox`, its end to `post` as ReplyFinished/ReplyFailed. Returns its ticket.
        `tools`: the tools and tool_choice the reply may call (stream_chat's arguments)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget the Session's caches once the running reply has ended (benchmarks: every run prefills)."""

    @abstractmethod
    def close(self) -> None:
        """Cancel what runs and release the Session's thread or process (not the Session: its owner closes it)."""

    def __enter__(self) -> "ReplyWorker":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ThreadWorker(ReplyWorker):
    """The Session in this process, each reply on its own thread; one Session call at a time (a lock)."""

    def __init__(self, session: Session) -> None:
        super().__init__()
        self._session = session
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self.info = SessionInfo.of(session)

    def reply(self, messages: Sequence[dict[str, Any]], config: GenerationConfig, inbox: list[Step], post: Post,
              tools: Mapping[str, Any] | None = None) -> int:
        ticket = self._ticket()
        self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(
            target=self._run, args=(ticket, list(messages), config, inbox, post, tools), name=f"reply-{ticket}",
            daemon=True,
        )
        self._threads.append(thread)
        thread.start()
        return ticket

    def _run(self, ticket: int, messages: list[dict[str, Any]], config: GenerationConfig, inbox: list[Step], post: Post,
             tools: Mapping[str, Any] | None) -> None:
        with self._lock:
            end = run_reply(self._session, ticket, messages, config, lambda: self._cancelled_upto >= ticket, inbox.append,
                            tools)
        post(end.message())

    def reset(self) -> None:
        with self._lock:
            self._session.reset()

    def close(self) -> None:
        self.cancel(self._tickets)
        for thread in self._threads:
            thread.join()
        self._threads.clear()
