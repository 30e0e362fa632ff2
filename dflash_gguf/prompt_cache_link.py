"""A Session's link to its PromptCache: its whole decoding state (target, drafter, every source) restored
from the entry sharing a prompt's longest prefix before the prefill, and stored after a generation.

Before a prompt is prefilled the entry sharing its longest prefix is restored, when it covers more than the
Session's live context does; at the end of every generation that runs to its end the whole state (prompt and
reply) is stored, as llama-server keeps a slot's prompt. On a hybrid target, whose recurrent state cannot be
cut back, the state before the prompt's last token is stored too, so the same prompt resent resumes there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any, Callable, Sequence

import llama_cpp

from .decoding import CacheState, PrefixHook
from .memory import TargetMemory
from .prompt_cache import CacheEvent, PromptCache, Snapshot, context_id, file_identity
from .sources import Commit
from .speculation import Speculation
from .target import Target

__all__ = ["PromptCacheLink", "check_prompt_cache"]

log = logging.getLogger("dflash_gguf.session")  # what it logs is the Session's doing, under the Session's name


def check_prompt_cache(cache: Any) -> None:
    if cache is not None and not isinstance(cache, PromptCache):
        raise TypeError(f"prompt_cache must be a PromptCache or None, got {type(cache).__name__}")


class PromptCacheLink:
    """What one Session restores from and stores in `cache` (None: nothing); `state` is its committed
    sequence, `forget` empties its caches. `context` (the entries' context id) is computed on first use and
    shared by a fork: the same files and settings make the same context."""

    def __init__(self, cache: PromptCache | None, target: Target, memory: TargetMemory, state: CacheState,
                 speculation: Speculation, forget: Callable[[], None]) -> None:
        self.cache = cache
        self.target, self.memory, self.state, self.speculation, self._forget = target, memory, state, speculation, forget
        self.context: str | None = None  # the prompt-cache context id, computed on first use
        self._prompt_snapshot: tuple[Snapshot, float] | None = None  # captured by this generation's prefill, and ms

    def usable(self) -> bool:
        """Whether this Session's whole decoding state can be saved and restored: a memory that keeps a
        prefix at all, and no source whose state is more than the tokens (features) but cannot save it."""
        return (self.cache is not None and self.memory.can_rollback
                and not any(s.needs_features and s.state_part is None for s in self.speculation.sources))

    def context_id(self) -> str:
        """Everything that shapes the saved bytes or the numbers in them: entries restore only into their own."""
        if self.context is None:
            t, d = self.target, self.speculation.drafter
            self.context = context_id({
                "libllama": llama_cpp.__version__, "target": file_identity(t.path), "fingerprint": t.fingerprint(),
                "n_ctx": t.n_ctx, "n_ctx_seq": t.n_ctx_seq, "n_batch": t.n_batch, "n_seq_max": t.n_seq_max,
                "n_rs_seq": t.n_rs_seq, "flash_attn": t.flash_attn, "type_k": t.type_k, "type_v": t.type_v,
                "drafter": None if d is None else [file_identity(d.path), d.type_k, d.type_v],
                "sources": [s.name for s in self.speculation.sources],
                # MTP heads given as the drafter: their KV is in the entry, as the drafter's is
                **({"mtp_heads": file_identity(h.path)} if (h := self.speculation.heads) is not None else {}),
            })
        return self.context

    def restore(self, tokens: list[int]) -> CacheEvent | None:
        """Restore the cached state sharing the longest prefix with `tokens` when it covers more than the
        live context would keep; a state libllama refuses is a miss (and the live caches are forgotten)."""
        if not self.usable():
            return None
        t0 = time.perf_counter()
        cache = self.cache
        live = self.state.common_prefix(tokens)
        if not self.memory.reaches_back and live < len(self.state.tokens):
            live = 0  # a hybrid memory may still reach it through a turn checkpoint: a restore is exact too
        hit = cache.lookup(self.context_id(), tokens, at_least=live, prefix_only=not self.memory.reaches_back)
        if hit is None:
            return CacheEvent(None, restore_ms=(time.perf_counter() - t0) * 1000.0)
        try:
            self._load(hit.snapshot)
        except (RuntimeError, ValueError) as e:
            log.warning("prompt cache: the %s entry of %d tokens did not restore (%s); prefilling instead",
                        hit.tier, len(hit.snapshot.tokens), e)
            cache.count_failed_restore(hit)
            self._forget()
            return CacheEvent(None, restore_ms=(time.perf_counter() - t0) * 1000.0)
        return CacheEvent(hit.tier, n_restored=hit.n_usable, restore_ms=(time.perf_counter() - t0) * 1000.0)

    def prompt_hook(self, tokens: list[int], restored: CacheEvent | None) -> PrefixHook | None:
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

    def store(self, restored: CacheEvent | None) -> CacheEvent | None:
        """Store the state after this generation (prompt and reply), and the one its prefill captured."""
        if restored is None:
            return None
        t0 = time.perf_counter()
        captured, self._prompt_snapshot = self._prompt_snapshot, None
        # the prompt's first: the end state, which the next turn extends, is the more recently used
        snapshots = ([captured[0]] if captured else []) + [self._snapshot(self.state.tokens)]
        stored = [self.cache.store(self.context_id(), x, supersede=self.memory.reaches_back)
                  for x in snapshots if x is not None]
        if not stored:
            return restored
        store_ms = (time.perf_counter() - t0) * 1000.0 + (captured[1] if captured else 0.0)
        return replace(restored, stored=any(stored), store_ms=store_ms)

    def _load(self, snapshot: Snapshot) -> None:
        """Put the target and every source in the state after snapshot.tokens."""
        n, sources = len(snapshot.tokens), self.speculation.sources
        if set(snapshot.parts) != {"target", *(s.state_part for s in sources if s.state_part is not None)}:
            raise ValueError("the entry does not hold this Session's parts")
        self.state.invalidate(sources)
        self.target.load_sequence(snapshot.parts["target"])
        if self.target.pos_max(0) + 1 != n:
            raise RuntimeError(f"the target holds {self.target.pos_max(0) + 1} positions after restoring {n}")
        self.memory.restored(n)
        self.state.commit(snapshot.tokens)
        commit = Commit(0, snapshot.tokens, sequence=self.state.tokens)
        for s in sources:  # a source without a saved part observes the tokens (lookup indexes them where they are held)
            s.restore_state(None if s.state_part is None else snapshot.parts[s.state_part], commit)

    def _snapshot(self, tokens: Sequence[int]) -> Snapshot | None:
        """The whole state after `tokens`, when every part of it is there: a plain generation leaves the
        sources with a state of their own (the drafter, the MTP heads) behind the target, and then there is none."""
        n, saved = len(tokens), [s for s in self.speculation.sources if s.state_part is not None]
        if n == 0 or self.target.pos_max(0) + 1 != n or any(s.cached() != n for s in saved):
            return None
        return Snapshot(tuple(tokens), {"target": self.target.save_sequence(), **{s.state_part: s.save_state() for s in saved}})
