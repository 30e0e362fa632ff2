"""Per-cycle choice of which source drafts and how many tokens to verify, from measured costs and acceptance.

Speculation only pays where the tokens a cycle is expected to commit outweigh what that cycle costs on
this machine. Every source offers what it expects its drafts to commit; one policy prices each offer with
the measured costs, compares the best against plain decoding each cycle, and says why it chose what it
did. A source with a BlockController steps aside when its drafts do not pay and probes now and then so it
can come back. Pure: the timings come from the loop and from `timing` (start-up calibration).
"""

from __future__ import annotations

import bisect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Mapping, Protocol, Sequence

from .acceptance import AcceptanceProfile
from .confidence import best_verify_length, confident_prefix
from .steps import StepKind

if TYPE_CHECKING:
    from .sources import Candidate, Offer, Schedule

TimingKind = Literal["draft", "verify", "plain", "rollback", "tree"]


class TreeShapes(Protocol):
    """What a controller asks of the shaper of its source's trees (tree.TreeShaper, which imports this module's
    VerifyCosts: a protocol here keeps the two out of an import circle)."""

    budget: int

    def take_outcome(self) -> Any: ...  # tree.TreeOutcome of the last shaped tree's cycle, once, or None

# an outlier sample (another process took the core) moves an estimate by at most this factor per update
_MAX_SAMPLE_RATIO = 2.0
_MIN_ROLLBACK_S = 1e-7  # a cycle that rolled nothing back still enters the rollback table's mean
CHEAP_DRAFT_S = 2e-5  # a proposal that runs no model (a dictionary read and a list copy): tens of microseconds


class CostTable:
    """Seconds per call as a function of batch tokens: measured points, EMA-updated, linear in between.

    Batched kernels do not scale linearly with batch size (and differ by quantization), so the table keeps
    the points actually measured on this machine rather than a fitted per-token slope.
    """

    def __init__(self, points: Mapping[int, float], *, smoothing: float = 0.2) -> None:
        if not points:
            raise ValueError("a cost table needs at least one measured point")
        if not 0.0 < smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing}")
        for n, s in points.items():
            _check_sample(n, s)
        self._n = sorted(int(n) for n in points)
        self._s = [float(points[n]) for n in self._n]
        self._smoothing = smoothing

    def seconds(self, n_tokens: int) -> float:
        """Estimated seconds for a call over `n_tokens` tokens (linear between points, flat-or-rising beyond)."""
        if n_tokens < 1:
            raise ValueError(f"n_tokens must be >= 1, got {n_tokens}")
        i = bisect.bisect_left(self._n, n_tokens)
        if i < len(self._n) and self._n[i] == n_tokens:
            return self._s[i]
        if i == 0 or len(self._n) == 1:  # below every point (or only one): as costly as the nearest one
            return self._s[0] if i == 0 else self._s[-1]
        lo = i - 1 if i < len(self._n) else len(self._n) - 2  # above every point: extend the last segment
        slope = max(0.0, (self._s[lo + 1] - self._s[lo]) / (self._n[lo + 1] - self._n[lo]))
        return self._s[lo] + slope * (n_tokens - self._n[lo])

    def seconds_each(self, first: int, last: int) -> list[float]:
        """seconds(n) for n = first..last (a table of one point is flat: its value, without a search each)."""
        if len(self._s) == 1:
            return [self._s[0]] * (last - first + 1)
        return [self.seconds(n) for n in range(first, last + 1)]

    def update(self, n_tokens: int, seconds: float) -> None:
        """Fold one measurement in (EMA); a batch size not seen before starts from the interpolated estimate."""
        _check_sample(n_tokens, seconds)
        i = bisect.bisect_left(self._n, n_tokens)
        if i == len(self._n) or self._n[i] != n_tokens:
            estimate = self.seconds(n_tokens)
            self._n.insert(i, n_tokens)
            self._s.insert(i, estimate)
        current = self._s[i]
        sample = min(max(seconds, current / _MAX_SAMPLE_RATIO), current * _MAX_SAMPLE_RATIO)
        self._s[i] = (1.0 - self._smoothing) * current + self._smoothing * sample

    def points(self) -> dict[int, float]:
        """The current estimate at every point measured so far."""
        return dict(zip(self._n, self._s))


def _check_sample(n_tokens: int, seconds: float) -> None:
    if not isinstance(n_tokens, int) or isinstance(n_tokens, bool) or n_tokens < 1:
        raise ValueError(f"n_tokens must be an integer >= 1, got {n_tokens!r}")
    if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds > 0.0):
        raise ValueError(f"seconds must be a finite positive number, got {seconds!r}")


