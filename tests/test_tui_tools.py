"""dflash-chat with --tools: a reply's calls are shown as calls, and what the user sends next is each call's
result, rendered into the template's tool turn before the model answers. Real app (Textual's Pilot), real
Session on the Hermes-template copy of the embedded target (tests/tool_fixtures.py), greedy replies.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from textual.widgets import Static

from dflash_gguf.config import GenerationConfig, SessionOptions
from dflash_gguf.defaults import embedded_drafter
from dflash_gguf.session import Session
from dflash_gguf.tui.app import PROMPT_HINT, ChatApp
from dflash_gguf.tui.cli import main as chat_main
from dflash_gguf.tui.options import ChatOptions
from dflash_gguf.tui.process_worker import ProcessWorker, SessionSpec
from dflash_gguf.tui.widgets import UserMessage
from test_tui_app import press_and_wait, run_app, send_and_wait

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}


@pytest.fixture(scope="module")
def session(tool_targets):
    with Session(tool_targets.path("hermes"), drafter=embedded_drafter(), n_ctx=1024) as s:
        yield s


@pytest.mark.slow  # 15 s a worker: the fast tier keeps under 5 minutes
@pytest.mark.parametrize("where", ["thread", "process"])
def test_calls_are_shown_as_calls_and_the_next_line_is_their_result(session, tool_targets, where):
    options = ChatOptions(generation=GenerationConfig(max_tokens=48, temperature=0.0), tools=(WEATHER,),
                          tool_choice="required")
    if where == "thread":
        app = ChatApp(session, options)
    else:  # the tools cross the pipe to the worker process with each reply
        worker = ProcessWorker(SessionSpec(tool_targets.path("hermes"), embedded_drafter(), SessionOptions(n_ctx=1024)))
        app = ChatApp(worker, options)

    async def scenario(pilot):
        await send_and_wait(pilot, "What is the weather in Paris?")
        shown = [w.render().plain if hasattr(w.render(), "plain") else str(w.render())
                 for w in app.query(".tool-call").results(Static)]
        assert shown and all(line.startswith("⚙ get_weather(") for line in shown)
        turn = app.history[-1]
        assert turn["role"] == "assistant" and len(turn["tool_calls"]) == len(shown) == len(app.pending_calls)
        for call in turn["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), WEATHER["function"]["parameters"])
        assert "get_weather" in app.query_one("#prompt").placeholder
        # one result per call; the last one sends the conversation back to the model
        for _ in range(len(app.pending_calls) - 1):
            app.query_one("#prompt").focus()
            await pilot.press(*"18 degrees", "enter")
        app.query_one("#prompt").focus()
        await pilot.press(*"18 degrees")
        await press_and_wait(pilot, "enter")
        results = [m for m in app.query(UserMessage) if m.role.startswith("tool result")]
        assert [m.role for m in results] == ["tool result · get_weather"] * len(shown)
        tool_turns = [m for m in app.history if m["role"] == "tool"]
        assert [m["tool_call_id"] for m in tool_turns] == [c["id"] for c in turn["tool_calls"]]
        assert app.history[-1]["role"] == "assistant"

    try:
        run_app(app, scenario)
    finally:
        if where == "process":
            worker.close()


def test_new_chat_forgets_waiting_calls(session):
    options = ChatOptions(generation=GenerationConfig(max_tokens=48, temperature=0.0), tools=(WEATHER,),
                          tool_choice="required")
    app = ChatApp(session, options)

    async def scenario(pilot):
        await send_and_wait(pilot, "Weather in Rome?")
        assert app.pending_calls
        await pilot.press("ctrl+n")
        await pilot.pause()
        assert not app.pending_calls and app.query_one("#prompt").placeholder == PROMPT_HINT

    run_app(app, scenario)


def test_tools_on_a_template_without_tool_support_is_one_line(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text(json.dumps([WEATHER]))
    assert chat_main(["--tools", str(tools), "--worker", "thread"]) == 2  # the embedded SmolLM2 template
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("dflash-chat: error: --tools") and "no tool support" in err[-1]


def test_a_tools_file_that_is_not_a_list_of_tools_is_one_line(tmp_path, capsys):
    tools = tmp_path / "tools.json"
    tools.write_text('{"name": "f"}')
    with pytest.raises(SystemExit) as e:
        chat_main(["--tools", str(tools)])
    assert e.value.code == 2 and "must hold a JSON list of tools" in capsys.readouterr().err
