"""dflash-serve's sampling fields through the official openai SDK: logprobs (streamed and not), penalties,
logit_bias, min_p, and a 400 naming the field for each bad value.

The replies are compared with Session.chat / generate run plainly (speculative=False) on another fork of
the same weights: the server speculates, so equal tokens and log-probabilities are the losslessness check.
"""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from test_server import serve_forks

from dflash_gguf.server import ServerConfig

N = 10
MESSAGES = [{"role": "user", "content": "List five fruits, separated by commas."}]
PROMPT = "Write a list of fruits: apple, banana,"


@pytest.fixture(scope="module")
def ref(embedded_session):
    s = embedded_session.fork()
    yield s
    s.close()


@pytest.fixture(scope="module")
def url(embedded_session):
    with serve_forks(embedded_session, ServerConfig(model_alias="smol"), slots=1) as u:
        yield u


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_chat_logprobs_are_the_targets_streamed_and_not(oai, ref):
    want = ref.chat(MESSAGES, max_tokens=N, temperature=0.0, speculative=False, logprobs=3)
    got = oai.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=N, temperature=0,
                                      logprobs=True, top_logprobs=3)
    content = got.choices[0].logprobs.content
    assert len(content) == len(want.tokens) == got.usage.completion_tokens
    assert "".join(c.token for c in content) == got.choices[0].message.content == want.text
    for c, w in zip(content, want.logprobs):
        assert bytes(c.bytes) == ref.target.vocab.token_bytes(w.token)
        assert c.logprob == pytest.approx(w.logprob, abs=1e-4)
        assert len(c.top_logprobs) == 3
        assert [t.logprob for t in c.top_logprobs] == pytest.approx([lp for _, lp in w.top], abs=1e-4)
        assert c.top_logprobs[0].token == c.token  # greedy takes the likeliest
    assert math.exp(content[0].logprob) <= 1.0

    stream = oai.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=N, temperature=0,
                                         logprobs=True, top_logprobs=3, stream=True)
    streamed = [c for chunk in stream for choice in chunk.choices if choice.logprobs for c in choice.logprobs.content]
    assert [c.token for c in streamed] == [c.token for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-6)

    plain = oai.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_llama_cpps_shape(oai, ref):
    want = ref.generate(PROMPT, max_tokens=N, temperature=0.0, speculative=False, logprobs=2)
    got = oai.completions.create(model="smol", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2)
    lp = got.choices[0].logprobs
    assert "".join(lp.tokens) == got.choices[0].text == want.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
    assert lp.text_offset[0] == len(PROMPT)
    assert all(top[t] == v for top, t, v in zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))
    stream = oai.completions.create(model="smol", prompt=PROMPT, max_tokens=N, temperature=0, logprobs=2, stream=True)
    assert [t for c in stream if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens] == lp.tokens


@pytest.mark.parametrize("settings", [
    dict(frequency_penalty=1.0, presence_penalty=0.5),
    dict(logit_bias={"30": -100}),  # "."
    dict(extra_body={"repeat_penalty": 1.4, "repeat_last_n": 16, "min_p": 0.1}),
])
def test_penalised_replies_equal_plain_session_chat(oai, ref, settings):
    gen = {k: v for k, v in settings.items() if k != "extra_body"} | settings.get("extra_body", {})
    if "logit_bias" in gen:
        gen["logit_bias"] = {int(k): float(v) for k, v in gen["logit_bias"].items()}
    want = ref.chat(MESSAGES, max_tokens=24, temperature=0.0, speculative=False, **gen)
    unpenalised = ref.chat(MESSAGES, max_tokens=24, temperature=0.0, speculative=False)
    assert want.tokens != unpenalised.tokens  # the setting acts
    got = oai.chat.completions.create(model="smol", messages=MESSAGES, max_tokens=24, temperature=0, **settings)
    assert got.choices[0].message.content == want.text


BAD = [
    ("/v1/chat/completions", {"presence_penalty": 3}, "presence_penalty"),
    ("/v1/chat/completions", {"frequency_penalty": "lots"}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"comma": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logit_bias": {"99999999": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"repeat_penalty": 0}, "repeat_penalty"),
    ("/v1/chat/completions", {"repeat_last_n": -2}, "repeat_last_n"),
    ("/v1/chat/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"logit_bias": {"11": 1}, "logit_bias_type": "tokens"}, "logit_bias_type"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
]


def test_bad_sampling_values_are_a_400_naming_the_field(url):
    with httpx.Client(base_url=url, timeout=60) as c:
        for path, extra, param in BAD:
            body = ({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT}) | {"max_tokens": 2} | extra
            r = c.post(path, json=body)
            assert r.status_code == 400, (extra, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["message"].startswith(param) or param in err["message"], (extra, err)
            assert "Traceback" not in r.text
        assert "one choice per request" in c.post("/v1/chat/completions", json={
            "messages": MESSAGES, "n": 3}).json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2}).status_code == 200
