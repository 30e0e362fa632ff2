"""dflash-serve against real clients: uvicorn on a loopback port, the embedded target and its shipped drafter.

Servers share one loaded model (Session.fork): "main" has 2 slots and an API key, "tight" has one
slot, a queue of one and a fixed block size (4), for the queue, disconnect and seeded-sampling cases.
Replies are compared with Session.chat / Session.generate on another fork, with short max_tokens.
They run under serving.Server, the uvicorn server dflash-serve runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import jsonschema
import httpx
import openai
import pytest
import uvicorn

from dflash_gguf import GenerationConfig
from dflash_gguf.server import ServerConfig, create_app
from dflash_gguf.server.cli import bind
from dflash_gguf.server.serving import Server

KEY = "sk-test-key"
N = 16  # max_tokens of the comparisons: short, the machine is shared
TIGHT_BLOCK = 4  # the tight server's fixed block size: its seeded replies follow one draft schedule


@contextlib.contextmanager
def running(app):
    """serving.Server (what dflash-serve runs) on a free loopback port, in a thread with its own loop.

    Yields (url, loop): the loop lets a test call into the app where it runs (the engine is loop-only).
    """
    sock = bind("127.0.0.1", 0)
    server = Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(server.serve(sockets=[sock]),), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", loop
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"
        loop.close()


@contextlib.contextmanager
def serve(sessions, config):
    with running(create_app(sessions, config)) as (url, _):
        yield url


@contextlib.contextmanager
def serve_forks(base, config, slots=1):
    """A server on `slots` forks of `base` (one loaded model), closed with it."""
    sessions = [base.fork() for _ in range(slots)]
    try:
        with serve(sessions, config) as url:
            yield url
    finally:
        for s in sessions:
            s.close()


@pytest.fixture(scope="module")
def base(embedded_session):
    return embedded_session


@pytest.fixture(scope="module")
def ref(base):
    """Session.chat / generate on the same weights, started cold for every comparison."""
    s = base.fork()
    yield s
    s.close()


@pytest.fixture(scope="module")
def main_url(base):
    with serve_forks(base, ServerConfig(api_key=KEY, model_alias="smol", accept_any_model=False, max_body_bytes=1 << 20), slots=2) as url:
        yield url


@pytest.fixture(scope="module")
def tight_session(base):
    """The tight server's one slot."""
    s = base.fork()
    yield s
    s.close()


@pytest.fixture(scope="module")
def tight_url(tight_session):
    with serve([tight_session], ServerConfig(max_queue=1, generation=GenerationConfig(block_size=TIGHT_BLOCK))) as url:
        yield url


@contextlib.contextmanager
def held(session):
    """Hold each of the session's generations after every Step until the yielded Event is set, so that a
    reply is still running while the test acts, however fast the machine decodes (never by its length).
    The server runs in this process, so the slot's own Session is the one held."""
    release = threading.Event()
    stream_tokens = session.stream_tokens

    def holding(*args, **kwargs):
        steps = stream_tokens(*args, **kwargs)
        try:
            for step in steps:
                yield step
                release.wait()
        finally:
            steps.close()

    session.stream_tokens = holding
    try:
        yield release
    finally:
        release.set()
        del session.stream_tokens


def sdk_clients(url: str, key: str) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    """The official clients for a test server, without retries (a failure shows at once)."""
    return (openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120),
            anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=120))


@pytest.fixture(scope="module")
def oai(main_url):
    return sdk_clients(main_url, KEY)[0]


@pytest.fixture(scope="module")
def claude(main_url):
    return sdk_clients(main_url, KEY)[1]


def reference_chat(ref, messages, **gen):
    ref.reset()
    return ref.chat(messages, max_tokens=N, temperature=0.0, **gen)


def ask(text):
    return [{"role": "user", "content": text}]


# -- the replies are the Session's ---------------------------------------------------------------
def test_models_and_health(main_url, oai):
    assert [m.id for m in oai.models.list().data] == ["smol"]
    h = httpx.get(main_url + "/health").json()  # open without the key
    assert h["status"] == "ok" and h["slots"] == 2


