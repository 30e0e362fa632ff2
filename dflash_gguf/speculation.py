"""A Session's speculation wiring: which draft sources it decodes with and what their drafts cost.

The sources a target and drafter allow (the caller's peers, lookup, the model's MTP heads, the native
drafter with its tree shaper), the policy and sources one generation's config asks for, and the verify
and draft costs, measured once per Session (or read from calibration_store) and kept for its life.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from . import calibration_store
from .batching import SequenceTarget, SharedContext
from .config import GenerationConfig
from .constraints import Constraint, ForcedTokenSource
from .controller import AdaptivePolicy, BlockController, CostModel, FixedPolicy, Policy, TimingKind
from .drafter import Drafter
from .drafter_source import NativeDrafterSource
from .lookup import DEFAULT_MAX_DRAFT, LookupSource
from .memory import TargetMemory
from .mtp import HeadsFile, MTPSource, is_heads_file, mtp_unusable_reason
from .sources import DraftSource
from .steps import TARGET_OWN
from .target import Target
from .timing import calibrate, calibrate_verify, extend_verify_costs
from .tree import tree_unusable

__all__ = ["SOURCES", "SessionParts", "Speculation"]


class Speculation:
    """The draft sources of one Session (its own contexts: a fork wires its own) and their measured costs.

    `sources` are peers in that order: the caller's, lookup, MTP, the native drafter. `disabled_reason`
    says why none can ever be verified on this target (then there are none), `tree_disabled_reason` why
    tree_nodes was asked for but cycles verify blocks. `forget` empties the Session's caches, which timing
    batches need first.
    """

    def __init__(
        self,
        target: Target,
        memory: TargetMemory,
        drafter: str | os.PathLike[str] | Drafter | HeadsFile | None,
        n_threads: int | None,
        *,
        forget: Callable[[], None],
        lookup: bool | None,
        sources: Sequence[DraftSource] = (),
        n_gpu_layers_draft: int | None = None,
        draft_kv: tuple[str | None, str | None] = (None, None),
        tree_nodes: int = 0,
        recalibrate: bool = False,
    ) -> None:
        given = _check_sources(sources)
        self.target, self.memory, self._forget = target, memory, forget
        self.tree_nodes = tree_nodes
        self.tree_disabled_reason: str | None = None
        self.disabled_reason: str | None = None
        self.drafter: Drafter | None = None
        self.heads: HeadsFile | None = None  # MTP heads given as the drafter (a heads file), drafting instead
        self.given = given
        self.sources: list[DraftSource] = []
        self.lookup: LookupSource | None = None
        self.native: NativeDrafterSource | None = None
        self.mtp: MTPSource | None = None
        self.costs: CostModel | None = None  # what every source is priced with, measured once
        self.recalibrate = recalibrate  # measure even where costs are saved for this key (SessionOptions.recalibrate)
        self.calibration_source: str | None = None  # 'saved' or 'measured' once the costs are known
        self.warned_plain = False
        unusable = _no_speculation_reason(target, memory)
        if unusable is not None:
            self.disabled_reason = unusable
            self.tree_disabled_reason = unusable if tree_nodes else None
            if drafter is not None or given:
                # stacklevel: the caller of Session(), from_llama() or fork() (through Session._attach)
                warnings.warn(f"{unusable}: speculative decoding is off, every generation decodes plainly", stacklevel=4)
                self.warned_plain = True  # said once, here
            if isinstance(drafter, (Drafter, HeadsFile)):
                drafter.close()
            return
        trees_off = tree_unusable(target, memory) if tree_nodes else None  # why no source may verify trees
        _check_names(s.name for s in given)
        if isinstance(drafter, HeadsFile) or (drafter is not None and not isinstance(drafter, Drafter)
                                              and is_heads_file(drafter)):
            self.heads = drafter if isinstance(drafter, HeadsFile) else HeadsFile.open(drafter, target)
        elif drafter is not None:
            self.drafter = drafter if isinstance(drafter, Drafter) else Drafter(
                drafter, target, n_gpu_layers=n_gpu_layers_draft, n_threads=n_threads,
                type_k=draft_kv[0], type_v=draft_kv[1])
        parts = SessionParts(target, memory, self.drafter, n_threads, lookup, 0 if trees_off else tree_nodes,
                             self.heads)
        try:
            self.sources += given
            for make in SOURCES:  # the Session's own, peers after the caller's
                source = make(parts)
                if source is not None:
                    self.sources.append(source)
                    _check_names(s.name for s in self.sources)
        except BaseException:
            for source in self.sources[len(given):]:
                source.close()
            for model in (self.drafter, self.heads):
                if model is not None:
                    model.close()
            raise
        self.lookup = next((s for s in self.sources if isinstance(s, LookupSource)), None)
        self.mtp = next((s for s in self.sources if isinstance(s, MTPSource)), None)
        self.native = next((s for s in self.sources if isinstance(s, NativeDrafterSource)), None)
        if tree_nodes:  # the drafter and lookup shape their own trees (SessionParts.tree_nodes)
            self.tree_disabled_reason = trees_off or (None if self.native is not None or self.lookup is not None
                                                      else "no drafter and no lookup: nothing to shape a tree from")

    def for_generation(self, config: GenerationConfig) -> tuple[list[DraftSource], Policy | None, Constraint | None]:
        """The sources, the policy (None: plain decoding) and the constraint one generation decodes with;
        the first time, the policy's costs are measured (which empties the caches)."""
        if config.speculative and not self.sources and not self.warned_plain:
            # stacklevel: past GenerationRun, Session._start and _steps, to the caller of the code iterating the stream
            warnings.warn(f"{self.disabled_reason or 'this Session has no drafter'}: decoding plainly", stacklevel=6)
            self.warned_plain = True
        policy = self.policy(config) if config.speculative and self.sources else None
        spec, sources = config.constraint, self.sources
        constraint = None if spec is None else Constraint(self.target.vocab.constraint_tokenizer(), spec, self.target.n_vocab)
        if constraint is not None and policy is not None and config.forced_drafts:
            # what the grammar forces is drafted for free, first among peers (the verify costs cover this length)
            longest = min(max(s.max_draft for s in sources), self.target.n_batch - 1)
            sources = [ForcedTokenSource(constraint, longest), *sources]
        return sources, policy, constraint

    def policy(self, config: GenerationConfig) -> Policy:
        """Fixed blocks from the first source that offers; else one policy pricing every source's offer."""
        threshold = config.confidence_threshold
        if config.block_size is not None:
            drafts = {s.name: s.drafts_in_block(config.block_size) for s in self.sources}
            return FixedPolicy(config.block_size, drafts=drafts, confidence_threshold=threshold)
        return AdaptivePolicy(self.verify_costs(), confidence_threshold=threshold)

    def verify_costs(self) -> CostModel:
        """The cost model every source is priced with, measured once: verify batches up to the longest block
        any source drafts, and the drafter's pass where there is one (its controller prices with the same)."""
        if self.costs is None:
            n = max((min(s.max_draft + 1, self.target.n_batch) for s in self.sources if s is not self.native),
                    default=0)
            if self.native is not None:
                controller = self._controller()
                if n > max(controller.costs.target.points()):
                    shorter = controller.costs

                    def extend() -> CostModel:
                        self._make_room(n)
                        return extend_verify_costs(shorter, self.target, memory=self.memory, max_tokens=n)

                    controller.costs = self._calibrated({"drafter_block": controller.max_draft + 1, "verify_tokens": n},
                                                        extend)
                self.costs = controller.costs
            else:
                def measure() -> CostModel:
                    self._make_room(n)
                    return calibrate_verify(self.target, memory=self.memory, max_tokens=n)

                self.costs = self._calibrated({"verify_tokens": n}, measure)
        return self.costs

    def _controller(self) -> BlockController:
        """The drafter's controller, one for the Session's life, which its source owns: the measured costs, the
        acceptance profile and its probing back-off carry over between generations, so a weak drafter is not
        re-probed every turn. Built here, not by the source: it prices the drafter's passes with the target's
        verify batches, timed together on empty caches and stored under both models (calibration_store)."""
        native = self.native
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

    def close(self) -> None:
        """Free the drafter's and the Session's own sources' contexts (the caller holds the Session's native lock);
        the caller's sources are the caller's to close."""
        for source in self.sources[len(self.given):]:
            source.close()
        for model in (self.drafter, self.heads):
            if model is not None:
                model.close()

    @property
    def draft_model(self) -> Drafter | HeadsFile | None:
        """What a fork drafts with too: the drafter, or the heads file given in its place."""
        return self.drafter if self.drafter is not None else self.heads

    def _calibrated(self, measurement: dict[str, int], measure: Callable[[], CostModel]) -> CostModel:
        """The costs saved for this build, device, models and settings, else measured now and saved
        (calibration_store); `calibration_source` says which, 'measured' if any part was."""
        key = calibration_store.session_key(self.target, self.drafter, self.memory, measurement)
        costs, source = calibration_store.saved_or_measured(key, measure, recalibrate=self.recalibrate)
        self.calibration_source = source if self.calibration_source in (None, source) else calibration_store.MEASURED
        return batch_priced(costs, self.target)

    def _make_room(self, n: int) -> None:
        """Empty caches before timing batches of n tokens where the context lacks room, or where a hybrid
        memory's turn checkpoints would see the timing batches."""
        if self.target.pos_max(0) + 1 + n > self.target.n_ctx_seq or self.memory.name != "kv":
            self._forget()