class DraftTimes:
    """Seconds a source's drafts take, by block tokens (n drafts + 1), learnt from timings of them: a source
    that times its own proposals offers them (Offer.draft_s); the policy keeps one for each source that does not.

    Before any timing a draft is priced as one that runs no model (CHEAP_DRAFT_S); the first timing is taken as
    measured (an update from CHEAP_DRAFT_S would cap it at twice that, and a source that runs a model would look
    cheap for dozens of cycles), the later ones folded in as a CostTable does.
    """

    def __init__(self) -> None:
        self.table: CostTable | None = None

    def observe(self, block_tokens: int, seconds: float) -> None:
        """One draft's time; a timer that saw no time pass tells nothing."""
        if seconds <= 0.0:
            return
        if self.table is None:
            self.table = CostTable({block_tokens: seconds})
        else:
            self.table.update(block_tokens, seconds)

    def seconds(self, block_tokens: int) -> float:
        return CHEAP_DRAFT_S if self.table is None else self.table.seconds(block_tokens)

    def per_length(self, n_max: int) -> list[float] | None:
        """Seconds a draft of n tokens takes, n = 0..n_max (Offer.draft_s); None before any timing."""
        return None if self.table is None else [0.0] + self.table.seconds_each(2, n_max + 1)


class CostModel:
    """What one cycle costs on this machine: a target batch of n tokens, and one drafter pass over a block.

    Plain decoding is a target batch of one token, so plain and verify timings feed the same table.
    """

    def __init__(
        self,
        target: Mapping[int, float],
        draft: Mapping[int, float],
        *,
        rollback: Mapping[int, float] | None = None,
        smoothing: float = 0.2,
    ) -> None:
        self.target = CostTable(target, smoothing=smoothing)
        self.draft = CostTable(draft, smoothing=smoothing)
        # mean seconds a verify of n tokens spends rolling the target back (0 on a full accept);
        # None where rollback is a KV truncation, whose cost is noise next to a decode
        self.rollback = CostTable(rollback, smoothing=smoothing) if rollback else None
        # the draft pass of each source that neither schedules itself nor times its own drafts (MTP), learnt by
        # the policy from the loop's timings; kept here so that it outlives one generation's policy, as the
        # verify costs do
        self.source_drafts: dict[str, DraftTimes] = {}
        # a draft tree's verify of n rows, sharing the prefix and keeping the accepted path included; None
        # until a tree is verified: priced as a block of its rows (their batches cost alike: BENCHMARKS.md)
        self.tree: CostTable | None = None
        self._smoothing = smoothing

    def verify_s(self, n_tokens: int) -> float:
        return self.target.seconds(n_tokens) + (self.rollback.seconds(n_tokens) if self.rollback else 0.0)

    def tree_verify_s(self, n_rows: int) -> float:
        return self.verify_s(n_rows) if self.tree is None else self.tree.seconds(n_rows)

    def draft_s(self, block_tokens: int) -> float:
        return self.draft.seconds(block_tokens)

    @property
    def plain_s(self) -> float:
        return self.target.seconds(1)

    def observe(self, kind: TimingKind, n_tokens: int, seconds: float) -> None:
        if kind == "draft":
            self.draft.update(n_tokens, seconds)
        elif kind in ("verify", "plain"):
            self.target.update(n_tokens, seconds)
        elif kind == "rollback":
            if self.rollback is not None:
                self.rollback.update(n_tokens, max(seconds, _MIN_ROLLBACK_S))
        elif kind == "tree":
            if self.tree is None:  # the block's points until trees are measured there
                self.tree = CostTable({n: self.verify_s(n) for n in self.target.points()}, smoothing=self._smoothing)
            self.tree.update(n_tokens, seconds)
        else:
            raise ValueError(f"timing kind must be 'draft', 'verify', 'plain', 'rollback' or 'tree', got {kind!r}")


class VerifyCosts(Protocol):
    """What pricing a cycle reads of the costs, the one seam between the measurements and the choice (a
    `CostModel`; a curve that depends on how many requests share a batch can stand in for it)."""

    @property
    def plain_s(self) -> float: ...

    def verify_s(self, n_tokens: int) -> float: ...

    def tree_verify_s(self, n_rows: int) -> float: ...

    def draft_s(self, block_tokens: int) -> float: ...


@dataclass(frozen=True)
class BlockChoice:
    """One cycle's decision: verify `n_draft` drafted tokens (0 = decode plainly), and why.

    tree_rows > 0: the drafter's candidates over n_draft slots are verified as a tree of that many rows, the
    anchor included (tree.TreeShaper), instead of the linear block."""

    n_draft: int
    reason: str
    expected_tokens_per_s: float
    probe: bool = False  # a draft tried while the controller keeps to plain decoding
    tree_rows: int = 0
    sized: bool = False  # the tree is cut per cycle to the rows that pay best (tree.best_rows), up to tree_rows

    @property
    def block_size(self) -> int:
        """Rows the target processes this cycle: the last committed token plus the drafts, or the tree's rows."""
        return self.tree_rows or self.n_draft + 1


