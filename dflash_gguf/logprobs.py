"""Token log-probabilities in the shapes clients read: llama_cpp's completion `logprobs` and OpenAI's chat one.

The numbers come from the decode loop (Step.logprobs): the verify logits already computed, so asking for
them costs no extra pass. Both the Session's llama_cpp-shaped methods and the server build them here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from .steps import TokenLogprob

TokenBytes = Callable[[int], bytes]


def _text(token_bytes: TokenBytes, token: int) -> str:
    """A token's text as llama_cpp reports it: its bytes decoded, an incomplete character dropped."""
    return token_bytes(token).decode("utf-8", errors="ignore")


class CompletionLogprobs:
    """llama_cpp's CompletionLogprobs (tokens, text_offset, token_logprobs, top_logprobs), built as tokens
    commit; text offsets count characters from `text_offset` (llama_cpp starts them after the prompt).
    The chosen token is always among its top_logprobs, as llama_cpp adds it."""

    def __init__(self, token_bytes: TokenBytes, text_offset: int = 0) -> None:
        self._token_bytes = token_bytes
        self._offset = text_offset

    def __call__(self, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
        tokens: list[str] = []
        offsets: list[int] = []
        tops: list[dict[str, float]] = []
        for e in entries:
            text = _text(self._token_bytes, e.token)
            tokens.append(text)
            offsets.append(self._offset)
            self._offset += len(text)
            top = {_text(self._token_bytes, t): lp for t, lp in e.top}
            top[text] = e.logprob
            tops.append(top)
        return {"tokens": tokens, "text_offset": offsets, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": tops}


def chat_logprobs(entries: Sequence[TokenLogprob], token_bytes: TokenBytes) -> dict[str, Any]:
    """OpenAI's chat `logprobs`: {"content": [{token, logprob, bytes, top_logprobs: [...]}], "refusal": None}."""
    def one(token: int, logprob: float) -> dict[str, Any]:
        raw = token_bytes(token)
        return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

    return {
        "content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
        "refusal": None,
    }
