"""The public API: a Session opens, forks and closes a target and its draft sources, locks, generates and runs
chat turns; opening, speculation, prompt_cache_link, generation, result and llama_compat hold the rest."""

from __future__ import annotations

import os
import threading
from functools import cached_property
from typing import Any, Iterator, Mapping, Sequence

import llama_cpp

from . import llama_compat
from .backends import Placement, placement
from .chat import ChatRequest, ChatTemplate, ReplyReader, Turn, prepare_turn
from .chat.tool_calls import ToolPlan
from .config import GenerationConfig, SessionOptions
from .decoding import CacheState, TokensView
from .drafter import Drafter
from .generation import GenerationRun, OneAtATime, SessionBusyError, check_prompt
from .memory import TargetMemory, memory_for
from .opening import default_drafter, fork_native, open_target
from .prompt_cache import PromptCache
from .prompt_cache_link import PromptCacheLink, check_prompt_cache
from .result import Result
from .sources import DraftSource
from .speculation import Speculation
from .stats import GenerationStats
from .steps import Step
from .target import ClosedError, Target

Message = Mapping[str, Any]

__all__ = ["GenerationStats", "Result", "Session", "SessionBusyError", "SessionClosedError"]


class SessionClosedError(ClosedError):
    """The Session was closed; its native memory is gone (one `except ClosedError` covers Target and Drafter too)."""


