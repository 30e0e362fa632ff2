"""Tool calling through dflash-serve with the official SDKs: the loop an agent runs (call, tool result, answer),
streamed and not, on the OpenAI and Anthropic APIs; bad tool input is a 400 naming the field.

The server serves a copy of the embedded target carrying the Hermes/Qwen2.5 template (tests/tool_fixtures.py)
with the embedded drafter, as test_server.py serves the embedded pair; replies are greedy and compared with
Session.chat on a fork of the same weights.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from dflash_gguf import Session, defaults
from dflash_gguf.server import ServerConfig
from test_server import serve

KEY = "sk-tools"
WEATHER_SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 24},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                                  "parameters": WEATHER_SCHEMA}}]
ANTHROPIC_TOOLS = [{"name": "get_weather", "description": "The current weather in a city", "input_schema": WEATHER_SCHEMA}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
RESULT = "18 degrees and sunny"


@pytest.fixture(scope="module")
def base(tool_targets):
    with Session(tool_targets.path("hermes"), drafter=defaults.embedded_drafter()) as s:
        yield s


@pytest.fixture(scope="module")
def url(base):
    session = base.fork()
    # as the agent recipe in docs/SERVER.md starts it: agents send their own model names
    with serve([session], ServerConfig(api_key=KEY, model_alias="smol-tools", accept_any_model=True)) as u:
        yield u
    session.close()


def test_openai_tool_loop_whole_and_streamed(oai, base):
    args = dict(model="smol-tools", tools=OPENAI_TOOLS, temperature=0.0, max_tokens=60)
    first = oai.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False, **args)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER_SCHEMA)
    # the reply is the Session's, token for token (greedy)
    ref = base.fork()
    try:
        expected = ref.chat(ASK, tools=OPENAI_TOOLS, tool_choice="required", parallel_tool_calls=False,
                            max_tokens=60, temperature=0.0)
    finally:
        ref.close()
    assert [(c.name, c.arguments) for c in expected.tool_calls] == [("get_weather", arguments)]

    # the same turn streamed: the id and name first, then the arguments in fragments that add up to the same
    pieces, finish = [], None
    for chunk in oai.chat.completions.create(messages=ASK, tool_choice="required", parallel_tool_calls=False,
                                             stream=True, **args):
        delta = chunk.choices[0].delta
        assert not delta.content
        pieces += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert pieces[0].index == 0 and pieces[0].id and pieces[0].function.name == "get_weather"
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None for p in pieces[1:])
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == arguments

    # the tool's result goes back, and the model answers in text
    history = [*ASK, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": RESULT}]
    answer = oai.chat.completions.create(messages=history, tool_choice="none", **args)
    assert answer.choices[0].finish_reason in ("stop", "length") and answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None
    streamed = "".join(c.choices[0].delta.content or "" for c in oai.chat.completions.create(
        messages=history, tool_choice="none", stream=True, **args) if c.choices)
    assert streamed == answer.choices[0].message.content


def test_anthropic_tool_loop_whole_and_streamed(claude):
    args = dict(model="smol-tools", tools=ANTHROPIC_TOOLS, max_tokens=60, extra_body={"temperature": 0.0})
    first = claude.messages.create(messages=ASK, tool_choice={"type": "any", "disable_parallel_tool_use": True}, **args)
    assert first.stop_reason == "tool_use"
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER_SCHEMA)

    with claude.messages.stream(messages=ASK, tool_choice={"type": "tool", "name": "get_weather",
                                                           "disable_parallel_tool_use": True}, **args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    (streamed_use,) = [b for b in final.content if b.type == "tool_use"]
    assert streamed_use.input == use.input  # assembled by the SDK from the input_json_delta fragments
    kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
    assert ("content_block_delta", "input_json_delta") in kinds

    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": RESULT}]}]
    answer = claude.messages.create(messages=history, tool_choice={"type": "none"}, **args)
    assert answer.stop_reason in ("end_turn", "max_tokens") and answer.content[0].type == "text"
    with claude.messages.stream(messages=history, tool_choice={"type": "none"}, **args) as stream:
        assert stream.get_final_text() == answer.content[0].text


BAD_OPENAI = [
    ({"tools": [{"type": "function", "function": {"parameters": {}}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]},
     "tools.0.function.parameters"),
    ({"tools": OPENAI_TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": OPENAI_TOOLS, "messages": [*ASK, {"role": "tool", "tool_call_id": "call_nope", "content": "x"}]},
     "messages.1.tool_call_id"),
    ({"tools": OPENAI_TOOLS, "tool_choice": "required", "regex": "x"}, "regex"),  # not a field of this API
    ({"tools": OPENAI_TOOLS, "tool_choice": "required", "grammar": "root ::= \"x\""}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "frobnicate": 1}}]}, "tools.0.function.frobnicate"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
]
BAD_ANTHROPIC = [
    ({"tools": [{"description": "no name", "input_schema": {"type": "object"}}]}, "tools.0.name"),
    ({"tools": [{"name": "f", "input_schema": {"type": "nonsense"}}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f"}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": ANTHROPIC_TOOLS, "messages": [*ASK, {"role": "assistant", "content": "ok"}, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_nope", "content": "x"}]}]}, "messages.2.content.0.tool_use_id"),
]


def test_bad_tool_input_is_a_400_naming_the_field(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        for extra, param in BAD_OPENAI:
            r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4} | extra)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], (extra, err)
        for extra, param in BAD_ANTHROPIC:
            r = c.post("/v1/messages", json={"model": "smol-tools", "messages": ASK, "max_tokens": 4} | extra)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and param in err["message"], (extra, err)
        # and the server keeps serving
        r = c.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "tools": OPENAI_TOOLS})
        assert r.status_code == 200


# what agents send: schemas written by their tool frameworks ($schema, closed objects, keywords llguidance does
# not implement), cache_control on system blocks and tools, metadata, strict function tools, usage in streams
AGENT_SCHEMA = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": False,
                "properties": {"file_path": {"type": "string", "maxLength": 40, "description": "absolute path"},
                               "env": {"type": "object", "propertyNames": {"pattern": "^[A-Z_]+$"},
                                       "additionalProperties": {"type": "string", "maxLength": 8}}},
                "required": ["file_path"]}


@pytest.mark.slow  # an 80-token tool call; test_agent_door replays real agents' requests quick
def test_an_agent_shaped_anthropic_request_streams(claude):
    tools = [{"name": "Read", "description": "Read a file", "input_schema": AGENT_SCHEMA},
             {**ANTHROPIC_TOOLS[0], "cache_control": {"type": "ephemeral"}}]
    with claude.messages.stream(
        model="claude-sonnet-4-5", max_tokens=80, tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
        system=[{"type": "text", "text": "You are a coding agent.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Open /etc/hosts please."}]}],
        metadata={"user_id": "session-1"}, extra_body={"temperature": 0.0},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    schema = AGENT_SCHEMA if use.name == "Read" else WEATHER_SCHEMA
    jsonschema.validate(use.input, schema)


@pytest.mark.slow  # an 80-token tool call; test_agent_door replays real agents' requests quick
def test_an_agent_shaped_openai_request_streams(oai):
    tools = [{"type": "function", "function": {"name": "read_file", "description": "Read a file", "strict": True,
                                               "parameters": AGENT_SCHEMA}}, *OPENAI_TOOLS]
    pieces, usage = [], None
    for chunk in oai.chat.completions.create(
        model="gpt-5-codex", messages=[{"role": "system", "content": "You are a coding agent."},
                                       {"role": "user", "content": "Open /etc/hosts please."}],
        tools=tools, tool_choice="required", parallel_tool_calls=True, max_tokens=80, temperature=0.0,
        stream=True, stream_options={"include_usage": True},
    ):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces += choice.delta.tool_calls or []
    assert usage is not None and usage.completion_tokens > 0
    first = [p for p in pieces if p.index == 0]
    name = first[0].function.name
    arguments = json.loads("".join(p.function.arguments or "" for p in first))
    jsonschema.validate(arguments, AGENT_SCHEMA if name == "read_file" else WEATHER_SCHEMA)


RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "The current weather in a city",
                    "parameters": WEATHER_SCHEMA}]


def test_responses_tool_loop_whole_and_streamed(oai):
    """/v1/responses: a function_call output item held to its schema, the same call streamed (the SDK's own
    accumulator agrees), then its function_call_output continuing the stored response to a text answer that
    is the chat route's answer to the same history."""
    args = dict(model="smol-tools", tools=RESPONSES_TOOLS, temperature=0.0, max_output_tokens=60)
    first = oai.responses.create(input=ASK[0]["content"], tool_choice="required", parallel_tool_calls=False, **args)
    assert first.status == "completed"
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER_SCHEMA)

    events = list(oai.responses.create(input=ASK[0]["content"], tool_choice="required", parallel_tool_calls=False,
                                       stream=True, **args))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == [i.type for i in first.output]
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(deltas) == json.loads(done.arguments) == arguments
    assert events[-1].type == "response.completed"
    with oai.responses.stream(input=ASK[0]["content"], tool_choice="required", parallel_tool_calls=False,
                              **args) as stream:
        final = stream.get_final_response()
    assert [json.loads(i.arguments) for i in final.output if i.type == "function_call"] == [arguments]

    answer = oai.responses.create(input=[{"type": "function_call_output", "call_id": call.call_id, "output": RESULT}],
                                  previous_response_id=first.id, tool_choice="none", **args)
    assert answer.output_text and not [i for i in answer.output if i.type == "function_call"]
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": RESULT}]
    chat = oai.chat.completions.create(messages=history, model="smol-tools", tools=OPENAI_TOOLS, tool_choice="none",
                                       temperature=0.0, max_tokens=60)
    assert answer.output_text == chat.choices[0].message.content
    # the first turn was still in the slot: only the tool result and the new turn were prefilled
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


