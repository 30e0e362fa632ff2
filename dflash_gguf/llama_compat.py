"""llama_cpp.Llama's dict shapes over a Session: create_completion and create_chat_completion, whole or as
chunks, with llama_cpp's defaults and spellings (max_tokens <= 0 for "no limit", logprobs as a bool beside
top_logprobs), so that code written for llama_cpp switches with one line. The Session's own methods of those
names call these; nothing here decodes or renders: the Session streams Steps and the chat floor prepares the turn.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Iterator, Mapping, Protocol, Sequence

from llama_cpp import llama_chat_format

from .checks import SettingError, SettingTypeError
from .chat import ChatRequest, Turn
from .chat.reply import ReplyReader, openai_delta
from .config import LLAMA_CHAT_DEFAULTS, LLAMA_COMPLETION_DEFAULTS, GenerationConfig
from .logprobs import CompletionLogprobs
from .steps import Step


class Session(Protocol):
    """What these shapes need of a dflash_gguf.Session (a protocol: this room sits beside the Session, not above it)."""

    @property
    def target(self) -> Any: ...

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]: ...

    def prepare_chat(self, request: ChatRequest, base: GenerationConfig | None = None) -> Turn: ...

    def run_turn(self, turn: Turn) -> Any: ...

    def generate_tokens(self, tokens: Sequence[int], config: GenerationConfig | None = None) -> Any: ...

    def stream_tokens(self, tokens: Sequence[int], config: GenerationConfig | None = None) -> Iterator[Step]: ...


def create_completion(session: Session, prompt: str, *, stream: bool = False,
                      **settings: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """llama_cpp.Llama.create_completion's dict (or chunk stream) for a raw prompt, with its defaults;
    logprobs=n reports each token's log-probability and its n likeliest alternatives, as llama_cpp does."""
    tokens = session.tokenize(prompt, add_special=True)
    config = GenerationConfig.build(LLAMA_COMPLETION_DEFAULTS, **_llama_max_tokens(settings))
    offset = len(prompt)  # llama_cpp's text offsets count from the end of the prompt
    return _completion_chunks(session, tokens, config, offset) if stream else \
        _completion(session, tokens, config, offset)


def create_chat_completion(session: Session, messages: Sequence[Mapping[str, Any]], *, stream: bool = False,
                           tools: Any = None, tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                           chat_template_kwargs: Any = None, **settings: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
    """llama_cpp.Llama.create_chat_completion's dict (or chunk stream), chat template from the GGUF;
    logprobs=True (with top_logprobs=n alternatives) fills choices[0].logprobs.content as llama_cpp does.
    With tools, the calls come back in message.tool_calls (streamed: delta.tool_calls), finish_reason
    "tool_calls", and a thinking template's thought in message.reasoning_content; without tools the reply
    is llama_cpp's, thought included in the content."""
    request = ChatRequest(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs,
                          settings=_chat_logprobs(_llama_max_tokens(settings)))
    turn = session.prepare_chat(request, LLAMA_CHAT_DEFAULTS)
    if turn.parses_calls:
        return _tool_chunks(session, turn) if stream else _tool_completion(session, turn)
    completion = _completion_chunks(session, turn.tokens, turn.config) if stream else \
        _completion(session, turn.tokens, turn.config)
    return llama_chat_format._convert_completion_to_chat(completion, stream=stream)


def _chat_header(session: Session) -> dict[str, Any]:
    return {"id": f"chatcmpl-{uuid.uuid4()}", "created": int(time.time()), "model": str(session.target.path)}


def _tool_completion(session: Session, turn: Turn) -> dict[str, Any]:
    result = session.run_turn(turn)
    message: dict[str, Any] = {"role": "assistant", "content": result.content}
    if result.reasoning:
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = [c.openai() for c in result.tool_calls]
    n, n_prompt = len(result.tokens), len(turn.tokens)
    return {
        **_chat_header(session), "object": "chat.completion",
        "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": result.finish_reason}],
        "usage": {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n},
    }


def _tool_chunks(session: Session, turn: Turn) -> Iterator[dict[str, Any]]:
    head = {**_chat_header(session), "object": "chat.completion.chunk"}
    reader: ReplyReader = turn.reader()

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {**head, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}

    yield chunk({"role": "assistant"})
    for step in session.stream_tokens(turn.tokens, turn.config):
        pieces = list(reader.feed(step.text))
        if step.finish_reason is not None:
            pieces += reader.finish()
        for piece in pieces:
            yield chunk(openai_delta(piece))
        if step.finish_reason is not None:
            yield chunk({}, "tool_calls" if reader.calls else step.finish_reason)


def _completion_header(session: Session) -> dict[str, Any]:
    return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()),
            "model": str(session.target.path)}


def _completion(session: Session, tokens: list[int], config: GenerationConfig, text_offset: int = 0) -> dict[str, Any]:
    """A whole completion in llama_cpp's text_completion shape, with usage (and logprobs when asked)."""
    header = _completion_header(session)
    result = session.generate_tokens(tokens, config)
    n = len(result.tokens)
    logprobs = None
    if config.logprobs is not None:
        logprobs = CompletionLogprobs(session.target.vocab.token_bytes, text_offset)(result.logprobs)
    return {
        **header,
        "choices": [{"text": result.text, "index": 0, "logprobs": logprobs, "finish_reason": result.finish_reason}],
        "usage": {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n},
    }


def _completion_chunks(session: Session, tokens: list[int], config: GenerationConfig,
                       text_offset: int = 0) -> Iterator[dict[str, Any]]:
    """llama_cpp's streamed text_completion chunks: one per cycle with text (and that cycle's logprobs when
    asked), then one with finish_reason."""
    header = _completion_header(session)
    shape = CompletionLogprobs(session.target.vocab.token_bytes, text_offset) if config.logprobs is not None else None
    for step in session.stream_tokens(tokens, config):
        if step.text or (shape is not None and step.logprobs):
            logprobs = shape(step.logprobs) if shape is not None else None
            yield {**header, "choices": [{"text": step.text, "index": 0, "logprobs": logprobs, "finish_reason": None}]}
        if step.finish_reason is not None:
            yield {**header, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": step.finish_reason}]}


def _llama_max_tokens(settings: dict[str, Any]) -> dict[str, Any]:
    """llama_cpp's convention: max_tokens None or <= 0 means up to the end of the context (our None)."""
    n = settings.get("max_tokens")
    if isinstance(n, int) and not isinstance(n, bool) and n <= 0:
        return {**settings, "max_tokens": None}
    return settings


def _chat_logprobs(settings: dict[str, Any]) -> dict[str, Any]:
    """llama_cpp's chat spelling (logprobs: bool, top_logprobs: n) as the config's logprobs (n, or None: off)."""
    if "logprobs" not in settings and "top_logprobs" not in settings:
        return settings
    settings = dict(settings)
    wanted, top = settings.pop("logprobs", None), settings.pop("top_logprobs", None)
    if wanted not in (None, True, False):
        raise SettingTypeError("logprobs", f"must be True or False for a chat completion, got {wanted!r}")
    if top is not None and not wanted:
        raise SettingError("top_logprobs", "needs logprobs=True")
    settings["logprobs"] = (0 if top is None else top) if wanted else None
    return settings