def test_chat_identical_to_session_chat_streamed_and_not(oai, ref):
    messages = ask("Name three colours of the rainbow.")
    want = reference_chat(ref, messages)
    got = oai.chat.completions.create(model="smol", messages=messages, max_tokens=N, temperature=0)
    assert got.choices[0].message.content == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == len(want.tokens) and got.usage.prompt_tokens == want.stats.n_prompt_tokens
    timings = got.model_extra["timings"]
    assert timings["predicted_n"] == len(want.tokens)
    assert timings["prompt_n"] + timings["cache_n"] == want.stats.n_prompt_tokens
    assert timings["predicted_per_second"] > 0 and timings["draft_n"] >= timings["draft_n_accepted"] >= 0
    dflash = got.model_extra["dflash"]
    assert dflash["tau"] >= 1.0 and dflash["cycles"] == sum(dflash["block_sizes"].values())
    # per source: the same counts as the reply's, each source's acceptance its own; the speedup is the
    # reply's own (None until it ran enough plain cycles), never against a baseline measured elsewhere
    sources = dflash["per_source"]
    assert sum(v["n_drafted"] for v in sources.values()) == dflash["n_drafted"] == timings["draft_n"]
    assert sum(v["n_accepted"] for v in sources.values()) == dflash["n_accepted"] == timings["draft_n_accepted"]
    assert all(v["acceptance_rate"] == v["n_accepted"] / v["n_drafted"] for v in sources.values() if v["n_drafted"])
    assert set(sources) <= {"dflash", "dflash2", "dspark", "lookup"}
    assert dflash["in_reply_speedup"] == want.stats.in_reply_speedup is None or dflash["in_reply_speedup"] > 0
    assert dflash["memory"] == "kv" and dflash["memory_extra_bytes"] == 0

    pieces, usage, last = [], None, None
    for chunk in oai.chat.completions.create(model="smol", messages=messages, max_tokens=N, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            if chunk.choices[0].finish_reason:
                last = chunk
        else:
            usage = chunk
    assert "".join(pieces) == want.text
    assert last.choices[0].finish_reason == want.finish_reason
    assert usage.usage.completion_tokens == len(want.tokens) == usage.model_extra["timings"]["predicted_n"]
    assert last.model_extra["timings"]["predicted_n"] == len(want.tokens)


def test_completions_identical_to_session_generate(oai, ref):
    prompt = "The capital of France is"
    ref.reset()
    want = ref.generate(prompt, max_tokens=N, temperature=0.0)
    got = oai.completions.create(model="smol", prompt=prompt, max_tokens=N, temperature=0)
    assert got.choices[0].text == want.text and got.usage.completion_tokens == len(want.tokens)
    streamed = "".join(c.choices[0].text for c in oai.completions.create(
        model="smol", prompt=prompt, max_tokens=N, temperature=0, stream=True) if c.choices)
    assert streamed == want.text


GREEDY = {"temperature": 0}  # the SDK no longer has a temperature argument; the API still takes one


def test_anthropic_messages_streamed_and_not(claude, ref):
    messages = ask("What is the boiling point of water?")
    want = reference_chat(ref, messages)
    got = claude.messages.create(model="smol", max_tokens=N, messages=messages, extra_body=GREEDY)
    assert got.content[0].text == want.text
    assert got.stop_reason == ("max_tokens" if want.finish_reason == "length" else "end_turn")
    assert got.usage.output_tokens == len(want.tokens)
    # Anthropic's usage: input_tokens are the uncached ones, the rest were read from the slot's context or the cache
    assert got.usage.input_tokens + got.usage.cache_read_input_tokens == want.stats.n_prompt_tokens
    with claude.messages.stream(model="smol", max_tokens=N, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == want.text and final.usage.output_tokens == len(want.tokens)
    # a stop sequence the reply reaches ends it there, and is named
    word = want.text.split()[2]
    cut = claude.messages.create(model="smol", max_tokens=N, messages=messages, stop_sequences=[word],
                                 extra_body=GREEDY)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert want.text.startswith(cut.content[0].text) and word not in cut.content[0].text


def test_anthropic_fields_the_sdk_sends_are_acted_on_accepted_or_refused_by_name(claude, ref):
    """What the 2.x SDK sends that changes nothing about a local model's reply is accepted; the same reply comes back."""
    messages = ask("What is the boiling point of water?")
    got = claude.messages.create(
        model="smol", max_tokens=N, messages=messages, extra_body=GREEDY, metadata={"user_id": "u-1"},
        service_tier="auto", cache_control={"type": "ephemeral"}, thinking={"type": "adaptive"},
        output_config={"effort": "low"},
    )
    assert got.content[0].text == reference_chat(ref, messages).text
    with pytest.raises(anthropic.BadRequestError) as unknown:
        claude.messages.create(model="smol", max_tokens=8, messages=messages, extra_body={"frobnicate": 1})
    assert "frobnicate" in unknown.value.body["error"]["message"]


ANSWER = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
          "required": ["city", "celsius"], "additionalProperties": False}


def test_structured_output_on_every_route_follows_the_schema(oai, claude):
    """OpenAI json_schema and json_object, Anthropic output_config.format, GBNF grammar: replies that parse and
    validate, streamed and not, and the same tokens as the Session's own constrained decoding."""
    messages = ask("Which city is the capital of France, and how warm is it there in July?")
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER, "strict": True}}
    r = oai.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0, response_format=fmt)
    jsonschema.validate(json.loads(r.choices[0].message.content), ANSWER)
    streamed = oai.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                           response_format=fmt, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == r.choices[0].message.content
    # json_object with llama-cpp-python's `schema` beside it is the same constraint; bare, any object
    obj = oai.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                      response_format={"type": "json_object", "schema": ANSWER})
    assert obj.choices[0].message.content == r.choices[0].message.content
    any_obj = oai.chat.completions.create(model="smol", messages=messages, max_tokens=64, temperature=0,
                                          response_format={"type": "json_object"})
    text = any_obj.choices[0].message.content
    assert text.startswith("{") and (any_obj.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict))
    msg = claude.messages.create(model="smol", max_tokens=64, messages=messages, extra_body=GREEDY,
                                 output_config={"format": {"type": "json_schema", "schema": ANSWER}})
    assert msg.content[0].text == r.choices[0].message.content  # the same constraint, the same greedy reply
    yes_no = oai.completions.create(model="smol", prompt="Is Paris in France? Answer:", max_tokens=4, temperature=0,
                                    extra_body={"grammar": 'root ::= " yes" | " no"'})
    assert yes_no.choices[0].text in (" yes", " no")


