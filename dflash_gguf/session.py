"""The public API: a target and its draft sources behind generate/stream/chat and llama_cpp-shaped methods."""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import llama_cpp

from . import calibration_store, defaults, llama_compat
from .chat import ChatRequest, ChatTemplate, Turn, prepare_turn
from .chat.tool_calls import ToolCall, ToolPlan
from .config import GenerationConfig, SessionOptions
from .constraints import Constraint, ForcedTokenSource
from .backends import Placement, placement
from .controller import AdaptivePolicy, BlockController, CostModel, FixedPolicy, Policy
from .decoding import CacheState, PrefixHook, TokensView, decode_steps
from .drafter import Drafter
from .lookup import DEFAULT_MAX_DRAFT, LookupSource
from .mtp import MTPSource, mtp_unusable_reason
from .memory import TargetMemory, memory_for, rs_seq_for
from .prompt_cache import CacheEvent, PromptCache, Snapshot, context_id, file_identity
from .sources import Commit, DraftSource, NativeDrafterSource
from .tree import TreeShaper, tree_unusable
from .stats import GenerationStats, StatsBuilder
from .steps import Step, TokenLogprob
from .target import ClosedError, Target
from .target_gguf import drafter_verify_tokens, trained_context
from .timing import calibrate, calibrate_verify, extend_verify_costs

Message = Mapping[str, Any]
log = logging.getLogger("dflash_gguf.session")

__all__ = ["GenerationStats", "Result", "Session", "SessionBusyError", "SessionClosedError"]


class SessionClosedError(ClosedError):
    """The Session was closed; its native memory is gone (one `except ClosedError` covers Target and Drafter too)."""


class SessionBusyError(RuntimeError):
    """Another generation is running on this Session (raised instead of waiting when wait=False)."""


@dataclass(frozen=True)
class Result:
    """A finished generation. With tools, `tool_calls` holds the calls the model made (finish_reason
    "tool_calls") and `content` the text around them; from a thinking template, `reasoning` holds the thought
    and `content` the answer after it; `text` is always the whole reply as generated."""

    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    tool_calls: tuple[ToolCall, ...] = ()
    content: str | None = None
    reasoning: str | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token when the config asked for logprobs


def _rs_seq(drafter: str | os.PathLike[str] | None, n_batch: int) -> int:
    """Recurrent-state snapshots a hybrid target needs to roll back any block of this drafter (0: none).

    libllama ignores it for targets without recurrent state. A drafter file that cannot be read gets 0
    here; the Drafter then says what is wrong with it.
    """
    if drafter is None or not isinstance(n_batch, int):
        return 0
    try:
        return rs_seq_for(drafter_verify_tokens(drafter), n_batch)
    except Exception:  # noqa: BLE001 - reported by Drafter with the file and field
        return 0


def _no_speculation_reason(target: Target, memory: TargetMemory) -> str | None:
    """Why no draft can ever be verified on this target, or None: speculation needs a rollback mechanism and
    room for a verify batch of two tokens (the last committed one and a draft) after a one-token prefix."""
    if not memory.can_rollback:
        return memory.reason or f"{target.architecture} keeps recurrent state that this runtime cannot roll back"
    if target.n_batch < 2:
        return f"n_batch={target.n_batch}: a verify batch needs at least 2 tokens"
    if target.n_ctx_seq < 3:
        return f"n_ctx={target.n_ctx_seq}: no room for a verify batch"
    return None


def _trained_context(target: str | os.PathLike[str]) -> int:
    """The context a target was trained for (n_ctx None), or SessionOptions' default where its GGUF does not say;
    a file that cannot be read gets the default here and Target.open says what is wrong with it."""
    fallback = int(SessionOptions().n_ctx)  # the field's default is a size; None is what a command asks for
    try:
        return trained_context(target) or fallback
    except (ValueError, OSError):
        return fallback


def _default_drafter() -> Path | None:
    """The drafter shipped for the embedded target, once the package carries one."""
    find = getattr(defaults, "embedded_drafter", None)
    return find() if find is not None else None


