"""What stood between a default Claude Code or Codex run and a reply (issue 35's door), against a real server.

Claude Code sends a system message inside `messages` and a model name of its own; Codex sends
`client_metadata`, a `namespace` tool and a hosted `web_search` tool, and no max_output_tokens. Their
recorded first requests (tests/agent_requests/, the exact bodies and headers the pinned versions sent) go
through the API translation and the prompt's rendering (count_tokens / input_tokens: no prefill), on a
ChatML-family template (Hermes: late system messages in place) and on Qwen3.5's (which refuses them: they
join the leading system message).
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from dflash_gguf import Session, defaults
from dflash_gguf.chat.template import place_system_messages, renders_late_system
from dflash_gguf.server import ServerConfig
from dflash_gguf.server.sse import heartbeat
from test_server import held, serve
from tool_fixtures import TEMPLATES, THINKING_TEMPLATE

RECORDED = Path(__file__).parent / "agent_requests"
HEADERS_SENT_BY_HTTPX = {"host", "content-length", "connection", "accept-encoding"}
SERVER_MAX_TOKENS = 6
NAMESPACED = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "close_agent", "description": "Close an agent.", "strict": False,
     "parameters": {"type": "object", "properties": {"id": {"type": "string", "maxLength": 8}}, "required": ["id"],
                    "additionalProperties": False}}]}


def recorded(name: str) -> dict:
    return json.loads((RECORDED / name).read_text())


def replay_headers(request: dict) -> dict[str, str]:
    return {k: v for k, v in request["headers"].items() if k.lower() not in HEADERS_SENT_BY_HTTPX}


@contextmanager
def serving(tool_targets, family: str, n_ctx: int) -> Iterator[httpx.Client]:
    """A server with the server's defaults but a short --max-tokens, on the embedded pair under `family`'s
    template ("hermes" or "qwen3.5"), with a context of n_ctx tokens; yields a client of it."""
    path = tool_targets.path("hermes") if family == "hermes" else tool_targets.thinking()
    with Session(path, drafter=defaults.embedded_drafter(), n_ctx=n_ctx) as s:
        with serve([s], ServerConfig(max_tokens=SERVER_MAX_TOKENS)) as url, httpx.Client(base_url=url, timeout=300) as c:
            yield c


@pytest.fixture(scope="module", params=["hermes", "qwen3.5"])
def served(request, tool_targets):
    """A server on a tool template that renders late system messages in place (hermes) and on one that refuses
    them (Qwen3.5); yields (client, template text)."""
    template = (TEMPLATES / "hermes.jinja" if request.param == "hermes" else THINKING_TEMPLATE).read_text()
    with serving(tool_targets, request.param, 512) as c:
        yield c, template


@pytest.fixture(scope="module")
def client(served):
    return served[0]


# a short context, so that replies run to its end in seconds: libllama's least (it pads a context to a multiple
# of 256: 192 ran as 256)
FULL_N_CTX = 256


@pytest.fixture(scope="module", params=["hermes", "qwen3.5"])
def short_client(request, tool_targets):
    """`served`'s server on each template, with a context of FULL_N_CTX tokens."""
    with serving(tool_targets, request.param, FULL_N_CTX) as c:
        yield c


@pytest.mark.parametrize("name", ["claude-code-2.1.197-title.json", "claude-code-2.1.197-turn.json"])
def test_claude_codes_recorded_requests_are_taken(client, name):
    request = recorded(name)
    body = {k: v for k, v in request["body"].items() if k not in ("max_tokens", "stream")}
    r = client.post("/v1/messages/count_tokens", json=body, headers=replay_headers(request))
    assert r.status_code == 200, r.text
    assert r.json()["input_tokens"] > (20_000 if "turn" in name else 300)


TURNS = {"claude-code-2.1.197-turn.json": "/v1/messages/count_tokens", "codex-0.171.0-turn.json": "/v1/responses/input_tokens",
         "opencode-1.18.33-turn.json": None}  # chat completions has no count route


@pytest.mark.parametrize("name", sorted(TURNS))
def test_each_agents_recorded_turn_is_translated_and_refused_only_for_its_length(client, name):
    """The exact body and headers each agent's default turn sent, on its own route: translated and rendered,
    then refused before any prefill for the one reason it must be on this 512-token server, its length (the
    length count_tokens / input_tokens gives, where the API has such a route)."""
    request = recorded(name)
    r = client.post(request["path"], json=request["body"], headers=replay_headers(request))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    n = int(error["message"].split("the prompt is ")[1].split()[0])
    assert n > 5_000
    if TURNS[name] is not None:
        body = {k: v for k, v in request["body"].items() if k not in ("max_tokens", "stream")} \
            if name.startswith("claude") else request["body"]
        assert client.post(TURNS[name], json=body, headers=replay_headers(request)).json()["input_tokens"] == n


