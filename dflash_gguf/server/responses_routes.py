"""POST /v1/responses: the OpenAI Responses API (what Codex-style clients speak), whole or as its event stream.

The request and its translation are responses_api's; here a reply is shaped back: a call comes back as a
function_call output item, a thinking model's thought as a reasoning item before the others (its text as
reasoning_text content, no summary). A stored response is retrievable with GET and removable with DELETE
(responses_api.ResponseStore).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Iterator

from fastapi import APIRouter, Request

from ..chat.reply import ReplyReader, Thought
from ..chat.tool_calls import CallDelta, ToolCall
from .engine import Engine, Finished, Prepared, Run
from .errors import APIError, cancelled
from .openai_routes import check_model
from .responses_api import ResponsesRequest, ResponseStore, function_tools, job
from .schemas import Message
from .sse import heartbeat, stream_response


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
        namespaces = function_tools(body.tools)[1]

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
