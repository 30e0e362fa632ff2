"""One way to time a target batch, shared by the controller's calibration and the benchmark's kernel sweep."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

from .memory import KVTruncation, TargetMemory
from .target import Target


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
