"""A request field is declared once (server/fields.py, FIELDS), with each protocol's name for it: a test adds
one, from a module of its own plus its line in FIELDS, and every API takes it, sets the generation setting
it names, and refuses a bad value naming the request's own field (issue 34, item 4's "Done when")."""

from __future__ import annotations

import importlib.util
from typing import Optional

import pytest

from dflash_gguf.server import anthropic_api, fields, openai_api
from dflash_gguf.server.config import ServerConfig
from dflash_gguf.server.engine import Engine
from dflash_gguf.server.errors import APIError
from dflash_gguf.server.metrics import Metrics
from dflash_gguf.server.responses_api import ResponsesRequest, ResponseStore, job

TOY_FIELD = '''
"""The draft block size a request may fix, spelled each protocol's way (GenerationConfig.block_size acts)."""

from typing import Optional

from dflash_gguf.server.fields import RequestField, Spelling

BLOCK = RequestField("block_size", {
    "chat": Spelling("draft_block", Optional[int]),
    "completions": Spelling("draft_block", Optional[int]),
    "anthropic": Spelling("draft_block_size", Optional[int]),
    "responses": Spelling("speculation_block", Optional[int]),
})
'''

ASK = [{"role": "user", "content": "Hi"}]
PROTOCOLS = {  # protocol: (its request model, its translation into a Job, a request body)
    "chat": (openai_api.ChatCompletionRequest, openai_api.chat_job, {"messages": ASK, "max_tokens": 2}),
    "completions": (openai_api.CompletionRequest, openai_api.completion_job, {"prompt": "Hi", "max_tokens": 2}),
    "anthropic": (anthropic_api.MessagesRequest, anthropic_api.messages_job, {"model": "m", "max_tokens": 2,
                                                                            "messages": ASK}),
    "responses": (ResponsesRequest, lambda r: job(r, ResponseStore())[0], {"input": "Hi", "max_output_tokens": 2}),
}


@pytest.fixture(scope="module")
def engine(embedded_session):
    return Engine([embedded_session], ServerConfig(), Metrics())