_TREE_EVIDENCE = 0.25  # a tree size seen less than this (decayed count) is tried again, one row past the best shape
_SIZED_DRAFT_SHARE = 0.1  # a sized tree drafts the slots that add at most this share of a cycle to the best shape's
_SIZED_TRIAL_CYCLES = 8  # a sized tree tried afresh is kept where it beats the fixed shapes this many cycles
_TREES_REFUSED_CYCLES = 64  # after the loop verified a tree as its first path, blocks only for this many cycles


class BlockController:
    """Chooses the block size (or draft tree) that maximises expected tokens per second, cycle by cycle.

    Acceptance is tracked per draft position as decayed Beta counts shrunk towards the pooled rate, so a
    few cycles are enough to react and positions never tried borrow from those that were. Once plain
    decoding wins, the controller keeps to it and probes with one draft (the cheapest cycle) after a plain
    streak that doubles on every probe that did not pay for itself, so probing a drafter that never passes
    costs a few percent; a probe that passes whole is followed at once by a longer one (3, 7, 15 drafts),
    because on some machines only long blocks can pay.

    Where its source shapes trees (`attach_trees`), each size m of tree is priced beside the blocks: the
    tokens an m-row tree commits, learned from every verified tree (which tells exactly what each of its
    smaller best-first subtrees would have committed, tree.TreeOutcome), shrunk towards the block of m - 1
    drafts (a tree of m rows holds at least as likely tokens as that chain), over the measured tree verify
    costs. A size without recent evidence is tried one row past the best shape, so trees grow where they
    pay and cost one slightly larger verify now and then where they do not.
    Call `choose` once per cycle, then `observe` with what happened.
    """

    def __init__(
        self,
        max_draft: int,
        costs: CostModel,
        *,
        adaptive: bool = True,
        prior_acceptance: float = 0.8,
        prior_strength: float = 2.0,
        pool_strength: float = 4.0,
        memory: float = 0.9,
        probe_after: int = 32,
        max_probe_after: int = 256,
        tree_memory: float = 0.98,
        tree_strength: float = 4.0,
    ) -> None:
        if not isinstance(max_draft, int) or max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
        if not 0.0 < prior_acceptance < 1.0:
            raise ValueError(f"prior_acceptance must be in (0, 1), got {prior_acceptance}")
        if prior_strength <= 0.0 or pool_strength <= 0.0 or tree_strength <= 0.0:
            raise ValueError("prior_strength, pool_strength and tree_strength must be > 0, got "
                             f"{prior_strength}, {pool_strength}, {tree_strength}")
        if not (0.0 < memory <= 1.0 and 0.0 < tree_memory <= 1.0):
            raise ValueError(f"memory and tree_memory must be in (0, 1], got {memory}, {tree_memory}")
        if probe_after < 1 or max_probe_after < probe_after:
            raise ValueError("need 1 <= probe_after <= max_probe_after")
        self.max_draft = max_draft
        self.costs = costs
        self.adaptive = adaptive
        # its acceptance per draft slot, which it owns: evidence fades with the cycles it chooses (`at`)
        self.profile = AcceptanceProfile(max_draft, prior=prior_acceptance, strength=pool_strength, memory=memory,
                                         pooled=prior_strength)
        self._base_probe_after = probe_after
        self._max_probe_after = max_probe_after
        self._cycle = 0
        self._aside = False
        self._aside_reason = ""  # why plain decoding was chosen when the controller set drafting aside
        self._plain_streak = 0
        self._probe_after = probe_after
        self._probing = False
        self._next_probe = 0  # > 0: the next cycle probes with this many drafts
        self.trees: TreeShapes | None = None  # the shaper of the source's trees, once attached
        self._tree_memory = tree_memory
        self._tree_strength = tree_strength
        self._tree_gain: list[float] = []  # [m]: decayed sum of what m-row trees committed beyond their 2 rows
        self._tree_seen: list[float] = []  # [m]: decayed count of the cycles that tell it
        self._tree_cycle = 0  # the cycle the tree counts were last decayed to
        self._cycle_tree: int | None = None  # the tree rows of the cycle chosen and not yet observed
        self._cycle_sized = False  # and whether it is sized per cycle
        self._sized = [0.0, 0.0, 0.0]  # trees sized per cycle: decayed tokens, priced seconds, cycles
        self._sized_trial = -_SIZED_TRIAL_CYCLES  # the cycle sized trees were last tried afresh
        self._fixed = [0.0, 0.0, 0.0]  # the same of the other drafting cycles (blocks, trees of a chosen size)
        self._trees_off_until = 0  # the loop verifies trees as their first path (a grammar): none before this cycle

    def attach_trees(self, shaper: TreeShapes) -> None:
        """Its source shapes draft trees of up to shaper.budget rows: price them beside the blocks."""
        self.trees = shaper
        self._tree_gain = [0.0] * (shaper.budget + 1)
        self._tree_seen = [0.0] * (shaper.budget + 1)

    # -- acceptance profile -------------------------------------------------------------------------

    def acceptance(self) -> list[float]:
        """P(draft j accepted | drafts before it accepted), j = 1..max_draft, as currently estimated."""
        return self.profile.rates(self._cycle)

    def expected_tokens(self) -> list[float]:
        """Expected tokens committed by a cycle verifying n drafts, n = 0..max_draft (bonus token included)."""
        return self.profile.expected_tokens(0, self.max_draft, self._cycle)

    def tree_expected(self, linear: Sequence[float] | None = None) -> list[float]:
        """Expected tokens committed by a tree of m rows, m = 0..budget (empty without trees).

        A tree of 2 rows is the block of one draft, which the block profile estimates (`linear`:
        expected_tokens()); a larger one adds what the verified trees' m likeliest rows committed beyond their
        own first row on the same cycles (the gain is measured where the text was, whatever it was then),
        shrunk towards the block of m - 1 drafts' gain."""
        linear = self.expected_tokens() if linear is None else linear
        decay = self._tree_decay()
        strength = self._tree_strength
        base = linear[1]
        return [base + (gain * decay + strength * (linear[min(max(m - 1, 1), self.max_draft)] - base))
                / (seen * decay + strength) for m, (gain, seen) in enumerate(zip(self._tree_gain, self._tree_seen))]

    def _trees_now(self, expected: Sequence[float]) -> list[float]:
        """tree_expected(), or none while the loop cannot verify trees."""
        return self.tree_expected(expected) if self._cycle >= self._trees_off_until else []

    # -- decisions ----------------------------------------------------------------------------------

    def choose(self) -> BlockChoice:
        self._cycle += 1
        self._cycle_tree, self._cycle_sized = None, False
        plain_rate = 1.0 / self.costs.plain_s
        if not self.adaptive:
            n, expected = self.max_draft, self.expected_tokens()
            if self.trees is not None:
                rows = self.trees.budget
                self._cycle_tree = rows
                return BlockChoice(n, f"fixed tree of {rows} rows", self._tree_rate(rows, self.tree_expected(expected)),
                                   tree_rows=rows)
            return BlockChoice(n, f"fixed block {n + 1}: {self._describe(n, expected)}", self._rate(n, expected))
        if not self._aside:
            expected = self.expected_tokens()
            trees = self._trees_now(expected)
            best_rate, best_n, best_rows = self._best(expected, trees)
            sized, fixed = self._realized_rates(best_rate) if trees else (0.0, 0.0)
            if max(sized, best_rate) > plain_rate:
                self._probe_after = self._base_probe_after
                best = self._describe_shape(best_n, best_rows, expected, trees)
                budget = len(trees) - 1
                # trees sized per cycle: where they did better lately, where only they beat plain decoding, or to
                # try them (their rate is realized: what their cycles committed, which no estimate reads high)
                # past its first cycles, a sized tree must beat plain decoding too: one cut to a draft or two
                # tells the block profile little, so the fixed shape then checks the estimate that keeps drafting on
                young = self._cycle - self._sized_trial < _SIZED_TRIAL_CYCLES
                sized_pays = sized > (fixed if young else max(fixed, plain_rate)) or best_rate <= plain_rate
                if trees and (sized_pays or self._sized[2] * self._tree_decay() < _TREE_EVIDENCE):
                    if not sized_pays:
                        self._sized_trial = self._cycle
                    self._cycle_tree, self._cycle_sized = budget, True
                    why = f"{sized:.0f} tok/s lately, fixed shapes {fixed:.0f}" if sized_pays else "not tried lately"
                    return BlockChoice(self._sized_depth(best_n, best_rows), f"tree sized per cycle (<= {budget} rows): "
                                       f"{why} (best fixed {best}; plain {plain_rate:.0f} tok/s)", sized,
                                       tree_rows=budget, sized=True)
                rows = min(budget, (best_rows or best_n + 1) + 1)  # one row past the best shape
                if rows >= 3 and self._tree_seen[rows] * self._tree_decay() < _TREE_EVIDENCE:
                    n = min(self.max_draft, rows - 1)
                    self._cycle_tree = rows
                    reason = f"tree {rows} rows, a size not verified lately (best {best} > plain {plain_rate:.0f} tok/s)"
                    return BlockChoice(n, reason, self._tree_rate(rows, trees), tree_rows=rows)
                self._cycle_tree = best_rows
                return BlockChoice(best_n, f"{best} > plain {plain_rate:.0f} tok/s", best_rate, tree_rows=best_rows)
            self._aside = True
            self._plain_streak = 0
            why = "drafts rarely accepted" if self.profile.judged() else "verifying costs too much here"
            best = self._describe_shape(best_n, best_rows, expected, trees)
            self._aside_reason = f"plain: {why} (best {best}) < plain {plain_rate:.0f} tok/s"
        # set aside: only probes look at the profile again, so a plain cycle costs the loop next to nothing
        if self._next_probe:  # the last probe passed whole: try a longer block at once
            n = self._next_probe
            self._next_probe = 0
            self._probing = True
            expected = self.expected_tokens()
            reason = f"probe draft {n} (the last probe passed): {self._describe(n, expected)}"
            self._cycle_tree = 0
            return BlockChoice(n, reason, self._rate(n, expected), probe=True)
        if self._plain_streak >= self._probe_after:  # the cheapest draft tells whether drafts pass again
            self._plain_streak = 0
            self._probing = True
            expected = self.expected_tokens()
            reason = f"probe draft 1 after {self._probe_after} plain cycles: {self._describe(1, expected)}"
            self._cycle_tree = 0
            return BlockChoice(1, reason, self._rate(1, expected), probe=True)
        self._plain_streak += 1
        return BlockChoice(0, self._aside_reason, plain_rate)

    @property
    def set_aside(self) -> bool:
        """Whether it keeps to plain decoding and only probes now and then (its source's offer is probing)."""
        return self.adaptive and self._aside

    def tree_rows_now(self) -> int | None:
        """The tree rows of the cycle `choose` chose (0: a linear block); None where this cycle was not
        chosen by it (a fixed policy's block: its source verifies trees of its whole budget)."""
        return self._cycle_tree

    def sized_now(self) -> bool:
        """Whether the tree `choose` chose is cut per cycle to the rows that pay best under the costs."""
        return self._cycle_sized

    def drafting_rate(self) -> float | None:
        """Expected tokens/s of the block `choose` would draft now; None while it keeps to plain decoding.

        Set aside, the profile drifts back towards the prior as evidence fades, so its best rate can look
        better than plain decoding long before a probe confirms it: a rival source must not yield to that.
        """
        if self.adaptive and self._aside:  # the cheap answer first: AdaptivePolicy asks every cycle with rivals
            return None
        expected = self.expected_tokens()
        if not self.adaptive:
            return self._rate(self.max_draft, expected)
        best = self._best(expected, self._trees_now(expected))[0]
        return best if best > 1.0 / self.costs.plain_s else None

    def observe(self, n_draft: int, n_accepted: int, verified_rows: int | None = None) -> bool:
        """Record a cycle's outcome: `n_accepted` of `n_draft` drafts matched (n_draft 0 = a plain cycle);
        verified_rows: the rows the target verified. True where they were its source's tree (whose outcome
        the tree sizes and, as its first chain, the block profile learn from; its timing is a tree's)."""
        if not (isinstance(n_draft, int) and isinstance(n_accepted, int)):
            raise ValueError("n_draft and n_accepted must be integers")
        if not 0 <= n_accepted <= n_draft <= self.max_draft:
            raise ValueError(f"need 0 <= n_accepted <= n_draft <= {self.max_draft}, got {n_accepted}, {n_draft}")
        sized, self._cycle_tree, self._cycle_sized = self._cycle_sized, None, False
        outcome = None if self.trees is None else self.trees.take_outcome()
        if n_draft == 0:
            return False
        whole = outcome is not None and outcome.rows == verified_rows  # the tree verified as shaped (a path: a block)
        tree = whole and not outcome.is_path
        if self.trees is not None and verified_rows is not None and not self._probing:
            # what the cycle committed over its time as the costs (learning from every cycle) price it, per way of
            # shaping (sized per cycle or not): priced, so that a cycle slowed by another process counts as any other
            seconds = self.costs.draft_s(n_draft + 1) + (
                self.costs.tree_verify_s(verified_rows) if tree else self.costs.verify_s(verified_rows))
            self._tree_cycle_decay(self._tree_decay())
            into = self._sized if sized else self._fixed
            into[0] += n_accepted + 1
            into[1] += seconds
            into[2] += 1.0
        if whole:  # a path too: what its size commits this cycle, so that a size shaped as a path is not retried
            self._observe_tree(outcome.committed)
            n_draft, n_accepted = outcome.chain_drafts, outcome.chain_accepted
        elif verified_rows is not None:
            n_draft = min(n_draft, verified_rows - 1)
            if outcome is not None and not outcome.is_path:  # a tree verified as its first path: the loop judges
                self._trees_off_until = self._cycle + _TREES_REFUSED_CYCLES  # one path at a time now (a grammar)
        self.profile.observe(0, n_draft, n_accepted, self._cycle)
        if self._probing:
            self._probing = False
            expected = self.expected_tokens()
            # whether to leave plain decoding is the blocks' call, as without trees: a tree's estimate (the block's
            # plus gains measured on other cycles) must not turn a probe into drafting the linear mode would not do
            best = self._best(expected, ())[0]
            plain_rate = 1.0 / self.costs.plain_s
            if n_accepted == 0:  # rejected outright: whatever the faded profile promises, wait twice as long
                self._probe_after = min(2 * self._probe_after, self._max_probe_after)
            elif best > plain_rate:
                self._aside = False
            elif n_accepted == n_draft < self.max_draft:  # all passed: grow the probe before judging
                self._next_probe = min(2 * n_draft + 1, self.max_draft)
            elif (n_accepted + 1) / self._cycle_s(n_draft) > plain_rate:
                self._probe_after = self._base_probe_after  # the probe paid for itself: the profile may be turning
            else:  # wait twice as long before the next probe, so a hopeless drafter costs little
                self._probe_after = min(2 * self._probe_after, self._max_probe_after)
        return tree

    def _observe_tree(self, committed: Sequence[int]) -> None:
        """committed[m - 1]: what the verified tree's m likeliest rows would have committed."""
        self._tree_cycle_decay(self._tree_decay())
        for m in range(2, min(len(committed), len(self._tree_seen) - 1) + 1):
            self._tree_gain[m] += committed[m - 1] - committed[1]
            self._tree_seen[m] += 1.0

    def _tree_decay(self) -> float:
        return self._tree_memory ** (self._cycle - self._tree_cycle)

    def _tree_cycle_decay(self, decay: float) -> None:
        """Bring the tree counts to this cycle (each observation decays them all to its cycle first)."""
        self._tree_gain = [g * decay for g in self._tree_gain]
        self._tree_seen = [c * decay for c in self._tree_seen]
        self._sized = [x * decay for x in self._sized]
        self._fixed = [x * decay for x in self._fixed]
        self._tree_cycle = self._cycle

    def _sized_depth(self, n: int, rows: int) -> int:
        """The slots a tree sized per cycle drafts, where the best fixed shape drafts n (or is a tree of `rows`):
        as many as its drafter pass can cover for at most a share of the best shape's cycle more than that
        shape's own pass (every slot on a GPU, where a pass costs nearly the same whatever its length; a few
        past the best shape's on a CPU, where a pass of every slot can cost more than the verify it saves)."""
        allowed = self.costs.draft_s(n + 1) + _SIZED_DRAFT_SHARE * (self._tree_s(rows) if rows else self._cycle_s(n))
        return next(d for d in range(self.max_draft, n - 1, -1) if d == n or self.costs.draft_s(d + 1) <= allowed)

    def _realized_rates(self, estimate: float) -> tuple[float, float]:
        """Tokens per priced second lately: of trees sized per cycle, and of the fixed shapes the estimates
        chose (blocks, trees of a size), realized against realized: the best estimate alone is the best of
        many noisy ones, which reads high. Either without a record reads `estimate` (the best fixed shape's);
        sized trees' few cycles shrink towards the fixed shapes' rate."""
        decay = self._tree_decay()
        f_tokens, f_seconds, f_cycles = (x * decay for x in self._fixed)
        s_tokens, s_seconds, s_cycles = (x * decay for x in self._sized)
        fixed = f_tokens / f_seconds if f_seconds > 0.0 else estimate
        if s_seconds <= 0.0:
            return fixed, fixed
        strength = self._tree_strength * s_seconds / s_cycles  # that many cycles of the sized trees' mean time
        return (s_tokens + strength * fixed) / (s_seconds + strength), fixed

    def observe_timing(self, kind: TimingKind, n_tokens: int, seconds: float) -> None:
        """Fold a measured draft pass (n_tokens = block tokens) or target batch into the cost model."""
        self.costs.observe(kind, n_tokens, seconds)

    def _best(self, expected: Sequence[float], trees: Sequence[float]) -> tuple[float, int, int]:
        """(tokens/s, drafts, tree rows or 0) of the best block or tree; the shorter block on a tie."""
        best = (self._rate(1, expected), 1, 0)
        for n in range(2, self.max_draft + 1):
            rate = self._rate(n, expected)
            if rate > best[0]:
                best = (rate, n, 0)
        for rows in range(3, len(trees)):  # two rows are the block of one draft
            rate = self._tree_rate(rows, trees)
            if rate > best[0]:
                best = (rate, min(self.max_draft, rows - 1), rows)
        return best

    def _cycle_s(self, n_draft: int) -> float:
        return self.costs.draft_s(n_draft + 1) + self.costs.verify_s(n_draft + 1)

    def _tree_s(self, rows: int) -> float:
        """A tree of `rows` rows: the drafter's pass over the slots it can reach, the tree's verify."""
        return self.costs.draft_s(min(self.max_draft, rows - 1) + 1) + self.costs.tree_verify_s(rows)

    def _rate(self, n_draft: int, expected: Sequence[float]) -> float:
        return expected[n_draft] / self._cycle_s(n_draft)

    def _tree_rate(self, rows: int, trees: Sequence[float]) -> float:
        return trees[rows] / self._tree_s(rows)

    def _describe(self, n_draft: int, expected: Sequence[float]) -> str:
        seconds = self._cycle_s(n_draft)
        return f"E={expected[n_draft]:.1f} tok for {seconds * 1e3:.1f} ms = {expected[n_draft] / seconds:.0f} tok/s"

    def _describe_shape(self, n_draft: int, rows: int, expected: Sequence[float], trees: Sequence[float]) -> str:
        if not rows:
            return f"draft {n_draft}: {self._describe(n_draft, expected)}"
        seconds = self._tree_s(rows)
        return f"tree {rows} rows: E={trees[rows]:.1f} tok for {seconds * 1e3:.1f} ms = {trees[rows] / seconds:.0f} tok/s"


