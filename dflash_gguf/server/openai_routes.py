"""The OpenAI routes: /v1/models, /v1/chat/completions, /v1/completions, streamed (SSE) and not.

Shapes are llama_cpp's (llama_cpp.llama_types); every response also carries llama-server's `timings`
and the namespaced `dflash` figures: in the body, or in the last chunk of a stream (and in the usage
chunk when stream_options.include_usage asks for one). With tools, the calls the model made are in
message.tool_calls (streamed: delta.tool_calls, the id and name first, then the arguments in fragments as
they are written) and finish_reason is "tool_calls". A thinking model's thought is in message.reasoning_content
(streamed: delta.reasoning_content), as llama-server and DeepSeek's API give it, and left out of the content.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator, Callable, Sequence

from fastapi import APIRouter, Request
from llama_cpp.llama_types import CreateChatCompletionResponse, CreateCompletionResponse
from llama_cpp.server.types import ModelList

from ..logprobs import CompletionLogprobs, chat_logprobs
from ..steps import TokenLogprob
from ..chat.reply import openai_delta
from .engine import Engine, Finished, Run
from .errors import APIError, cancelled, error_body
from .openai_api import ChatCompletionRequest, CompletionRequest, chat_job, completion_job
from .sse import stream_response


def check_model(engine: Engine, model: str | None) -> None:
    cfg = engine.config
    if model and model != cfg.model_alias and not cfg.accept_any_model:
        raise APIError(404, f"the model {model!r} does not exist here; this server serves {cfg.model_alias!r} "
                       "(started with --no-accept-any-model)", param="model", code="model_not_found")


def _usage(f: Finished) -> dict[str, Any]:
    """OpenAI's usage, with the prompt tokens the slot's context or the prompt cache already held."""
    return {"prompt_tokens": f.n_prompt, "completion_tokens": len(f.tokens), "total_tokens": f.n_prompt + len(f.tokens),
            "prompt_tokens_details": {"cached_tokens": f.stats.n_cached_tokens}}


def router(engine: Engine) -> APIRouter:
    r = APIRouter()

    @r.get("/v1/models")
    async def models() -> dict[str, Any]:
        out: ModelList = {"object": "list", "data": [{"id": engine.config.model_alias, "object": "model", "owned_by": "dflash-gguf",
                                            "permissions": []}]}
        # OpenAI's `created`; the context as OpenRouter names it (agents size their prompts by it) and as
        # llama-server's meta does; whether another model name is answered too
        out["data"][0].update({"created": engine.config.created, "context_length": engine.n_ctx,  # type: ignore[typeddict-unknown-key]
                               "meta": {"n_ctx": engine.n_ctx, "n_ctx_train": engine.n_ctx_train,
                                        "max_tokens": engine.config.max_tokens,
                                        "accepts_any_model_name": engine.config.accept_any_model}})
        return out

    @r.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        check_model(engine, body.model)
        job = chat_job(body)
        prepared = engine.prepare(job)
        run = await engine.start(prepared, request)
        header = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.config.model_alias}
        token_bytes = engine.token_bytes
        logprobs = (lambda entries: chat_logprobs(entries, token_bytes)) if job.gen.get("logprobs") is not None else None
        if job.stream:
            return stream_response(run, _sse(_chat_chunks(run, header, job.include_usage, logprobs)))
        f = await _finish(run)
        message: dict[str, Any] = {"role": "assistant", "content": f.text}
        finish = f.finish_reason
        reader = prepared.reader()
        if reader is not None:
            thought, content, calls = reader.read(f.text)
            message["content"] = content
            if thought:
                message["reasoning_content"] = thought
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                finish = "tool_calls"
        out: CreateChatCompletionResponse = {
            **header, "object": "chat.completion",
            "choices": [{"index": 0, "message": message, "logprobs": logprobs(f.logprobs) if logprobs else None,
                         "finish_reason": finish}],
            "usage": _usage(f),
        }
        return {**out, "timings": f.timings, "dflash": f.dflash}

    @r.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        check_model(engine, body.model)
        job = completion_job(body)
        run = await engine.start(engine.prepare(job), request)
        header = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": engine.config.model_alias}
        logprobs = None
        if job.gen.get("logprobs") is not None:  # llama_cpp's shape; text offsets count from the end of the prompt
            logprobs = CompletionLogprobs(engine.token_bytes, len(job.prompt))
        if job.stream:
            return stream_response(run, _sse(_completion_chunks(run, header, job.include_usage, logprobs)))
        f = await _finish(run)
        out: CreateCompletionResponse = {
            **header, "object": "text_completion",
            "choices": [{"text": f.text, "index": 0, "logprobs": logprobs(f.logprobs) if logprobs else None,
                         "finish_reason": f.finish_reason}],
            "usage": _usage(f),
        }
        return {**out, "timings": f.timings, "dflash": f.dflash}

    return r


async def _finish(run: Run) -> Finished:
    async for event in run.events():
        if isinstance(event, Finished):
            return event
    raise cancelled()


async def _sse(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, str]]:
    """SSE events for OpenAI chunks; a failure after the headers went out becomes an error event."""
    try:
        async for chunk in chunks:
            yield {"data": json.dumps(chunk, ensure_ascii=False)}
    except APIError as e:
        yield {"data": json.dumps(error_body(e.status, e.message, e.param, e.code))}
    yield {"data": "[DONE]"}


LogprobShape = Callable[[Sequence[TokenLogprob]], dict[str, Any]]


async def _chat_chunks(run: Run, header: dict[str, Any], include_usage: bool,
                       logprobs: LogprobShape | None = None) -> AsyncIterator[dict[str, Any]]:
    head = {**header, "object": "chat.completion.chunk"}

    def chunk(delta: dict[str, Any], shown: dict[str, Any] | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": shown, "finish_reason": None}]}

    reader = run.prepared.reader()
    yield chunk({"role": "assistant", "content": ""})
    async for event in run.events():
        if isinstance(event, Finished):
            finish = event.finish_reason
            if reader is not None:
                for piece in reader.finish():
                    yield chunk(openai_delta(piece))
                finish = "tool_calls" if reader.calls else finish
            last = {**head, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish}],
                    "timings": event.timings, "dflash": event.dflash}
            yield last
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(event), "timings": event.timings, "dflash": event.dflash}
            return
        shown = logprobs(event.logprobs) if logprobs and event.logprobs else None
        if reader is not None:  # the step's logprobs ride on its first piece (or alone when the text waits)
            pieces = [openai_delta(piece) for piece in reader.feed(event.text)]
            for i, delta in enumerate(pieces or ([{}] if shown else [])):
                yield chunk(delta, shown if i == 0 else None)
        elif event.text or shown:
            yield chunk({"content": event.text}, shown)
    raise cancelled()


async def _completion_chunks(run: Run, header: dict[str, Any], include_usage: bool,
                             logprobs: LogprobShape | None = None) -> AsyncIterator[dict[str, Any]]:
    head = {**header, "object": "text_completion"}
    async for event in run.events():
        if isinstance(event, Finished):
            yield {**head, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": event.finish_reason}],
                   "timings": event.timings, "dflash": event.dflash}
            if include_usage:
                yield {**head, "choices": [], "usage": _usage(event), "timings": event.timings, "dflash": event.dflash}
            return
        if event.text or (logprobs and event.logprobs):
            yield {**head, "choices": [{"text": event.text, "index": 0,
                                        "logprobs": logprobs(event.logprobs) if logprobs else None,
                                        "finish_reason": None}]}
    raise cancelled()