@pytest.fixture
def toy(tmp_path, monkeypatch):
    (tmp_path / "toy_field.py").write_text(TOY_FIELD)
    spec = importlib.util.spec_from_file_location("toy_field", tmp_path / "toy_field.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(fields, "FIELDS", (*fields.FIELDS, module.BLOCK))  # the registry line
    return module.BLOCK


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_field_declared_once_is_taken_set_and_named_on_every_protocol(engine, toy, protocol):
    base, translate, body = PROTOCOLS[protocol]
    name = toy.spellings[protocol].name
    model = fields.declared(base, protocol)
    assert name in model.model_fields and name not in base.model_fields

    prepared = engine.prepare(translate(model.model_validate({**body, name: 3})))
    assert prepared.config.block_size == 3  # where it acts: the loop's block size
    assert engine.prepare(translate(model.model_validate(body))).config.block_size is None  # unset: the server's

    with pytest.raises(APIError) as e:
        engine.prepare(translate(model.model_validate({**body, name: 0})))
    assert e.value.status == 400 and e.value.param == name
    assert e.value.message.startswith(f"{name}: ")


def test_the_declared_sampling_fields_set_what_they_name():
    """FIELDS is what the shipped request models take: each protocol's spelling is a field of its model, and a
    request's value reaches its setting (a protocol without the field gives its `absent` value)."""
    spelled = [(p, f.spellings[p].name) for f in fields.FIELDS for p in PROTOCOLS if p in f.spellings]
    assert len(spelled) >= 12 and all(name in PROTOCOLS[p][0].model_fields for p, name in spelled)
    anthropic = anthropic_api.messages_job(anthropic_api.MessagesRequest.model_validate(
        {**PROTOCOLS["anthropic"][2], "top_k": 7, "temperature": 0.5}))
    assert anthropic.gen["top_k"] == 7 and anthropic.gen["temperature"] == 0.5 and anthropic.gen["top_p"] == 1.0
    responses = PROTOCOLS["responses"][1](ResponsesRequest.model_validate(PROTOCOLS["responses"][2]))
    assert responses.gen["top_k"] == 0 and responses.gen["seed"] is None and "min_p" not in responses.gen


def test_a_field_spelt_for_no_known_protocol_is_refused_where_it_is_declared():
    with pytest.raises(ValueError, match="no protocol 'antropic'"):
        fields.RequestField("top_k", {"antropic": fields.Spelling("top_k", int)})


def _draft_block(n):
    """A toy field's own reading: null is a block of 2, a negative block refused in the field's words."""
    if n is None:
        return 2
    if n < 0:
        raise ValueError("must be positive")
    return n


def test_a_field_may_take_several_names_on_a_protocol_and_read_its_value_its_own_way(engine, monkeypatch):
    """Spelling.also: the protocol's other names, read where the first is null (OpenAI chat's
    max_completion_tokens, then max_tokens); RequestField.read: the value, null included, as the setting,
    a ValueError a 400 naming the name the request used."""
    block = fields.RequestField("block_size", {"chat": fields.Spelling(
        "draft_block", Optional[int], also=(fields.Spelling("n_draft", Optional[int]),))}, read=_draft_block)
    monkeypatch.setattr(fields, "FIELDS", (*fields.FIELDS, block))

    def config(given, protocol="chat"):
        base, translate, body = PROTOCOLS[protocol]
        model = fields.declared(base, protocol)
        return engine.prepare(translate(model.model_validate({**body, **given}))).config.block_size

    assert config({"n_draft": 5}) == 5 and config({"draft_block": 3, "n_draft": 5}) == 3
    assert config({}) == 2  # the field's own null
    assert config({}, "completions") is None  # no such field: the server's
    with pytest.raises(APIError) as e:
        config({"n_draft": -1})
    assert e.value.status == 400 and e.value.param == "n_draft" and e.value.message == "n_draft: must be positive"
    assert fields.renames("chat")["block_size"] == "draft_block"  # a setting refused later: the preferred name


@pytest.mark.parametrize("protocol, name", [("chat", "stop"), ("completions", "stop"), ("anthropic", "stop_sequences")])
def test_stop_strings_are_one_field_refused_in_each_protocols_name(protocol, name):
    model, translate, body = PROTOCOLS[protocol]
    assert translate(model.model_validate({**body, name: ["x", "y"]})).user_stops == ["x", "y"]
    with pytest.raises(APIError) as e:
        translate(model.model_validate({**body, name: ["x", ""]}))
    assert e.value.param == name and e.value.message == f"{name}: stop strings must be non-empty"


def test_the_reply_length_penalties_and_biases_read_nulls_as_each_api_means_them():
    """OpenAI's max_tokens 0 or null leaves the server's --max-tokens, and its null penalties and bias are off;
    Anthropic has no penalties, so they stay the server's; the Responses API's length is max_output_tokens."""
    chat = openai_api.chat_job(openai_api.ChatCompletionRequest.model_validate(
        {"messages": ASK, "max_tokens": 0, "presence_penalty": None, "frequency_penalty": 0.5, "logit_bias": None}))
    assert "max_tokens" not in chat.gen and chat.user_stops == []
    assert chat.gen["presence_penalty"] == 0.0 and chat.gen["frequency_penalty"] == 0.5 and chat.gen["logit_bias"] == {}
    completion = openai_api.completion_job(openai_api.CompletionRequest.model_validate({"prompt": "Hi"}))
    assert completion.gen["max_tokens"] == 16  # llama_cpp's completions default
    anthropic = PROTOCOLS["anthropic"][1](PROTOCOLS["anthropic"][0].model_validate(PROTOCOLS["anthropic"][2]))
    assert anthropic.gen["max_tokens"] == 2 and not {"presence_penalty", "logit_bias"} & set(anthropic.gen)
    responses = PROTOCOLS["responses"][1](ResponsesRequest.model_validate({"input": "Hi", "max_output_tokens": 7}))
    assert responses.gen["max_tokens"] == 7 and fields.renames("responses") == {"max_tokens": "max_output_tokens"}
