"""POST /v1/messages: the Anthropic Messages API, whole or as its stream of named events; and
POST /v1/messages/count_tokens, the length of the prompt a request would send.

stop_reason: end_turn (the model ended its turn), max_tokens, model_context_window_exceeded (the context
had no room left), stop_sequence (one of the caller's
stop_sequences, named in stop_sequence), tool_use (the reply calls tools: a tool_use block each, streamed
as content_block_start and input_json_delta fragments). A thinking model's thought is a thinking block
before the others (streamed as thinking_delta events), its signature empty: a local model has nothing to
sign, as in llama-server. `timings` and `dflash` ride along in the message and in the message_delta event;
the SDK keeps unknown fields aside.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request

from ..chat.reply import ReplyReader, Thought
from ..chat.tool_calls import CallDelta
from .engine import Engine, Finished, Run
from .errors import APIError, cancelled, error_body
from .openai_routes import check_model
from .anthropic_api import CountTokensRequest, MessagesRequest, messages_job
from .sse import heartbeat, stream_response


def _stop_reason(f: Finished, tool_use: bool = False) -> str:
    if tool_use:
        return "tool_use"
    if f.context_full:  # Anthropic's own reason: a client that continues a max_tokens reply would overflow
        return "model_context_window_exceeded"
    if f.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if f.stop_sequence is not None else "end_turn"


def _usage(f: Finished) -> dict[str, int]:
    """Anthropic's usage: input_tokens are the prompt's uncached tokens, cache_read_input_tokens the ones the
    slot's context or the prompt cache already held (as llama-server counts them)."""
    cached = f.stats.n_cached_tokens
    return {"input_tokens": f.n_prompt - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": len(f.tokens)}


def router(engine: Engine) -> APIRouter:
    r = APIRouter()

    @r.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Any:
        check_model(engine, body.model)
        job = messages_job(body)
        prepared = engine.prepare(job)
        run = await engine.start(prepared, request)
        message = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": body.model}
        reader = prepared.reader()
        if job.stream:
            events = _events(run, message, len(prepared.tokens)) if reader is None else \
                _block_events(run, message, len(prepared.tokens), reader)
            return stream_response(run, events)
        async for event in run.events():
            if isinstance(event, Finished):
                content: list[dict[str, Any]] = [{"type": "text", "text": event.text}]
                calls = []
                if reader is not None:
                    thought, text, calls = reader.read(event.text)
                    content = ([{"type": "thinking", "thinking": thought, "signature": ""}] if thought else []) + (
                        [{"type": "text", "text": text}] if text else []) + [
                        {"type": "tool_use", "id": c.id, "name": c.name, "input": c.arguments} for c in calls]
                return {
                    **message, "content": content,
                    "stop_reason": _stop_reason(event, bool(calls)), "stop_sequence": event.stop_sequence,
                    "usage": _usage(event),
                    "timings": event.timings, "dflash": event.dflash,
                }
        raise cancelled()

    @r.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> dict[str, int]:
        """The prompt's length in tokens as /v1/messages would render it (Claude Code asks before it sends)."""
        check_model(engine, body.model)
        job = messages_job(body)
        tokens = engine.prompt(job)
        return {"input_tokens": len(tokens)}

    return r


def _event(name: str, data: dict[str, Any]) -> dict[str, str]:
    return {"event": name, "data": json.dumps({"type": name, **data}, ensure_ascii=False)}


async def _events(run: Run, message: dict[str, Any], n_prompt: int) -> AsyncIterator[dict[str, str]]:
    yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    yield _event("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {})
    try:
        async for event in heartbeat(run.events(), run.keepalive_s):
            if event is None:
                yield _event("ping", {})
                continue
            if isinstance(event, Finished):
                yield _event("content_block_stop", {"index": 0})
                yield _event("message_delta", {
                    "delta": {"stop_reason": _stop_reason(event), "stop_sequence": event.stop_sequence},
                    "usage": _usage(event), "timings": event.timings, "dflash": event.dflash})
                yield _event("message_stop", {})
                return
            if event.text:
                yield _event("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event.text}})
        raise cancelled()
    except APIError as e:
        body = error_body(e.status, e.message, e.param, e.code, anthropic=True)
        yield {"event": "error", "data": json.dumps(body)}


async def _block_events(run: Run, message: dict[str, Any], n_prompt: int, reader: ReplyReader,
                        ) -> AsyncIterator[dict[str, str]]:
    """The stream of a reply that may think or call tools: a thinking block while the model thinks, a text
    block while it writes text, then a tool_use block per call (its input as input_json_delta fragments),
    each opened as its first piece arrives."""
    yield _event("message_start", {"message": {**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                               "usage": {"input_tokens": n_prompt, "output_tokens": 0}}})
    yield _event("ping", {})
    index, open_kind = -1, None  # the block being written: its index and kind ("thinking", "text", or a call's index)

    def close():
        if open_kind == "thinking":  # Anthropic's clients expect a signature before a thinking block ends
            yield _event("content_block_delta", {"index": index, "delta": {"type": "signature_delta", "signature": ""}})
        if open_kind is not None:
            yield _event("content_block_stop", {"index": index})

    def blocks(pieces):
        nonlocal index, open_kind
        for piece in pieces:
            kind = "thinking" if isinstance(piece, Thought) else "text" if isinstance(piece, str) else piece.index
            if kind != open_kind:
                yield from close()
                index, open_kind = index + 1, kind
                block = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else \
                    {"type": "text", "text": ""} if kind == "text" else \
                    {"type": "tool_use", "id": piece.id, "name": piece.name, "input": {}}
                yield _event("content_block_start", {"index": index, "content_block": block})
            if isinstance(piece, Thought):
                yield _event("content_block_delta", {"index": index, "delta": {"type": "thinking_delta",
                                                                               "thinking": piece.text}})
            elif isinstance(piece, CallDelta):
                if piece.arguments:
                    yield _event("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta", "partial_json": piece.arguments}})
            elif piece:
                yield _event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": piece}})

    try:
        async for event in heartbeat(run.events(), run.keepalive_s):
            if event is None:
                yield _event("ping", {})
                continue
            if isinstance(event, Finished):
                for e in [*blocks(reader.finish()), *close()]:
                    yield e
                yield _event("message_delta", {
                    "delta": {"stop_reason": _stop_reason(event, bool(reader.calls)),
                              "stop_sequence": event.stop_sequence},
                    "usage": _usage(event), "timings": event.timings, "dflash": event.dflash})
                yield _event("message_stop", {})
                return
            for e in blocks(reader.feed(event.text)):
                yield e
        raise cancelled()
    except APIError as e:
        body = error_body(e.status, e.message, e.param, e.code, anthropic=True)
        yield {"event": "error", "data": json.dumps(body)}
