"""Reasoning: thinking templates recognised by their markers, the thought split from the answer however the
reply streams, and a constrained reply (tools, a JSON schema) held after the thought rather than instead of it.

The templates are upstream llama.cpp's (models/templates/); the grammars run in llguidance over the embedded
target's real vocabulary.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_gguf.checks import SettingError
from dflash_gguf.constraints import Constraint, ConstraintSpec, compile_grammar, schema_text
from dflash_gguf.chat.reasoning import Thinking, check_chat_template_kwargs, json_answer, thinking_for
from dflash_gguf.chat.reply import ReplyReader, Thought
from dflash_gguf.chat.tool_calls import CallDelta, plan_tools
from dflash_gguf.chat.turn import turn_config
from tool_fixtures import TEMPLATES
from upstream import LLAMA_CPP_SRC

UPSTREAM = LLAMA_CPP_SRC / "models/templates"
QWEN35 = Thinking("<think>", "</think>", opened=True)  # the prompt ended with "<think>\n"
QWEN3 = Thinking("<think>", "</think>", opened=False)  # the model may open a thought itself
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}


@pytest.mark.parametrize("template, markers", [
    ("Qwen3.5-4B.jinja", ("<think>", "</think>")),
    ("Qwen-Qwen3-0.6B.jinja", ("<think>", "</think>")),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", ("<think>", "</think>")),
    ("HuggingFaceTB-SmolLM3-3B.jinja", ("<think>", "</think>")),
    ("mistralai-Ministral-3-14B-Reasoning-2512.jinja", ("[THINK]", "[/THINK]")),
    ("ByteDance-Seed-OSS.jinja", ("<seed:think>", "</seed:think>")),
])
def test_thinking_templates_are_known_by_their_markers(template, markers):
    text = (UPSTREAM / template).read_text()
    start, end = markers
    assert thinking_for(text, "<|im_start|>assistant\n" + start + "\n") == Thinking(start, end, opened=True)
    assert thinking_for(text, "<|im_start|>assistant\n") == Thinking(start, end, opened=False)  # the model may open one
    assert thinking_for(text, "<|im_start|>assistant\n" + start + "\n\n" + end + "\n\n") is None  # thinking off


def test_templates_without_a_thought_have_no_thinking():
    assert thinking_for((TEMPLATES / "hermes.jinja").read_text(), "<|im_start|>assistant\n") is None
    assert thinking_for(None, "anything") is None


def split(thinking: Thinking, chunks: list[str]) -> tuple[str, str, list[str], list[str]]:
    """The thought and answer the reply reader gives, whole and per chunk (the last: what finish() gave)."""
    reader = ReplyReader(thinking, None)

    def parts(pieces: list) -> tuple[str, str]:
        return "".join(p.text for p in pieces if isinstance(p, Thought)), "".join(p for p in pieces if isinstance(p, str))

    thoughts, answers = [], []
    for pieces in [*(reader.feed(chunk) for chunk in chunks), reader.finish()]:
        thought, answer = parts(pieces)
        thoughts.append(thought)
        answers.append(answer)
    return "".join(thoughts), "".join(answers), thoughts, answers


REPLIES = [
    # (thinking, reply, thought, answer)
    (QWEN35, "Paris is in France.\n</think>\n\nThe capital is Paris.", "Paris is in France.", "The capital is Paris."),
    (QWEN35, "\nstill thinking about </thi", "still thinking about </thi", ""),  # never closed: all thought
    (QWEN35, "a < b and b <</think>done", "a < b and b <", "done"),
    (QWEN35, "</think>\n\nAt once.", "", "At once."),
    (QWEN3, "<think>\nHmm.\n</think>\n\nHi!", "Hmm.", "Hi!"),
    (QWEN3, "  Hi, no thought here.", "", "  Hi, no thought here."),
    (QWEN3, "<thin", "", "<thin"),  # ended before it became a marker: answer text
    (QWEN3, "Answer first <think>not a thought</think>", "", "Answer first <think>not a thought</think>"),
]


@pytest.mark.parametrize("thinking, reply, thought, answer", REPLIES)
def test_the_thought_is_split_from_the_answer(thinking, reply, thought, answer):
    assert split(thinking, [reply])[:2] == (thought, answer)


@settings(max_examples=300, deadline=None)
@given(case=st.sampled_from(REPLIES), cuts=st.lists(st.integers(0, 80), max_size=12))
def test_any_chunking_of_a_reply_gives_the_same_split(case, cuts):
    """However the reply arrives (token by token, a marker cut in two), the pieces add up to the same split, and
    no piece of a marker is ever given out as thought or answer."""
    thinking, reply, thought, answer = case
    bounds = sorted({min(c, len(reply)) for c in cuts} | {0, len(reply)})
    chunks = [reply[a:b] for a, b in zip(bounds, bounds[1:])]
    got_thought, got_answer, thoughts, _ = split(thinking, chunks)
    assert (got_thought, got_answer) == (thought, answer)
    assert all(thinking.end not in t for t in thoughts)


def test_tokens_in_thought_count_up_to_the_end_marker():
    assert QWEN35.tokens_in_thought(["Let", " me", " see", "</", "think", ">", "\n\n", "Yes"]) == 6
    assert QWEN35.tokens_in_thought(["never", " done"]) == 2
    assert QWEN3.tokens_in_thought(["<think>", "x", "</think>", "y"]) == 3
    assert QWEN3.tokens_in_thought(["Plain", " answer"]) == 0


def test_a_reply_reader_gives_the_thought_then_the_calls():
    """The thought is split off before the calls are read: a call the model only thinks about is not a call."""
    plan = plan_tools((UPSTREAM / "Qwen3.5-4B.jinja").read_text(), [WEATHER], "auto")
    reader = ReplyReader(QWEN35, plan)
    reply = ("I could write <tool_call> here, but not yet.\n</think>\n\n"
             "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
    pieces = [p for i in range(0, len(reply), 7) for p in reader.feed(reply[i:i + 7])] + reader.finish()
    assert "".join(p.text for p in pieces if isinstance(p, Thought)) == "I could write <tool_call> here, but not yet."
    assert not [p for p in pieces if isinstance(p, str) and p]
    assert [p.name for p in pieces if isinstance(p, CallDelta) and p.name] == ["get_weather"]
    assert [(c.name, c.arguments) for c in reader.calls] == [("get_weather", {"city": "Paris"})]


def decoded(target, tokens):
    return b"".join(target.vocab.token_bytes(t) for t in tokens).decode()


@pytest.mark.parametrize("choice", ["required", "auto"])
def test_a_tool_grammar_holds_the_reply_after_the_thought(embedded_session, choice):
    """Inside the thought anything goes, the call opener included; after the end marker the tools' grammar
    holds the reply as it would without thinking (forced: a call to the tool, its name written for free)."""
    target = embedded_session.target
    plan = plan_tools((TEMPLATES / "hermes.jinja").read_text(), [WEATHER], choice)
    grammar = QWEN35.constrain_after(plan.grammar)
    c = Constraint(target.vocab.constraint_tokenizer(), ConstraintSpec("grammar", compile_grammar("grammar", grammar)),
                   target.n_vocab)
    c.commit(target.vocab.tokenize("Should I write <tool_call> now? Later.\n", add_special=False))
    assert c.allowed().sum() > 1000 and not c.forced()
    c.commit(target.vocab.tokenize("</think>\n\n<tool_call>", add_special=False))
    assert decoded(target, c.forced()) == '\n{"name": "get_weather", "arguments": {"city":'
    if choice == "required":  # without a thought the forced grammar admits only a call from the first token
        bare = Constraint(target.vocab.constraint_tokenizer(), ConstraintSpec("grammar", compile_grammar("grammar", plan.grammar)),
                          target.n_vocab)
        assert bare.valid_prefix(target.vocab.tokenize("Should I", add_special=False)) == 0


def test_a_json_schema_holds_the_reply_after_the_thought(embedded_session):
    target = embedded_session.target
    schema = schema_text({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                          "additionalProperties": False})
    grammar = QWEN35.constrain_after(json_answer(schema))
    c = Constraint(target.vocab.constraint_tokenizer(), ConstraintSpec("grammar", compile_grammar("grammar", grammar)),
                   target.n_vocab)
    c.commit(target.vocab.tokenize("It wants {json}, so: </thin", add_special=False))
    assert c.allowed().sum() > 1000  # still the thought: "</thin" is not the marker yet
    c.commit(target.vocab.tokenize("k>\n\n{", add_special=False))
    assert c.allowed().sum() < 1000  # the schema now: whitespace or its one key
    answer = target.vocab.tokenize(' "n": 7}', add_special=False)
    assert c.valid_prefix(answer) == len(answer)
    assert c.valid_prefix(target.vocab.tokenize(' "m": 7}', add_special=False)) < len(answer)


def test_a_forced_call_may_follow_a_thought_the_model_opens_itself(embedded_session):
    """Where the prompt left no thought open (Qwen3, SmolLM3), the model may open one before a forced call, or
    call at once: the thought is optional, blank space before it allowed."""
    target = embedded_session.target
    grammar = QWEN3.constrain_after(plan_tools((TEMPLATES / "hermes.jinja").read_text(), [WEATHER], "required").grammar)
    for reply in ("<think>\nI should <tool_call> now.\n</think>\n\n<tool_call>", "<tool_call>", "\n<think>x</think><tool_call>"):
        c = Constraint(target.vocab.constraint_tokenizer(), ConstraintSpec("grammar", compile_grammar("grammar", grammar)),
                       target.n_vocab)
        c.commit(target.vocab.tokenize(reply, add_special=False))
        assert decoded(target, c.forced()) == '\n{"name": "get_weather", "arguments": {"city":', reply
    c = Constraint(target.vocab.constraint_tokenizer(), ConstraintSpec("grammar", compile_grammar("grammar", grammar)),
                   target.n_vocab)
    assert c.valid_prefix(target.vocab.tokenize("Sure", add_special=False)) == 0  # free text is still no answer


@pytest.mark.parametrize("tools, choice", [(None, None), ([WEATHER], "none")])
@pytest.mark.parametrize("thinking", [QWEN35, QWEN3])
def test_a_json_schema_is_held_after_the_thought_with_or_without_tools(thinker, tools, choice, thinking):
    """A JSON schema with no tools, or beside tools that constrain nothing (tool_choice "none"), follows the
    thought: the config carries the wrapped grammar, not the bare schema."""
    from dflash_gguf.config import GenerationConfig

    config = GenerationConfig.build(None, json_schema={"type": "object"})
    got = turn_config(config, thinker.tool_plan(tools, choice), thinking)
    assert got.json_schema is None and "thought[lazy]" in got.grammar and "%json" in got.grammar


def test_a_grammar_to_follow_a_thought_must_be_lark_with_one_start_rule():
    with pytest.raises(ValueError, match="one start rule"):
        QWEN35.constrain_after("root ::= \"x\"")


@pytest.mark.parametrize("kwargs, field, words", [
    ({"enable_thinking": "false"}, "chat_template_kwargs.enable_thinking", "true or false"),
    ({"messages": []}, "chat_template_kwargs.messages", "set by the server"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt", "set by the server"),
    ({"not a name": 1}, "chat_template_kwargs.not a name", "variable name"),
])
def test_bad_template_variables_name_the_field(kwargs, field, words):
    with pytest.raises(SettingError, match=words) as e:
        check_chat_template_kwargs(kwargs)
    assert e.value.field == field


@pytest.fixture(scope="module")
def thinker(tool_targets):
    """The embedded target with Qwen3.5's thinking template (its prompt ends inside `<think>`)."""
    from dflash_gguf import Session

    with Session(tool_targets.thinking(), drafter=None, n_threads=1) as s:
        yield s


