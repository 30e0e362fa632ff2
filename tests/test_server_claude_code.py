"""What Claude Code sends, through the official anthropic SDK's beta client, against a real dflash-serve.

Claude Code opens its system prompt with a billing header whose `cch=` stamp changes on every request,
asks for extended thinking with a budget, sends context-management edits and replays earlier turns'
thinking blocks. Each is accepted, the reply is the Session's own for the same conversation without them,
and the stamp does not cut the cached prefix short.
"""

from __future__ import annotations

import anthropic
import pytest

from dflash_gguf.server import ServerConfig
from test_server import N, serve_forks

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
BETAS = ["claude-code-20250219", "interleaved-thinking-2025-05-14", "context-management-2025-06-27"]
GREEDY = {"temperature": 0}


def system_blocks(cch: str) -> list[dict]:
    return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.101.e51; cc_entrypoint=cli; cch={cch};"},
            {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral"}}]


def claude_code_request(cch: str, messages: list[dict]) -> dict:
    return dict(model="smol", max_tokens=N, betas=BETAS, system=system_blocks(cch), messages=messages,
                thinking={"type": "enabled", "budget_tokens": 1024}, metadata={"user_id": "user_abc_account_x"},
                context_management={"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
                extra_body=GREEDY)


@pytest.fixture(scope="module")
def claude(embedded_session):
    """One slot, so that a request's conversation is cached where the next one lands."""
    with serve_forks(embedded_session, ServerConfig(model_alias="smol", accept_any_model=False)) as url:
        yield anthropic.Anthropic(base_url=url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(embedded_session):
    s = embedded_session.fork()
    yield s
    s.close()


def reference(ref, messages: list[dict]) -> str:
    ref.reset()
    return ref.chat([{"role": "system", "content": SYSTEM}, *messages], max_tokens=N, temperature=0.0).text


QUESTION = [{"role": "user", "content": "What colour is the sky on a clear day?"}]


def test_a_claude_code_request_is_answered_as_the_conversation_without_its_extras(claude, ref):
    got = claude.beta.messages.create(**claude_code_request("a5145", QUESTION))
    assert got.content[0].text == reference(ref, QUESTION)


def test_the_billing_stamp_does_not_cut_the_cached_prefix(claude):
    """The stamp changes on every request: the second request still reuses its whole prompt but the last token."""
    claude.beta.messages.create(**claude_code_request("a5145", QUESTION))
    again = claude.beta.messages.create(**claude_code_request("0b3e9", QUESTION))
    # Anthropic's usage: the cached prompt tokens are cache_read_input_tokens, the uncached ones input_tokens
    assert again.timings["cache_n"] == again.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens == again.usage.input_tokens + again.usage.cache_read_input_tokens - 1


def test_earlier_thinking_blocks_are_left_out_of_the_prompt(claude, ref):
    first = reference(ref, QUESTION)
    follow_up = [{"role": "user", "content": "And at sunset?"}]
    history = [*QUESTION, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user asks about the sky.", "signature": "c2lnbmF0dXJl"},
        {"type": "redacted_thinking", "data": "ZW5jcnlwdGVk"},
        {"type": "text", "text": first}]}, *follow_up]
    got = claude.beta.messages.create(**claude_code_request("a5145", history))
    plain = [*QUESTION, {"role": "assistant", "content": first}, *follow_up]
    assert got.content[0].text == reference(ref, plain)


@pytest.mark.parametrize("change, field", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"context_management": {"edits": [{"type": "summarize_everything"}]}}, "context_management.edits.0.type"),
    ({"context_management": {"keep": 3}}, "context_management"),
])
def test_a_bad_thinking_or_context_edit_is_a_400_naming_the_field(claude, change, field):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.beta.messages.create(**(claude_code_request("a5145", QUESTION) | change))
    assert e.value.body["error"]["message"].startswith(f"{field}:")


def test_count_tokens_is_the_prompt_a_request_sends(claude):
    """Claude Code counts before it sends: the count is the input_tokens of the same request answered, and a
    request the Messages route refuses is refused here with the same field."""
    request = claude_code_request("a5145", QUESTION)
    counted = claude.beta.messages.count_tokens(model="smol", betas=BETAS, system=request["system"],
                                                messages=QUESTION, thinking=request["thinking"])
    usage = claude.beta.messages.create(**request).usage
    assert counted.input_tokens == usage.input_tokens + usage.cache_read_input_tokens
    tools = [{"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}]
    with pytest.raises(anthropic.BadRequestError) as e:  # the embedded model's template has no tool support
        claude.messages.count_tokens(model="smol", messages=QUESTION, tools=tools)
    assert e.value.body["error"]["message"].startswith("tools:")
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.count_tokens(model="another-model", messages=QUESTION)
