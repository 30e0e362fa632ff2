"""A thinking model through dflash-serve with the official SDKs: the thought given apart from the answer on every
API (OpenAI reasoning_content, Anthropic thinking blocks, Responses reasoning items), whole and streamed; thinking
turned off per request; earlier thoughts given back to the template; bad reasoning fields a 400 naming them.

The server serves a copy of the embedded target carrying Qwen3.5's chat template (tests/tool_fixtures.py): its
prompt ends inside `<think>`, so SmolLM2's whole reply is a thought ("The capital of France is Paris.", then its
end of turn): it never writes `</think>` by itself, and a grammar makes it where a test needs a thought that
ends. Replies are greedy. Replies compared with each other are all warm: a prompt prefilled whole in one batch
and the same prompt kept from the slot (its last token decoded alone) can part at a near tie, as the CPU
backend's batched and single-row kernels differ (README), so each comparison starts with warm(), which leaves
the prompt in the slot.
"""

from __future__ import annotations

import httpx
import pytest

from dflash_gguf import Session, defaults
from dflash_gguf.server import ServerConfig
from test_server import serve

KEY = "sk-think"
ASK = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = dict(model="smol-think", temperature=0.0)
# a thought of lowercase words that ends, then an answer: the grammar makes SmolLM2 close its thought
ENDS = '%llguidance {}\nstart: /[a-z ]{4,24}/ "\\n</think>\\n\\n" /[A-Z][a-z ]{3,20}/\n'
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]


@pytest.fixture(scope="module")
def url(tool_targets):
    with Session(tool_targets.thinking(), drafter=defaults.embedded_drafter(), n_threads=1) as s:
        with serve([s], ServerConfig(api_key=KEY, model_alias="smol-think", accept_any_model=True)) as u:
            yield u


def reasoning(message) -> str | None:
    return (message.model_extra or {}).get("reasoning_content")


def warm(oai, **request) -> None:
    """Leave this request's prompt in the slot, so the next ones with it all keep it and decode alike."""
    oai.chat.completions.create(**{**GREEDY, **request, "max_tokens": 1})


def test_openai_gives_the_thought_apart_whole_and_streamed(oai):
    warm(oai, messages=ASK)
    raw = oai.chat.completions.create(messages=ASK, max_tokens=12, extra_body={"reasoning_format": "none"}, **GREEDY)
    text = raw.choices[0].message.content
    assert text and reasoning(raw.choices[0].message) is None  # "none": the reply as written, in the content

    r = oai.chat.completions.create(messages=ASK, max_tokens=12, **GREEDY)
    assert r.choices[0].finish_reason == raw.choices[0].finish_reason
    assert reasoning(r.choices[0].message) == text.strip() and r.choices[0].message.content == ""

    thought, content = "", ""
    for chunk in oai.chat.completions.create(messages=ASK, max_tokens=12, stream=True, **GREEDY):
        if chunk.choices:
            thought += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (thought, content) == (text.strip(), "")