def test_enable_thinking_false_closes_the_thought_in_the_prompt(thinker):
    """The Session renders template variables: Qwen3.5's prompt ends inside a thought unless told otherwise."""
    on, _ = thinker.render_chat([{"role": "user", "content": "Hi"}])
    off, _ = thinker.render_chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"enable_thinking": False})
    assert thinking_for(thinker.target.vocab.chat_template(), on).opened
    assert thinking_for(thinker.target.vocab.chat_template(), off) is None
    assert off.endswith("<think>\n\n</think>\n\n")
    with pytest.raises(SettingError):
        thinker.render_chat([{"role": "user", "content": "Hi"}], chat_template_kwargs={"tools": []})


ASK = [{"role": "user", "content": "What is the capital of France?"}]


def test_session_chat_gives_the_thought_apart(thinker):
    """SmolLM2 under Qwen3.5's template answers inside the thought it was left in, and never closes it."""
    r = thinker.chat(ASK, max_tokens=16, temperature=0.0)
    assert r.reasoning == r.text.strip() and r.reasoning and r.content == ""
    off = thinker.chat(ASK, max_tokens=16, temperature=0.0, chat_template_kwargs={"enable_thinking": False})
    assert off.reasoning is None and off.content is None and off.text  # no thought to split: the reply as it is


def test_session_tool_calls_come_after_the_thought(thinker):
    """create_chat_completion with tools reads the thought first (message.reasoning_content); the forced call
    waits for the thought to end, which SmolLM2's never does, and comes at once with thinking off."""
    args = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0.0)
    # the two compared below both keep the prompt from the Session's cache (prefilled whole or kept, a prompt's
    # last logits can part at a near tie: the CPU backend's batched and single-row kernels differ, README)
    thinker.create_chat_completion(ASK, **{**args, "max_tokens": 1})
    thinking = thinker.create_chat_completion(ASK, **args)["choices"][0]
    assert thinking["message"]["reasoning_content"] and "tool_calls" not in thinking["message"]
    streamed = list(thinker.create_chat_completion(ASK, stream=True, **args))
    thought = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in streamed)
    assert thought == thinking["message"]["reasoning_content"]
    off = thinker.create_chat_completion(ASK, chat_template_kwargs={"enable_thinking": False}, **args)["choices"][0]
    assert off["finish_reason"] == "tool_calls" and "reasoning_content" not in off["message"]
    assert [c["function"]["name"] for c in off["message"]["tool_calls"]] == ["get_weather"]
