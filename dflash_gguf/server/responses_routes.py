"""POST /v1/responses: the OpenAI Responses API (what Codex-style clients speak), whole or as its event stream.

A request becomes the same chat Job as /v1/chat/completions: `instructions` is the system message,
`input` the turns (a string, or message items with input_text / output_text parts), `text.format` the
structured-output constraint. A stored response (`store`, on by default as in OpenAI's API) keeps its
conversation, so `previous_response_id` continues it: the prompt rendered again starts with the turn
before, which the slot's live context or the prompt cache already holds. Stored responses live in this
process (the newest STORED_RESPONSES), retrievable with GET and removable with DELETE.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from .engine import Engine, Finished, Run
from .errors import APIError
from .openai_routes import check_model
from .schemas import Job, Message, _constraint, _refuse, _sampling
from .sse import stream_response

STORED_RESPONSES = 1024  # the newest stored responses kept for previous_response_id / GET; older ones are forgotten
# `include` values that ask for nothing this server could add (a local model has no encrypted reasoning)
NEUTRAL_INCLUDES = frozenset({"reasoning.encrypted_content"})
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class ResponsesRequest(BaseModel):
    """POST /v1/responses. A field this model does not declare is a 400 naming it; declared ones are acted
    on, accepted as neutral (they change nothing about a local model's reply) or refused by name in job()."""

    model_config = ConfigDict(extra="forbid")

    model: Optional[str] = None
    input: Union[str, List[dict[str, Any]]] = Field(min_length=1)
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: Optional[str] = None
    text: Optional[dict[str, Any]] = None
    tools: Optional[List[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    background: Optional[bool] = None
    include: Optional[List[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    # neutral: echoed or ignored, the reply is the same
    parallel_tool_calls: Optional[bool] = None
    metadata: Optional[dict[str, str]] = None
    reasoning: Optional[dict[str, Any]] = None
    stream_options: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    user: Optional[str] = None


class ResponseStore:
    """The stored responses of this process, newest last: each with the conversation it ended."""

    def __init__(self, capacity: int = STORED_RESPONSES) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, tuple[dict[str, Any], list[Message]]] = OrderedDict()

    def put(self, response: dict[str, Any], conversation: list[Message]) -> None:
        self._entries[response["id"]] = (response, conversation)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str = "response_id") -> tuple[dict[str, Any], list[Message]]:
        try:
            return self._entries[response_id]
        except KeyError:
            raise APIError(404, f"no stored response with id {response_id!r} (not stored, deleted, or from before "
                           "a restart)", param=param, code="response_not_found") from None

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


def job(req: ResponsesRequest, store: ResponseStore) -> tuple[Job, list[Message]]:
    """The chat Job for a request, and the conversation it continues (previous turns, then this input)."""
    if req.tools or req.tool_choice not in (None, "none", "auto"):
        raise _refuse("tools" if req.tools else "tool_choice", "tool calling is not served on /v1/responses yet",
                      "tools_unsupported")
    if req.background:
        raise _refuse("background", "background responses are not supported: stream it or wait for it")
    if req.truncation == "auto":
        raise _refuse("truncation", "'auto' would drop turns silently; a prompt over the context is a 400 instead")
    unknown = sorted(set(req.include or ()) - NEUTRAL_INCLUDES)
    if unknown:
        raise _refuse("include", f"{unknown[0]!r} is not served here")
    conversation: list[Message] = []
    if req.previous_response_id is not None:
        _, conversation = store.get(req.previous_response_id, "previous_response_id")
        conversation = [m for m in conversation if m["role"] != "system"]  # instructions are not carried over
    if req.instructions:
        conversation = [{"role": "system", "content": req.instructions}, *conversation]
    conversation += _input_messages(req.input)
    gen = _sampling(req.temperature, req.top_p, 0, None) | _text_format(req.text)
    gen["max_tokens"] = req.max_output_tokens
    return Job(conversation, None, gen, [], req.stream, True), conversation


def _input_messages(items: str | list[dict[str, Any]]) -> list[Message]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind != "message":
            raise _refuse(f"input.{i}.type", f"input item {kind!r} is not supported: messages only",
                          "tools_unsupported" if "call" in kind else "unsupported_parameter")
        role = _ROLES.get(item.get("role"))
        if role is None:
            raise _refuse(f"input.{i}.role", f"must be user, assistant, system or developer, got {item.get('role')!r}",
                          "invalid_value")
        out.append({"role": role, "content": _parts_text(item.get("content"), f"input.{i}.content")})
    return out


def _parts_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _refuse(param, "must be a string or a list of text parts", "invalid_value")
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text"):
            raise _refuse(f"{param}.{i}.type", f"content part {kind!r} is not supported: text only")
        texts.append(part.get("text") or "")
    return "".join(texts)


def _text_format(text: dict[str, Any] | None) -> dict[str, Any]:
    """`text.format` as a constraint: json_schema (enforced, strict or not) or json_object."""
    fmt = (text or {}).get("format") or {"type": "text"}
    kind = fmt.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return _constraint("json_schema", {"type": "object"}, "text.format")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise _refuse("text.format.schema", "a json_schema format needs its 'schema' object", "invalid_value")
        return _constraint("json_schema", fmt["schema"], "text.format.schema")
    raise _refuse("text.format.type", f"must be text, json_object or json_schema, got {kind!r}", "invalid_value")


def router(engine: Engine) -> APIRouter:
    r = APIRouter()
    store = ResponseStore()

    @r.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Any:
        check_model(engine, body.model)
        the_job, conversation = job(body, store)
        prepared = engine.prepare(the_job)
        run = await engine.start(prepared, request)
        shell = _shell(body, engine.config.model_alias)

        def finish(f: Finished, item_id: str) -> dict[str, Any]:
            response = _completed(shell, f, len(prepared.tokens), item_id)
            if body.store:
                store.put(response, [*conversation, {"role": "assistant", "content": f.text}])
            return response

        if body.stream:
            return stream_response(run, _events(run, shell, finish))
        async for event in run.events():
            if isinstance(event, Finished):
                return finish(event, f"msg_{uuid.uuid4().hex}")
        raise _CANCELLED

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id)[0]

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return r


_CANCELLED = APIError(503, "the generation was cancelled (the server is shutting down)", code="cancelled")


def _shell(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object before its output: what every event's `response` carries."""
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": req.model or model, "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
        "tools": [], "tool_choice": req.tool_choice or "auto", "parallel_tool_calls": bool(req.parallel_tool_calls),
        "truncation": req.truncation or "disabled", "metadata": req.metadata or {}, "usage": None,
    }


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _completed(shell: dict[str, Any], f: Finished, n_prompt: int, item_id: str) -> dict[str, Any]:
    truncated = f.finish_reason == "length"
    return {
        **shell, "status": "incomplete" if truncated else "completed", "completed_at": int(time.time()),
        "incomplete_details": {"reason": "max_output_tokens"} if truncated else None,
        "output": [_message(item_id, f.text, "incomplete" if truncated else "completed")],
        "usage": {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": f.stats.n_cached_tokens},
                  "output_tokens": len(f.tokens), "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": n_prompt + len(f.tokens)},
        "timings": f.timings, "dflash": f.dflash,
    }


async def _events(run: Run, shell: dict[str, Any], finish: Callable[[Finished, str], dict[str, Any]],
                  ) -> AsyncIterator[dict[str, str]]:
    """The Responses stream: created, the message item and its text part opened, text deltas, then each
    closed and the whole response in response.completed (or response.incomplete at max_output_tokens)."""
    sequence = iter(range(1 << 62))

    def event(name: str, **data: Any) -> dict[str, str]:
        return {"event": name, "data": json.dumps({"type": name, "sequence_number": next(sequence), **data},
                                                  ensure_ascii=False)}

    item_id = f"msg_{uuid.uuid4().hex}"
    where = {"item_id": item_id, "output_index": 0, "content_index": 0}
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    yield event("response.output_item.added", output_index=0, item=_message(item_id, "", "in_progress") | {"content": []})
    yield event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})
    try:
        async for step in run.events():
            if isinstance(step, Finished):
                response = finish(step, item_id)
                [message] = response["output"]
                yield event("response.output_text.done", **where, text=step.text, logprobs=[])
                yield event("response.content_part.done", **where, part=message["content"][0])
                yield event("response.output_item.done", output_index=0, item=message)
                yield event(f"response.{response['status']}", response=response)
                return
            if step.text:
                yield event("response.output_text.delta", **where, delta=step.text, logprobs=[])
        raise _CANCELLED
    except APIError as e:
        yield event("error", code=e.code, message=e.message, param=e.param)