def test_a_thought_that_ends_is_followed_by_the_answer(oai):
    warm(oai, messages=ASK)
    raw = oai.chat.completions.create(messages=ASK, max_tokens=40, extra_body={"grammar": ENDS, "reasoning_format": "none"},
                                      **GREEDY).choices[0].message.content
    thought, answer = raw.split("\n</think>\n\n")
    r = oai.chat.completions.create(messages=ASK, max_tokens=40, extra_body={"grammar": ENDS}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    assert (reasoning(r.choices[0].message), r.choices[0].message.content) == (thought.strip(), answer)
    kinds = []  # each delta carries one of the two, the thought first
    for chunk in oai.chat.completions.create(messages=ASK, max_tokens=40, stream=True, extra_body={"grammar": ENDS},
                                             **GREEDY):
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta and (delta.content or (delta.model_extra or {}).get("reasoning_content")):
            kinds.append("content" if delta.content else "thought")
    assert kinds[0] == "thought" and kinds[-1] == "content" and kinds == sorted(kinds, key=lambda k: k == "content")


def test_thinking_turned_off_answers_at_once(oai, claude):
    warm(oai, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    off = oai.chat.completions.create(messages=ASK, max_tokens=12, extra_body={"chat_template_kwargs": {"enable_thinking": False}},
                                      **GREEDY)
    effort = oai.chat.completions.create(messages=ASK, max_tokens=12, reasoning_effort="none", **GREEDY)
    answer = off.choices[0].message.content
    assert answer and reasoning(off.choices[0].message) is None
    assert effort.choices[0].message.content == answer and reasoning(effort.choices[0].message) is None
    # "none" wins over the template variable, as in llama-server
    both = oai.chat.completions.create(messages=ASK, max_tokens=1, reasoning_effort="none",
                                       extra_body={"chat_template_kwargs": {"enable_thinking": True}}, **GREEDY)
    assert both.usage.prompt_tokens == off.usage.prompt_tokens
    # the template closed the thought in the prompt ("<think>\n\n</think>\n\n" where it ended with "<think>\n")
    on = oai.chat.completions.create(messages=ASK, max_tokens=1, **GREEDY)
    assert off.usage.prompt_tokens > on.usage.prompt_tokens

    warm(oai, messages=ASK, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    msg = claude.messages.create(model="smol-think", messages=ASK, max_tokens=12, thinking={"type": "disabled"},
                                 extra_body={"temperature": 0.0})
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == answer


def test_anthropic_gives_the_thought_as_a_thinking_block(oai, claude):
    warm(oai, messages=ASK)
    thought = reasoning(oai.chat.completions.create(messages=ASK, max_tokens=12, **GREEDY).choices[0].message)
    args = dict(model="smol-think", messages=ASK, max_tokens=12, extra_body={"temperature": 0.0})
    msg = claude.messages.create(**args)
    assert [(b.type, b.thinking, b.signature) for b in msg.content] == [("thinking", thought, "")]
    with claude.messages.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert [(b.type, b.thinking) for b in final.content] == [("thinking", thought)]  # the SDK's own accumulation
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert set(deltas) == {"thinking_delta", "signature_delta"} and deltas[-1] == "signature_delta"


def test_responses_give_the_thought_as_a_reasoning_item(oai):
    warm(oai, messages=ASK)
    thought = reasoning(oai.chat.completions.create(messages=ASK, max_tokens=12, **GREEDY).choices[0].message)
    args = dict(model="smol-think", input=ASK[0]["content"], temperature=0.0, max_output_tokens=12)
    r = oai.responses.create(**args)
    assert [i.type for i in r.output] == ["reasoning"]
    assert [c.text for c in r.output[0].content] == [thought] and r.output[0].summary == []
    assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens > 0  # every token was thought
    with oai.responses.stream(**args) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
    assert [c.text for c in final.output[0].content] == [thought]

    off = oai.responses.create(**args, reasoning={"effort": "none"})
    assert [i.type for i in off.output] == ["message"] and off.usage.output_tokens_details.reasoning_tokens == 0

    # the reasoning item goes back in the input before the call it led to; the template renders it in the loop
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    loop = [{"role": "user", "content": ASK[0]["content"]}, call,
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
    sizes = [oai.responses.create(model="smol-think", temperature=0.0, max_output_tokens=1, tools=tools,
                                  input=items).usage.input_tokens
             for items in (loop, [loop[0], r.output[0].model_dump(exclude_none=True), *loop[1:]])]
    assert sizes[1] > sizes[0]


def test_tools_are_called_after_the_thought(oai):
    """tool_choice required holds the reply after the thought: SmolLM2 thinks, never ends its thought, and
    calls nothing; with thinking off, the call comes at once."""
    args = dict(messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=60, **GREEDY)
    warm(oai, **args)
    thinking = oai.chat.completions.create(**args)
    assert thinking.choices[0].finish_reason != "tool_calls" and thinking.choices[0].message.tool_calls is None
    assert reasoning(thinking.choices[0].message)
    # reasoning_format "none" changes what comes back, not the grammar: the same reply, the thought in the content
    raw = oai.chat.completions.create(**args, extra_body={"reasoning_format": "none"})
    assert raw.choices[0].message.content.strip() == reasoning(thinking.choices[0].message)
    off = oai.chat.completions.create(**args, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in off.choices[0].message.tool_calls] == ["get_weather"]


def test_an_earlier_thought_goes_back_to_the_template(oai, claude):
    """In a tool loop, Qwen3.5's template renders the assistant turn's thought: given back (OpenAI
    reasoning_content, an Anthropic thinking block), the prompt holds it."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    turn = {"role": "assistant", "content": None, "tool_calls": [call]}
    loop = [*ASK, turn, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    bare = oai.chat.completions.create(messages=loop, tools=TOOLS, max_tokens=1, **GREEDY)
    loop[1] = {**turn, "reasoning_content": "I should look up the weather in Paris first."}
    kept = oai.chat.completions.create(messages=loop, tools=TOOLS, max_tokens=1, **GREEDY)
    assert kept.usage.prompt_tokens > bare.usage.prompt_tokens

    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    thinking = {"type": "thinking", "thinking": "I should look up the weather in Paris first.", "signature": ""}
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}
    tools = [{"name": "get_weather", "input_schema": WEATHER}]
    count = [claude.messages.count_tokens(model="smol-think", tools=tools, messages=[
        *ASK, {"role": "assistant", "content": blocks}, result]).input_tokens for blocks in ([use], [thinking, use])]
    assert count[1] > count[0]


BAD = [
    ("/v1/messages", {"messages": [*ASK, {"role": "assistant", "content": [{"type": "thinking", "thinking": 5}]},
                                   {"role": "user", "content": "Go on"}]}, "messages.1.content.0.thinking"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ("/v1/chat/completions", {"chat_template_kwargs": {"enable_thinking": "no"}}, "chat_template_kwargs.enable_thinking"),
    ("/v1/chat/completions", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("/v1/chat/completions", {"reasoning_format": "sideways"}, "reasoning_format"),
    ("/v1/responses", {"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ("/v1/responses", {"reasoning": {"budget": 3}}, "reasoning.budget"),
    ("/v1/responses", {"input": [{"role": "user", "content": "Hi"}, {"type": "reasoning", "id": "rs_1", "summary": [],
                                                                       "content": [{"type": "text", "text": "x"}]}]},
     "input.1.content.0"),
]


def test_bad_reasoning_fields_are_a_400_naming_them(url):
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        for route, extra, param in BAD:
            body = {"input": "Hi", "max_output_tokens": 4} if route == "/v1/responses" else \
                {"model": "smol-think", "messages": ASK, "max_tokens": 4}
            r = c.post(route, json=body | extra)
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param, (extra, r.json())
