"""One generation on a Session: the lock that lets one run at a time, its prompt checked, and its
bookkeeping (the sources and policy its config asks for, the cached prefix restored before the prefill,
every Step counted into the stats, the state stored at the end).

The Session takes its locks around each call (one generation at a time, one cycle in C at a time, close()
between cycles); `GenerationRun` takes none.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Sequence

from .backends import Placement
from .config import GenerationConfig
from .decoding import CacheState, StopCheck, decode_steps
from .memory import TargetMemory
from .prompt_cache_link import PromptCacheLink
from .speculation import Speculation
from .stats import GenerationStats, StatsBuilder
from .steps import Step
from .target import Target

__all__ = ["GenerationRun", "OneAtATime", "SessionBusyError", "check_prompt"]


class SessionBusyError(RuntimeError):
    """Another generation is running on this Session (raised instead of waiting when wait=False)."""


class OneAtATime:
    """Held for a whole generation of one Session: a second caller (another thread) waits until the running
    one ends, or, with wait=False, gets SessionBusyError at once; the thread still iterating a stream of the
    Session gets a RuntimeError instead of waiting for itself."""

    def __init__(self, wait: bool) -> None:
        self.wait = wait
        self._lock = threading.Lock()
        self._thread: int | None = None

    def __enter__(self) -> None:
        if self._thread == threading.get_ident():
            raise RuntimeError("this thread is still iterating a stream of this Session: finish or close it first")
        if not self._lock.acquire(blocking=self.wait):
            raise SessionBusyError("another generation is running on this Session (wait=False)")
        self._thread = threading.get_ident()

    def __exit__(self, *exc: object) -> None:
        self._thread = None
        self._lock.release()


class GenerationRun:
    """decode_steps for `tokens` with the Session's caches (`state`, `memory`), its sources and its prompt
    cache; `next()` gives the next Step, `finish()` stores the end state and gives the stats. `stop_check`:
    where the reply ends at one of config.stop (the Session hands the chat floor's reader).

    Started after the policy: measuring the costs the first time empties the caches, so the cached prefix
    is restored after it.
    """

    def __init__(self, target: Target, tokens: list[int], config: GenerationConfig, state: CacheState,
                 memory: TargetMemory, speculation: Speculation, cache_link: PromptCacheLink,
                 stop_check: StopCheck | None = None) -> None:
        sources, policy, constraint = speculation.for_generation(config)
        self._restored = cache_link.restore(tokens)
        self._steps = decode_steps(
            target, tokens, config, state, memory=memory, sources=sources, policy=policy,
            constraint=constraint, prefix_hook=cache_link.prompt_hook(tokens, self._restored), stop_check=stop_check,
        )
        self._n_prompt, self._config, self._state, self._memory = len(tokens), config, state, memory
        self._speculation, self._cache_link = speculation, cache_link
        self._builder = StatsBuilder()
        self._t0 = time.perf_counter()

    def next(self) -> Step:
        """The next cycle's Step (StopIteration after the last, which has the finish_reason)."""
        step = next(self._steps)
        self._builder.add(step)
        return step

    def finish(self, where: Placement, drafter_where: Placement | None) -> GenerationStats:
        """Store the state after the prompt and reply in the prompt cache; the whole generation's stats."""
        cache_event = self._cache_link.store(self._restored)
        spec, config = self._speculation, self._config
        stats = self._builder.stats(
            wall_s=time.perf_counter() - self._t0,
            n_prompt_tokens=self._n_prompt,
            n_cached_tokens=self._state.reused,
            block_size=config.block_size,
            speculative=config.speculative and bool(spec.sources),
            memory=self._memory.name,
            memory_extra_bytes=self._memory.extra_bytes,
            speculative_disabled_reason=spec.disabled_reason,
            backend=where.backend,
            device=where.device,
            drafter_device=None if drafter_where is None else drafter_where.device,
            calibration_source=spec.calibration_source,
            tree_disabled_reason=spec.tree_disabled_reason,
        )
        return stats if cache_event is None else replace(stats, prompt_cache=cache_event)


def check_prompt(tokens: Sequence[int], target: Target) -> list[int]:
    """A prompt's tokens as a list, checked to be in the target's vocabulary and to fit its context."""
    tokens = list(tokens)
    if not tokens:
        raise ValueError("the prompt is empty: nothing to condition on")
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < target.n_vocab for t in tokens):
        raise ValueError(f"prompt tokens must be integers in [0, {target.n_vocab})")
    if len(tokens) > target.n_ctx_seq:
        raise ValueError(
            f"the prompt is {len(tokens)} tokens, longer than the context of {target.n_ctx_seq}; "
            "shorten it or open the Session with a larger n_ctx"
        )
    return tokens
