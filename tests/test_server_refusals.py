"""Refusals in each API's own terms (issue 35, the probe's items 3 and 6): what was a 500, a refusal during the
generation in the grammar engine's words, or a 400 naming the chat request's field instead of the request's,
is a 400 naming the request's own field, on every API; each refusal leaves one line in the server's log. And
/metrics counts /v1/responses under its own route and reuse of a slot's live context as a prompt-cache hit.

The server serves the Hermes-template copy of the embedded target (tests/tool_fixtures.py), no drafter.
"""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from dflash_gguf import Session
from dflash_gguf.prompt_cache import PromptCache
from dflash_gguf.server import ServerConfig
from test_chat_floor import DEEP
from test_server import serve

KEY = "sk-refusals"
HEADERS = {"Authorization": f"Bearer {KEY}", "x-api-key": KEY, "content-type": "application/json"}


@pytest.fixture(scope="module")
def url(tool_targets):
    with Session(tool_targets.path("hermes"), drafter=None, lookup=False, n_ctx=512,
                 prompt_cache=PromptCache(ram_bytes=64 << 20)) as session:
        with serve([session], ServerConfig(api_key=KEY, model_alias="smol", accept_any_model=True)) as u:
            yield u


def post(url: str, path: str, body: dict | str) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    return httpx.post(url + path, content=content.encode(), headers=HEADERS, timeout=120)


def refused(response: httpx.Response, param: str, words: str = "") -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param, error
    assert words in error["message"], error


SURROGATE = '"a\\ud800"'  # valid JSON, not valid Unicode text


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}], "max_tokens": 2}', "messages.0.content"),
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}', "prompt"),
    ("/v1/messages", '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": %s}]}',
     "messages.0.content"),
    ("/v1/messages/count_tokens", '{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", '
     '"text": %s}]}]}', "messages.0.content.0.text"),
    ("/v1/responses", '{"input": [{"role": "user", "content": %s}], "max_output_tokens": 2}', "input.0.content"),
    ("/v1/responses/input_tokens", '{"input": %s}', "input"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(url, path, body, param):
    refused(post(url, path, body % SURROGATE), param, "not valid Unicode")


ASK = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "deep", "parameters": DEEP}}]}, "tools.0.function.parameters"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": ASK, "tools": [{
        "name": "deep", "input_schema": DEEP}]}, "tools.0.input_schema"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "deep", "parameters": DEEP}]},
     "tools.0.parameters"),
    ("/v1/chat/completions", {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": DEEP}}}, "response_format.json_schema.schema"),
])
def test_a_schema_nested_past_the_limit_is_a_400_naming_it(url, path, body, param):
    refused(post(url, path, body), param, "deeper than 128")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "grammar": 'root ::= "a" root'}, "grammar"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "grammar": 'root ::= "a" root'}, "grammar"),
    ("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}}, "response_format.json_schema.schema"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": ASK, "output_config": {"format": {
        "type": "json_schema", "schema": {"$ref": "#"}}}}, "output_config.format.schema"),
    ("/v1/responses", {"input": "Hi", "max_output_tokens": 4, "text": {"format": {
        "type": "json_schema", "name": "x", "schema": {"$ref": "#"}}}}, "text.format.schema"),
])
def test_a_grammar_with_no_finite_reply_is_refused_up_front(url, path, body, param):
    """Unbounded recursion passes llguidance's compile and fails at the first mask or token: it was refused
    only during the generation (NoExtensionBias, the 50,000-item limit), naming no field."""
    refused(post(url, path, body), param, "recurses without end")


def test_anthropic_names_its_own_blocks(url):
    body = {"model": "m", "max_tokens": 2, "system": "Be brief.", "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "input": {}}]}]}
    refused(post(url, "/v1/messages", body), "messages.1.content.0.name", "name")


def test_responses_name_their_input_items(url):
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "[1]"}
    body = {"input": [{"role": "user", "content": "Weather?"}, call,
                      {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]}
    refused(post(url, "/v1/responses", body), "input.1.arguments", "JSON object")
    refused(post(url, "/v1/responses", {"input": "word " * 600}), "input", "context holds 512")


SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "get_weather", "parameters": SCHEMA}}], "tool_choice": {"type": "function", "function": {
            "name": "nope"}}}, "tool_choice.function.name"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": ASK, "tools": [{
        "name": "get_weather", "input_schema": SCHEMA}], "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ("/v1/responses", {"input": "Hi", "tools": [{"type": "function", "name": "get_weather", "parameters": SCHEMA}],
                       "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
])
def test_a_tool_choice_naming_no_tool_is_refused_in_each_apis_terms(url, path, body, param):
    """The chat floor names it tool_choice.function.name; each API's rename table gives its own path."""
    refused(post(url, path, body), param, "nope")


def test_openai_chat_names_a_history_calls_arguments(url):
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "[1]"}}
    body = {"messages": [ASK[0], {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], "max_tokens": 2}
    refused(post(url, "/v1/chat/completions", body), "messages.1.tool_calls.0.function.arguments", "JSON object")


LONG = "word " * 600  # over the context of 512


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/completions", {"prompt": LONG}, "prompt"),
    ("/v1/messages", {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": LONG}]}, "messages"),
    ("/v1/responses", {"input": [{"role": "user", "content": LONG}]}, "input"),
])
def test_a_prompt_over_the_context_names_each_apis_conversation(url, path, body, param):
    refused(post(url, path, body), param, "context holds 512")


def test_a_logit_bias_that_bans_every_token_is_refused_naming_it(url):
    ban = {str(t): float("-inf") for t in range(49152)}
    refused(post(url, "/v1/chat/completions", {"messages": ASK, "max_tokens": 2, "temperature": 0.7,
                                               "logit_bias": ban}), "logit_bias", "bans every token")


def test_a_refusal_leaves_one_line_in_the_log(url, caplog):
    with caplog.at_level(logging.WARNING, logger="dflash_gguf.server"):
        refused(post(url, "/v1/chat/completions", {"messages": ASK, "n": 2}), "n")
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_gguf.server"]
    assert len(lines) == 1 and lines[0].startswith("refused POST /v1/chat/completions: 400 n:"), lines


def test_metrics_count_responses_and_live_context_reuse(url):
    def metric(name: str) -> float:
        for line in httpx.get(url + "/metrics", headers=HEADERS).text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    live = 'dflash_prompt_cache_lookups_total{result="live"}'
    before = metric(live)
    messages = [{"role": "user", "content": "Name a colour."}]
    first = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0.0}).json()
    follow = [*messages, first["choices"][0]["message"], {"role": "user", "content": "Another?"}]
    second = post(url, "/v1/chat/completions", {"messages": follow, "max_tokens": 4, "temperature": 0.0}).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert metric(live) == before + 1
    responses = 'dflash_requests_total{route="/v1/responses",status="200"}'
    before = metric(responses)
    assert post(url, "/v1/responses", {"input": "Hi", "max_output_tokens": 2}).status_code == 200
    assert metric(responses) == before + 1