class Session:
    """A target GGUF and its draft sources decoding together; output is the target's, only faster.

    target=None uses the embedded SmolLM2 target and, with drafter=None, its drafter. Without a drafter the
    Session speculates with lookup drafts (lookup=False: plain decoding, a warning says so once); lookup=True
    puts lookup next to the drafter. sources: more DraftSources, each for this Session alone, peers of the
    drafter and lookup, priced by one policy with the measured costs (a fixed block drafts from the first).
    prompt_cache: a PromptCache shared by forks and a server's slots (prompt_cache_link says when it is read
    and written; what it did is in the stats' `prompt_cache`). Generations on one Session are serialised (a
    second caller waits, or with wait=False gets SessionBusyError). fork() gives an independent Session on the
    same weights; with sequences=N, the next sequence of one context, whose generations at once decode in one
    batch. After close() every method raises SessionClosedError; a running stream ends at its next cycle.
    """

    def __init__(self, target: str | os.PathLike[str] | None = None, drafter: str | os.PathLike[str] | None = None,
                 options: SessionOptions | None = None, *, sources: Sequence[DraftSource] = (),
                 prompt_cache: PromptCache | None = None, **settings: Any) -> None:
        """`options` (or the defaults) with any SessionOptions field given by name, e.g. n_ctx=2048."""
        check_prompt_cache(prompt_cache)
        o = SessionOptions.build(options, **settings)
        if drafter is None and target is None:
            drafter = default_drafter()
        tgt = open_target(target, drafter, o)
        try:
            self._attach(tgt, drafter, o.n_threads, wait=o.wait, lookup=o.lookup, sources=sources,
                         n_gpu_layers_draft=o.n_gpu_layers_draft, prompt_cache=prompt_cache,
                         draft_kv=(o.type_k_draft, o.type_v_draft), tree_nodes=o.tree_nodes,
                         recalibrate=o.recalibrate)
        except BaseException:
            tgt.close()
            raise
        self._llama: llama_cpp.Llama | None = None

    @classmethod
    def from_llama(cls, llama: llama_cpp.Llama, drafter: str | os.PathLike[str] | None = None, *,
                   n_threads: int | None = None, wait: bool = True, lookup: bool | None = None,
                   prompt_cache: PromptCache | None = None) -> "Session":
        """Wrap an existing llama_cpp.Llama: its model and context become the target (still owned by it).
        Create the Llama with flash_attn=True for greedy output identical to plain decoding (see README)."""
        o = SessionOptions.build(n_threads=n_threads, wait=wait, lookup=lookup)
        check_prompt_cache(prompt_cache)
        self = cls.__new__(cls)
        self._attach(Target.from_llama(llama), drafter, o.n_threads, wait=o.wait, lookup=o.lookup,
                     prompt_cache=prompt_cache)
        self._llama = llama
        llama.reset()
        return self

    def fork(self) -> "Session":
        """A new Session on the same loaded target and drafter weights, with its own contexts and caches."""
        if self._speculation.given:
            raise ValueError("fork() cannot copy caller-given draft sources (each holds one context's state)")
        with self._native:
            self._check_open()
            target, drafter = fork_native(self.target, self._speculation.draft_model)
        other = Session.__new__(Session)
        other._attach(target, drafter, None, wait=self._one_at_a_time.wait, lookup=self._lookup is not None,
                      prompt_cache=self.prompt_cache, tree_nodes=self._speculation.tree_nodes)
        other._cache_link.context = self._cache_link.context  # the same files and settings: the same context
        other._llama = None
        return other

    def _attach(self, target: Target, drafter: str | os.PathLike[str] | Drafter | None, n_threads: int | None, *,
                wait: bool, prompt_cache: PromptCache | None = None, **wiring: Any) -> None:
        """Wire an opened target and its drafter (a path, an opened one, or None) into this Session;
        `wiring`: the rest of Speculation's arguments (lookup, sources, tree_nodes, ...)."""
        self.target = target
        self.memory: TargetMemory = memory_for(target)
        self._cache, self._closed = CacheState(), False
        self._one_at_a_time = OneAtATime(wait)  # held for a whole generation
        self._native = threading.Lock()  # held while a cycle runs in C: close() waits for it
        self.last_stats: GenerationStats | None = None  # of the last generation that ran to its end
        self._speculation = spec = Speculation(target, self.memory, drafter, n_threads, forget=self._forget, **wiring)
        self.drafter: Drafter | None = spec.drafter
        self.speculative_disabled_reason: str | None = spec.disabled_reason
        self.tree_disabled_reason: str | None = spec.tree_disabled_reason  # tree_nodes asked for, blocks verified
        # the draft sources, peers in this order: the caller's, then its own; below, as tests and benchmarks read them
        self.sources: tuple[DraftSource, ...] = tuple(spec.sources)
        self._sources, self._lookup, self._mtp, self._verify_costs = spec.sources, spec.lookup, spec.mtp, spec.verify_costs
        # whether lookup drafts (n-gram matches over prompt and output) and the target's own MTP heads are sources
        self.lookup, self.mtp = spec.lookup is not None, spec.mtp is not None
        self._cache_link = PromptCacheLink(prompt_cache, target, self.memory, self._cache, spec, self._forget)

    # -- generation ------------------------------------------------------------------------
    # Each method takes a GenerationConfig, or its fields by name (max_tokens=64, temperature=0.7, ...) applied
    # over `config` or the defaults; an unknown name is a TypeError, a bad value a SettingError naming it.
    def stream(self, prompt: str, config: GenerationConfig | None = None, **settings: Any) -> Iterator[Step]:
        """One Step per decode cycle for a raw prompt (no chat template); the last Step has finish_reason."""
        config = GenerationConfig.build(config, **settings)
        return self._steps(self.tokenize(prompt, add_special=True), config)

    def stream_tokens(self, tokens: Sequence[int], config: GenerationConfig | None = None, **settings: Any) -> Iterator[Step]:
        """stream() for a prompt already tokenized (a server tokenizes once, to check the context before queueing)."""
        config = GenerationConfig.build(config, **settings)
        return self._steps(self._check_prompt_tokens(tokens), config)

    def generate(self, prompt: str, config: GenerationConfig | None = None, **settings: Any) -> Result:
        """Complete a raw prompt."""
        return self._collect(self.stream(prompt, config, **settings))

    def generate_tokens(self, tokens: Sequence[int], config: GenerationConfig | None = None, **settings: Any) -> Result:
        """generate() for a prompt already tokenized."""
        return self._collect(self.stream_tokens(tokens, config, **settings))

    def chat(self, messages: Sequence[Message], config: GenerationConfig | None = None, *, tools: Any = None,
             tool_choice: Any = None, parallel_tool_calls: bool | None = None,
             chat_template_kwargs: Mapping[str, Any] | None = None, **settings: Any) -> Result:
        """Answer a conversation rendered with the GGUF's chat template; a follow-up turn reuses the cached prefix.

        tools (OpenAI-shaped: [{"type": "function", "function": {"name", "parameters", ...}}]) are rendered by
        the template; the calls the model makes come back in Result.tool_calls, each one's arguments held to
        its tool's schema while it is written. tool_choice: "auto" (default), "none", "required" or
        {"type": "function", "function": {"name": ...}}. Bad tools or tool messages raise ToolError naming the field.
        A thinking template's thought comes back in Result.reasoning, the answer in Result.content;
        chat_template_kwargs are the template's variables ({"enable_thinking": False} turns thinking off).
        """
        request = ChatRequest(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs, settings=settings)
        return self.run_turn(self.prepare_chat(request, config))

    def stream_chat(self, messages: Sequence[Message], config: GenerationConfig | None = None, *, tools: Any = None,
                    tool_choice: Any = None, parallel_tool_calls: bool | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None, **settings: Any) -> Iterator[Step]:
        """chat(), one Step per decode cycle (the raw reply, thought and calls in it); the template's stop
        strings are added to the caller's. prepare_chat() and stream_tokens() give the turn's reader too."""
        request = ChatRequest(messages, tools, tool_choice, parallel_tool_calls, chat_template_kwargs, settings=settings)
        turn = self.prepare_chat(request, config)
        return self.stream_tokens(turn.tokens, turn.config)

    @cached_property
    def chat_template(self) -> ChatTemplate:
        """The GGUF's chat template, its family learned once."""
        self._check_open()
        v = self.target.vocab
        return ChatTemplate(v.chat_template(), v.special_token_text(v.bos_token()), v.special_token_text(v.eos_token()),
                            where=str(self.target.path))

    def prepare_chat(self, request: ChatRequest, base: GenerationConfig | None = None) -> Turn:
        """The chat floor's turn for `request` over `base` (or the defaults), its prompt checked to fit."""
        self._check_open()
        turn = prepare_turn(self.chat_template, self.target.vocab, request, base)
        self._check_prompt_tokens(turn.tokens)
        return turn

    def run_turn(self, turn: Turn) -> Result:
        """A prepared turn's whole reply, its thought and calls read apart where the turn has a reader."""
        return self.generate_tokens(turn.tokens, turn.config).read_by(turn)

    def tool_plan(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolPlan | None:
        """The tools checked against this model's chat template: the family that writes and reads the calls,
        and the grammar the reply follows (None without tools)."""
        self._check_open()
        return self.chat_template.plan_tools(tools, tool_choice, parallel_tool_calls)

    def reset(self) -> None:
        """Forget every cache, so that the next generation prefills its whole prompt (benchmarks want that).
        The prompt cache, shared with other Sessions, is not this Session's to forget: PromptCache.clear() empties
        it. Like a generation, it waits for one running on another thread (or raises SessionBusyError, wait=False).
        """
        self._check_open()
        with self._one_at_a_time, self._native:
            self._check_open()
            self._forget()

    def _forget(self) -> None:
        self._cache.invalidate(self._sources)
        self.memory.truncate(0)

    def _steps(self, tokens: list[int], config: GenerationConfig) -> Iterator[Step]:
        """decode_steps with this Session's caches, one generation at a time; sets `last_stats` at the end."""
        self._check_open()
        with self._one_at_a_time:
            with self._native, self.target.cycle():  # a sequence of a shared context: the batch waits for it
                self._check_open()
                generation = self._start(tokens, config)
            while True:
                with self._native, self.target.cycle():
                    if self._closed:
                        return  # close() was called during the stream: end it cleanly
                    try:
                        step = generation.next()
                    except StopIteration:
                        break
                    except BaseException:
                        self._forget()  # a failure mid-cycle leaves the memory in an unknown state
                        raise
                yield step
            with self._native:
                if self._closed:
                    return
                self.last_stats = generation.finish(self.placement, self.drafter_placement)

    def _start(self, tokens: list[int], config: GenerationConfig) -> GenerationRun:
        """One generation on this Session's parts, after a wrapped Llama's own decoding is accounted for."""
        if self._llama is not None:
            if self._llama.n_tokens:
                self._forget()  # the wrapped Llama decoded in between: our cached prefix is gone
            self._llama.reset()  # and it must not trust its own prefix once we have used the context
        stops = ReplyReader(stops=config.stop) if config.stop else None  # the chat floor judges the stop strings
        return GenerationRun(self.target, tokens, config, self._cache, self.memory, self._speculation, self._cache_link, stops)

    def _collect(self, steps: Iterator[Step]) -> Result:
        all_steps = list(steps)
        if not all_steps or all_steps[-1].finish_reason is None:  # the stream ended early: close() cut it
            raise SessionClosedError("the Session was closed during the generation")
        return Result.of_steps(all_steps, self.last_stats)

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this Session is closed")

    @property
    def prompt_cache(self) -> PromptCache | None:
        """The PromptCache this Session restores from and stores in (prompt_cache_link), or None."""
        return self._cache_link.cache

    @property
    def calibration_source(self) -> str | None:
        """'saved' or 'measured' once the costs are known ('measured' if any part was), else None."""
        return self._speculation.calibration_source

    @cached_property
    def placement(self) -> Placement:
        """Where the target's layers are: the backend and device its stats name (CPU unless offloaded)."""
        return placement(self.target.model, self.target.n_gpu_layers)

    @cached_property
    def drafter_placement(self) -> Placement | None:
        """Where the drafter's layers are (n_gpu_layers_draft may keep it off the target's device); None without one."""
        return None if self.drafter is None else self.drafter.placement()

    @property
    def n_ctx(self) -> int:
        """Tokens one generation's prompt and reply may hold together."""
        return self.target.n_ctx_seq

    @property
    def committed_tokens(self) -> TokensView:
        """The tokens this Session's context holds (the last prompt and its reply, or a restored state), which a
        prompt extending them reuses: a read-only view the next generation changes (a server's slots route by it)."""
        return self._cache.view

    # -- text ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The target's tokens for `text` (special tokens parsed), checked to fit the context."""
        self._check_open()
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        return self._check_prompt_tokens(self.target.vocab.tokenize(text, add_special=add_special, parse_special=True))

    def _check_prompt_tokens(self, tokens: Sequence[int]) -> list[int]:
        self._check_open()
        return check_prompt(tokens, self.target)

    def render_chat(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[str]]:
        """The prompt text from the GGUF's chat template, and the template's stop strings (ChatTemplate.render)."""
        self._check_open()
        return self.chat_template.render(messages, tools, chat_template_kwargs)

    def calibrate(self) -> None:
        """Measure the costs blocks are priced with now (or read the saved ones), not at the first speculative
        generation: a server does it before its slots share one context, where a timing would hold others' rows."""
        with self._one_at_a_time, self._native, self.target.cycle():
            if self._sources:
                self._verify_costs()

    # -- llama_cpp.Llama-shaped methods (their shapes: llama_compat) ------------------------
    def create_completion(self, prompt: str, *, stream: bool = False,
                          **settings: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """llama_cpp.Llama.create_completion's dict (or chunk stream) for a raw prompt, with its defaults;
        logprobs=n reports each token's log-probability and its n likeliest alternatives, as llama_cpp does."""
        return llama_compat.create_completion(self, prompt, stream=stream, **settings)

    def create_chat_completion(
        self, messages: Sequence[Message], *, stream: bool = False, tools: Any = None, tool_choice: Any = None,
        parallel_tool_calls: bool | None = None, chat_template_kwargs: Mapping[str, Any] | None = None,
        **settings: Any
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """llama_cpp.Llama.create_chat_completion's dict (or chunk stream), chat template from the GGUF; with
        tools or logprobs, as llama_compat.create_chat_completion says."""
        return llama_compat.create_chat_completion(
            self, messages, stream=stream, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs, **settings)

    # -- lifetime --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the drafter and, unless wrapped from a Llama, the target; a running stream ends at its next cycle.
        Then wait for the prompt cache's queued disk writes (the next process that opens the directory finds them).
        Safe to call twice, and from another thread: it waits for the cycle in progress, never for the stream."""
        with self._native:
            if self._closed:
                return
            self._closed = True
            self._speculation.close()
            self.target.close()
            if self._llama is not None:
                self._llama.reset()
        if self.prompt_cache is not None:
            self.prompt_cache.flush()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