@dataclass(frozen=True)
class Choice:
    """What the next cycle does: verify n_draft tokens from `source` (None and 0: a plain step)."""

    source: str | None
    n_draft: int
    kind: StepKind
    reason: str


PLAIN_CHOICE_REASON = "plain decoding"


class Policy(ABC):
    """Chooses each cycle's (source, length) from what the sources offer, and learns from the outcome.

    confidence_threshold: where a proposal carries predicted acceptances (DSpark's confidence head), its
    drafts are cut at the first one below this (upstream's --spec-draft-p-min); None cuts nothing.
    """

    confidence_threshold: float | None = None

    @abstractmethod
    def choose(self, offers: Sequence["Offer"]) -> Choice:
        """offers: what each source can propose now, in the Session's order (sources with nothing are left out)."""

    def verify_length(self, candidate: "Candidate") -> int:
        """How many of a proposal's drafts to verify (0: decode plainly instead)."""
        if candidate.confidences is None or self.confidence_threshold is None:
            return len(candidate)
        return confident_prefix(candidate.confidences, self.confidence_threshold)

    def observe(self, choice: Choice, n_accepted: int, timing: "CycleTiming") -> None:
        """What the chosen cycle accepted and cost."""


def _best_verify_length(candidate: "Candidate", costs: "CostModel", threshold: float | None) -> int:
    """With confidences: the verify length with the most expected tokens per second under the measured costs
    (the draft is already paid for, so only verification is priced), within the threshold's cut."""
    if candidate.confidences is None:
        return len(candidate)
    return best_verify_length(candidate.confidences, costs.verify_s, threshold=threshold or 0.0)