def test_codexs_recorded_request_is_taken(client):
    request = recorded("codex-0.171.0-turn.json")
    r = client.post("/v1/responses/input_tokens", json=request["body"], headers=replay_headers(request))
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "response.input_tokens" and r.json()["input_tokens"] > 5_000


def test_a_late_system_message_reaches_the_prompt(served):
    """In place where the template renders it there, else joined to the leading system message (the same prompt
    as sending it joined)."""
    client, template = served
    late = {"model": "claude-opus-4-8", "system": "Be brief.",
            "messages": [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Answer in French."},
                         {"role": "user", "content": "And now?"}]}
    joined = {**late, "system": "Be brief.\n\nAnswer in French.", "messages": [late["messages"][0], late["messages"][2]]}
    late_n, joined_n = (client.post("/v1/messages/count_tokens", json=b).json()["input_tokens"] for b in (late, joined))
    in_place = renders_late_system(template, "", "")
    assert (late_n != joined_n) if in_place else (late_n == joined_n)


@pytest.mark.parametrize("template, in_place", [
    (TEMPLATES / "hermes.jinja", True), (TEMPLATES / "llama3.jinja", True), (TEMPLATES / "qwen3-coder.jinja", True),
    (TEMPLATES / "mistral.jinja", False), (THINKING_TEMPLATE, False)], ids=lambda v: getattr(v, "stem", str(v)))
def test_what_each_template_does_with_a_late_system_message_is_learned(template, in_place):
    """Mistral's and Qwen3.5's templates raise on a system message after the first turn; the ChatML family and
    Llama 3 render it in place."""
    assert renders_late_system(template.read_text(), "<s>", "</s>") is in_place


def test_late_system_messages_join_the_leading_one_in_order():
    messages = [{"role": "user", "content": "a"}, {"role": "system", "content": "x"},
                {"role": "assistant", "content": "b"}, {"role": "system", "content": [{"type": "text", "text": "y"}]}]
    assert place_system_messages(messages, in_place=False) == [
        {"role": "system", "content": "x\n\ny"}, messages[0], messages[2]]
    with_lead = [{"role": "system", "content": "s"}, *messages]
    assert place_system_messages(with_lead, in_place=False)[0] == {"role": "system", "content": "s\n\nx\n\ny"}
    assert place_system_messages(with_lead, in_place=True) == with_lead


def test_any_model_name_is_answered_and_models_says_the_context(client):
    r = client.post("/v1/messages", json={"model": "claude-opus-4-8", "max_tokens": 2,
                                          "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 200 and r.json()["model"] == "claude-opus-4-8"
    (model,) = client.get("/v1/models").json()["data"]
    assert model["context_length"] == 512 and model["meta"]["accepts_any_model_name"] is True
    assert model["meta"]["n_ctx_train"] == 8192 and model["meta"]["max_tokens"] == SERVER_MAX_TOKENS


def test_a_request_without_a_length_gets_the_servers(client):
    """Codex sends no max_output_tokens: the reply ends at --max-tokens, not at the end of the context."""
    r = client.post("/v1/responses", json={"model": "gpt-5", "input": "Count to one hundred.", "temperature": 0,
                                           "client_metadata": {"session_id": "s"}}).json()
    assert r["usage"]["output_tokens"] <= SERVER_MAX_TOKENS
    assert r["status"] == ("incomplete" if r["usage"]["output_tokens"] == SERVER_MAX_TOKENS else "completed")


def test_a_namespaced_function_is_offered_and_its_call_names_the_namespace(client):
    """Codex's `namespace` tools are offered as functions; a call of one names its namespace. A hosted web_search
    is not offered: the prompt is the one without it."""
    body = {"model": "gpt-5", "input": "Close agent a1.", "temperature": 0, "max_output_tokens": 40,
            "tools": [NAMESPACED], "tool_choice": {"type": "function", "name": "close_agent"},
            "reasoning": {"effort": "none"}}  # Qwen3.5 would think first, past max_output_tokens
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    (call,) = [item for item in r.json()["output"] if item["type"] == "function_call"]
    assert call["name"] == "close_agent" and call["namespace"] == "multi_agent_v1"
    assert "id" in json.loads(call["arguments"])
    with_search = {**body, "tools": [NAMESPACED, {"type": "web_search", "external_web_access": False}]}
    counts = [client.post("/v1/responses/input_tokens", json=b).json()["input_tokens"] for b in (body, with_search)]
    assert counts[0] == counts[1]


@pytest.mark.slow  # two replies that run to the end of a 256-token context
def test_a_full_context_is_said_as_such(short_client):
    """A reply that runs out of context: Anthropic's model_context_window_exceeded (a client that continues a
    max_tokens reply would overflow), OpenAI's length; a max_tokens past the context is clamped, not refused."""
    client = short_client
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 4000}}, "required": ["a"]}
    r = client.post("/v1/messages", json={
        "model": "m", "max_tokens": 100_000, "messages": [{"role": "user", "content": "Write a long story."}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["stop_reason"] == "model_context_window_exceeded"
    assert body["usage"]["input_tokens"] + body["usage"]["cache_read_input_tokens"] + body["usage"]["output_tokens"] == FULL_N_CTX
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 100_000,
        "grammar": "root ::= [a-z ]{3000,}"}).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["total_tokens"] == FULL_N_CTX


def test_cached_prompt_tokens_are_in_usage(client):
    ask = {"model": "m", "max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": "Name a colour."}]}
    first, again = (client.post("/v1/messages", json=ask).json()["usage"] for _ in range(2))
    assert again["cache_read_input_tokens"] > 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == first["input_tokens"] + first["cache_read_input_tokens"]
    chat = {"messages": ask["messages"], "max_tokens": 2, "temperature": 0}
    client.post("/v1/chat/completions", json=chat)
    usage = client.post("/v1/chat/completions", json=chat).json()["usage"]
    assert 0 < usage["prompt_tokens_details"]["cached_tokens"] < usage["prompt_tokens"]


