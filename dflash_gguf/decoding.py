"""The decode loop: prefill, then draft -> verify -> accept -> roll back -> inject, one Step per cycle.

Modelled on z-lab's `dflash_generate`: a block is [last committed token, d1..dk]; after verification
the KV rows of the rejected drafts are dropped from both caches, the features of the committed block
tokens (last + accepted drafts) go into the drafter, and the target's bonus token starts the next block.
Plain decoding (no drafter, or a cycle the controller keeps plain) runs through the same loop; the
drafter is given the features of plain cycles in one batch when it next drafts.
"""

from __future__ import annotations

import codecs
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .acceptance import accept_greedy, accept_sampled
from .controller import BlockController
from .drafter import Drafter
from .sampling import SamplingParams, probabilities, sample_token
from .target import Target


@dataclass(frozen=True)
class Step:
    """What one cycle committed (the first Step is the token sampled from the prefill)."""

    tokens: list[int]
    text: str
    n_drafted: int
    n_accepted: int
    bonus_token: int | None
    block_size: int
    reason: str
    draft_s: float
    verify_s: float
    finish_reason: str | None = None


@dataclass(frozen=True)
class GenerationConfig:
    """Generation arguments shared by generate/stream/chat, validated once."""

    max_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: tuple[str, ...] = ()
    speculative: bool = True
    block_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        b = self.block_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"block_size must be None (adaptive) or an integer >= 1, got {b!r}")


@dataclass
class CacheState:
    """Which tokens the target KV cache holds, and how many of their positions the drafter has features for."""

    tokens: list[int] = field(default_factory=list)
    drafter_n: int = 0
    reused: int = 0  # prompt tokens the last generation found cached


class TextStream:
    """Incremental detokenisation with stop strings: text that could start a stop string is held back."""

    def __init__(self, target: Target, stop: Sequence[str]) -> None:
        self._target = target
        self._stop = tuple(stop)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._held = ""

    def feed(self, token: int) -> tuple[str, bool]:
        """(text now safe to emit, whether a stop string completed) after one more token."""
        self._held += self._decoder.decode(self._target.token_bytes(token))
        for s in self._stop:
            i = self._held.find(s)
            if i >= 0:
                out, self._held = self._held[:i], ""
                return out, True
        keep = max((k for s in self._stop for k in range(1, len(s)) if self._held.endswith(s[:k])), default=0)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out, False

    def flush(self) -> str:
        out, self._held = self._held + self._decoder.decode(b"", final=True), ""
        return out


def decode_steps(
    target: Target,
    drafter: Drafter | None,
    prompt: Sequence[int],
    config: GenerationConfig,
    cache: CacheState,
    controller: BlockController | None = None,
) -> Iterator[Step]:
    """Generate from `prompt`, reusing the cached prefix; yields one Step per cycle, the last with finish_reason.

    The first Step (reason "prefill") holds the token sampled from the prompt, its verify_s the prefill time.
    `cache` is kept true after every yield, so a caller may stop iterating at any point.
    """
    speculative = drafter is not None and config.speculative
    if speculative and target.recurrent:
        raise ValueError("speculative decoding needs a target whose KV cache can be rolled back; this one is recurrent/hybrid")
    if speculative and config.block_size is None and controller is None:
        raise ValueError("adaptive block size (block_size=None) needs a BlockController")
    if not 0 < len(prompt) <= target.n_ctx_seq:
        raise ValueError(f"prompt of {len(prompt)} tokens does not fit: need 1..{target.n_ctx_seq} (the context size)")
    params = config.sampling
    rng = params.rng()
    n_ctx = target.n_ctx_seq
    text = TextStream(target, config.stop)

    keep = 0 if target.recurrent else _reusable_prefix(cache, prompt, speculative)
    target.remove(0, keep)
    if drafter is not None:
        drafter.remove(min(keep, cache.drafter_n))
    cache.tokens = list(prompt[:keep])
    cache.reused = keep
    cache.drafter_n = min(keep, cache.drafter_n) if drafter is not None else 0

    # prefill the uncached prompt suffix in n_batch chunks, features injected for every chunk
    t0 = time.perf_counter()
    pos = keep
    while pos < len(prompt):
        chunk = prompt[pos : pos + target.n_batch]
        target.decode(chunk, pos, logits="last" if pos + len(chunk) == len(prompt) else False)
        if speculative:
            drafter.inject(target.features(len(chunk)), pos)
            cache.drafter_n = pos + len(chunk)
        cache.tokens.extend(chunk)
        pos += len(chunk)
    last = _pick(target.output_logits()[-1:], params, rng)
    prefill_s = time.perf_counter() - t0

    # features of committed rows not yet given to the drafter: injected in one batch before the next
    # draft, so that cycles the controller keeps plain pay no drafter call at all
    pending: list[np.ndarray] = []

    step, done = _commit([last], text, target, config, 0)
    n_generated = 1
    yield Step(step.tokens, step.text, 0, 0, None, 1, "prefill", 0.0, prefill_s, done)
    n_past = len(prompt)

    while not done:
        if n_past >= n_ctx:
            yield Step([], text.flush(), 0, 0, None, 0, "context full", 0.0, 0.0, "length")
            return
        n_draft, reason = _block_choice(drafter if speculative else None, config, controller)
        # the block [last, drafts] must fit the context, and commit no more than max_tokens allows
        n_draft = max(0, min(n_draft, n_ctx - n_past - 1, config.max_tokens - n_generated - 1))
        block = [last]

        t_draft = time.perf_counter()
        proposal = None
        if n_draft > 0:
            _flush(drafter, pending, cache)
            proposal = drafter.propose(last, n_past, n_draft, params, rng)
            block += proposal.tokens.tolist()
        draft_s = time.perf_counter() - t_draft

        t_verify = time.perf_counter()
        target.decode(block, n_past, logits=True)
        n_accepted, bonus = _verify(target.output_logits(), proposal, params, rng)
        verify_s = time.perf_counter() - t_verify

        # roll back the rejected drafts in the target; keep the committed block rows' features for the drafter
        committed = block[: n_accepted + 1]
        if n_accepted < n_draft:
            target.remove(0, n_past + n_accepted + 1)
        cache.tokens.extend(committed)
        if speculative:
            pending.append(target.features(len(committed)))
        n_past += len(committed)
        if controller is not None and speculative:
            controller.observe(n_draft, n_accepted)
            controller.observe_timing("verify" if n_draft else "plain", len(block), verify_s)
            if n_draft:
                controller.observe_timing("draft", len(block), draft_s)

        new = block[1 : n_accepted + 1] + [bonus]
        step, done = _commit(new, text, target, config, n_generated)
        n_generated += len(new)
        last = bonus
        if done and speculative:
            _flush(drafter, pending, cache)  # so that a follow-up turn reuses the whole prefix in both caches
        yield Step(step.tokens, step.text, n_draft, n_accepted, bonus, len(block), reason, draft_s, verify_s, done)