@dataclass(frozen=True)
class CycleTiming:
    block_tokens: int  # tokens the target decoded (last committed + drafts)
    draft_s: float
    verify_s: float
    rollback_s: float


class PlainPolicy(Policy):
    """Never drafts: speculation off, or no source can run on this target."""

    def __init__(self, reason: str = PLAIN_CHOICE_REASON) -> None:
        self._choice = Choice(None, 0, StepKind.PLAIN, reason)

    def choose(self, offers: Sequence["Offer"]) -> Choice:
        return self._choice


class FixedPolicy(Policy):
    """A fixed block: the first source that offers anything drafts what a block of block_size holds
    (block_size - 1 tokens, or block_size for sources named in `drafts`, e.g. anchor-first DSpark)."""

    def __init__(self, block_size: int, *, drafts: Mapping[str, int] | None = None,
                 confidence_threshold: float | None = None) -> None:
        self.block_size = block_size
        self.drafts = dict(drafts or {})
        self.confidence_threshold = confidence_threshold

    def choose(self, offers: Sequence["Offer"]) -> Choice:
        for offer in offers:
            n = min(offer.n_max, self.drafts.get(offer.source, self.block_size - 1))
            if n > 0:
                return Choice(offer.source, n, StepKind.DRAFT, f"fixed block {self.block_size}")
        return Choice(None, 0, StepKind.PLAIN, f"fixed block {self.block_size}: no draft offered")