# bounded strings and numbers: a sampled reply then always closes well within max_tokens (43 tokens at most
# in 30 seeded replies here), so every reply is judged whole
BOUNDED = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                            "celsius": {"type": "integer", "minimum": -90, "maximum": 60}},
           "required": ["city", "celsius"], "additionalProperties": False}


@pytest.mark.slow
def test_sampled_schema_replies_all_validate(oai):
    """Sampled replies (temperature 1) under response_format json_schema: 25 of 25 end, parse and validate.
    Each is a different seed's walk through the schema's grammar (25 rather than 100: two minutes less)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": BOUNDED, "strict": True}}
    for seed in range(25):
        r = oai.chat.completions.create(model="smol", messages=ask("Name a city and its July temperature."),
                                        max_tokens=200, temperature=1.0, seed=seed, response_format=fmt)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), BOUNDED)


def test_max_completion_tokens_wins_over_max_tokens(oai):
    r = oai.chat.completions.create(model="smol", messages=ask("Tell me a long story about a cat."), max_tokens=12,
                                    max_completion_tokens=3, temperature=0)
    assert r.usage.completion_tokens == 3 == r.model_extra["timings"]["predicted_n"]
    assert r.choices[0].finish_reason == "length"


def test_stop_on_the_openai_routes_cuts_the_reply_there(oai, ref):
    messages = ask("Name three colours of the rainbow.")
    want = reference_chat(ref, messages).text
    word = want.split()[2]
    cut = want[: want.index(word)]
    got = oai.chat.completions.create(model="smol", messages=messages, max_tokens=N, temperature=0, stop=[word])
    assert got.choices[0].message.content == cut and got.choices[0].finish_reason == "stop"
    streamed = oai.chat.completions.create(model="smol", messages=messages, max_tokens=N, temperature=0, stop=word,
                                           stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == cut
    prompt = "The capital of France is"
    ref.reset()
    full = ref.generate(prompt, max_tokens=N, temperature=0.0).text
    word = full.split()[1]
    done = oai.completions.create(model="smol", prompt=prompt, max_tokens=N, temperature=0, stop=[word])
    assert done.choices[0].text == full[: full.index(word)] and done.choices[0].finish_reason == "stop"


@pytest.mark.slow  # several seeded sampled replies on the tight server
def test_a_seed_reproduces_a_sampled_reply(tight_url, ref):
    """With a fixed block size the draft schedule is fixed, so a seed fixes the reply: the same twice over
    HTTP, and the same as Session.chat with that seed (docs/SERVER.md says why adaptive blocks differ)."""
    messages = ask("Write a short poem about rain.")
    body = {"messages": messages, "max_tokens": N, "temperature": 0.9, "top_p": 1.0, "top_k": 0}

    def reply(seed):
        r = httpx.post(tight_url + CHAT, json={**body, "seed": seed}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    first = reply(1234)
    assert reply(1234) == first
    ref.reset()
    want = ref.chat(messages, max_tokens=N, temperature=0.9, top_p=1.0, top_k=0, seed=1234, block_size=TIGHT_BLOCK)
    assert first == want.text
    assert len({first, reply(1), reply(2), reply(3)}) >= 2  # and the seed matters


def test_anthropic_stream_carries_timings_and_figures(main_url):
    body = {"model": "smol", "max_tokens": N, "temperature": 0, "stream": True,
            "messages": ask("What is the boiling point of water?")}
    events, texts = {}, []
    with httpx.stream("POST", main_url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                events[name] = data
                if name == "content_block_delta":
                    texts.append(data["delta"]["text"])
    delta = events["message_delta"]
    assert "message_stop" in events
    assert delta["timings"]["predicted_n"] == delta["usage"]["output_tokens"] > 0
    assert delta["timings"]["prompt_n"] + delta["timings"]["cache_n"] == events["message_start"]["message"]["usage"]["input_tokens"]
    assert delta["dflash"]["tau"] >= 1.0 and "per_source" in delta["dflash"] and texts


# -- concurrency, cancellation, the queue --------------------------------------------------------
@pytest.mark.slow  # eight replies on two slots, each compared with its own Session reply
def test_eight_concurrent_clients_on_two_slots(oai, ref):
    questions = [f"Count from {i} to {i + 5}." for i in range(8)]
    wants = [reference_chat(ref, ask(q)).text for q in questions]

    def one(q):
        r = oai.chat.completions.create(model="smol", messages=ask(q), max_tokens=N, temperature=0)
        return r.choices[0].message.content, r.model_extra["dflash"]["slot"]

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, questions))
    assert [text for text, _ in results] == wants
    assert {slot for _, slot in results} == {0, 1}


def _health(url):
    return httpx.get(url + "/health").json()


def _wait_for(cond, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def _metric(url, name, headers=None):
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


# a streamed reply the tests hold open (held()): its length only bounds it once released
LONG = {"messages": ask("Tell me a very long story about a dragon."), "max_tokens": 64, "temperature": 0.0,
        "stream": True}


def test_disconnect_mid_stream_frees_the_slot(tight_url, tight_session):
    cancelled = _metric(tight_url, "dflash_requests_cancelled_total")
    with held(tight_session) as release:
        with httpx.stream("POST", tight_url + "/v1/chat/completions", json=LONG, timeout=60) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert any(line.startswith("data: ") and "content" in line for line in lines)
        # the server saw the client go while the reply was still held mid-generation
        _wait_for(lambda: _metric(tight_url, "dflash_requests_cancelled_total") == cancelled + 1, timeout=15)
        release.set()
        _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    r = httpx.post(tight_url + "/v1/chat/completions", json={"messages": ask("Hi"), "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_full_queue_gives_429_with_retry_after(tight_url, tight_session):
    with held(tight_session) as release, httpx.stream("POST", tight_url + CHAT, json=LONG, timeout=60) as first:
        assert first.status_code == 200
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, tight_url + "/v1/completions",
                                 json={"prompt": "One, two,", "max_tokens": 4}, timeout=60)
            _wait_for(lambda: _health(tight_url)["queue_depth"] == 1)
            refused = httpx.post(tight_url + "/v1/completions", json={"prompt": "Three", "max_tokens": 4})
            assert refused.status_code == 429
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.json()["error"]["code"] == "queue_full"
            first.close()  # the running stream goes: the queued request gets the slot
            release.set()
            assert queued.result().status_code == 200
    assert _metric(tight_url, 'dflash_requests_rejected_total{reason="queue_full"}') >= 1


# -- security and errors -------------------------------------------------------------------------
def test_api_key(main_url):
    body = {"messages": ask("Hi"), "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"x-api-key": "wrong"}, {"Authorization": KEY}):
        r = httpx.post(main_url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(main_url + "/metrics").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=main_url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=main_url, api_key="nope", max_retries=0).messages.create(
            model="smol", max_tokens=2, messages=ask("Hi"))
    assert httpx.post(main_url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2},
                      headers={"x-api-key": KEY}).status_code == 200


AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = "/v1/chat/completions"
MALFORMED = [
    # (path, body or raw bytes, status, code, param)
    (CHAT, b"{not json", 400, "invalid_body", None),
    (CHAT, b"[1, 2]", 400, "invalid_body", None),
    (CHAT, {"messages": ask("Hi"), "temperature": "hot"}, 400, "invalid_value", "temperature"),
    (CHAT, {"messages": ask("Hi"), "max_tokens": "many"}, 400, "invalid_value", "max_tokens"),
    (CHAT, {"messages": ask("Hi"), "temperature": -1}, 400, "invalid_value", "temperature"),
    (CHAT, {"messages": ask("Hi"), "top_p": 0}, 400, "invalid_value", "top_p"),
    (CHAT, {"messages": ask("Hi"), "stop": [""]}, 400, "invalid_value", "stop"),
    (CHAT, {}, 400, "invalid_value", "messages"),
    (CHAT, {"messages": [{"role": "wizard", "content": "Hi"}]}, 400, "invalid_value", "messages.0"),
    (CHAT, {"messages": ask("Hi"), "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     400, "tools_unsupported", "tools"),
    (CHAT, {"messages": ask("Hi"), "n": 2}, 400, "unsupported_parameter", "n"),
    (CHAT, {"messages": ask("Hi"), "frequency_penalty": 5}, 400, "invalid_value", "frequency_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     400, "unsupported_parameter", "messages.0.content.0.type"),  # and the file:// URL is never opened
    (CHAT, {"messages": ask("word " * 5000)}, 400, "context_length_exceeded", "messages"),
    (CHAT, {"model": "gpt-4o", "messages": ask("Hi")}, 404, "model_not_found", "model"),
    (CHAT, {"messages": ask("x" * (2 << 20))}, 413, "request_too_large", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("/v1/messages", {"model": "smol", "messages": ask("Hi")}, 400, "invalid_value", "max_tokens"),
    ("/v1/messages", {"model": "smol", "max_tokens": 4, "messages": ask("Hi"),
                      "tools": [{"name": "f", "input_schema": {"type": "object"}}]},
     400, "tools_unsupported", "tools"),
    ("/v1/messages", {"model": "smol", "max_tokens": 4, "messages": ask("Hi"), "output_config": {"format": {
        "type": "json_schema", "schema": {"type": "nonsense"}}}}, 400, "invalid_value", "output_config.format.schema"),
    (CHAT, {"messages": ask("Hi"), "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     400, "invalid_value", "response_format.json_schema.schema"),
    (CHAT, {"messages": ask("Hi"), "grammar": "root ::= (("}, 400, "invalid_value", "grammar"),
    ("/v1/messages", {"model": "smol", "max_tokens": 4, "messages": ask("Hi"), "mcp_servers": []},
     400, "unsupported_parameter", "mcp_servers"),
    (CHAT, {"messages": ask("Hi"), "frobnicate": 1}, 400, "unsupported_parameter", "frobnicate"),
    (CHAT, {"messages": ask("Hi"), "store": True}, 400, "unsupported_parameter", "store"),
    (CHAT, {"messages": ask("Hi"), "modalities": ["text", "audio"]}, 400, "unsupported_parameter", "modalities"),
    ("/v1/completions", {"prompt": "Hi", "frobnicate": 1}, 400, "unsupported_parameter", "frobnicate"),
    ("/v1/nowhere", {}, 404, "not_found", None),
]


def test_every_malformed_request_gets_its_status_and_the_server_keeps_serving(main_url):
    with httpx.Client(base_url=main_url, headers=AUTH, timeout=60) as c:
        for path, body, status, code, param in MALFORMED:
            if isinstance(body, bytes):
                r = c.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = c.post(path, json=body)
            assert r.status_code == status, (path, body if len(str(body)) < 200 else "...", r.text[:300])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
            assert err["code"] == code and (param is None or (err["param"] or "").startswith(param)), (path, err)
            assert "Traceback" not in r.text
        # a body that is not declared JSON is not parsed (a web page can send text/plain without a preflight)
        r = c.post(CHAT, content=json.dumps({"messages": ask("Hi")}), headers={"content-type": "text/plain"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type"
        assert c.get(CHAT).status_code == 405
        assert c.post("/v1/messages", json={"model": "smol", "messages": ask("Hi")}).json()["type"] == "error"
        r = c.post(CHAT, json={"messages": ask("Hi"), "max_tokens": 4})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_metrics_counters_move(main_url, oai):
    before = {n: _metric(main_url, n, AUTH) for n in (
        "dflash_completion_tokens_total", "dflash_generations_total", "dflash_cycles_total", "dflash_prompt_tokens_total")}
    requests_before = _metric(main_url, 'dflash_requests_total{route="/v1/chat/completions",status="200"}', AUTH)
    r = oai.chat.completions.create(model="smol", messages=ask("Say hello."), max_tokens=6, temperature=0)
    text = httpx.get(main_url + "/metrics", headers=AUTH).text
    assert "# TYPE dflash_requests_total counter" in text and "dflash_acceptance_length" in text
    assert _metric(main_url, "dflash_completion_tokens_total", AUTH) == before["dflash_completion_tokens_total"] + r.usage.completion_tokens
    assert _metric(main_url, "dflash_generations_total", AUTH) == before["dflash_generations_total"] + 1
    assert _metric(main_url, "dflash_cycles_total", AUTH) > before["dflash_cycles_total"]
    assert _metric(main_url, 'dflash_requests_total{route="/v1/chat/completions",status="200"}', AUTH) == requests_before + 1


def test_follow_up_turns_land_on_the_slot_that_holds_their_prefix(main_url):
    """Two conversations, then a follow-up turn of each: it is routed to its own slot and reuses its KV."""
    def turn(messages):
        r = httpx.post(main_url + CHAT, headers=AUTH, timeout=60,
                       json={"messages": messages, "max_tokens": 6, "temperature": 0}).json()
        return r["choices"][0]["message"]["content"], r["dflash"]["slot"], r["timings"]

    first = ask("Describe the moon in one sentence, please, with detail.")
    second = ask("List two animals that live in the ocean and say why.")
    # the two opening turns run side by side, so they take different slots
    with ThreadPoolExecutor(2) as pool:
        (a_text, a_slot, _), (b_text, b_slot, _) = pool.map(turn, [first, second])
    assert a_slot != b_slot
    for history, text, slot in ((first, a_text, a_slot), (second, b_text, b_slot)):
        follow = history + [{"role": "assistant", "content": text}, {"role": "user", "content": "And then?"}]
        _, got_slot, timings = turn(follow)
        assert got_slot == slot
        assert timings["cache_n"] > 40  # the whole first turn, not only the template's system prefix


@pytest.mark.slow  # a server of its own and a conversation of follow-up turns
def test_a_queued_follow_up_turn_gets_the_slot_that_holds_its_conversation(base):
    """Both slots busy, two follow-ups queued (B's first): when A's slot frees it goes to A's follow-up,
    not to the queue's head, whose conversation lives on the other slot; B's gets B's slot after.

    The test holds the slots itself (through the pool, on the server's loop), so the queue forms and
    drains when the test says, however fast the machine decodes.
    """
    sessions = [base.fork(), base.fork()]
    app = create_app(sessions, ServerConfig(max_queue=4))
    pool = app.state.engine.pool

    def on_loop(fn, *args):
        return asyncio.run_coroutine_threadsafe(_call(fn, *args), loop).result(30)

    def turn(messages, max_tokens=6):
        r = httpx.post(url + CHAT, timeout=120, json={"messages": messages, "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        r = r.json()
        return r["choices"][0]["message"]["content"], r["dflash"]["slot"], r["timings"]

    try:
        with running(app) as (url, loop), ThreadPoolExecutor(2) as threads:
            opening = [ask("Describe a lighthouse in one sentence, please."), ask("Name two rivers in Europe and their seas.")]
            (a_text, a_slot, _), (b_text, b_slot, _) = threads.map(turn, opening)
            assert a_slot != b_slot
            a = opening[0] + [{"role": "assistant", "content": a_text}]
            b = opening[1] + [{"role": "assistant", "content": b_text}]
            assert _health(url)["slots_idle"] == 2  # a reply's slot is free by the time its answer arrives
            taken = {slot.id: on_loop(pool.acquire, pool.slots[slot.id].cached) for slot in pool.slots}
            assert all(taken[i].id == i for i in taken) and _health(url)["slots_idle"] == 0
            follow = {"role": "user", "content": "And then?"}
            queued_b = threads.submit(turn, b + [follow])
            _wait_for(lambda: _health(url)["queue_depth"] == 1)
            with held(sessions[a_slot]) as a_running:  # A's turn still runs when B's slot frees
                queued_a = threads.submit(turn, a + [follow])
                _wait_for(lambda: _health(url)["queue_depth"] == 2)
                on_loop(pool.release, taken[a_slot], None)  # A's slot frees: B's turn is first in line, A's lives here
                _wait_for(lambda: _health(url)["queue_depth"] == 1)
                on_loop(pool.release, taken[b_slot], None)
                _, got_b, timings_b = queued_b.result(120)
                a_running.set()
            _, got_a, timings_a = queued_a.result(120)
        assert (got_a, got_b) == (a_slot, b_slot)
        assert timings_a["cache_n"] > 40 and timings_b["cache_n"] > 40
    finally:
        for s in sessions:
            s.close()


@pytest.mark.slow  # a server of its own
def test_a_retry_waits_for_the_prefill_it_repeats(base):
    """A client that gives up on a long prefill and sends the same request again (Claude Code after 300 s
    without events) joins it: its first request's generation is cancelled, so the retry waits for that slot,
    though the other is free, and finds the whole prompt cached there instead of prefilling it twice."""
    sessions = [base.fork(), base.fork()]
    app = create_app(sessions, ServerConfig(max_queue=4))
    prompt = ask("Summarise this: " + "the river runs to the sea and the sea runs to the sky; " * 12)
    try:
        with held(sessions[0]) as first, held(sessions[1]) as second, running(app) as (url, _):
            with httpx.stream("POST", url + CHAT, timeout=120,
                              json={"messages": prompt, "max_tokens": 8, "temperature": 0, "stream": True}) as r:
                next(r.iter_lines())  # the prefill is done and the generation held: then the client leaves
            _wait_for(lambda: app.state.engine.metrics.cancelled == 1)
            with ThreadPoolExecutor(1) as pool:
                retry = pool.submit(httpx.post, url + CHAT, timeout=120,
                                    json={"messages": prompt, "max_tokens": 8, "temperature": 0})
                _wait_for(lambda: _health(url)["queue_depth"] == 1)
                assert _health(url)["slots_idle"] == 1  # it waits though a slot is free
                first.set()
                second.set()
                r = retry.result(120)
        assert r.status_code == 200, r.text
        body = r.json()
        slot = body["dflash"]["slot"]
        assert body["timings"]["cache_n"] == body["usage"]["prompt_tokens"] - 1  # all but the last token cached
        assert sessions[slot].last_stats.n_cached_tokens == body["usage"]["prompt_tokens"] - 1
    finally:
        for s in sessions:
            s.close()


async def _call(fn, *args):
    """fn(*args) on the running loop, awaited if it is a coroutine function (the pool is loop-only)."""
    out = fn(*args)
    return await out if asyncio.iscoroutine(out) else out


def test_shutdown_refuses_queued_and_new_requests_and_ends_streams(base):
    """What the app does once uvicorn begins to stop (serving.Server calls engine.begin_shutdown, then
    closes the listening socket; here it is called alone, so the refusals can be seen over HTTP)."""
    sessions = [base.fork()]
    app = create_app(sessions, ServerConfig(max_queue=2))
    try:
        with running(app) as (url, loop), ThreadPoolExecutor(1) as pool, held(sessions[0]) as release:
            with httpx.stream("POST", url + CHAT, json=LONG, timeout=60) as stream:
                lines = stream.iter_lines()
                assert stream.status_code == 200 and any("content" in line for line in lines)
                queued = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "One,", "max_tokens": 4},
                                     timeout=60)
                _wait_for(lambda: _health(url)["queue_depth"] == 1)
                loop.call_soon_threadsafe(app.state.engine.begin_shutdown)
                refused = queued.result()
                health = httpx.get(url + "/health")
                new = httpx.post(url + "/v1/completions", json={"prompt": "Two,", "max_tokens": 4})
                release.set()  # the held stream's next cycle sees the shutdown's cancellation
                rest = list(lines)
            for r in (refused, new):
                assert r.status_code == 503 and r.headers["retry-after"] == "5"
                assert r.json()["error"]["code"] == "shutting_down"
            assert health.status_code == 503 and health.json()["status"] == "shutting_down"
            assert [line for line in rest if line][-1] == "data: [DONE]"
            assert any('"code": "cancelled"' in line for line in rest)
            _wait_for(lambda: _health(url)["slots_idle"] == 1)
    finally:
        sessions[0].close()


def test_chunked_body_over_the_limit_is_413(main_url):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB, no Content-Length

    r = httpx.post(main_url + CHAT, headers={**AUTH, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_client_that_leaves_while_queued_or_waiting_for_a_whole_reply_is_dropped(tight_url, tight_session):
    cancelled = _metric(tight_url, "dflash_requests_cancelled_total")
    long_whole = {**LONG, "stream": False}
    with held(tight_session) as release:
        with httpx.stream("POST", tight_url + CHAT, json=LONG, timeout=60) as first:
            assert first.status_code == 200
            with pytest.raises(httpx.ReadTimeout):  # queued behind the held stream, then gone
                httpx.post(tight_url + CHAT, json=long_whole, timeout=1.0)
            _wait_for(lambda: _health(tight_url)["queue_depth"] == 0, timeout=10)
        _wait_for(lambda: _metric(tight_url, "dflash_requests_cancelled_total") == cancelled + 1, timeout=15)
        release.set()
        _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    with held(tight_session) as release:
        with pytest.raises(httpx.ReadTimeout):  # generating a whole (held) reply, then gone
            httpx.post(tight_url + CHAT, json=long_whole, timeout=2.0)
        _wait_for(lambda: _metric(tight_url, "dflash_requests_cancelled_total") == cancelled + 2, timeout=15)
        release.set()  # the stream and the whole reply were both cancelled
        _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    assert _metric(tight_url, 'dflash_requests_rejected_total{reason="client_gone"}') >= 1
