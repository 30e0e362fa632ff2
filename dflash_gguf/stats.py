"""One statistics model: every figure shown anywhere (Session, TUI, bench, server) is a view of this.

Fed Steps, one at a time. tau (acceptance_length) counts the target's own token per cycle, so plain
decoding has tau = 1.

Two rates, and which one a speedup divides:
- `loop_tokens_per_s`: tokens committed by decoding cycles over the sum of their `cycle_s`, timed inside
  the loop. What a consumer does between Steps (rendering, network, a pipe) is not counted. Every speedup
  (the TUI, `dflash-generate --compare`, the bench, the server) divides this rate by a baseline's same rate.
- `decode_tokens_per_s`: every token after the prefill over the wall time after the prefill, consumer time
  included: what a caller sees. It is reported, never divided for a speedup.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Iterable

from .prompt_cache import CacheEvent
from .steps import DRAFTED_KINDS, Step, StepKind

MIN_BASELINE_CYCLES = 8  # plain cycles needed before their rate is a baseline worth dividing by


def speedup(tokens_per_s: float | None, baseline_tokens_per_s: float | None) -> float | None:
    """The one definition of speedup: a loop rate (`loop_tokens_per_s`) over a baseline's loop rate measured
    under the same conditions; None when either is missing."""
    if not tokens_per_s or not baseline_tokens_per_s:
        return None
    return tokens_per_s / baseline_tokens_per_s


def generation_speedup(stats: "GenerationStats", plain: "GenerationStats") -> float | None:
    """Speedup of one generation over a plain generation of the same prompt run under the same conditions."""
    return speedup(stats.loop_tokens_per_s, plain.loop_tokens_per_s)


class BaselineSource(str, Enum):
    """Where a like-for-like plain-decoding baseline came from; the value is what a view prints."""

    IN_REPLY = "in reply"  # the reply's own plain cycles (the adaptive controller's, probes excluded)
    SAME_UI = "compare"  # a plain run streamed through the same consumer (the chat's Ctrl+G)
    NONE = "not measured yet"  # no like-for-like measurement: no speedup figure


@dataclass(frozen=True)
class Baseline:
    """Plain decoding measured under the same conditions as a reply, and where it came from."""

    tokens_per_s: float | None
    source: BaselineSource

    @classmethod
    def choose(cls, in_reply: float | None, same_ui: float | None = None) -> "Baseline":
        """The reply's own plain cycles first, else a plain run through the same consumer, else none.

        A headless or start-up measurement is never offered: it ran under other conditions.
        """
        if in_reply is not None:
            return cls(in_reply, BaselineSource.IN_REPLY)
        if same_ui is not None:
            return cls(same_ui, BaselineSource.SAME_UI)
        return cls(None, BaselineSource.NONE)

    def speedup(self, loop_tokens_per_s: float | None) -> float | None:
        return speedup(loop_tokens_per_s, self.tokens_per_s)


@dataclass(frozen=True)
class Calibration:
    """A confidence head against what the target did, over the draft slots the target judged.

    Confidences are P(slot accepted | every earlier slot accepted), so a slot counts only when every
    earlier slot of its draft was accepted (the rest were never judged): `predicted` is the mean
    confidence of those slots, `observed` the share of them accepted. Calibrated: predicted ≈ observed.
    """

    slots: int
    predicted: float
    observed: float


@dataclass(frozen=True)
class SourceStats:
    """How one draft source did: cycles it drafted, tokens it proposed, tokens the target accepted."""

    cycles: int = 0
    n_drafted: int = 0
    n_accepted: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        return self.n_accepted / self.n_drafted if self.n_drafted else None


@dataclass(frozen=True)
class TreeStats:
    """The cycles that verified a draft tree (issue 36): rows verified, depth accepted, branches won."""

    cycles: int = 0
    nodes: int = 0  # rows verified in those cycles, anchors included
    accepted: int = 0  # drafts accepted: the depth each accepted path reached, summed
    off_chain: int = 0  # cycles whose accepted path left the likeliest chain (a linear block would have stopped)

    @property
    def mean_nodes(self) -> float | None:
        return self.nodes / self.cycles if self.cycles else None

    @property
    def mean_depth(self) -> float | None:
        return self.accepted / self.cycles if self.cycles else None


@dataclass(frozen=True)
class GenerationStats:
    """How a generation went."""

    acceptance_length: float
    cycles: int
    n_drafted: int
    n_accepted: int
    acceptance_histogram: list[int]  # [i] = cycles that accepted exactly i drafts
    prefill_s: float
    decode_s: float
    decode_tokens_per_s: float  # wall clock after the prefill, consumer time included (not for speedups)
    block_size: int | None  # the fixed block size asked for; None = adaptive
    mean_block_size: float
    draft_s: float
    verify_s: float
    n_prompt_tokens: int
    n_cached_tokens: int
    n_tokens: int
    speculative: bool
    rollback_s: float = 0.0
    loop_s: float = 0.0  # sum of the cycles' wall time inside the loop
    plain_cycles: int = 0
    acceptance_by_slot: list[float] = field(default_factory=list)  # [k]: P(slot k+1 accepted | drafted)
    per_source: dict[str, SourceStats] = field(default_factory=dict)
    tokens_by_provenance: dict[str, int] = field(default_factory=dict)  # by source name, and prefill/plain/bonus
    in_reply_plain_tokens_per_s: float | None = None  # the reply's own plain cycles: a like-for-like baseline
    in_reply_speedup: float | None = None  # None until enough plain cycles ran in this reply
    memory: str | None = None  # how the target rolls back (kv, snapshot, checkpoint)
    memory_extra_bytes: int = 0
    speculative_disabled_reason: str | None = None
    loop_tokens_per_s: float | None = None  # committed tokens over loop_s: the rate every speedup divides
    confidence: Calibration | None = None  # where the drafts carried confidences (DSpark's head)
    backend: str | None = None  # where the target's layers ran: CPU, Vulkan, CUDA, MTL (Metal); 'CUDA, CPU': partly offloaded
    device: str | None = None  # the target's device: 'CPU', 'CUDA0 (NVIDIA GeForce RTX 4090)', ...
    drafter_device: str | None = None  # the drafter's, which n_gpu_layers_draft may make another; None without one
    calibration_source: str | None = None  # the cost model: 'saved' (reused from disk), 'measured', None (not needed)
    prompt_cache: CacheEvent | None = None  # what the prompt cache restored and stored (None: no cache)
    tree: TreeStats | None = None  # the cycles that verified trees; None: no tree was verified
    tree_disabled_reason: str | None = None  # why trees were asked for (tree_nodes) but blocks were verified

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["per_source"] = {k: {**asdict(v), "acceptance_rate": v.acceptance_rate} for k, v in self.per_source.items()}
        return out


class StatsBuilder:
    """Folds Steps in as they arrive; `stats()` may be read at any moment (live views) or at the end."""

    def __init__(self) -> None:
        self.prefill_s = 0.0
        self.cycles = 0
        self.plain_cycles = 0
        self.plain_loop_s = 0.0
        self.loop_s = 0.0
        self.committed = 0  # tokens committed by decoding cycles (EOG included), the loop's own count
        self.n_tokens = 0
        self.decode_tokens = 0
        self.draft_s = self.verify_s = self.rollback_s = 0.0
        self.block_tokens = 0
        self.histogram: list[int] = []
        self.slot_drafted: list[int] = []
        self.slot_accepted: list[int] = []
        self.sources: dict[str, list[int]] = {}
        self.provenance: dict[str, int] = {}
        self.finish_reason: str | None = None
        self.conf_slots = 0
        self.conf_sum = 0.0
        self.conf_accepted = 0
        self.tree = [0, 0, 0, 0]  # TreeStats' fields

    def add(self, step: Step) -> None:
        self.n_tokens += len(step.tokens)
        for p in step.provenance:
            key = str(p)  # a source's name, or a TokenSource's value
            self.provenance[key] = self.provenance.get(key, 0) + 1
        if step.finish_reason is not None:
            self.finish_reason = step.finish_reason
        if step.kind is StepKind.PREFILL:
            self.prefill_s += step.verify_s
            return
        self.decode_tokens += len(step.tokens)
        if step.kind is StepKind.CONTEXT_FULL:
            return
        self.cycles += 1
        self.committed += step.n_accepted + 1
        self.loop_s += step.cycle_s
        self.draft_s += step.draft_s
        self.verify_s += step.verify_s
        self.rollback_s += step.rollback_s
        self.block_tokens += step.block_size
        if step.kind is StepKind.PLAIN:
            self.plain_cycles += 1
            self.plain_loop_s += step.cycle_s
        _grow(self.histogram, step.n_drafted + 1)
        self.histogram[step.n_accepted] += 1
        if step.tree_nodes:
            t = self.tree
            t[0] += 1
            t[1] += step.tree_nodes
            t[2] += step.n_accepted
            t[3] += step.tree_branch > 0
        if step.kind in DRAFTED_KINDS:
            _grow(self.slot_drafted, step.n_drafted)
            _grow(self.slot_accepted, step.n_drafted)
            for k in range(step.n_drafted):
                self.slot_drafted[k] += 1
                self.slot_accepted[k] += k < step.n_accepted
            counts = self.sources.setdefault(step.source or "?", [0, 0, 0])
            counts[0] += 1
            counts[1] += step.n_drafted
            counts[2] += step.n_accepted
            # slots judged: the accepted ones and the first rejected one, if any
            judged = min(len(step.confidences), step.n_drafted, step.n_accepted + 1)
            self.conf_slots += judged
            self.conf_sum += sum(step.confidences[:judged])
            self.conf_accepted += min(step.n_accepted, judged)

    @property
    def n_drafted(self) -> int:
        return sum(c[1] for c in self.sources.values())

    @property
    def n_accepted(self) -> int:
        return sum(c[2] for c in self.sources.values())

    @property
    def tau(self) -> float | None:
        return self.committed / self.cycles if self.cycles else None

    @property
    def loop_tokens_per_s(self) -> float | None:
        """Tokens per second of decoding cycles, measured inside the loop."""
        return self.committed / self.loop_s if self.loop_s > 0 else None

    @property
    def per_source(self) -> dict[str, SourceStats]:
        """How each draft source did, by its name (the drafter's kind, lookup)."""
        return {k: SourceStats(*v) for k, v in self.sources.items()}

    @property
    def acceptance_by_slot(self) -> list[float]:
        """[k]: P(slot k+1 accepted | drafted), over the cycles that drafted slot k+1."""
        return [a / d for a, d in zip(self.slot_accepted, self.slot_drafted) if d]

    @property
    def calibration(self) -> Calibration | None:
        """Mean predicted confidence against observed acceptance, once any judged slot had a confidence."""
        if not self.conf_slots:
            return None
        return Calibration(self.conf_slots, self.conf_sum / self.conf_slots, self.conf_accepted / self.conf_slots)

    @property
    def in_reply_plain_tokens_per_s(self) -> float | None:
        """The rate of this reply's own plain cycles, once there are enough to be a baseline."""
        if self.plain_cycles < MIN_BASELINE_CYCLES or self.plain_loop_s <= 0:
            return None
        return self.plain_cycles / self.plain_loop_s

    def stats(
        self,
        *,
        wall_s: float,
        n_prompt_tokens: int,
        n_cached_tokens: int,
        block_size: int | None,
        speculative: bool,
        memory: str | None = None,
        memory_extra_bytes: int = 0,
        speculative_disabled_reason: str | None = None,
        backend: str | None = None,
        device: str | None = None,
        drafter_device: str | None = None,
        calibration_source: str | None = None,
        tree_disabled_reason: str | None = None,
    ) -> GenerationStats:
        decode_s = max(wall_s - self.prefill_s, 1e-9)
        baseline = self.in_reply_plain_tokens_per_s
        return GenerationStats(
            acceptance_length=self.tau or 0.0,
            cycles=self.cycles,
            n_drafted=self.n_drafted,
            n_accepted=self.n_accepted,
            acceptance_histogram=list(self.histogram),
            prefill_s=self.prefill_s,
            decode_s=decode_s,
            decode_tokens_per_s=self.decode_tokens / decode_s,
            block_size=block_size,
            mean_block_size=self.block_tokens / self.cycles if self.cycles else 0.0,
            draft_s=self.draft_s,
            verify_s=self.verify_s,
            n_prompt_tokens=n_prompt_tokens,
            n_cached_tokens=n_cached_tokens,
            n_tokens=self.n_tokens,
            speculative=speculative,
            rollback_s=self.rollback_s,
            loop_s=self.loop_s,
            plain_cycles=self.plain_cycles,
            acceptance_by_slot=self.acceptance_by_slot,
            per_source=self.per_source,
            tokens_by_provenance=dict(self.provenance),
            in_reply_plain_tokens_per_s=baseline,
            in_reply_speedup=speedup(self.loop_tokens_per_s, baseline),
            memory=memory,
            memory_extra_bytes=memory_extra_bytes,
            speculative_disabled_reason=speculative_disabled_reason,
            loop_tokens_per_s=self.loop_tokens_per_s,
            confidence=self.calibration,
            backend=backend,
            device=device,
            drafter_device=drafter_device,
            calibration_source=calibration_source,
            tree=TreeStats(*self.tree) if self.tree[0] else None,
            tree_disabled_reason=tree_disabled_reason,
        )


def _grow(counts: list[int], n: int) -> None:
    if len(counts) < n:
        counts.extend([0] * (n - len(counts)))


def collect(steps: Iterable[Step]) -> StatsBuilder:
    """A builder fed every Step of a finished generation."""
    builder = StatsBuilder()
    for step in steps:
        builder.add(step)
    return builder
