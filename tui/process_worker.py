"""The chat's Session in a worker process, so that no UI work can take the interpreter from the decoder.

The process (multiprocessing's spawn context: no forked threads or native state) opens the Session,
says it is ready or why it could not load, then runs one request at a time: a reply, whose Steps it
sends as they are committed (a Step pickles), then how the reply ended; a cache reset; close.
Cancellation is a shared counter the decode loop reads between cycles: every ticket up to it stops.
A reader thread on the app's side appends Steps to the reply's inbox; if the process dies, the reader
sees the pipe close and every reply still waiting fails with one line, so the UI never hangs on it.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Mapping, Sequence

from dflash_gguf.config import CacheOptions, GenerationConfig, SessionOptions
from dflash_gguf.rpc import EXIT_RPC_LOST
from dflash_gguf.steps import Step
from dflash_gguf.tui.messages import ReplyFailed
from dflash_gguf.tui.worker import Post, ReplyEnd, ReplyWorker, SessionInfo, run_reply

START_METHOD = "spawn"
# how long close() lets the process end a reply and free the models before it is terminated
CLOSE_WAIT_S = 10.0


@dataclass(frozen=True)
class SessionSpec:
    """The Session to open in the worker process: Session's own arguments (picklable). The prompt cache
    travels as its settings and is opened where the Session runs: a PromptCache holds a lock and live bytes."""

    target: Path | None = None
    drafter: Path | None = None
    options: SessionOptions = field(default_factory=SessionOptions)
    cache: CacheOptions = field(default_factory=CacheOptions)

    def open(self):
        from dflash_gguf.session import Session

        return Session(self.target, self.drafter, self.options, prompt_cache=self.cache.open())


def _serve(spec: SessionSpec, requests: Connection, events: Connection, cancelled_upto: Any) -> None:
    """The worker process: open the Session, then serve requests until close or the app goes away."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):  # the app owns the terminal: a warning printed here would scribble over the screen
        os.dup2(devnull, fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C belongs to the app, which closes this process
    try:
        session = spec.open()
    except Exception as error:  # a file that is not a usable target/drafter pair: one line to the app
        lines = str(error).strip().splitlines()
        events.send(("error", lines[0] if lines else type(error).__name__))
        return
    with session:
        events.send(("ready", SessionInfo.of(session)))
        while True:
            try:
                request = requests.recv()
            except EOFError:  # the app is gone
                return
            if request[0] == "close":
                return
            if request[0] == "reset":
                session.reset()
                continue
            _, ticket, messages, config, tools = request

            def emit(step: Step, ticket: int = ticket) -> None:
                events.send(("step", ticket, step))

            end = run_reply(session, ticket, messages, config, lambda t=ticket: cancelled_upto.value >= t, emit, tools)
            events.send(("end", end))


class ProcessWorker(ReplyWorker):
    """Opens the Session in a worker process and runs the chat's replies there.

    The constructor returns once the models are loaded; a Session that cannot open raises ValueError
    with its one-line reason (the CLI prints it and exits 2), a process that dies while loading RuntimeError.
    """

    def __init__(self, spec: SessionSpec) -> None:
        super().__init__()
        ctx = multiprocessing.get_context(START_METHOD)
        child_requests, self._requests = ctx.Pipe(duplex=False)
        self._events, child_events = ctx.Pipe(duplex=False)
        self._shared_cancel = ctx.Value("q", 0, lock=False)
        self._process = ctx.Process(
            target=_serve, args=(spec, child_requests, child_events, self._shared_cancel),
            name="dflash-chat-session", daemon=True,
        )
        self._process.start()
        # only the child holds these now: when it dies, our ends read EOF instead of waiting forever
        child_requests.close()
        child_events.close()
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[list[Step], Post]] = {}
        self._gone: str | None = None  # why the process cannot take requests any more
        self._closing = False
        try:
            kind, payload = self._events.recv()
        except (EOFError, OSError):
            self._process.join(5)
            self._close_pipes()
            raise RuntimeError(f"the generation process {self._exit_status()} while loading the models") from None
        if kind == "error":
            self._process.join(5)
            self._close_pipes()
            raise ValueError(payload)
        self.info: SessionInfo = payload
        self._reader = threading.Thread(target=self._read, name="dflash-chat-events", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def cancel(self, ticket: int) -> None:
        super().cancel(ticket)
        self._shared_cancel.value = self._cancelled_upto

    def reply(self, messages: Sequence[dict[str, Any]], config: GenerationConfig, inbox: list[Step], post: Post,
              tools: Mapping[str, Any] | None = None) -> int:
        ticket = self._ticket()
        with self._lock:
            failure = self._gone
            if failure is None:
                self._pending[ticket] = (inbox, post)
                try:
                    self._requests.send(("reply", ticket, list(messages), config, dict(tools) if tools else None))
                except OSError:
                    del self._pending[ticket]
                    failure = self._gone = f"the generation process {self._exit_status()}; restart dflash-chat"
        if failure is not None:
            post(ReplyFailed(ticket, failure))
        return ticket

    def reset(self) -> None:
        with self._lock:
            if self._gone is None:
                self._requests.send(("reset",))

    def _read(self) -> None:
        """Route the process's events to the replies they belong to, until its pipe closes."""
        try:
            while True:
                event = self._events.recv()
                if event[0] == "step":
                    _, ticket, step = event
                    pending = self._pending.get(ticket)
                    if pending is not None:
                        pending[0].append(step)
                else:
                    end: ReplyEnd = event[1]
                    with self._lock:
                        _, post = self._pending.pop(end.ticket, (None, None))
                    if post is not None:
                        post(end.message())
        except (EOFError, OSError):
            pass
        self._process.join(1)
        with self._lock:
            if self._gone is None:
                self._gone = f"the generation process {self._exit_status()}; restart dflash-chat"
            waiting, self._pending = self._pending, {}
        if not self._closing:
            for ticket, (_, post) in waiting.items():
                post(ReplyFailed(ticket, self._gone))

    def _exit_status(self) -> str:
        code = self._process.exitcode
        if code is None:
            return "stopped answering"
        if code == EXIT_RPC_LOST:  # its one line went to the null device with the rest of its stderr
            return f"lost an RPC server (exit status {code})"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"was killed by signal {-code}"
        return f"exited with status {code}"

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self.cancel(self._tickets)
        try:
            self._requests.send(("close",))
        except OSError:
            pass
        self._process.join(CLOSE_WAIT_S)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(2)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._reader.join(2)
        self._close_pipes()

    def _close_pipes(self) -> None:
        self._requests.close()
        self._events.close()
