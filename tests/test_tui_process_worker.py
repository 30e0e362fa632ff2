"""dflash-chat with its Session in a worker process (ProcessWorker): the real app, the real Session in a
spawned process, Steps pickled across the pipe. Replies, Esc, Ctrl+G, Ctrl+R and Ctrl+N behave as with the
thread worker; a worker that dies is an error in the UI, never a hang; a bad file is one clear error."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import time
from dataclasses import dataclass
from typing import Any

import pytest
from textual.pilot import Pilot
from textual.widgets import Static

from dflash_gguf.session import Session
from dflash_gguf.tui.app import ChatApp
from dflash_gguf.config import SessionOptions
from dflash_gguf.tui.process_worker import ProcessWorker, SessionSpec
from test_tui_app import (
    LONG_PROMPT, SHORT_PROMPT, figures, number, options, press_and_wait, replies, run_app, send, send_and_wait,
    shown_markdown, wait_for,
)

pytestmark = pytest.mark.slow  # spawns the worker process and generates long replies through it


@pytest.fixture(scope="module")
def spec(dflash_gguf_path) -> SessionSpec:
    return SessionSpec(None, dflash_gguf_path, SessionOptions(n_ctx=1024, n_threads=1))


@dataclass(frozen=True)
class HeldSpec(SessionSpec):
    """A SessionSpec whose k-th reply, once it has shown some text, waits in the worker process for
    `releases[k]` (a multiprocessing Event the test sets): mid-reply however fast the machine decodes."""

    releases: tuple[Any, ...] = ()

    def open(self):
        session = super().open()
        stream_chat, releases, replied = session.stream_chat, self.releases, [0]

        def held(*args, **kwargs):
            release = releases[replied[0]] if replied[0] < len(releases) else None
            replied[0] += 1
            text = ""
            for step in stream_chat(*args, **kwargs):
                yield step
                text += step.text
                if release is not None and len(text) > 8:
                    release.wait()

        session.stream_chat = held
        return session


def held_spec(spec: SessionSpec, replies_held: int) -> HeldSpec:
    events = tuple(multiprocessing.get_context("spawn").Event() for _ in range(replies_held))
    return HeldSpec(spec.target, spec.drafter, spec.options, spec.cache, releases=events)


@pytest.fixture(scope="module")
def worker(spec):
    with ProcessWorker(spec) as w:
        yield w


def test_replies_cancel_compare_regenerate_and_new_chat_run_in_the_worker_process(worker, spec) -> None:
    assert worker.info.drafter_kind == "dflash" and worker.pid != os.getpid()
    app = ChatApp(worker, options(max_tokens=16))
    with spec.open() as local:  # the same reply generated in this process, for comparison
        want = local.chat([{"role": "user", "content": SHORT_PROMPT}], max_tokens=16, block_size=4).text

    async def scenario(pilot: Pilot) -> None:
        await send_and_wait(pilot, SHORT_PROMPT)
        [reply] = replies(app)
        # greedy: the Steps that crossed the pipe are the reply this process would have generated
        assert reply.tokens.text == want == shown_markdown(reply)
        assert number(figures(app)["drafted"]) >= 3
        assert app.last_generation is not None and app.last_generation.loop_tokens_per_s > 0
        await press_and_wait(pilot, "ctrl+g")
        assert shown_markdown(replies(app)[-1]) == want
        assert figures(app)["plain"].endswith("compare")
        await press_and_wait(pilot, "ctrl+r")
        assert [shown_markdown(r) for r in replies(app)] == [want]  # the compare run went with the reply

    run_app(app, scenario)


def test_escape_and_new_chat_stop_a_reply_in_the_worker_process(spec) -> None:
    """Each of the two long replies is held in the worker after its first text until Esc / Ctrl+N has
    landed, so both land while the worker still decodes."""
    held = held_spec(spec, replies_held=2)
    escape_pressed, new_chat_pressed = held.releases
    worker = ProcessWorker(held)
    # the holds, not the length, keep the long replies running; SHORT_PROMPT's reply runs to max_tokens,
    # here and in the worker, so it is kept short
    max_tokens = 48
    app = ChatApp(worker, options(max_tokens=max_tokens))
    with spec.open() as local:
        want = local.chat([{"role": "user", "content": SHORT_PROMPT}], max_tokens=max_tokens, block_size=4).text

    async def scenario(pilot: Pilot) -> None:
        # Esc mid-reply: the worker stops at its next cycle and the partial reply is kept
        await send(pilot, LONG_PROMPT)
        await wait_for(pilot, lambda: app.reply is not None and len(app.reply.widget.tokens.text) > 8, "streamed text")
        await pilot.press("escape")
        escape_pressed.set()
        await wait_for(pilot, lambda: not app.busy, "the cancelled reply to stop")
        assert "cancelled after" in str(replies(app)[-1].query_one(".status", Static).content)
        # Ctrl+N while a reply streams discards it; the next prompt gets its own reply
        await send(pilot, LONG_PROMPT)
        await wait_for(pilot, lambda: app.reply is not None and len(app.reply.widget.tokens.text) > 8, "the reply to start")
        await pilot.press("ctrl+n")
        new_chat_pressed.set()
        await send_and_wait(pilot, SHORT_PROMPT)
        assert [shown_markdown(r) for r in replies(app)] == [want]

    try:
        run_app(app, scenario)
    finally:
        for release in held.releases:
            release.set()
        worker.close()


def test_a_worker_that_dies_is_an_error_in_the_ui_never_a_hang(spec) -> None:
    worker = ProcessWorker(held_spec(spec, replies_held=1))  # the reply is held until the process is killed
    app = ChatApp(worker, options(max_tokens=200))

    async def scenario(pilot: Pilot) -> None:
        await send(pilot, LONG_PROMPT)
        await wait_for(pilot, lambda: app.reply is not None and len(app.reply.widget.tokens.text) > 8, "the reply to start")
        os.kill(worker.pid, signal.SIGKILL)
        await wait_for(pilot, lambda: not app.busy, "the failure to reach the UI")
        [failed] = replies(app)
        assert failed.has_class("-failed")
        assert "killed by SIGKILL" in str(failed.query_one(".status", Static).content)
        # the next prompt fails at once with the same reason instead of waiting for a process that is gone
        started = time.monotonic()
        await send_and_wait(pilot, SHORT_PROMPT)
        assert time.monotonic() - started < 30
        assert replies(app)[-1].has_class("-failed")
        assert "restart dflash-chat" in str(replies(app)[-1].query_one(".status", Static).content)

    try:
        run_app(app, scenario)
    finally:
        worker.close()


def test_a_bad_file_is_one_clear_error_and_no_process_is_left(tmp_path) -> None:
    bogus = tmp_path / "notes.gguf"
    bogus.write_text("this is not a model\n")
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="not a GGUF file") as raised:
        ProcessWorker(SessionSpec(bogus))
    assert len(str(raised.value).splitlines()) == 1
    assert set(multiprocessing.active_children()) <= before, "the worker process that failed to load is gone"


def test_steps_and_stats_cross_the_pipe_as_the_session_made_them(spec) -> None:
    """What the worker sends: every Step of a reply and the Session's stats, unchanged by pickling."""
    with Session(spec.target, spec.drafter, spec.options) as local:
        messages = [{"role": "user", "content": SHORT_PROMPT}]
        steps = list(local.stream_chat(messages, max_tokens=8, block_size=4))
        stats = local.last_stats
    assert pickle.loads(pickle.dumps(steps)) == steps
    assert pickle.loads(pickle.dumps(stats)) == stats