def test_heartbeat_fills_the_silences_and_passes_every_event():
    """A None for each interval without an event (the stream's keep-alive); the source's events all pass."""

    async def collect() -> list:
        release = asyncio.Event()

        async def events():
            yield "a"
            await release.wait()  # a long prefill: silent until the test has seen two keep-alives
            yield "b"

        got = []
        async for event in heartbeat(events(), every=0.01):
            got.append(event)
            if got.count(None) == 2:
                release.set()
        return got

    got = asyncio.run(collect())
    assert got[0] == "a" and got[-1] == "b" and set(got[1:-1]) == {None} and len(got) >= 4


KEEPALIVE_S = 0.2  # the queued streams' keep-alive interval here (the server's default is 15 s)


def _queue_depth(client: httpx.Client) -> int:
    return client.get("/health").json()["queue_depth"]


def _until(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_queued_stream_gets_its_headers_and_keep_alives_while_it_waits(embedded_session):
    """Two requests on one slot (--parallel 1): the second, queued behind the first, gets its response headers
    and its stream's opening at once, then its protocol's keep-alive at each interval while it waits (Anthropic
    message_start then `event: ping`; SSE comments on chat; response.in_progress again on Responses), not after
    the wait; a queued stream whose client leaves gives its place up; the last one runs once the slot frees.
    The first request is held after its first step (never raced against the machine's speed)."""
    session = embedded_session.fork()
    ask = [{"role": "user", "content": "Name a colour."}]
    streams = {
        "/v1/chat/completions": ({"messages": ask, "max_tokens": 4, "stream": True}, ": ping"),
        "/v1/responses": ({"input": "Name a colour.", "max_output_tokens": 4, "stream": True},
                          'data: {"type": "response.in_progress"'),
        "/v1/messages": ({"model": "m", "max_tokens": 4, "messages": ask, "stream": True}, "event: ping"),
    }
    try:
        with serve([session], ServerConfig(keepalive_s=KEEPALIVE_S)) as url, httpx.Client(base_url=url, timeout=60) as c, \
                held(session) as release, ThreadPoolExecutor(1) as pool:
            first = pool.submit(c.post, "/v1/chat/completions", json={"messages": ask, "max_tokens": 4})
            _until(lambda: c.get("/health").json()["slots_idle"] == 0)
            for route, (body, keepalive) in streams.items():
                with c.stream("POST", route, json=body) as r:
                    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                    lines = r.iter_lines()
                    seen: list[str] = []
                    while sum(line.startswith(keepalive) for line in seen) < 2:
                        seen.append(next(lines))
                    assert _queue_depth(c) == 1  # all of it while queued
                    if route == "/v1/messages":
                        assert seen[0] == "event: message_start"
                        release.set()  # the slot frees: the queued stream runs to its end
                        rest = [line for line in lines if line.startswith("event: ")]
                        assert rest[-1] == "event: message_stop", rest
                        assert "event: content_block_delta" in rest
                    elif route == "/v1/responses":
                        assert seen[0] == "event: response.created"
                _until(lambda: _queue_depth(c) == 0)  # a stream closed while queued gave its place up
            assert first.result(60).status_code == 200
            health = c.get("/health").json()
            assert health["slots_idle"] == 1 and health["queue_depth"] == 0
            gone = [line for line in c.get("/metrics").text.splitlines() if 'reason="client_gone"' in line]
            assert gone and float(gone[0].split()[-1]) == 2  # the chat and Responses streams closed while queued
    finally:
        session.close()