BAD_RESPONSES = [
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools.0.name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "nonsense"}}]}, "tools.0.parameters"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools.0.type"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tools": RESPONSES_TOOLS, "input": [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}]},
     "input.0.call_id"),
    ({"tools": RESPONSES_TOOLS, "input": [{"type": "function_call", "call_id": "c1", "name": "get_weather",
                                           "arguments": "{not json"}]}, "input.0.arguments"),
]


def test_bad_responses_tool_input_is_a_400_naming_the_field(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        for extra, param in BAD_RESPONSES:
            r = c.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 4} | extra)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and param in err["message"], (extra, err)


def test_what_the_openai_sdk_sends_back_is_taken(oai):
    """An assistant turn of tool calls with content null (what model_dump() gives), system content as text
    parts, and the `developer` role newer clients send for the system turn."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    history = [{"role": "developer", "content": [{"type": "text", "text": "Be brief."}]}, *ASK,
               {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_1", "content": RESULT}]
    with_developer = oai.chat.completions.create(messages=history, model="smol-tools", tools=OPENAI_TOOLS,
                                                 tool_choice="none", temperature=0.0, max_tokens=12)
    as_system = oai.chat.completions.create(messages=[{"role": "system", "content": "Be brief."}, *history[1:]],
                                            model="smol-tools", tools=OPENAI_TOOLS, tool_choice="none",
                                            temperature=0.0, max_tokens=12)
    assert with_developer.choices[0].message.content == as_system.choices[0].message.content