class AdaptivePolicy(Policy):
    """Each cycle, the offer expected to commit most tokens per second under the measured costs, or plain decoding.

    An offer's expected tokens per length are priced as one verify of n + 1 tokens (the shared cost model)
    plus its draft of n tokens: the offer's own `draft_s` where its source times its drafts, else what the
    loop's timings of that source's drafts taught the policy (a source under a schedule (a BlockController) is
    priced by it, with the same verify costs). A probing offer bids nothing: a source on its own schedule
    that has set drafting aside (so a profile faded back to its prior but not confirmed by a probe never
    outbids a rival), or one exploring. Otherwise a schedule bids its drafting_rate() and takes the cycle
    when its bid wins. When no bid beats plain decoding, the offers that may still draft are asked in the
    Session's order: a schedule decides as it would alone (stay plain, or probe), a probing offer probes its
    n_max drafts. Ties go to the earlier offer. Any number of sources; none is special.
    """

    def __init__(self, costs: CostModel, *, confidence_threshold: float | None = None) -> None:
        self.costs = costs
        self.confidence_threshold = confidence_threshold
        self._schedules: dict[str, Schedule] = {}  # sources that drafted on their own schedule, by name
        self._drafts = costs.source_drafts  # draft-pass seconds per block, sources that do not time their own
        self._self_timed: set[str] = set()  # sources whose offers carry their own draft times
        self._plain = Choice(None, 0, StepKind.PLAIN, "")  # the last plain choice, reused while its reason holds

    def verify_length(self, candidate: "Candidate") -> int:
        return _best_verify_length(candidate, self.costs, self.confidence_threshold)

    def choose(self, offers: Sequence["Offer"]) -> Choice:
        if len(offers) == 1 and offers[0].schedule is not None:
            return self._controlled(offers[0])  # no rival: what the rule below gives, priced once
        plain_rate = 1.0 / self.costs.plain_s
        best, best_n, best_rate, best_expected, best_s = None, 0, plain_rate, 0.0, 0.0
        for offer in offers:
            c = offer.schedule
            if c is not None:
                if c.costs is not self.costs:
                    raise ValueError(f"{offer.source}: its schedule prices verifies with another cost model")
                rate = None if offer.probing else c.drafting_rate()
                if rate is not None and rate > best_rate:
                    best, best_rate = offer, rate
            elif offer.expected is not None and not offer.probing:
                expected, own = offer.expected, offer.draft_s
                if own is not None:
                    self._self_timed.add(offer.source)
                    draft_s = own.__getitem__
                else:
                    times = self._drafts.get(offer.source)
                    draft_s = ((lambda n: CHEAP_DRAFT_S) if times is None  # noqa: E731
                               else (lambda n: times.seconds(n + 1)))
                for n in range(1, min(len(expected) - 1, offer.n_max) + 1):
                    seconds = self.costs.verify_s(n + 1) + draft_s(n)
                    rate = expected[n] / seconds
                    if rate > best_rate:
                        best, best_n, best_rate, best_expected, best_s = offer, n, rate, expected[n], seconds
        if best is not None:
            if best.schedule is not None:
                return self._controlled(best)
            reason = (f"{best.source} {best_n}: E={best_expected:.1f} tok for {best_s * 1e3:.1f} ms = "
                      f"{best_rate:.0f} tok/s > plain {plain_rate:.0f} tok/s")
            return Choice(best.source, best_n, StepKind.DRAFT, reason)
        reason = None
        for offer in offers:  # no bid pays: a source under a controller keeps its own schedule (it may probe)
            if offer.schedule is not None:
                choice = self._controlled(offer)
                if choice.n_draft:
                    return choice
                reason = choice.reason
            elif offer.probing and offer.n_max:  # an exploring offer probes where nothing else pays
                why = f"probe {offer.source} {offer.n_max}: no offer pays more than plain {plain_rate:.0f} tok/s"
                return Choice(offer.source, offer.n_max, StepKind.PROBE, why)
        if reason is None:
            reason = f"plain: {_no_bid(offers)}, plain {plain_rate:.0f} tok/s"
        return self._plain_choice(reason)

    def _controlled(self, offer: "Offer") -> Choice:
        """The cycle as the offer's schedule decides it, cut to what the source can propose now."""
        block = offer.schedule.choose()
        n = min(block.n_draft, offer.n_max)
        if n == 0:
            return self._plain_choice(block.reason)
        self._schedules[offer.source] = offer.schedule
        return Choice(offer.source, n, StepKind.PROBE if block.probe else StepKind.DRAFT, block.reason)

    def _plain_choice(self, reason: str) -> Choice:
        if self._plain.reason is not reason:
            self._plain = Choice(None, 0, StepKind.PLAIN, reason)
        return self._plain

    def observe(self, choice: Choice, n_accepted: int, timing: CycleTiming) -> None:
        c = self._schedules.get(choice.source) if choice.n_draft else None
        if c is not None and c.observe(choice.n_draft, n_accepted, timing.block_tokens):
            # a tree: its verify, the shared prefix and the kept path together, priced apart from blocks
            self.costs.observe("tree", timing.block_tokens, timing.verify_s + timing.rollback_s)
            self.costs.observe("draft", choice.n_draft + 1, timing.draft_s)  # the schedule's costs are these
            return
        self.costs.observe("verify" if choice.n_draft else "plain", timing.block_tokens, timing.verify_s)
        if not choice.n_draft:  # a plain cycle tells no acceptance profile anything
            return
        if c is not None:
            self.costs.observe("draft", timing.block_tokens, timing.draft_s)
        elif choice.source not in self._self_timed:
            times = self._drafts.get(choice.source)
            if times is None:
                times = self._drafts[choice.source] = DraftTimes()
            times.observe(timing.block_tokens, timing.draft_s)
        self.costs.observe("rollback", timing.block_tokens, timing.rollback_s)


def _no_bid(offers: Sequence["Offer"]) -> str:
    """Why no offer was worth verifying, for a plain choice's reason."""
    priced = [o for o in offers if o.expected is not None and len(o.expected) > 1]
    if not priced:
        return "no source offers a draft"
    best = max(priced, key=lambda o: max(o.expected[1:]))
    return f"{best.source} does not pay (best E={max(best.expected[1:]):.1f} tok)"
