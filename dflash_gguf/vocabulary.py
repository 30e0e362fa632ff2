"""A loaded model's vocabulary: text to tokens and back, its special and end-of-generation tokens, its chat
template, and llguidance's view of it. What the chat floor and the loop's stop rules read of a model,
apart from the Target, which decodes (issue 34: the vocabulary was one of the Target's six jobs).

Each Target holds one (`Target.vocab`), closed with it; forks share the model's llguidance tokenizer
(`TokenizerCache`), which takes about a second to build for a 50k vocabulary.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from typing import TYPE_CHECKING, Callable, Iterator

from llama_cpp import llama_cpp as capi

if TYPE_CHECKING:
    import llguidance

__all__ = ["TokenizerCache", "Vocabulary"]


class TokenizerCache:
    """llguidance's tokenizer of one loaded model, built once for every context on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.tokenizer: "llguidance.LLTokenizer | None" = None


class Vocabulary:
    """The vocabulary of a loaded model (libllama's llama_vocab), checked before C sees a token id.

    `closed` raises the owner's error once the owner (a Target) is closed: after close() nothing reaches C.
    """

    def __init__(self, model: capi.llama_model_p, tokenizers: TokenizerCache,
                 closed: Callable[[], Exception]) -> None:
        self._model = model
        self._vocab = capi.llama_model_get_vocab(model)
        self._tokenizers = tokenizers
        self._closed = closed
        self.n_vocab: int = capi.llama_vocab_n_tokens(self._vocab)
        self._pieces: dict[int, bytes] = {}  # token -> bytes: the vocabulary never changes
        self._eog: dict[int, bool] = {}

    def close(self) -> None:
        """Its owner freed the model or context: every later call raises the owner's closed error."""
        self._vocab = self._model = None

    def _check_open(self) -> None:
        if self._vocab is None:
            raise self._closed()

    def tokenize(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        self._check_open()
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (capi.llama_token * cap)()
        n = capi.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (capi.llama_token * cap)()
            n = capi.llama_tokenize(self._vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            raise RuntimeError(f"tokenization failed ({n})")
        return list(buf[:n])

    def token_bytes(self, token: int, *, special: bool = False) -> bytes:
        """The UTF-8 bytes of one token (may be part of a character)."""
        self._check_open()
        if not special and token in self._pieces:
            return self._pieces[token]
        if not 0 <= token < self.n_vocab:
            raise ValueError(f"token id must be in [0, {self.n_vocab}), got {token}")
        buf = ctypes.create_string_buffer(64)
        n = capi.llama_token_to_piece(self._vocab, token, buf, 64, 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = capi.llama_token_to_piece(self._vocab, token, buf, -n, 0, special)
        piece = buf.raw[:n]
        if not special:
            self._pieces[int(token)] = piece
        return piece

    def is_eog(self, token: int) -> bool:
        self._check_open()
        eog = self._eog.get(token)
        if eog is None:
            if not 0 <= token < self.n_vocab:
                raise ValueError(f"token id must be in [0, {self.n_vocab}), got {token}")
            eog = self._eog[int(token)] = bool(capi.llama_vocab_is_eog(self._vocab, token))
        return eog

    def special_token_text(self, token: int) -> str:
        return self.token_bytes(token, special=True).decode("utf-8", errors="replace") if token >= 0 else ""

    def bos_token(self) -> int:
        self._check_open()
        return int(capi.llama_vocab_bos(self._vocab))

    def eos_token(self) -> int:
        self._check_open()
        return int(capi.llama_vocab_eos(self._vocab))

    def texts(self) -> Iterator[bytes]:
        """Every token's text as the GGUF stores it, in id order (the target's fingerprint hashes them)."""
        self._check_open()
        return (capi.llama_vocab_get_text(self._vocab, i) for i in range(self.n_vocab))

    def chat_template(self) -> str | None:
        """The GGUF's default chat template (tokenizer.chat_template), or None."""
        self._check_open()
        raw = capi.llama_model_chat_template(self._model, None)
        return raw.decode("utf-8") if raw else None

    def constraint_tokenizer(self) -> "llguidance.LLTokenizer":
        """The vocabulary as llguidance's tokenizer, for constrained decoding; built once per model (~1 s
        for a 50k vocabulary), every end-of-generation token an end of the grammar's text."""
        self._check_open()
        cache = self._tokenizers
        with cache.lock:
            if cache.tokenizer is None:
                from llguidance.llamacpp import lltokenizer_from_vocab

                eog = [t for t in range(self.n_vocab) if capi.llama_vocab_is_eog(self._vocab, t)]
                with warnings.catch_warnings():  # it reads each token's attributes by a deprecated name
                    warnings.simplefilter("ignore", DeprecationWarning)
                    cache.tokenizer = lltokenizer_from_vocab(self._vocab, eos_token=eog or None)
            return cache.tokenizer
