"""Tool calling in the Session: each family's template renders the tools and the history, the grammar holds
the calls to their schemas (so even SmolLM2-135M writes calls that parse), and speculation stays lossless.

Targets: copies of the embedded SmolLM2 GGUF carrying each family's real template (tests/tool_fixtures.py),
with the embedded drafter (it pairs by weights, which the copies share).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from dflash_gguf import Session, defaults
from dflash_gguf.constraints import Constraint, ConstraintSpec, compile_grammar
from dflash_gguf.chat.tool_calls import FAMILIES, ToolError, detect_family, plan_tools, prepare_messages
from tool_fixtures import FAMILIES as FIXTURE_FAMILIES
from upstream import LLAMA_CPP_SRC

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time now in a timezone",
                                          "parameters": {"type": "object", "properties": {"tz": {"type": "string", "maxLength": 16}},
                                                         "required": ["tz"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def sessions(tool_targets):
    """One Session per family, opened on first use, with the embedded drafter."""
    opened: dict[str, Session] = {}

    def get(family: str) -> Session:
        if family not in opened:
            opened[family] = Session(tool_targets.path(family), drafter=defaults.embedded_drafter())
        return opened[family]

    yield get
    for s in opened.values():
        s.close()


def schema_of(tool):
    return tool["function"]["parameters"]


# -- recognising the templates, checking the request ------------------------------------------------------
def test_each_fixture_template_is_read_as_its_family(tool_targets):
    assert {f.name for f in FAMILIES} == set(FIXTURE_FAMILIES)
    for family in FIXTURE_FAMILIES:
        assert detect_family(tool_targets.template(family)).name == family


# templates with <tool_call> / [TOOL_CALLS] / Llama headers whose call syntax is not the family's (upstream's
# models/templates): each is refused with the reason, never parsed in the wrong syntax
LOOK_ALIKES = ["GLM-4.6", "MiniMax-M3", "poolside-Laguna-XS.2", "Spark2.5", "Mistral-Small-3.2-24B-Instruct-2506",
               "meetkai-functionary-medium-v3.1", "fireworks-ai-llama-3-firefunction-v2", "google-gemma-4-31B-it"]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_look_alike_templates_are_refused_not_misread(name):
    template = (LLAMA_CPP_SRC / "models" / "templates" / f"{name}.jinja").read_text()
    assert detect_family(template) is None
    with pytest.raises(ToolError, match="none of the known families"):
        plan_tools(template, [WEATHER])


def test_a_template_without_tools_is_a_clear_error():
    with Session() as s:  # the embedded SmolLM2 template takes no tools
        with pytest.raises(ToolError, match="no tool support") as e:
            s.chat(ASK, tools=[WEATHER])
        assert e.value.field == "tools"
        assert s.tool_plan(None) is None  # no tools: nothing to plan, chat as before


@pytest.mark.parametrize("tools, choice, field, words", [
    ([{"type": "function", "function": {"parameters": {}}}], None, "tools[0].function.name", "non-empty name"),
    ([{"type": "function", "function": {"name": "a b"}}], None, "tools[0].function.name", "letters"),
    ([{"type": "retrieval"}], None, "tools[0].type", "function tools"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}],
     None, "tools[0].function.parameters", "does not compile"),
    ([WEATHER, WEATHER], None, "tools", "must differ"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name", "no tool is named"),
    ([WEATHER], "sometimes", "tool_choice", "must be"),
    (None, "required", "tool_choice", "needs tools"),
])
def test_bad_tools_name_the_field(tool_targets, tools, choice, field, words):
    with pytest.raises(ToolError, match=words) as e:
        plan_tools(tool_targets.template("hermes"), tools, choice)
    assert e.value.field == field


@pytest.mark.parametrize("messages, field, words", [
    ([{"role": "user", "content": "hi"}, {"role": "tool", "tool_call_id": "call_x", "content": "18C"}],
     "messages[1].tool_call_id", "no earlier assistant tool call"),
    ([{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}],
     "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]}],
     "messages[0].tool_calls[0].id", "needs an id"),
])
def test_bad_tool_history_names_the_field(messages, field, words):
    with pytest.raises(ToolError, match=words) as e:
        prepare_messages(messages)
    assert e.value.field == field


# -- rendering ----------------------------------------------------------------------------------------------
def test_the_template_renders_the_tools_the_calls_and_their_results(sessions):
    s = sessions("hermes")
    history = [*ASK,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    prompt, _ = s.render_chat(history, tools=s.tool_plan([WEATHER]).tools)
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather"' in prompt
    # the arguments (a JSON string in the OpenAI shape) are an object to the template, as it writes them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>' in prompt
    assert "<tool_response>\n18 degrees, sunny\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


# -- the grammar ----------------------------------------------------------------------------------------------
def test_auto_is_lazy_free_text_until_the_opener_then_only_a_call(sessions):
    s = sessions("hermes")
    plan = s.tool_plan([WEATHER, CLOCK], "auto")
    tok = s.target.vocab.constraint_tokenizer()
    c = Constraint(tok, ConstraintSpec("grammar", compile_grammar("grammar", plan.grammar)), s.target.n_vocab)
    c.commit(s.target.vocab.tokenize("Sure, I can look that up: {not a call} ", add_special=False))
    assert c.allowed().sum() > 1000 and not c.forced()  # free text, braces and all
    c.commit(s.target.vocab.tokenize("<tool_call>", add_special=False))
    forced = b"".join(s.target.vocab.token_bytes(t) for t in c.forced()).decode()
    assert forced == '\n{"name": "get_'  # the opener leaves a call to one of the tools, nothing else
    c.commit(s.target.vocab.tokenize(forced + "time", add_special=False))
    assert b"".join(s.target.vocab.token_bytes(t) for t in c.forced()).decode().startswith('", "arguments": {"tz":')


# hermes in the fast tier; the other families (each its own model and drafter calibration) in the slow one
EVERY_FAMILY = [f if f == "hermes" else pytest.param(f, marks=pytest.mark.slow) for f in FIXTURE_FAMILIES]


@pytest.mark.parametrize("family", EVERY_FAMILY)
def test_required_calls_parse_and_follow_the_schema_in_every_family(sessions, family):
    s = sessions(family)
    r = s.chat(ASK, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert r.finish_reason == "tool_calls", r.text
    (call,) = r.tool_calls
    assert call.name in ("get_weather", "get_time")
    jsonschema.validate(call.arguments, schema_of(WEATHER if call.name == "get_weather" else CLOCK))
    assert call.id and call.openai()["function"]["arguments"] == json.dumps(call.arguments, ensure_ascii=False)
    assert not r.content


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3-coder", "mistral"])
def test_a_named_tool_choice_calls_that_tool(sessions, family):
    s = sessions(family)
    r = s.chat(ASK, tools=[WEATHER, CLOCK], tool_choice={"type": "function", "function": {"name": "get_time"}},
               parallel_tool_calls=False, max_tokens=60)
    assert [c.name for c in r.tool_calls] == ["get_time"], r.text
    jsonschema.validate(r.tool_calls[0].arguments, schema_of(CLOCK))
    if family == "mistral":
        assert len(r.tool_calls[0].id) == 9 and r.tool_calls[0].id.isalnum()  # the template's rule for ids


@pytest.mark.slow
def test_tool_choice_none_and_auto_answer_in_text(sessions):
    s = sessions("llama3")
    none = s.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=12)
    assert none.tool_calls == () and none.finish_reason != "tool_calls"
    auto = s.chat([{"role": "user", "content": "Say hello."}], tools=[WEATHER], max_tokens=12)
    assert auto.tool_calls == () and auto.content == auto.text


def test_tools_and_a_grammar_exclude_each_other(sessions):
    with pytest.raises(ToolError, match="not both") as e:
        sessions("hermes").chat(ASK, tools=[WEATHER], tool_choice="required", regex="[a-z]+")
    assert e.value.field == "tools"


# -- lossless under speculation, streamed as llama_cpp streams --------------------------------------------------
@pytest.mark.parametrize("family, choice", [
    ("hermes", "required"), pytest.param("hermes", "auto", marks=pytest.mark.slow),
    pytest.param("qwen3-coder", "required", marks=pytest.mark.slow),  # lazy raw-text values in the grammar
])
def test_greedy_speculative_output_equals_plain_under_the_tool_grammar(sessions, family, choice):
    s = sessions(family)
    args = dict(tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=72, temperature=0.0)
    s.reset()
    plain = s.chat(ASK, speculative=False, **args)
    s.reset()
    spec = s.chat(ASK, **args)
    assert spec.tokens == plain.tokens
    assert [(c.name, c.arguments) for c in spec.tool_calls] == [(c.name, c.arguments) for c in plain.tool_calls]
    if choice == "required":
        assert spec.tool_calls and spec.stats.n_drafted > 0  # the call was drafted, not decoded token by token


def test_create_chat_completion_streams_the_calls_as_llama_cpp_deltas(sessions):
    s = sessions("hermes")
    args = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, temperature=0.0)
    s.reset()
    whole = s.create_chat_completion(ASK, **args)
    s.reset()
    chunks = list(s.create_chat_completion(ASK, stream=True, **args))
    (choice,) = whole["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant"} and chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    parts = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert parts[0]["id"].startswith("call_") and parts[0]["function"]["name"] == "get_weather"
    assert len(parts) > 1  # the arguments come in fragments as they are written
    assert json.loads("".join(p["function"]["arguments"] for p in parts)) == json.loads(call["function"]["arguments"])
    assert not any(d.get("content") for d in deltas)


@pytest.mark.slow
def test_a_tool_loop_call_result_answer(sessions):
    s = sessions("qwen3-coder")
    first = s.chat(ASK, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60)
    (call,) = first.tool_calls
    history = [*ASK, {"role": "assistant", "content": first.content, "tool_calls": [call.openai()]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    answer = s.chat(history, tools=[WEATHER], tool_choice="none", max_tokens=16)
    assert answer.tool_calls == () and answer.text
    prompt, _ = s.render_chat(history, tools=s.tool_plan([WEATHER]).tools)
    assert f"<function={call.name}>" in prompt and "<tool_response>\n18 degrees and sunny\n</tool_response>" in prompt