@dataclass(frozen=True)
class SessionParts:
    """What the Session's own draft sources are made from: its target and memory, its drafter (opened, or None),
    its threads and whether lookup was asked for (None: where there is no drafter)."""

    target: Target
    memory: TargetMemory
    drafter: Drafter | None
    n_threads: int | None
    lookup: bool | None
    tree_nodes: int = 0  # rows a source's tree may have (0: trees are off on this target)
    heads: HeadsFile | None = None  # MTP heads shipped apart, given as the drafter: they draft, not the target's own


def lookup_source(parts: SessionParts) -> DraftSource | None:
    """N-gram lookup over the prompt and the reply: beside a drafter only where asked for."""
    if not (parts.lookup if parts.lookup is not None else parts.drafter is None):
        return None
    t = parts.target
    return LookupSource(max_draft=min(DEFAULT_MAX_DRAFT, t.n_batch - 1, t.n_ctx_seq - 1), tree_nodes=parts.tree_nodes)


def mtp_source(parts: SessionParts) -> DraftSource | None:
    """The heads file given as the drafter, else the target's own MTP heads, where it has them."""
    if parts.heads is not None:
        return MTPSource(parts.target, heads=parts.heads, n_threads=parts.n_threads)
    return MTPSource(parts.target, n_threads=parts.n_threads) if mtp_unusable_reason(parts.target) is None else None


