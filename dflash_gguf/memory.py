"""How a target's memory rolls back: one interface, one implementation per mechanism.

The loop verifies a block of n tokens and keeps the first k; it never calls seq_rm itself. KV truncation
serves attention-only targets; recurrent and hybrid targets need snapshots or checkpoint-and-replay.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from .target import Target


class TargetMemory(ABC):
    """Rollback for one target sequence. After keep(), target.features(n_keep) are the committed rows'."""

    name: str
    can_rollback: bool = True  # False: only plain decoding can run on this target
    max_verify: int | None = None  # longest verify batch it can roll back; None = any
    extra_bytes: int = 0  # memory the mechanism costs beyond a plain context

    def __init__(self, target: Target) -> None:
        self.target = target

    @abstractmethod
    def truncate(self, n: int) -> int:
        """Keep positions < n for prefix reuse; returns how many are really kept (0 = start over)."""

    def before_verify(self, n_past: int, n_tokens: int) -> None:
        """Called before the target decodes a verify batch of n_tokens at n_past."""

    @abstractmethod
    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        """The verify batch `block` at n_past was decoded; keep its first n_keep tokens only."""

    def end_of_turn(self, n_past: int) -> None:
        """The generation ended with n_past positions cached (a checkpoint for the next turn, say)."""


class KVTruncation(TargetMemory):
    """Attention-only memory: dropping the rejected positions is exact and nearly free."""

    name = "kv"

    def truncate(self, n: int) -> int:
        self.target.remove(0, n)
        return n

    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        if n_keep < len(block):
            self.target.remove(0, n_past + n_keep)


class NoRollback(TargetMemory):
    """Recurrent state without a rollback mechanism: plain decoding only, and no prefix reuse."""

    name = "none"
    can_rollback = False

    def truncate(self, n: int) -> int:
        self.target.remove(0, 0)
        return 0

    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        if n_keep < len(block):
            raise RuntimeError(f"{self.target.architecture}: this target's recurrent state cannot be rolled back")


def memory_for(target: Target) -> TargetMemory:
    """The cheapest correct rollback for this target (NoRollback if there is none)."""
    if not target.recurrent:
        return KVTruncation(target)
    return NoRollback(target)