class Session:
    """A target GGUF and its draft sources decoding together; output is the target's, only faster.

    target=None uses the embedded SmolLM2 target and, with drafter=None, its embedded drafter. Without a
    drafter the Session speculates with lookup drafts (lookup=False: plain decoding, a warning says so once);
    lookup=True puts lookup next to the drafter. sources: more draft sources (DraftSource instances, each
    for this Session alone), peers of the drafter and lookup: every cycle each offers, and one policy
    prices the offers with the measured costs; a fixed block drafts from the first that offers, these first.

    prompt_cache: a PromptCache (shared by forks and by a server's slots). Before a prompt is prefilled the
    entry sharing its longest prefix is restored, when it covers more than this Session's live context
    does; at the end of every generation that runs to its end the whole state (prompt and reply) is stored,
    as llama-server keeps a slot's prompt. On a hybrid target, whose recurrent state cannot be cut back, the
    state before the prompt's last token is stored too, so the same prompt resent resumes there. What it
    did is in the stats' `prompt_cache`.

    Generations on one Session are serialised: a second caller (another thread) waits until the running
    one ends, or, with wait=False, gets SessionBusyError at once. fork() gives an independent Session on
    the same loaded weights for real parallelism. After close() every method raises SessionClosedError;
    a stream running while close() is called ends at its next cycle.
    """

    def __init__(
        self,
        target: str | os.PathLike[str] | None = None,
        drafter: str | os.PathLike[str] | None = None,
        options: SessionOptions | None = None,
        *,
        sources: Sequence[DraftSource] = (),
        prompt_cache: PromptCache | None = None,
        **settings: Any,
    ) -> None:
        """`options` (or the defaults) with any SessionOptions field given by name, e.g. n_ctx=2048."""
        _check_prompt_cache(prompt_cache)
        o = SessionOptions.build(options, **settings)
        if drafter is None and target is None:
            drafter = _default_drafter()
        tgt = Target.open(
            defaults.embedded_target() if target is None else target,
            n_ctx=o.n_ctx or _trained_context(defaults.embedded_target() if target is None else target),
            n_batch=o.n_batch,
            n_gpu_layers=o.n_gpu_layers,
            n_threads=o.n_threads,
            flash_attn=o.flash_attn,
            verbose=o.verbose,
            n_rs_seq=_rs_seq(drafter, o.n_batch) if o.n_rs_seq is None else o.n_rs_seq,
            type_k=o.type_k,
            type_v=o.type_v,
            load_mtp=o.mtp,  # the model's own MTP heads, where it has them, draft beside the other sources
            rpc_servers=o.rpc_servers,
            n_seq_max=max(1, o.tree_nodes - 1),  # a tree of n rows has at most n - 1 leaves
            kv_unified=o.tree_nodes > 0,
        )
        try:
            self._attach(tgt, drafter, o.n_threads, wait=o.wait, lookup=o.lookup, sources=sources,
                         n_gpu_layers_draft=o.n_gpu_layers_draft, prompt_cache=prompt_cache,
                         draft_kv=(o.type_k_draft, o.type_v_draft), tree_nodes=o.tree_nodes)
        except BaseException:
            tgt.close()
            raise
        self._recalibrate = o.recalibrate
        self._llama: llama_cpp.Llama | None = None

    @classmethod
    def from_llama(
        cls,
        llama: llama_cpp.Llama,
        drafter: str | os.PathLike[str] | None = None,
        *,
        n_threads: int | None = None,
        wait: bool = True,
        lookup: bool | None = None,
        prompt_cache: PromptCache | None = None,
    ) -> "Session":
        """Wrap an existing llama_cpp.Llama: its model and context become the target (still owned by it).

        Create the Llama with flash_attn=True for greedy output identical to plain decoding (see README).
        """
        o = SessionOptions.build(n_threads=n_threads, wait=wait, lookup=lookup)
        _check_prompt_cache(prompt_cache)
        self = cls.__new__(cls)
        self._attach(Target.from_llama(llama), drafter, o.n_threads, wait=o.wait, lookup=o.lookup,
                     prompt_cache=prompt_cache)
        self._llama = llama
        llama.reset()
        return self

    def fork(self) -> "Session":
        """A new Session on the same loaded target and drafter weights, with its own contexts and caches."""
        if self._given_sources:
            raise ValueError("fork() cannot copy caller-given draft sources (each holds one context's state)")
        with self._native:
            self._check_open()
            target = self.target.fork()
            try:
                drafter = self.drafter.fork(target) if self.drafter is not None else None
            except BaseException:
                target.close()
                raise
        other = Session.__new__(Session)
        other._attach(target, drafter, None, wait=self._wait, lookup=self._lookup is not None,
                      prompt_cache=self._prompt_cache, tree_nodes=self._tree_nodes)
        other._context = self._context  # the same files and settings: the same prompt-cache context
        other._llama = None
        return other

    def _attach(
        self,
        target: Target,
        drafter: str | os.PathLike[str] | Drafter | None,
        n_threads: int | None,
        *,
        wait: bool,
        lookup: bool | None,
        sources: Sequence[DraftSource] = (),
        n_gpu_layers_draft: int | None = None,
        prompt_cache: PromptCache | None = None,
        draft_kv: tuple[str | None, str | None] = (None, None),
        tree_nodes: int = 0,
    ) -> None:
        given = _check_sources(sources)
        self._tree_nodes = tree_nodes
        self.tree_disabled_reason: str | None = None  # why tree_nodes was asked for but cycles verify blocks
        self._prompt_cache = prompt_cache
        self._context: str | None = None  # the prompt-cache context id, computed on first use
        self._prompt_snapshot: tuple[Snapshot, float] | None = None  # captured by this generation's prefill, and ms
        self.target = target
        self.drafter: Drafter | None = None
        self.memory: TargetMemory = memory_for(target)
        self.speculative_disabled_reason: str | None = None
        self._cache = CacheState()
        self._warned_plain = False
        self._wait = wait
        self._closed = False
        self._generation = threading.Lock()  # held for a whole generation: one at a time
        self._generation_thread: int | None = None
        self._native = threading.Lock()  # held while a cycle runs in C: close() waits for it
        self.last_stats: GenerationStats | None = None  # of the last generation that ran to its end
        self._given_sources = given
        self._sources: list[DraftSource] = []
        self._lookup: LookupSource | None = None
        self._native_source: NativeDrafterSource | None = None
        self._mtp: MTPSource | None = None
        self._costs: CostModel | None = None  # what every source is priced with, measured once
        self._recalibrate = False  # measure even where costs are saved for this key (SessionOptions.recalibrate)
        self.calibration_source: str | None = None  # 'saved' or 'measured' once the costs are known
        unusable = _no_speculation_reason(target, self.memory)
        if unusable is not None:
            self.speculative_disabled_reason = unusable
            self.tree_disabled_reason = unusable if tree_nodes else None
            if drafter is not None or given:
                warnings.warn(f"{unusable}: speculative decoding is off, every generation decodes plainly", stacklevel=3)
                self._warned_plain = True  # said once, here
            if isinstance(drafter, Drafter):
                drafter.close()
            return
        self._sources += given
        if lookup if lookup is not None else drafter is None:
            self._lookup = LookupSource(max_draft=min(DEFAULT_MAX_DRAFT, target.n_batch - 1, target.n_ctx_seq - 1))
            self._sources.append(self._lookup)
        if mtp_unusable_reason(target) is None:
            self._mtp = MTPSource(target, n_threads=n_threads)
            self._sources.append(self._mtp)
        _check_names(s.name for s in self._sources)
        if drafter is not None:
            self.drafter = drafter if isinstance(drafter, Drafter) else Drafter(
                drafter, target, n_gpu_layers=n_gpu_layers_draft, n_threads=n_threads,
                type_k=draft_kv[0], type_v=draft_kv[1])
            self._native_source = NativeDrafterSource(self.drafter)
            self._sources.append(self._native_source)
            if tree_nodes:
                self.tree_disabled_reason = tree_unusable(target, self.memory, self.drafter)
                if self.tree_disabled_reason is None:
                    self._native_source.tree = TreeShaper(self.drafter.max_draft, tree_nodes)
            try:
                _check_names(s.name for s in self._sources)
            except ValueError:
                self.drafter.close()
                raise
        elif tree_nodes:
            self.tree_disabled_reason = "no drafter: a tree is shaped from a drafter's candidates"

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
        t = self.target
        return ChatTemplate(t.chat_template(), t.special_token_text(t.bos_token()), t.special_token_text(t.eos_token()),
                            where=str(t.path))

    def prepare_chat(self, request: ChatRequest, base: GenerationConfig | None = None) -> Turn:
        """The chat floor's turn for `request` over `base` (or the defaults), its prompt checked to fit."""
        self._check_open()
        turn = prepare_turn(self.chat_template, self.target, request, base)
        self._check_prompt_tokens(turn.tokens)
        return turn

    def run_turn(self, turn: Turn) -> Result:
        """A prepared turn's whole reply, its thought and calls read apart where the turn has a reader."""
        result = self.generate_tokens(turn.tokens, turn.config)
        reader = turn.reader()
        if reader is None:
            return result
        thought, content, calls = reader.read(result.text)
        return replace(result, tool_calls=tuple(calls), content=content,
                       reasoning=thought if turn.thinking is not None else None,
                       finish_reason="tool_calls" if calls else result.finish_reason)

    def tool_plan(self, tools: Any, tool_choice: Any = None, parallel_tool_calls: bool | None = None) -> ToolPlan | None:
        """The tools checked against this model's chat template: the family that writes and reads the calls,
        and the grammar the reply follows (None without tools)."""
        self._check_open()
        return self.chat_template.plan_tools(tools, tool_choice, parallel_tool_calls)

    def reset(self) -> None:
        """Forget every cache, so that the next generation prefills its whole prompt (benchmarks want that).

        The prompt cache, shared with other Sessions, is not this Session's to forget: PromptCache.clear() empties it.

        Like a generation, it waits for one running on another thread (or raises SessionBusyError, wait=False).
        """
        self._check_open()
        self._enter_generation()
        try:
            with self._native:
                self._check_open()
                self._forget()
        finally:
            self._leave_generation()

    def _forget(self) -> None:
        self._cache.invalidate(self._sources)
        self.memory.truncate(0)

    def _steps(self, tokens: list[int], config: GenerationConfig) -> Iterator[Step]:
        """decode_steps with this Session's caches, one generation at a time; sets `last_stats` at the end."""
        self._check_open()
        self._enter_generation()
        try:
            with self._native:
                self._check_open()
                steps, restored = self._start(tokens, config)
            builder = StatsBuilder()
            t0 = time.perf_counter()
            while True:
                with self._native:
                    if self._closed:
                        return  # close() was called during the stream: end it cleanly
                    try:
                        step = next(steps)
                    except StopIteration:
                        break
                    except BaseException:
                        self._forget()  # a failure mid-cycle leaves the memory in an unknown state
                        raise
                builder.add(step)
                yield step
            with self._native:
                if self._closed:
                    return
                cache_event = self._store_prefix(restored)
            self.last_stats = builder.stats(
                wall_s=time.perf_counter() - t0,
                n_prompt_tokens=len(tokens),
                n_cached_tokens=self._cache.reused,
                block_size=config.block_size,
                speculative=config.speculative and bool(self._sources),
                memory=self.memory.name,
                memory_extra_bytes=self.memory.extra_bytes,
                speculative_disabled_reason=self.speculative_disabled_reason,
                backend=self.placement.backend,
                device=self.placement.device,
                drafter_device=None if self.drafter_placement is None else self.drafter_placement.device,
                calibration_source=self.calibration_source,
                tree_disabled_reason=self.tree_disabled_reason,
            )
            if cache_event is not None:
                self.last_stats = replace(self.last_stats, prompt_cache=cache_event)
        finally:
            self._leave_generation()

    # -- the prompt cache ------------------------------------------------------------------
    @property
    def prompt_cache(self) -> PromptCache | None:
        return self._prompt_cache

    def _cache_usable(self) -> bool:
        """Whether this Session's whole decoding state can be saved and restored: a memory that keeps a
        prefix at all, and no caller-given source whose state is more than the tokens (features)."""
        return (self._prompt_cache is not None and self.memory.can_rollback
                and not any(s.needs_features and s is not self._native_source for s in self._sources))

    def _context_id(self) -> str:
        """Everything that shapes the saved bytes or the numbers in them: entries restore only into their own."""
        if self._context is None:
            t, d = self.target, self.drafter
            self._context = context_id({
                "libllama": llama_cpp.__version__, "target": file_identity(t.path), "fingerprint": t.fingerprint(),
                "n_ctx": t.n_ctx, "n_ctx_seq": t.n_ctx_seq, "n_batch": t.n_batch, "n_seq_max": t.n_seq_max,
                "n_rs_seq": t.n_rs_seq, "flash_attn": t.flash_attn, "type_k": t.type_k, "type_v": t.type_v,
                "drafter": None if d is None else [file_identity(d.path), d.type_k, d.type_v],
                "sources": [s.name for s in self._sources],
            })
        return self._context

    def _restore_prefix(self, tokens: list[int]) -> CacheEvent | None:
        """Restore the cached state sharing the longest prefix with `tokens` when it covers more than the
        live context would keep; a state libllama refuses is a miss (and the live caches are forgotten)."""
        if not self._cache_usable():
            return None
        t0 = time.perf_counter()
        cache = self._prompt_cache
        live = self._cache.common_prefix(tokens)
        if not self.memory.reaches_back and live < len(self._cache.tokens):
            live = 0  # a hybrid memory may still reach it through a turn checkpoint: a restore is exact too
        hit = cache.lookup(self._context_id(), tokens, at_least=live, prefix_only=not self.memory.reaches_back)
        if hit is None:
            return CacheEvent(None, restore_ms=(time.perf_counter() - t0) * 1000.0)
        try:
            self._load_snapshot(hit.snapshot)
        except (RuntimeError, ValueError) as e:
            log.warning("prompt cache: the %s entry of %d tokens did not restore (%s); prefilling instead",
                        hit.tier, len(hit.snapshot.tokens), e)
            cache.count_failed_restore(hit)
            self._forget()
            return CacheEvent(None, restore_ms=(time.perf_counter() - t0) * 1000.0)
        return CacheEvent(hit.tier, n_restored=hit.n_usable, restore_ms=(time.perf_counter() - t0) * 1000.0)

    def _load_snapshot(self, snapshot: Snapshot) -> None:
        """Put the target, the drafter and every source in the state after snapshot.tokens."""
        n = len(snapshot.tokens)
        if "target" not in snapshot.parts or (self.drafter is not None) != ("drafter" in snapshot.parts) or \
                (self._mtp is not None) != ("mtp" in snapshot.parts):
            raise ValueError("the entry does not hold this Session's parts")
        self._cache.invalidate(self._sources)
        self.target.load_sequence(snapshot.parts["target"])
        if self.target.pos_max(0) + 1 != n:
            raise RuntimeError(f"the target holds {self.target.pos_max(0) + 1} positions after restoring {n}")
        self.memory.restored(n)
        self._cache.commit(snapshot.tokens)
        for s in self._sources:
            if s is self._native_source:
                self.drafter.load_state(snapshot.parts["drafter"])
                if self.drafter.pos_max() + 1 != n:
                    raise RuntimeError(f"the drafter holds {self.drafter.pos_max() + 1} positions after restoring {n}")
                s.restored(n)
            elif s is self._mtp:
                s.restore(snapshot.parts["mtp"], n)
            else:  # its state is a function of the tokens (lookup indexes them where they are held)
                s.observe(Commit(0, snapshot.tokens, sequence=self._cache.tokens))

    def _prompt_hook(self, tokens: list[int], restored: CacheEvent | None) -> PrefixHook | None:
        """Where the cache is used and the memory cannot reach back (a recurrent state), the entry stored at
        the end serves only prompts that extend the reply: the state before the prompt's last token, captured
        during the prefill, serves the same prompt resent (llama-server checkpoints near a prompt's end too)."""
        self._prompt_snapshot = None
        if restored is None or self.memory.reaches_back:
            return None
        n = len(tokens) - 1

        def capture() -> None:
            t0 = time.perf_counter()
            snapshot = self._snapshot(tokens[:n])
            if snapshot is not None:
                self._prompt_snapshot = snapshot, (time.perf_counter() - t0) * 1000.0

        return PrefixHook(n, capture)

    def _snapshot(self, tokens: Sequence[int]) -> Snapshot | None:
        """The whole state after `tokens`, when every part of it is there: a plain generation leaves the
        drafter and the MTP heads behind the target, and then there is none."""
        n, native = len(tokens), self._native_source
        behind = any(s is not None and s.cached() != n for s in (native, self._mtp))
        if n == 0 or self.target.pos_max(0) + 1 != n or behind:
            return None
        parts = {"target": self.target.save_sequence()}
        if native is not None:
            parts["drafter"] = self.drafter.save_state()
        if self._mtp is not None:
            parts["mtp"] = self._mtp.snapshot()
        return Snapshot(tuple(tokens), parts)

    def _store_prefix(self, restored: CacheEvent | None) -> CacheEvent | None:
        """Store the state after this generation (prompt and reply), and the one its prefill captured."""
        if restored is None:
            return None
        t0 = time.perf_counter()
        captured, self._prompt_snapshot = self._prompt_snapshot, None
        # the prompt's first: the end state, which the next turn extends, is the more recently used
        snapshots = ([captured[0]] if captured else []) + [self._snapshot(self._cache.tokens)]
        stored = [self._prompt_cache.store(self._context_id(), x, supersede=self.memory.reaches_back)
                  for x in snapshots if x is not None]
        if not stored:
            return restored
        store_ms = (time.perf_counter() - t0) * 1000.0 + (captured[1] if captured else 0.0)
        return replace(restored, stored=any(stored), store_ms=store_ms)

    def _enter_generation(self) -> None:
        if self._generation_thread == threading.get_ident():
            raise RuntimeError("this thread is still iterating a stream of this Session: finish or close it first")
        if not self._generation.acquire(blocking=self._wait):
            raise SessionBusyError("another generation is running on this Session (wait=False)")
        self._generation_thread = threading.get_ident()

    def _leave_generation(self) -> None:
        self._generation_thread = None
        self._generation.release()

    def _start(self, tokens: list[int], config: GenerationConfig) -> tuple[Iterator[Step], CacheEvent | None]:
        """The decode_steps generator for one generation, with its policy, and what the prompt cache restored
        (after the policy: measuring the costs the first time empties the caches)."""
        if self._llama is not None:
            if self._llama.n_tokens:
                self._forget()  # the wrapped Llama decoded in between: our cached prefix is gone
            self._llama.reset()  # and it must not trust its own prefix once we have used the context
        if config.speculative and not self._sources and not self._warned_plain:
            warnings.warn(
                f"{self.speculative_disabled_reason or 'this Session has no drafter'}: decoding plainly", stacklevel=4
            )
            self._warned_plain = True
        policy = self._policy(config) if config.speculative and self._sources else None
        spec, sources = config.constraint, self._sources
        constraint = None if spec is None else Constraint(self.target.constraint_tokenizer(), spec, self.target.n_vocab)
        if constraint is not None and policy is not None and config.forced_drafts:
            # what the grammar forces is drafted for free, first among peers (the verify costs cover this length)
            longest = min(max(s.max_draft for s in sources), self.target.n_batch - 1)
            sources = [ForcedTokenSource(constraint, longest), *sources]
        restored = self._restore_prefix(tokens)
        return decode_steps(
            self.target, tokens, config, self._cache, memory=self.memory, sources=sources, policy=policy,
            constraint=constraint, prefix_hook=self._prompt_hook(tokens, restored),
        ), restored

    def _policy(self, config: GenerationConfig) -> Policy:
        """Fixed blocks from the first source that offers; else one policy pricing every source's offer."""
        threshold = config.confidence_threshold
        if config.block_size is not None:
            drafts = {s.name: s.drafts_in_block(config.block_size) for s in self._sources}
            return FixedPolicy(config.block_size, drafts=drafts, confidence_threshold=threshold)
        return AdaptivePolicy(self._verify_costs(), confidence_threshold=threshold)

    def _verify_costs(self) -> CostModel:
        """The cost model every source is priced with, measured once: verify batches up to the longest block
        any source drafts, and the drafter's pass where there is one (its controller prices with the same)."""
        if self._costs is None:
            n = max((min(s.max_draft + 1, self.target.n_batch) for s in self._sources if s is not self._native_source),
                    default=0)
            if self._native_source is not None:
                controller = self._controller()
                if n > max(controller.costs.target.points()):
                    shorter = controller.costs

                    def extend() -> CostModel:
                        self._make_room(n)
                        return extend_verify_costs(shorter, self.target, memory=self.memory, max_tokens=n)

                    controller.costs = self._calibrated({"drafter_block": controller.max_draft + 1, "verify_tokens": n},
                                                        extend)
                self._costs = controller.costs
            else:
                def measure() -> CostModel:
                    self._make_room(n)
                    return calibrate_verify(self.target, memory=self.memory, max_tokens=n)

                self._costs = self._calibrated({"verify_tokens": n}, measure)
        return self._costs

    def _calibrated(self, measurement: dict[str, int], measure: Callable[[], CostModel]) -> CostModel:
        """The costs saved for this build, device, models and settings, else measured now and saved
        (calibration_store); `calibration_source` says which, 'measured' if any part was."""
        key = calibration_store.session_key(self.target, self.drafter, self.memory, measurement)
        costs, source = calibration_store.saved_or_measured(key, measure, recalibrate=self._recalibrate)
        self.calibration_source = source if self.calibration_source in (None, source) else calibration_store.MEASURED
        return costs

    def _make_room(self, n: int) -> None:
        """Empty caches before timing batches of n tokens where the context lacks room, or where a hybrid
        memory's turn checkpoints would see the timing batches."""
        if self.target.pos_max(0) + 1 + n > self.target.n_ctx_seq or self.memory.name != "kv":
            self._forget()

    def _controller(self) -> BlockController:
        """The drafter's controller, one for the Session's life: the measured costs, the acceptance profile
        and its probing back-off carry over between generations, so a weak drafter is not re-probed every turn."""
        native = self._native_source
        if native.controller is None:
            drafter = self.drafter
            room = min(self.target.n_ctx_seq, drafter.n_ctx)
            # the verify batch: the last token and the drafts, after a one-token prefix at most
            block = min(drafter.max_draft + 1, room - 1, self.target.n_batch)

            def measure() -> CostModel:
                # on empty caches: the context may be too full, a hybrid memory's turn checkpoints must not
                # see the timing batches, and the drafter may be behind the target (after plain generations)
                self._forget()
                return calibrate(self.target, drafter, memory=self.memory, max_block=block)

            costs = self._calibrated({"drafter_block": block}, measure)
            native.controller = BlockController(block - 1, costs)
        return native.controller

    def _collect(self, steps: Iterator[Step]) -> Result:
        all_steps = list(steps)
        if not all_steps or all_steps[-1].finish_reason is None:  # the stream ended early: close() cut it
            raise SessionClosedError("the Session was closed during the generation")
        return Result(
            text="".join(s.text for s in all_steps),
            tokens=[t for s in all_steps for t in s.tokens],
            finish_reason=all_steps[-1].finish_reason or "stop",
            stats=self.last_stats,
            logprobs=tuple(e for s in all_steps for e in s.logprobs),
        )

    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this Session is closed")

    @property
    def lookup(self) -> bool:
        """Whether lookup drafts (n-gram matches over prompt and output) are among this Session's sources."""
        return self._lookup is not None

    @property
    def mtp(self) -> bool:
        """Whether the target's own MTP heads draft among this Session's sources (mtp.MTPSource)."""
        return self._mtp is not None

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
        """The tokens this Session's context holds (the last prompt and its reply, or a restored state): a
        prompt that extends them reuses them. A read-only view of the one copy, which the next generation
        changes: a server's slot routes follow-up turns by it."""
        return self._cache.view

    # -- text ------------------------------------------------------------------------------
    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        """The target's tokens for `text` (special tokens parsed), checked to fit the context."""
        self._check_open()
        if not isinstance(text, str):
            raise TypeError(f"prompt must be a str, got {type(text).__name__}")
        return self._check_prompt_tokens(self.target.tokenize(text, add_special=add_special, parse_special=True))

    def _check_prompt_tokens(self, tokens: Sequence[int]) -> list[int]:
        """A prompt's tokens as a list, checked to be in the vocabulary and to fit the context."""
        self._check_open()
        tokens = list(tokens)
        if not tokens:
            raise ValueError("the prompt is empty: nothing to condition on")
        if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.target.n_vocab for t in tokens):
            raise ValueError(f"prompt tokens must be integers in [0, {self.target.n_vocab})")
        if len(tokens) > self.target.n_ctx_seq:
            raise ValueError(
                f"the prompt is {len(tokens)} tokens, longer than the context of {self.target.n_ctx_seq}; "
                "shorten it or open the Session with a larger n_ctx"
            )
        return tokens

    def render_chat(self, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> tuple[str, list[str]]:
        """The prompt text from the GGUF's chat template, and the template's stop strings (ChatTemplate.render)."""
        self._check_open()
        return self.chat_template.render(messages, tools, chat_template_kwargs)

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
        """llama_cpp.Llama.create_chat_completion's dict (or chunk stream), chat template from the GGUF;
        logprobs=True (with top_logprobs=n alternatives) fills choices[0].logprobs.content as llama_cpp does.
        With tools, the calls come back in message.tool_calls (streamed: delta.tool_calls), finish_reason
        "tool_calls", and a thinking template's thought in message.reasoning_content; without tools the reply
        is llama_cpp's, thought included in the content."""
        return llama_compat.create_chat_completion(
            self, messages, stream=stream, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, chat_template_kwargs=chat_template_kwargs, **settings)

    # -- lifetime --------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the drafter and, unless wrapped from a Llama, the target; a running stream ends at its next cycle.
        Then wait for the prompt cache's queued disk writes, so that what this Session stored is on disk for
        the next process (or Session) that opens the directory.

        Safe to call twice, and from another thread: it waits for the cycle in progress, never for the stream.
        """
        with self._native:
            if self._closed:
                return
            self._closed = True
            if self.drafter is not None:
                self.drafter.close()
            if self._mtp is not None:
                self._mtp.close()
            self.target.close()
            if self._llama is not None:
                self._llama.reset()
        if self._prompt_cache is not None:
            self._prompt_cache.flush()

    def __enter__(self) -> "Session":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_prompt_cache(cache: Any) -> None:
    if cache is not None and not isinstance(cache, PromptCache):
        raise TypeError(f"prompt_cache must be a PromptCache or None, got {type(cache).__name__}")


def _check_sources(sources: Any) -> list[DraftSource]:
    """Caller-given draft sources as a list, each a DraftSource with a name and a max_draft >= 1."""
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence):
        raise TypeError(f"sources must be a list of DraftSource, got {sources!r}")
    for s in sources:
        if not isinstance(s, DraftSource):
            raise TypeError(f"sources must be DraftSource instances, got {s!r}")
        if not isinstance(getattr(s, "name", None), str) or not s.name:
            raise ValueError(f"draft source {s!r} needs a non-empty name")
        m = getattr(s, "max_draft", None)
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"draft source {s.name!r}: max_draft must be an integer >= 1, got {m!r}")
    return list(sources)


def _check_names(names: Iterator[str]) -> None:
    """Sources are told apart by name (stats, Steps, the policy): two with one name are refused."""
    names = list(names)
    if len(set(names)) < len(names):
        raise ValueError(f"draft source names must differ, got {names}")
