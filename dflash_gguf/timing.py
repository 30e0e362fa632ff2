"""Measuring what a cycle costs on this machine: one way to time a target batch (shared with the benchmark's
kernel sweep), and the start-up calibration that turns such timings into the controller's cost model.

The controller stays pure: it prices offers with a CostModel and folds in the timings the loop reports;
everything here runs real batches on the target (and drafter), so it lives apart from it.
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .controller import _MIN_ROLLBACK_S, CHEAP_DRAFT_S, CostModel
from .memory import KVTruncation, TargetMemory
from .target import Target

if TYPE_CHECKING:
    from .drafter import Drafter


@dataclass(frozen=True)
class BatchTiming:
    wall_s: float  # the decode, every row with logits (as verification needs)
    cpu_s: float  # process CPU time of the decode: steadier than wall time on a shared machine at one thread
    rollback_s: float  # what the rollback costs: the memory's save before the verify, then keeping the first token


def time_batch(target: Target, tokens: Sequence[int], pos: int, memory: TargetMemory | None = None) -> BatchTiming:
    """Decode `tokens` at `pos` as a verify batch and roll it back to its first token, as the loop would
    (a snapshot or a checkpoint and replay on hybrid targets); then the cache is left as it was."""
    memory = memory or KVTruncation(target)
    start = time.perf_counter()
    memory.before_verify(pos, len(tokens))
    save = time.perf_counter() - start
    start, start_cpu = time.perf_counter(), time.process_time()
    target.decode(tokens, pos, logits=True)
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    start = time.perf_counter()
    memory.keep(pos, tokens, 1)
    rollback = save + time.perf_counter() - start
    memory.truncate(pos)
    return BatchTiming(wall, cpu, rollback)


CALIBRATION_SIZES = (1, 2, 4, 8, 16)
MIN_SWEEPS = 2  # the fastest of two: one stalled sample (another process took the core) does not decide


def calibrate(
    target: Target,
    drafter: Drafter,
    *,
    memory: TargetMemory | None = None,
    max_block: int | None = None,
    budget_s: float = 0.4,
    smoothing: float = 0.2,
) -> CostModel:
    """Measure target batches and draft passes on this machine at start-up, in about `budget_s` seconds.

    Target batches of 1..block tokens (every row outputs logits, as verification needs) and draft passes
    of the smallest and the full block (plus a one-row feature injection, as every cycle has) run beyond
    the cached positions, and `memory` rolls each back as a rejected verify would be, so positions cached
    stay as they were. After a warm-up, sweeps repeat while the budget lasts (at least two) and the
    fastest time per size is kept: the one least disturbed by other work; a size never costs more than
    a larger one did. Where rolling back is more than a KV truncation, its cost is measured too.
    """
    if budget_s <= 0.0:
        raise ValueError(f"budget_s must be > 0, got {budget_s}")
    memory = memory or KVTruncation(target)
    block = min(drafter.block_size, max_block or drafter.block_size)
    p0 = max(1, target.pos_max(0) + 1)
    if block < 2 or p0 + block > min(target.n_ctx_seq, drafter.n_ctx):
        raise ValueError(f"no room to calibrate a block of {block}: {p0} positions cached, context {target.n_ctx_seq}")
    token = max(0, target.vocab.bos_token())
    with _timing_position(target, memory, token) as p0:
        return _calibrate_at(p0, target, drafter, memory, block, token, budget_s, smoothing)


@contextmanager
def _timing_position(target: Target, memory: TargetMemory, token: int) -> Iterator[int]:
    """The position to time batches at: after the cached ones, or after a one-token prefix on an empty
    cache (rolling back to position 0 is a plain clear on hybrid targets, not the rollback the loop pays).
    The prefix is a turn checkpoint for hybrid memory, so each timed batch rolls back to it; it is
    removed afterwards."""
    p0 = target.pos_max(0) + 1
    if p0 > 0:
        yield p0
        return
    target.decode([token], 0, logits=False)
    memory.end_of_turn(1)
    try:
        yield 1
    finally:
        memory.truncate(0)


def _calibrate_at(p0: int, target: Target, drafter: Drafter, memory: TargetMemory, block: int, token: int,
                  budget_s: float, smoothing: float) -> CostModel:
    sizes = sorted({n for n in CALIBRATION_SIZES if n <= block} | {block})
    draft_sizes = sorted({2, block})
    rollback: dict[int, float] = {}

    def time_verify(n: int) -> float:
        timing = time_batch(target, [token] * n, p0, memory)
        rollback[n] = min(timing.rollback_s, rollback.get(n, math.inf))
        return timing.wall_s

    def time_draft(n: int) -> float:
        memory.before_verify(p0, 1, keep_min=0)
        target.decode([token], p0, logits=False)
        features = target.features(1)
        memory.keep(p0, [token], 0)
        start = time.perf_counter()
        drafter.inject(features, p0)
        drafter.draft(token, p0 + 1, n - 1)
        seconds = time.perf_counter() - start
        drafter.remove(p0)
        return seconds

    measures: list[tuple[Callable[[int], float], dict[int, float], int]] = []
    verify: dict[int, float] = {}
    draft: dict[int, float] = {}
    measures += [(time_verify, verify, n) for n in sizes]
    measures += [(time_draft, draft, n) for n in draft_sizes]
    deadline = time.perf_counter() + budget_s
    time_verify(block)  # warm-up: the first calls allocate graphs and buffers
    time_draft(block)
    sweeps = 0
    while sweeps < MIN_SWEEPS or time.perf_counter() < deadline:
        for fn, table, n in measures:
            seconds = fn(n)
            table[n] = min(seconds, table.get(n, math.inf))
        sweeps += 1
    return CostModel(_non_decreasing(verify), _non_decreasing(draft), rollback=_rollback_table(memory, rollback),
                     smoothing=smoothing)


def _rollback_table(memory: TargetMemory, measured: dict[int, float]) -> dict[int, float] | None:
    """Rollback costs worth pricing: none for a KV truncation (nearly free), else what was measured."""
    return None if isinstance(memory, KVTruncation) else {n: max(s, _MIN_ROLLBACK_S) for n, s in measured.items()}


def _non_decreasing(table: dict[int, float]) -> dict[int, float]:
    """Each size costs at most what any larger one did: a stalled sample at a small size cannot stand."""
    out: dict[int, float] = {}
    smallest_above = math.inf
    for n in sorted(table, reverse=True):
        smallest_above = min(smallest_above, table[n])
        out[n] = smallest_above
    return out


# -- verify costs alone, for sources that run no model ----------------------------------------------

VERIFY_CALIBRATION_SIZES = (1, 2, 4, 8, 16, 24, 33)


def calibrate_verify(
    target: Target,
    *,
    memory: TargetMemory | None = None,
    max_tokens: int = 33,
    budget_s: float = 0.3,
    smoothing: float = 0.2,
) -> CostModel:
    """Target batches of 1..max_tokens tokens timed as `calibrate` does, for sources that need no drafter pass.

    The draft table holds lookup's own (tiny) proposal cost; the verify table is what decides lookup.
    """
    memory = memory or KVTruncation(target)
    p0 = max(1, target.pos_max(0) + 1)
    top = min(max_tokens, target.n_batch, target.n_ctx_seq - p0)
    if top < 2:
        raise ValueError(f"no room to calibrate: {p0 - 1} positions cached, context {target.n_ctx_seq}")
    sizes = sorted({n for n in VERIFY_CALIBRATION_SIZES if n <= top} | {top})
    token = max(0, target.vocab.bos_token())
    verify: dict[int, float] = {}
    rollback: dict[int, float] = {}
    with _timing_position(target, memory, token) as p0:
        time_batch(target, [token] * top, p0, memory)  # warm-up
        deadline = time.perf_counter() + budget_s
        sweeps = 0
        while sweeps < MIN_SWEEPS or time.perf_counter() < deadline:
            for n in sizes:
                timing = time_batch(target, [token] * n, p0, memory)
                verify[n] = min(timing.wall_s, verify.get(n, math.inf))
                rollback[n] = min(timing.rollback_s, rollback.get(n, math.inf))
            sweeps += 1
    return CostModel(_non_decreasing(verify), {1: CHEAP_DRAFT_S}, rollback=_rollback_table(memory, rollback),
                     smoothing=smoothing)


def extend_verify_costs(costs: CostModel, target: Target, *, memory: TargetMemory | None = None, max_tokens: int = 33,
                        budget_s: float = 0.2) -> CostModel:
    """A drafter's cost model with target batches measured up to max_tokens (other sources draft longer blocks)."""
    longer = calibrate_verify(target, memory=memory, max_tokens=max_tokens, budget_s=budget_s)
    merged = {**longer.target.points(), **costs.target.points()}
    return CostModel(_non_decreasing(merged), costs.draft.points(),
                     rollback=costs.rollback.points() if costs.rollback else None)
