"""The public API: a target and its DFlash drafter behind generate/stream/chat and llama_cpp-shaped methods."""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import llama_cpp
from llama_cpp import llama_chat_format

from . import defaults
from .controller import BlockController, calibrate
from .decoding import CacheState, GenerationConfig, Step, decode_steps
from .drafter import Drafter
from .sampling import SamplingParams
from .target import Target

Message = Mapping[str, Any]


@dataclass(frozen=True)
class GenerationStats:
    """How a generation went. acceptance_length (tau) counts the bonus token: plain decoding has tau = 1."""

    acceptance_length: float
    cycles: int
    n_drafted: int
    n_accepted: int
    acceptance_histogram: list[int]  # [i] = cycles that accepted exactly i drafts
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float
    block_size: int | None  # the fixed block size asked for; None = adaptive
    mean_block_size: float
    draft_s: float
    verify_s: float
    n_prompt_tokens: int
    n_cached_tokens: int
    n_tokens: int
    speculative: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Result:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats


def _default_drafter() -> Path | None:
    """The drafter shipped for the embedded target, once the package carries one."""
    find = getattr(defaults, "embedded_drafter", None)
    return find() if find is not None else None


class Session:
    """A target GGUF and a dflash drafter GGUF decoding together; output is the target's, only faster.

    target=None uses the embedded SmolLM2 target and, with drafter=None, its embedded drafter when the
    package ships one. Without a drafter every generation is plain decoding (a warning says so once).
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        drafter: str | os.PathLike[str] | None = None,
        *,
        n_ctx: int = 4096,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        n_batch: int = 512,
        flash_attn: bool = True,
        verbose: bool = False,
    ) -> None:
        if drafter is None and target is None:
            drafter = _default_drafter()
        tgt = Target.open(
            defaults.embedded_target() if target is None else target,
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_gpu_layers=n_gpu_layers,
            n_threads=n_threads,
            flash_attn=flash_attn,
            verbose=verbose,
        )
        try:
            self._attach(tgt, drafter, n_threads)
        except BaseException:
            tgt.close()
            raise
        self._llama: llama_cpp.Llama | None = None

    @classmethod
    def from_llama(
        cls, llama: llama_cpp.Llama, drafter: str | os.PathLike[str] | None = None, *, n_threads: int | None = None
    ) -> "Session":
        """Wrap an existing llama_cpp.Llama: its model and context become the target (still owned by it).

        Create the Llama with flash_attn=True for greedy output identical to plain decoding (see README).
        """
        self = cls.__new__(cls)
        self._attach(Target.from_llama(llama), drafter, n_threads)
        self._llama = llama
        llama.reset()
        return self

    def _attach(self, target: Target, drafter: str | os.PathLike[str] | None, n_threads: int | None) -> None:
        self.target = target
        self.drafter: Drafter | None = None
        self._cache = CacheState()
        self._block_controller: BlockController | None = None
        self._warned_plain = False
        self.last_stats: GenerationStats | None = None  # of the last generation that ran to its end
        if drafter is None:
            return
        if target.recurrent:
            warnings.warn(
                f"{target.architecture} keeps recurrent state that cannot be rolled back: "
                "speculative decoding is off, every generation decodes plainly",
                stacklevel=3,
            )
            return
        self.drafter = Drafter(drafter, target, n_threads=n_threads)

    # -- generation ------------------------------------------------------------------------
    def stream(
        self,
        prompt: str,
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        speculative: bool = True,
        block_size: int | None = None,
    ) -> Iterator[Step]:
        """One Step per decode cycle for a raw prompt (no chat template); the last Step has finish_reason."""
        config = _config(max_tokens, temperature, top_p, top_k, seed, stop, speculative, block_size)
        tokens = self.tokenize(prompt, add_special=True)
        return self._steps(tokens, config)

    def generate(self, prompt: str, **gen: Any) -> Result:
        """Complete a raw prompt; same keyword arguments as stream()."""
        config = _config(**_gen_args(gen))
        return self._collect(self._steps(self.tokenize(prompt, add_special=True), config))

    def chat(self, messages: Sequence[Message], **gen: Any) -> Result:
        """Answer a conversation rendered with the GGUF's chat template; a follow-up turn reuses the cached prefix."""
        return self._collect(self.stream_chat(messages, **gen))

    def stream_chat(self, messages: Sequence[Message], **gen: Any) -> Iterator[Step]:
        """chat(), one Step per decode cycle; the template's stop strings are added to the caller's."""
        prompt, stops = self.render_chat(messages)
        args = _gen_args(gen)
        user_stop = args.pop("stop", None)
        user_stops = [user_stop] if isinstance(user_stop, str) else list(user_stop or [])
        config = _config(stop=user_stops + stops, **args)
        return self._steps(self.tokenize(prompt, add_special=False), config)

    def reset(self) -> None:
        """Forget both KV caches, so that the next generation prefills its whole prompt (benchmarks want that)."""
        self._cache = CacheState()
        self.target.remove(0, 0)
        if self.drafter is not None:
            self.drafter.remove(0)

    def _steps(self, tokens: list[int], config: GenerationConfig) -> Iterator[Step]:
        """decode_steps with this Session's caches; `last_stats` describes the generation once it ends."""
        if self._llama is not None:
            if self._llama.n_tokens:
                self._cache = CacheState()  # the wrapped Llama decoded in between: our cached prefix is gone
            self._llama.reset()  # and it must not trust its own prefix once we have used the context
        speculative = config.speculative and self.drafter is not None
        if config.speculative and self.drafter is None and not self._warned_plain:
            warnings.warn("this Session has no drafter: decoding plainly", stacklevel=3)
            self._warned_plain = True
        controller = self._controller() if speculative and config.block_size is None else None
        steps: list[Step] = []
        t0 = time.perf_counter()
        try:
            for step in decode_steps(self.target, self.drafter, tokens, config, self._cache, controller):
                steps.append(step)
                yield step
        except GeneratorExit:
            raise  # the caller stopped reading: the cache is consistent at every yield
        except BaseException:
            self._cache = CacheState()  # a failure mid-cycle leaves the KV caches in an unknown state
            self.target.remove(0, 0)
            raise
        self.last_stats = self._stats(steps, time.perf_counter() - t0, len(tokens), config)

    def _controller(self) -> BlockController:
        """One controller for the Session's life: the measured costs, the acceptance profile and its
        probing back-off carry over between generations, so a weak drafter is not re-probed every turn."""
        if self._block_controller is None:
            self._block_controller = BlockController(self.drafter.block_size - 1, calibrate(self.target, self.drafter))
        return self._block_controller

    def _collect(self, steps: Iterator[Step]) -> Result:
        all_steps = list(steps)
        return Result(
            text="".join(s.text for s in all_steps),
            tokens=[t for s in all_steps for t in s.tokens],
            finish_reason=all_steps[-1].finish_reason or "stop",
            stats=self.last_stats,
        )

    def _stats(self, steps: list[Step], wall: float, n_prompt: int, config: GenerationConfig) -> GenerationStats:
        prefill, cycles = steps[0], [s for s in steps[1:] if s.block_size > 0]
        n_drafted = sum(s.n_drafted for s in cycles)
        n_accepted = sum(s.n_accepted for s in cycles)
        histogram = [0] * (max((s.n_drafted for s in cycles), default=0) + 1)
        for s in cycles:
            histogram[s.n_accepted] += 1
        decode_s = max(wall - prefill.verify_s, 1e-9)
        decode_tokens = sum(len(s.tokens) for s in steps[1:])
        return GenerationStats(
            acceptance_length=sum(s.n_accepted + 1 for s in cycles) / len(cycles) if cycles else 0.0,
            cycles=len(cycles),
            n_drafted=n_drafted,
            n_accepted=n_accepted,
            acceptance_histogram=histogram,
            prefill_s=prefill.verify_s,
            decode_s=decode_s,
            decode_tokens_per_s=decode_tokens / decode_s,
            block_size=config.block_size,
            mean_block_size=sum(s.block_size for s in cycles) / len(cycles) if cycles else 0.0,
            draft_s=sum(s.draft_s for s in cycles),
            verify_s=sum(s.verify_s for s in cycles),
            n_prompt_tokens=n_prompt,
            n_cached_tokens=self._cache.reused,
            n_tokens=sum(len(s.tokens) for s in steps),
            speculative=config.speculative and self.drafter is not None,
        )

    # -- text ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The target's tokens for `text` (special tokens parsed), checked to fit the context."""
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        tokens = self.target.tokenize(text, add_special=add_special, parse_special=True)
        if not tokens:
            raise ValueError("the prompt is empty: nothing to condition on")
        if len(tokens) > self.target.n_ctx_seq:
            raise ValueError(
                f"the prompt is {len(tokens)} tokens, longer than the context of {self.target.n_ctx_seq}; "
                "shorten it or open the Session with a larger n_ctx"
            )
        return tokens

    def render_chat(self, messages: Sequence[Message]) -> tuple[str, list[str]]:
        """The prompt text from the GGUF's chat template, and the template's stop strings."""
        if not messages or any(not isinstance(m, Mapping) or "role" not in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        template = self.target.chat_template()
        if template is None:
            raise ValueError(f"{self.target.path}: the GGUF has no chat template; use generate() with a raw prompt")
        formatter = llama_chat_format.Jinja2ChatFormatter(
            template=template,
            eos_token=self.target.special_token_text(self.target.eos_token()),
            bos_token=self.target.special_token_text(self.target.bos_token()),
        )
        response = formatter(messages=list(messages))
        stops = [response.stop] if isinstance(response.stop, str) else list(response.stop or [])
        return response.prompt, [s for s in stops if s]

    # -- llama_cpp.Llama-shaped methods ----------------------------------------------------
    def create_completion(
        self,
        prompt: str,
        *,
        max_tokens: int | None = 16,
        temperature: float = 0.8,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        speculative: bool = True,
        block_size: int | None = None,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """llama_cpp.Llama.create_completion's dict (or chunk stream) for a raw prompt."""
        tokens = self.tokenize(prompt, add_special=True)
        config = _config(
            self._max_tokens(max_tokens, len(tokens)), temperature, top_p, top_k, seed, stop, speculative, block_size
        )
        return self._completion_chunks(tokens, config) if stream else self._completion(tokens, config)

    def create_chat_completion(
        self,
        messages: Sequence[Message],
        *,
        max_tokens: int | None = None,
        temperature: float = 0.2,
        top_p: float = 0.95,
        top_k: int = 40,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        stream: bool = False,
        speculative: bool = True,
        block_size: int | None = None,
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """llama_cpp.Llama.create_chat_completion's dict (or chunk stream), chat template from the GGUF."""
        prompt, stops = self.render_chat(messages)
        tokens = self.tokenize(prompt, add_special=False)
        user_stops = [stop] if isinstance(stop, str) else list(stop or [])
        config = _config(
            self._max_tokens(max_tokens, len(tokens)),
            temperature, top_p, top_k, seed, user_stops + stops, speculative, block_size,
        )
        completion = self._completion_chunks(tokens, config) if stream else self._completion(tokens, config)
        return llama_chat_format._convert_completion_to_chat(completion, stream=stream)

    def _max_tokens(self, max_tokens: int | None, n_prompt: int) -> int:
        """llama_cpp's convention: None or <= 0 means up to the end of the context."""
        if max_tokens is None or max_tokens <= 0:
            return max(1, self.target.n_ctx_seq - n_prompt + 1)
        return max_tokens

    def _completion_header(self) -> dict[str, Any]:
        return {"id": f"cmpl-{uuid.uuid4()}", "object": "text_completion", "created": int(time.time()), "model": str(self.target.path)}

    def _completion(self, tokens: list[int], config: GenerationConfig) -> dict[str, Any]:
        """A whole completion in llama_cpp's text_completion shape, with usage."""
        header = self._completion_header()
        result = self._collect(self._steps(tokens, config))
        n = len(result.tokens)
        return {
            **header,
            "choices": [{"text": result.text, "index": 0, "logprobs": None, "finish_reason": result.finish_reason}],
            "usage": {"prompt_tokens": len(tokens), "completion_tokens": n, "total_tokens": len(tokens) + n},
        }

    def _completion_chunks(self, tokens: list[int], config: GenerationConfig) -> Iterator[dict[str, Any]]:
        """llama_cpp's streamed text_completion chunks: one per cycle with text, then one with finish_reason."""
        header = self._completion_header()
        for step in self._steps(tokens, config):
            if step.text:
                yield {**header, "choices": [{"text": step.text, "index": 0, "logprobs": None, "finish_reason": None}]}
            if step.finish_reason is not None:
                yield {**header, "choices": [{"text": "", "index": 0, "logprobs": None, "finish_reason": step.finish_reason}]}

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Free the drafter and, unless wrapped from a Llama, the target."""
        if self.drafter is not None:
            self.drafter.close()
            self.drafter = None
        self.target.close()
        if self._llama is not None:
            self._llama.reset()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_GEN_ARGS = frozenset({"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "speculative", "block_size"})


def _gen_args(gen: Mapping[str, Any]) -> dict[str, Any]:
    """generate/stream/chat keyword arguments, unknown names refused."""
    unknown = set(gen) - _GEN_ARGS
    if unknown:
        raise TypeError(f"unknown generation argument(s): {', '.join(sorted(unknown))}")
    return dict(gen)


def _config(
    max_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    seed: int | None = None,
    stop: str | Sequence[str] | None = None,
    speculative: bool = True,
    block_size: int | None = None,
) -> GenerationConfig:
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    return GenerationConfig(
        max_tokens=max_tokens,
        sampling=SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed),
        stop=stops,
        speculative=bool(speculative),
        block_size=block_size,
    )