def _flush(drafter: Drafter, pending: list[np.ndarray], cache: CacheState) -> None:
    """Inject the backlog of committed rows' features at the positions after the drafter's last."""
    if pending:
        features = np.concatenate(pending) if len(pending) > 1 else pending[0]
        drafter.inject(features, cache.drafter_n)
        cache.drafter_n += len(features)
        pending.clear()


def _reusable_prefix(cache: CacheState, prompt: Sequence[int], speculative: bool) -> int:
    """Cached tokens shared with the prompt, leaving the last prompt token to decode for its logits."""
    n = 0
    limit = min(len(cache.tokens), len(prompt) - 1)
    while n < limit and cache.tokens[n] == prompt[n]:
        n += 1
    return min(n, cache.drafter_n) if speculative else n


def _block_choice(drafter: Drafter | None, config: GenerationConfig, controller: BlockController | None) -> tuple[int, str]:
    if drafter is None:
        return 0, "plain decoding"
    if config.block_size is not None:
        n = min(config.block_size, drafter.block_size) - 1
        return n, f"fixed block {n + 1}"
    choice = controller.choose()
    return choice.n_draft, choice.reason


def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The next token from one row of logits: argmax, or a sample from the params' distribution."""
    if params.greedy:
        return int(logits[0].argmax())
    return sample_token(probabilities(logits, params)[0], rng)


def _verify(logits: np.ndarray, proposal, params: SamplingParams, rng: np.random.Generator) -> tuple[int, int]:
    """(n_accepted, bonus) for a verified block; logits (k+1, V) are the target's rows for [last, d1..dk]."""
    if proposal is None:
        return 0, _pick(logits, params, rng)
    if params.greedy:
        return accept_greedy(proposal.tokens, logits.argmax(axis=1))
    return accept_sampled(
        proposal.tokens, proposal.q, probabilities(logits, params), rng, draft_indices=proposal.q_ids
    )


@dataclass(frozen=True)
class _Committed:
    tokens: list[int]
    text: str


def _commit(
    new: list[int], text: TextStream, target: Target, config: GenerationConfig, n_generated: int
) -> tuple[_Committed, str | None]:
    """Apply the stop rules to freshly committed tokens: EOG, stop strings, max_tokens, in token order."""
    tokens: list[int] = []
    out = ""
    for i, tok in enumerate(new):
        if target.is_eog(tok):
            return _Committed(tokens, out + text.flush()), "stop"
        tokens.append(tok)
        piece, stopped = text.feed(tok)
        out += piece
        if stopped:
            return _Committed(tokens, out), "stop"
        if n_generated + i + 1 >= config.max_tokens:
            return _Committed(tokens, out + text.flush()), "length"
    return _Committed(tokens, out), None
