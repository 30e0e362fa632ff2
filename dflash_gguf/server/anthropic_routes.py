"""POST /v1/messages: the Anthropic Messages API, whole or as its stream of named events.

stop_reason: end_turn (the model ended its turn), max_tokens, stop_sequence (one of the caller's
stop_sequences, named in stop_sequence). `timings` and `dflash` ride along in the message and in
the message_delta event; the SDK keeps unknown fields aside.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from .engine import Engine, Finished, Run
from .errors import APIError, error_body
from .openai_routes import check_model
from .schemas import MessagesRequest, messages_job
from .sse import stream_response


def _stop_reason(f: Finished) -> str:
    if f.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if f.stop_sequence is not None else "end_turn"


def router(engine: Engine) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        check_model(engine, body.model)
        job = messages_job(body, engine.template_has_tools)
        prepared = engine.prepare(job)
        run = await engine.start(prepared, request)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model}
        if job.stream:
            return stream_response(run, _events(run, message, len(prepared.tokens)))
        async for event in run.events():
            if isinstance(event, Finished):
                return {
                    **message, "content": [{"type": "text", "text": event.text}],
                    "stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence,
                    "usage": {"input_tokens": event.n_prompt, "output_tokens": len(event.tokens)},
                    "timings": event.timings, "dflash": event.dflash,
                }
        raise APIError(503, "the generation was cancelled (the server is shutting down)", code="cancelled")

    return r


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}


async def _events(run: Run, message: dict[str, Any], n_prompt: int) -> AsyncIterator[dict[str, str]]:
    yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {})
    try:
        async for event in run.events():
            if isinstance(event, Finished):
                yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {
                    "delta": {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence},
                    "usage": {"output_tokens": len(event.tokens)}, "timings": event.timings, "dflash": event.dflash})
                yield _event("message_stop", {})
                return
            if event.text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event.text}})
        raise APIError(503, "the generation was cancelled (the server is shutting down)", code="cancelled")
    except APIError as e:
        body = error_body(e.status, e.message, e.param, e.code, anthropic=True)
        yield {"event": "error", "data": json.dumps(body)}
