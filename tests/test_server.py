"""dflash-serve against real clients: uvicorn on a loopback port, the embedded target and its shipped drafter.

Two servers share one loaded model (Session.fork): "main" has 2 slots and an API key, "tight" has one
slot and a queue of one, for the queue and disconnect cases. Replies are compared with Session.chat /
Session.generate on a third fork, greedy, with short max_tokens.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest
import uvicorn

from dflash_gguf import Session
from dflash_gguf.server import ServerConfig, create_app
from dflash_gguf.server.cli import bind

KEY = "sk-test-key"
N = 16  # max_tokens of the comparisons: short, the machine is shared


@contextlib.contextmanager
def serve(sessions, config):
    sock = bind("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(create_app(sessions, config), log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        assert not thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="module")
def base():
    with Session() as s:
        yield s


@pytest.fixture(scope="module")
def ref(base):
    """Session.chat / generate on the same weights, started cold for every comparison."""
    s = base.fork()
    yield s
    s.close()


@pytest.fixture(scope="module")
def main_url(base):
    sessions = [base.fork(), base.fork()]
    with serve(sessions, ServerConfig(api_key=KEY, model_alias="smol")) as url:
        yield url
    for s in sessions:
        s.close()


@pytest.fixture(scope="module")
def tight_url(base):
    sessions = [base.fork()]
    with serve(sessions, ServerConfig(max_queue=1)) as url:
        yield url
    for s in sessions:
        s.close()


@pytest.fixture(scope="module")
def oai(main_url):
    return openai.OpenAI(base_url=main_url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(main_url):
    return anthropic.Anthropic(base_url=main_url, api_key=KEY, max_retries=0, timeout=120)


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
    assert got.usage.output_tokens == len(want.tokens) and got.usage.input_tokens == want.stats.n_prompt_tokens
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


# -- concurrency, cancellation, the queue --------------------------------------------------------
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


LONG = {"messages": ask("Tell me a very long story about a dragon."), "max_tokens": 2000, "temperature": 0.7,
        "stream": True}


def test_disconnect_mid_stream_frees_the_slot(tight_url):
    cancelled = _metric(tight_url, "dflash_requests_cancelled_total")
    with httpx.stream("POST", tight_url + "/v1/chat/completions", json=LONG, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert any(line.startswith("data: ") and "content" in line for line in lines)
    _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    assert _metric(tight_url, "dflash_requests_cancelled_total") == cancelled + 1
    r = httpx.post(tight_url + "/v1/chat/completions", json={"messages": ask("Hi"), "max_tokens": 4}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_full_queue_gives_429_with_retry_after(tight_url):
    with httpx.stream("POST", tight_url + "/v1/chat/completions", json=LONG, timeout=60) as first:
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
    (CHAT, {"messages": ask("Hi"), "frequency_penalty": 0.5}, 400, "unsupported_parameter", "frequency_penalty"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]},
     400, "unsupported_parameter", "messages.0.content.0.type"),  # and the file:// URL is never opened
    (CHAT, {"messages": ask("word " * 5000)}, 400, "context_length_exceeded", "messages"),
    (CHAT, {"model": "gpt-4o", "messages": ask("Hi")}, 404, "model_not_found", "model"),
    (CHAT, {"messages": ask("x" * (2 << 20))}, 413, "request_too_large", None),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "unsupported_parameter", "prompt"),
    ("/v1/completions", {"prompt": "Hi", "echo": True}, 400, "unsupported_parameter", "echo"),
    ("/v1/messages", {"model": "smol", "messages": ask("Hi")}, 400, "invalid_value", "max_tokens"),
    ("/v1/messages", {"model": "smol", "max_tokens": 4, "messages": ask("Hi"), "tools": [{"name": "f"}]},
     400, "tools_unsupported", "tools"),
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


def test_chunked_body_over_the_limit_is_413(main_url):
    def chunks():
        for _ in range(40):
            yield b"x" * 65536  # 2.5 MiB, no Content-Length

    r = httpx.post(main_url + CHAT, headers={**AUTH, "content-type": "application/json"}, content=chunks())
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_client_that_leaves_while_queued_or_waiting_for_a_whole_reply_is_dropped(tight_url):
    cancelled = _metric(tight_url, "dflash_requests_cancelled_total")
    long_whole = {**LONG, "stream": False}
    with httpx.stream("POST", tight_url + "/v1/chat/completions", json=LONG, timeout=60) as first:
        assert first.status_code == 200
        with pytest.raises(httpx.ReadTimeout):  # queued behind the stream, then gone
            httpx.post(tight_url + "/v1/chat/completions", json=long_whole, timeout=1.0)
        _wait_for(lambda: _health(tight_url)["queue_depth"] == 0, timeout=10)
    _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    with pytest.raises(httpx.ReadTimeout):  # generating a whole reply, then gone
        httpx.post(tight_url + "/v1/chat/completions", json=long_whole, timeout=2.0)
    _wait_for(lambda: _health(tight_url)["slots_idle"] == 1, timeout=15)
    assert _metric(tight_url, "dflash_requests_cancelled_total") == cancelled + 2  # the stream and the whole reply
    assert _metric(tight_url, 'dflash_requests_rejected_total{reason="client_gone"}') >= 1
