"""Per-response figures: llama-server's `timings` object, and the DFlash figures under a `dflash` key.

Every number is read from the stats model (GenerationStats); only the block sizes chosen per cycle,
which the model keeps as a mean, are counted here from the Steps. Standard clients ignore both keys.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from ..stats import GenerationStats
from ..steps import Step, StepKind


class BlockSizes:
    """How often each block size was verified, over a generation's decoding cycles."""

    def __init__(self) -> None:
        self.counts: Counter[int] = Counter()

    def add(self, step: Step) -> None:
        if step.kind is not StepKind.PREFILL and step.block_size > 0:
            self.counts[step.block_size] += 1

    def as_dict(self) -> dict[str, int]:
        return {str(k): v for k, v in sorted(self.counts.items())}


def llama_timings(stats: GenerationStats) -> dict[str, Any]:
    """llama-server's `timings`: prompt_n counts the prompt tokens decoded (cache_n those reused: from the
    slot's live context or restored from the prompt cache)."""
    prompt_n = stats.n_prompt_tokens - stats.n_cached_tokens
    prompt_ms = stats.prefill_s * 1000.0
    predicted_ms = stats.decode_s * 1000.0
    return {
        "cache_n": stats.n_cached_tokens,
        "prompt_n": prompt_n,
        "prompt_ms": prompt_ms,
        "prompt_per_token_ms": prompt_ms / prompt_n if prompt_n else None,
        "prompt_per_second": prompt_n / stats.prefill_s if prompt_n and stats.prefill_s > 0 else None,
        "predicted_n": stats.n_tokens,
        "predicted_ms": predicted_ms,
        "predicted_per_token_ms": predicted_ms / stats.n_tokens if stats.n_tokens else None,
        "predicted_per_second": stats.decode_tokens_per_s,
        "draft_n": stats.n_drafted,
        "draft_n_accepted": stats.n_accepted,
    }


def dflash_figures(stats: GenerationStats, blocks: BlockSizes, *, slot: int, queue_ms: float) -> dict[str, Any]:
    """The namespaced DFlash figures: tau, cycles, block sizes chosen, each draft source's acceptance,
    the like-for-like speedup (None until the reply ran enough plain cycles), where the time went."""
    return {
        "tau": stats.acceptance_length,
        "cycles": stats.cycles,
        "plain_cycles": stats.plain_cycles,
        "n_drafted": stats.n_drafted,
        "n_accepted": stats.n_accepted,
        "acceptance_histogram": list(stats.acceptance_histogram),
        "block_size": stats.block_size,  # fixed by the request/server, or None: adaptive
        "block_sizes": blocks.as_dict(),  # block size -> cycles that verified it
        "mean_block_size": stats.mean_block_size,
        "per_source": {name: {"cycles": s.cycles, "n_drafted": s.n_drafted, "n_accepted": s.n_accepted,
                              "acceptance_rate": s.acceptance_rate} for name, s in stats.per_source.items()},
        "tokens_by_provenance": dict(stats.tokens_by_provenance),
        "in_reply_speedup": stats.in_reply_speedup,
        "in_reply_plain_tokens_per_s": stats.in_reply_plain_tokens_per_s,
        "draft_ms": stats.draft_s * 1000.0,
        "verify_ms": stats.verify_s * 1000.0,
        "speculative": stats.speculative,
        "speculative_disabled_reason": stats.speculative_disabled_reason,
        "memory": stats.memory,
        "memory_extra_bytes": stats.memory_extra_bytes,
        # the shared prompt cache: tier ("ram", "disk", None = miss), tokens restored, ms; None without a cache
        "prompt_cache": stats.prompt_cache.as_dict() if stats.prompt_cache is not None else None,
        "slot": slot,
        "queue_ms": queue_ms,
    }
