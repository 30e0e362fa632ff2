"""POST /v1/responses: the OpenAI Responses API (what Codex-style clients speak), whole or as its event stream.

A request becomes the same chat Job as /v1/chat/completions: `instructions` is the system message,
`input` the turns (a string, or message / function_call / function_call_output items), `text.format`
the structured-output constraint, `tools` (function tools) the Session's tools, so a call is held to
its tool's schema and comes back as a function_call output item. A stored response (`store`, on by
default as in OpenAI's API) keeps its conversation, so `previous_response_id` continues it: the prompt
rendered again starts with the turn before, which the slot's live context or the prompt cache already
holds. Stored responses live in this process (the newest STORED_RESPONSES), retrievable with GET and
removable with DELETE. A thinking model's thought is a reasoning item before the others (its text as
reasoning_text content, no summary), and a reasoning item sent back in `input` is given to the template as the
next assistant turn's reasoning_content; `reasoning.effort` "none" turns the template's thinking off.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, Iterator, List, Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from ..chat.reply import ReplyReader, Thought
from ..chat.tool_calls import CallDelta, ToolCall
from .engine import Engine, Finished, Prepared, Run
from .errors import RESPONSES_TERMS, APIError, cancelled
from .openai_routes import check_model
from .schemas import Job, Message, _constraint, _max_tokens, _refuse, _sampling, refuse_unencodable, template_variables
from .sse import heartbeat, stream_response

STORED_RESPONSES = 1024  # the newest stored responses kept for previous_response_id / GET; older ones are forgotten
# `include` values that ask for nothing this server could add (a local model has no encrypted reasoning)
NEUTRAL_INCLUDES = frozenset({"reasoning.encrypted_content"})
REASONING_KEYS = frozenset({"effort", "summary", "generate_summary"})  # summary: accepted, none is written
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
    parallel_tool_calls: Optional[bool] = None
    background: Optional[bool] = None
    include: Optional[List[str]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    reasoning: Optional[dict[str, Any]] = None  # effort: "none" turns thinking off; summary: none is written
    # neutral: echoed or ignored, the reply is the same
    metadata: Optional[dict[str, str]] = None
    stream_options: Optional[dict[str, Any]] = None
    prompt_cache_key: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    safety_identifier: Optional[str] = None
    service_tier: Optional[str] = None
    user: Optional[str] = None
    client_metadata: Optional[dict[str, Any]] = None  # Codex's ids for its own logs


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
    refuse_unencodable(req)
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
    origins = {f"messages.{k}": "previous_response_id" for k in range(len(conversation))}
    if req.instructions:
        origins["messages.0"] = "instructions"
    conversation += _input_messages(req.input, {c["id"] for m in conversation for c in m.get("tool_calls", ())},
                                    origins, len(conversation))
    gen = _sampling(req.temperature, req.top_p, 0, None) | _text_format(req.text)
    gen |= _max_tokens(req.max_output_tokens)
    reasoning = req.reasoning or {}
    unknown = sorted(set(reasoning) - REASONING_KEYS)
    if unknown:
        raise _refuse(f"reasoning.{unknown[0]}", "not supported")
    return Job(conversation, None, gen, [], req.stream, True, tools=_tools(req.tools)[0],
               tool_choice=_tool_choice(req.tool_choice), parallel_tool_calls=req.parallel_tool_calls,
               chat_template_kwargs=template_variables(None, reasoning.get("effort"), "reasoning.effort"),
               origins=origins), conversation


# Hosted tools the client may list that this server does not run: the model is not offered them (OpenAI's own
# API runs them itself; Codex lists web_search by default). Any other hosted tool is refused by name.
NOT_OFFERED_TOOLS = frozenset({"web_search", "web_search_preview"})


def _tools(tools: list[dict[str, Any]] | None) -> tuple[list[dict[str, Any]] | None, dict[str, str]]:
    """Responses function tools ({type, name, parameters, ...}) in the chat shape the Session checks, and the
    namespace of each function that came inside a `namespace` tool (Codex groups its sub-agent tools so): the
    model sees them as plain functions, and a call of one names its namespace in the function_call item."""
    if not tools:
        return None, {}
    out: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}

    def function(tool: dict[str, Any], where: str) -> None:
        if tool.get("type") != "function":
            raise _refuse(f"{where}.type", f"only function tools are served here, got {tool.get('type')!r}")
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})

    for i, tool in enumerate(tools):
        kind = tool.get("type")
        if kind in NOT_OFFERED_TOOLS:
            continue
        if kind != "namespace":
            function(tool, f"tools.{i}")
            continue
        name, inner = tool.get("name"), tool.get("tools")
        if not isinstance(name, str) or not name:
            raise _refuse(f"tools.{i}.name", "a namespace tool needs its name", "invalid_value")
        if not isinstance(inner, list):
            raise _refuse(f"tools.{i}.tools", "a namespace tool needs its list of function tools", "invalid_value")
        for j, t in enumerate(inner):
            function(t if isinstance(t, dict) else {}, f"tools.{i}.tools.{j}")
            namespaces[str(t.get("name"))] = name
    return out or None, namespaces


def _tool_choice(choice: str | dict[str, Any] | None) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise _refuse("tool_choice", "must be 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
                  "invalid_value")


def _input_messages(items: str | list[dict[str, Any]], calls: set[str], origins: dict[str, str], at: int,
                    ) -> list[Message]:
    """Input items as chat messages (the first the chat's message `at`, the item each came from noted in
    `origins`): function_call items join the assistant turn before them as its tool calls, a
    function_call_output is the tool turn answering one of `calls` (those so far, theirs included), a
    reasoning item is the thought of the assistant turn after it."""
    if isinstance(items, str):
        origins[f"messages.{at}"] = "input"
        return [{"role": "user", "content": items}]
    out: list[Message] = []
    thought: list[str] = []  # reasoning items waiting for their assistant turn
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))
            if role is None:
                raise _refuse(f"input.{i}.role", f"must be user, assistant, system or developer, got {item.get('role')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(out)}"] = f"input.{i}"
            out.append({"role": role, "content": _parts_text(item.get("content"), f"input.{i}.content")})
        elif kind == "function_call":
            call = _history_call(item, f"input.{i}")
            calls.add(call["id"])
            if not (out and out[-1]["role"] == "assistant" and not any(thought)):
                origins[f"messages.{at + len(out)}"] = f"input.{i}"
                out.append({"role": "assistant", "content": "", "tool_calls": []})
            origins[f"messages.{at + len(out) - 1}.tool_calls.{len(out[-1].setdefault('tool_calls', []))}"] = f"input.{i}"
            out[-1]["tool_calls"].append(call)
        elif kind == "reasoning":
            thought.append(_reasoning_text(item, f"input.{i}"))
            continue
        elif kind == "function_call_output":
            if item.get("call_id") not in calls:
                raise _refuse(f"input.{i}.call_id", f"no earlier function_call has the call_id {item.get('call_id')!r}",
                              "invalid_value")
            origins[f"messages.{at + len(out)}"] = f"input.{i}"
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts_text(item.get("output"), f"input.{i}.output")})
        else:
            raise _refuse(f"input.{i}.type", f"input item {kind!r} is not supported: messages, function calls and "
                          "reasoning are")
        text = "\n".join(t for t in thought if t)
        if text and out[-1]["role"] == "assistant":
            out[-1]["reasoning_content"] = text
        thought = []
    return out


def _reasoning_text(item: dict[str, Any], where: str) -> str:
    """A reasoning item's thought: its reasoning_text content (what this server returns); an item with only
    encrypted content or a summary (another provider's) has none a local model could read."""
    content = item.get("content") or []
    if not isinstance(content, list):
        raise _refuse(f"{where}.content", "must be a list of reasoning_text parts", "invalid_value")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "reasoning_text" or not isinstance(part.get("text"), str):
            raise _refuse(f"{where}.content.{j}", "must be {'type': 'reasoning_text', 'text': ...}", "invalid_value")
    return "".join(part["text"] for part in content)


def _history_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    for name in ("call_id", "name", "arguments"):
        if not isinstance(item.get(name), str) or not item[name]:
            raise _refuse(f"{where}.{name}", f"a function_call item needs its {name} (a string)", "invalid_value")
    try:
        json.loads(item["arguments"])
    except ValueError:
        raise _refuse(f"{where}.arguments", "must be the call's arguments as JSON text", "invalid_value") from None
    return {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}


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
        with RESPONSES_TERMS.speaking(the_job.origins):
            prepared = engine.prepare(the_job)
        run = await engine.start(prepared, request)
        shell = _shell(body, engine.config.model_alias)
        namespaces = _tools(body.tools)[1]

        def finish(f: Finished, output: _Output) -> dict[str, Any]:
            """The whole response once the reply's output items are closed; stored when asked."""
            response = _completed(shell, f, len(prepared.tokens), output.items, _thought_tokens(engine, prepared, f))
            if body.store:
                turn: Message = {"role": "assistant", "content": output.content}
                if output.calls:
                    turn["tool_calls"] = [c.openai() for c in output.calls]
                if output.thought:
                    turn["reasoning_content"] = output.thought
                store.put(response, [*conversation, turn])
            return response

        if body.stream:
            return stream_response(run, _events(run, shell, prepared.reader(), finish, namespaces))
        async for event in run.events():
            if isinstance(event, Finished):
                output = _Output(lambda name, **data: {}, namespaces)  # a whole response: its events go nowhere
                list(output.feed(prepared.reader(), event.text, final=True))
                output.close(_status(event))
                return finish(event, output)
        raise cancelled()

    @r.post("/v1/responses/input_tokens")
    async def input_tokens(body: ResponsesRequest) -> dict[str, Any]:
        """The prompt's length in tokens as /v1/responses would render it, refused as that request would be
        (OpenAI's input-token count; nothing is generated)."""
        check_model(engine, body.model)
        the_job, _ = job(body, store)
        with RESPONSES_TERMS.speaking(the_job.origins):
            tokens = engine.prompt(the_job)
        return {"object": "response.input_tokens", "input_tokens": len(tokens)}

    @r.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> dict[str, Any]:
        return store.get(response_id)[0]

    @r.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return r




def _status(f: Finished) -> str:
    return "incomplete" if f.finish_reason == "length" else "completed"


def _shell(req: ResponsesRequest, model: str) -> dict[str, Any]:
    """The response object before its output: what every event's `response` carries."""
    return {
        "id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
        "model": req.model or model, "output": [], "error": None, "incomplete_details": None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "previous_response_id": req.previous_response_id, "store": req.store,
        "temperature": req.temperature, "top_p": req.top_p, "text": req.text or {"format": {"type": "text"}},
        "tools": req.tools or [], "tool_choice": req.tool_choice or "auto",
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "truncation": req.truncation or "disabled", "metadata": req.metadata or {}, "usage": None,
    }


def _thought_tokens(engine: Engine, prepared: Prepared, f: Finished) -> int:
    """How many of the reply's tokens its thought took (usage.output_tokens_details.reasoning_tokens)."""
    if prepared.thinking is None:
        return 0
    token_bytes = engine.token_bytes
    return prepared.thinking.tokens_in_thought([token_bytes(t).decode("utf-8", "replace") for t in f.tokens])


def _completed(shell: dict[str, Any], f: Finished, n_prompt: int, output: list[dict[str, Any]],
               reasoning_tokens: int) -> dict[str, Any]:
    status = _status(f)
    return {
        **shell, "status": status, "completed_at": int(time.time()), "output": output,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "usage": {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": f.stats.n_cached_tokens},
                  "output_tokens": len(f.tokens), "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
                  "total_tokens": n_prompt + len(f.tokens)},
        "timings": f.timings, "dflash": f.dflash,
    }


Event = Callable[..., dict[str, str]]


class _Output:
    """The response's output items as the reply is read: a reasoning item for its thought, a message item for
    its text, a function_call item per call. Each item opens when its first piece arrives and closes when the
    next one opens or the reply ends; `event` makes the stream event for each step (a no-op for a whole
    response)."""

    def __init__(self, event: Event, namespaces: dict[str, str] | None = None) -> None:
        self.event = event
        self.namespaces = namespaces or {}  # a namespaced function's namespace, named in its call's item
        self.items: list[dict[str, Any]] = []
        self.content = ""
        self.thought = ""
        self.calls: list[ToolCall] = []
        self._open: dict[str, Any] | None = None

    def feed(self, reader: ReplyReader | None, text: str, *, final: bool = False) -> Iterator[dict[str, str]]:
        pieces: list[Thought | str | CallDelta] = ([text] if text else []) if reader is None else reader.feed(text)
        if reader is not None and final:
            pieces += reader.finish()
            self.calls = reader.calls
        for piece in pieces:
            if isinstance(piece, Thought):
                yield from self._thought(piece.text)
            else:
                yield from self._text(piece) if isinstance(piece, str) else self._call(piece)

    def _thought(self, delta: str) -> Iterator[dict[str, str]]:
        if self._open is None or self._open["type"] != "reasoning":
            yield from self._close("completed")
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                    "status": "in_progress"}
            yield from self._add(item)
            part = {"type": "reasoning_text", "text": ""}
            item["content"].append(part)
            yield self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                             content_index=0, part=part)
        item = self._open
        item["content"][0]["text"] += delta
        self.thought += delta
        yield self.event("response.reasoning_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                         content_index=0, delta=delta)

    def _text(self, delta: str) -> Iterator[dict[str, str]]:
        if self._open is None or self._open["type"] != "message":
            yield from self._open_message()
        item = self._open
        item["content"][0]["text"] += delta
        self.content += delta
        yield self.event("response.output_text.delta", item_id=item["id"], output_index=len(self.items) - 1,
                         content_index=0, delta=delta, logprobs=[])

    def _open_message(self) -> Iterator[dict[str, str]]:
        yield from self._close("completed")
        item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress", "role": "assistant",
                "content": []}
        yield from self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        yield self.event("response.content_part.added", item_id=item["id"], output_index=len(self.items) - 1,
                         content_index=0, part=part)

    def _call(self, piece: CallDelta) -> Iterator[dict[str, str]]:
        if piece.id is not None:
            yield from self._close("completed")
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece.id,
                    "name": piece.name, "arguments": "", "status": "in_progress"}
            if piece.name in self.namespaces:
                item["namespace"] = self.namespaces[piece.name]
            yield from self._add(item)
        item = self._open
        if piece.arguments and item is not None:
            item["arguments"] += piece.arguments
            yield self.event("response.function_call_arguments.delta", item_id=item["id"],
                             output_index=len(self.items) - 1, delta=piece.arguments)

    def _add(self, item: dict[str, Any]) -> Iterator[dict[str, str]]:
        self.items.append(item)
        self._open = item
        yield self.event("response.output_item.added", output_index=len(self.items) - 1,
                         item={**item, "content": []} if "content" in item else dict(item))

    def _close(self, status: str) -> Iterator[dict[str, str]]:
        item, self._open = self._open, None
        if item is None:
            return
        item["status"] = status
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "message":
            part = item["content"][0]
            yield self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        elif item["type"] == "reasoning":
            part = item["content"][0]
            yield self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        else:
            yield self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=where["output_index"], item=item)

    def close(self, status: str) -> list[dict[str, str]]:
        """The reply has ended: close what is open, with the events that say so. A reply with neither text
        nor calls is one empty message, as OpenAI answers it."""
        opened = [] if self.items else list(self._open_message())
        return opened + list(self._close(status))


async def _events(run: Run, shell: dict[str, Any], reader: ReplyReader | None,
                  finish: Callable[[Finished, _Output], dict[str, Any]], namespaces: dict[str, str],
                  ) -> AsyncIterator[dict[str, str]]:
    """The Responses stream: created, each output item opened, its text or arguments in deltas, closed,
    then the whole response in response.completed (or response.incomplete at max_output_tokens)."""
    sequence = iter(range(1 << 62))

    def event(name: str, **data: Any) -> dict[str, str]:
        return {"event": name, "data": json.dumps({"type": name, "sequence_number": next(sequence), **data},
                                                  ensure_ascii=False)}

    output = _Output(event, namespaces)
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    try:
        async for step in heartbeat(run.events(), run.keepalive_s):
            if step is None:  # the Responses API has no ping: in_progress again says the response is alive
                yield event("response.in_progress", response=shell)
                continue
            if isinstance(step, Finished):
                for e in [*output.feed(reader, "", final=True), *output.close(_status(step))]:
                    yield e
                response = finish(step, output)
                yield event(f"response.{response['status']}", response=response)
                return
            for e in output.feed(reader, step.text):
                yield e
        raise cancelled()
    except APIError as e:
        yield event("error", code=e.code, message=e.message, param=e.param)
