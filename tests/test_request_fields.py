"""A request field is declared once (server/fields.py, FIELDS), with each protocol's name for it: a test adds
one, from a module of its own plus its line in FIELDS, and every API takes it, sets the generation setting
it names, and refuses a bad value naming the request's own field (issue 34, item 4's "Done when")."""

from __future__ import annotations

import importlib.util

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