def native_source(parts: SessionParts) -> DraftSource | None:
    """The drafter the Session was opened with, shaping its own trees where the target verifies them."""
    return None if parts.drafter is None else NativeDrafterSource(parts.drafter, tree_nodes=parts.tree_nodes)


# The Session's own draft sources, in peer order (after the caller's): each makes its source from a Session's
# parts, or None where it cannot draft there. A new source is a module and its line here.
SOURCES: tuple[Callable[[SessionParts], DraftSource | None], ...] = (lookup_source, mtp_source, native_source)


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


def _check_names(names: Iterable[str]) -> None:
    """Sources are told apart by name (stats, Steps' source and provenance, the policy): two with one name are
    refused, and so is the name of the target's own tokens."""
    names = list(names)
    if len(set(names)) < len(names):
        raise ValueError(f"draft source names must differ, got {names}")
    own = sorted(str(n) for n in TARGET_OWN.intersection(names))
    if own:
        raise ValueError(f"a draft source may not be named {own[0]!r}: it names the target's own tokens")


class BatchPricedCosts(CostModel):
    """A cost model that prices one sequence's share of the shared batch (issue 37).

    With k generations decoding at once, each choosing blocks of n rows, a cycle is one batch of about k * n
    rows: a sequence's share of it is t(k * n) / k, and plain decoding's t(k) / k. Where t is flat in rows (a
    GPU), blocks cost little more than plain steps at any k and stay long; where it climbs (this CPU: 16 rows
    cost 11.5 steps) the extra rows of k blocks cost k times over and blocks shrink to plain steps as k grows,
    coming back when the load falls. t is the calibrated table of this machine (linear past its last point).
    A cycle's own timing is the whole batch's, others' rows included, so verify and plain timings are not
    folded into the table while others decode with it; drafts and rollbacks are this sequence's own.
    """

    def __init__(self, costs: CostModel, shared: SharedContext) -> None:
        self.__dict__.update(costs.__dict__)  # the same tables: what one learns, the other sees
        self.shared = shared

    def verify_s(self, n_tokens: int) -> float:
        k = max(1, self.shared.busy)
        rollback = self.rollback.seconds(n_tokens) if self.rollback else 0.0
        return self.target.seconds(k * n_tokens) / k + rollback

    @property
    def plain_s(self) -> float:
        k = max(1, self.shared.busy)
        return self.target.seconds(k) / k

    def observe(self, kind: TimingKind, n_tokens: int, seconds: float) -> None:
        if kind in ("verify", "plain") and self.shared.busy > 1:
            return
        super().observe(kind, n_tokens, seconds)


def batch_priced(costs: CostModel, target: Target) -> CostModel:
    """The costs a Session on this target prices its blocks with: its share of the batch on a shared sequence."""
    return BatchPricedCosts(costs, target.shared) if isinstance(target, SequenceTarget) else costs
