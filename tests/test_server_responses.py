"""/v1/responses with the official openai SDK against a running dflash-serve: replies are the Session's,
the event stream adds up to the whole response, previous_response_id continues a stored conversation
from its cached prefix, text.format constrains, and what the route does not serve is a 400 naming it."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from dflash_gguf.server import ServerConfig
from test_server import N, serve_forks

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}
STORY = "Tell me a very long story about a dragon."  # runs past N tokens
SHORT = "What is 2+2?"  # ends within N tokens


@pytest.fixture(scope="module")
def ref(embedded_session):
    s = embedded_session.fork()
    yield s
    s.close()


@pytest.fixture(scope="module")
def url(embedded_session):
    with serve_forks(embedded_session, ServerConfig(model_alias="smol", accept_any_model=False), slots=2) as u:
        yield u


@pytest.fixture(scope="module")
def oai(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def greedy(ref, messages, max_tokens=N):
    ref.reset()
    return ref.chat(messages, max_tokens=max_tokens, temperature=0.0).text


def test_a_response_is_the_sessions_reply_and_is_stored(oai, ref):
    r = oai.responses.create(model="smol", instructions="You are a storyteller.", input=STORY,
                             max_output_tokens=N, temperature=0.0)
    want = greedy(ref, [{"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": STORY}])
    assert r.output_text == want and r.output[0].role == "assistant"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"  # N tokens: cut
    assert r.usage.output_tokens == N and r.usage.input_tokens > 0
    assert r.model == "smol" and r.instructions == "You are a storyteller."
    again = oai.responses.retrieve(r.id)
    assert again.id == r.id and again.output_text == want


def test_the_stream_adds_up_to_the_response(oai, ref):
    """A reply that ends by itself (within N tokens): response.completed closes the stream."""
    events = list(oai.responses.create(model="smol", input=[{"role": "user", "content": SHORT}],
                                       max_output_tokens=N, temperature=0.0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert deltas == final.output_text == events[-4].text == greedy(ref, [{"role": "user", "content": SHORT}])
    assert {e.item_id for e in events if hasattr(e, "item_id")} == {final.output[0].id}
    with oai.responses.stream(model="smol", input=SHORT, max_output_tokens=N, temperature=0.0) as stream:
        assert stream.get_final_response().output_text == deltas  # the SDK's own accumulator agrees


def test_previous_response_id_continues_from_the_cached_prefix(oai, ref):
    first = oai.responses.create(model="smol", input="My name is Ada. Say hello.", max_output_tokens=8, temperature=0.0)
    second = oai.responses.create(model="smol", input="What is my name?", previous_response_id=first.id,
                                  max_output_tokens=N, temperature=0.0)
    conversation = [{"role": "user", "content": "My name is Ada. Say hello."},
                    {"role": "assistant", "content": first.output_text},
                    {"role": "user", "content": "What is my name?"}]
    assert second.output_text == greedy(ref, conversation)
    assert second.previous_response_id == first.id
    # the first turn's prompt was still in a slot's context: only the new turn was prefilled
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens


def test_text_format_json_schema_constrains_the_reply(oai):
    r = oai.responses.create(model="smol", input="Give a city and its population as JSON.", temperature=0.0,
                             max_output_tokens=64,
                             text={"format": {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def test_unstored_and_deleted_responses_are_gone(oai):
    kept = oai.responses.create(model="smol", input="Hi", max_output_tokens=2, temperature=0.0)
    unkept = oai.responses.create(model="smol", input="Hi", max_output_tokens=2, temperature=0.0, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unkept.id)
    assert oai.responses.delete(kept.id) is None
    with pytest.raises(openai.NotFoundError) as gone:
        oai.responses.create(model="smol", input="Hi", previous_response_id=kept.id, max_output_tokens=2)
    assert gone.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize("body, status, code, param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "file:///etc/passwd"}]}]},
     400, "unsupported_parameter", "input.0.content.0.type"),
    ({"input": [{"role": "wizard", "content": "Hi"}]}, 400, "invalid_value", "input.0.role"),
    ({"input": "Hi", "background": True}, 400, "unsupported_parameter", "background"),
    ({"input": "Hi", "truncation": "auto"}, 400, "unsupported_parameter", "truncation"),
    ({"input": "Hi", "include": ["file_search_call.results"]}, 400, "unsupported_parameter", "include"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}},
     400, "invalid_value", "text.format.schema"),
    ({"input": "Hi", "conversation": "conv_1"}, 400, "unsupported_parameter", "conversation"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f"}]}, 400, "tools_unsupported", "tools"),  # no tool template
    ({"input": ""}, 400, "invalid_value", "input"),
    ({"input": "Hi", "model": "gpt-5"}, 404, "model_not_found", "model"),
])
def test_what_the_route_does_not_serve_is_refused_by_name(url, body, status, code, param):
    r = httpx.post(url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == code and error["param"] == param, error
