"""How a target's memory rolls back: one interface, one implementation per mechanism.

The loop verifies a block of n tokens and keeps the first k; it never calls seq_rm itself. KV truncation
serves attention-only targets; recurrent and hybrid targets roll back with recurrent-state snapshots
(libllama's `n_rs_seq`) where the architecture has them and the rollback is short enough, else with a
checkpoint of the recurrent state saved before the verify, restored, and the kept tokens replayed.

Measured on this libllama (0.3.36), tiny qwen35/lfm2/qwen3next GGUFs (scripts/measure_rollback.py):
- with n_rs_seq = 16, seq_rm rolls back exactly, but only inside the last decode call and only once:
  a rollback that reaches its first token or behind it returns True and leaves wrong state, a second
  seq_rm before the next decode returns False. HybridMemory enforces both rules in code;
- with n_rs_seq = 0 (or on architectures libllama clamps it for, e.g. qwen3next) partial seq_rm fails;
- a PARTIAL_ONLY state save/restore (recurrent state only; attention KV stays and is seq_rm'd) is exact.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from llama_cpp import llama_cpp as capi

from .target import Target

PARTIAL = capi.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY
MAX_TURN_CHECKPOINTS = 4  # prompt-end and end-of-turn checkpoints kept for prefix reuse (upstream: --ctx-checkpoints)


def rs_seq_for(max_block: int, n_batch: int | None = None) -> int:
    """n_rs_seq for a target whose verify batches are at most `max_block` tokens (target_gguf.drafter_verify_tokens).

    A verify keeps at least its first token, so it rolls back at most max_block - 1. libllama also needs
    n_rs_seq + 1 < n_ubatch (= n_batch here): a block as long as the batch rolls back with a checkpoint.
    """
    if not isinstance(max_block, int) or max_block < 1:
        raise ValueError(f"max_block must be an integer >= 1, got {max_block!r}")
    n = max_block - 1
    if n_batch is not None:
        n = min(n, n_batch - 2)
    return max(0, n)


@dataclass(frozen=True)
class Checkpoint:
    """The recurrent state of sequence 0 after `pos` positions (attention KV not included)."""

    pos: int
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


def save_state(target: Target, pos: int, seq_id: int = 0) -> Checkpoint:
    """The recurrent part of a sequence's memory (PARTIAL_ONLY), through the Target's state call, so that a
    sequence of a shared context saves its own (batching.SequenceTarget)."""
    return Checkpoint(pos, target.save_sequence(seq_id, flags=PARTIAL))


def load_state(target: Target, checkpoint: Checkpoint, seq_id: int = 0) -> None:
    """Restore a checkpoint's recurrent state, then drop the attention KV at and after its position."""
    target.load_sequence(checkpoint.data, seq_id, flags=PARTIAL)
    target.remove(seq_id, checkpoint.pos)


class TargetMemory(ABC):
    """Rollback for one target sequence. After keep(), target.features(n_keep) are the committed rows'."""

    name: str
    can_rollback: bool = True  # False: only plain decoding can run on this target
    reason: str | None = None  # why it cannot roll back, for Session.speculative_disabled_reason
    max_verify: int | None = None  # longest verify batch it can roll back; None = any
    extra_bytes: int = 0  # memory the mechanism costs beyond a plain context
    keeps_trees: bool = False  # whether a draft tree's verify can be rolled back to its accepted path

    def __init__(self, target: Target) -> None:
        self.target = target

    @abstractmethod
    def truncate(self, n: int) -> int:
        """Keep positions < n for prefix reuse; returns how many are really kept (0 = start over)."""

    def before_verify(self, n_past: int, n_tokens: int, *, keep_min: int = 1) -> None:
        """Called before the target decodes a verify batch of n_tokens at n_past.

        keep_min: the fewest tokens the following keep() may keep. The loop always keeps the block's
        first token (1); a caller that rolls a whole batch back (calibration) passes 0.
        """

    @abstractmethod
    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        """The verify batch `block` at n_past was decoded; keep its first n_keep tokens only."""

    def end_of_turn(self, n_past: int) -> None:
        """The generation ended with n_past positions cached (a checkpoint for the next turn, say)."""

    def restored(self, n: int) -> None:
        """The target's sequence 0 was replaced by a saved state of n positions (the prompt cache)."""

    @property
    def reaches_back(self) -> bool:
        """Whether truncate() can keep a prefix shorter than what is cached without a checkpoint of it
        (attention KV: always); else a restored state serves only prompts that extend all of it."""
        return True


class KVTruncation(TargetMemory):
    """Attention-only memory: dropping the rejected positions is exact and nearly free."""

    name = "kv"
    keeps_trees = True  # each path a sequence of a unified cache: dropping the others is a seq_rm (tree.keep_path)

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
    reaches_back = False

    def truncate(self, n: int) -> int:
        self.target.remove(0, 0)
        return 0

    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        if n_keep < len(block):
            raise RuntimeError(f"{self.target.architecture}: this target's recurrent state cannot be rolled back")


class HybridMemory(TargetMemory):
    """Recurrent or hybrid memory: snapshot rollback where it is exact, else checkpoint and replay.

    Snapshots (target.n_rs_seq > 0) roll back up to n_rs_seq tokens of the last decode call, once, at the
    cost of a seq_rm. Anything else (a longer rollback, an architecture libllama gives no snapshots, a
    caller that may keep nothing) saves the recurrent state before the verify; keep() then restores it,
    drops the attention KV past n_past and re-decodes the kept tokens, whose features come from that replay.
    Prefix reuse: the state at the end of each prompt and each turn is checkpointed, so a new prompt
    that extends (or shares a prefix up to) one of them resumes there; otherwise it re-prefills.
    """

    max_verify = None

    def __init__(self, target: Target, *, max_turn_checkpoints: int = MAX_TURN_CHECKPOINTS) -> None:
        super().__init__(target)
        if not target.recurrent:
            raise ValueError(f"{target.architecture}: HybridMemory is for targets with recurrent state")
        self.n_rs_seq = target.n_rs_seq
        self.name = "rs-snapshot" if self.n_rs_seq > 0 else "checkpoint"
        self._max_turn = max_turn_checkpoints
        self._state_bytes = _state_size(target)
        self._verify: tuple[int, int, int] | None = None  # (n_past, n_tokens, decode_count before it)
        self._checkpoint: Checkpoint | None = None  # saved by before_verify for this verify
        self._rolled_at = -1  # decode_count when a snapshot rollback was last spent
        self._turns: list[Checkpoint] = []  # ascending pos
        self._prompt_pending = False
        self.replayed_tokens = 0  # re-decoded by checkpoint replays, for stats and measurements
        self.rollbacks = {"snapshot": 0, "checkpoint": 0}

    # -- what it costs ------------------------------------------------------------------------
    @property
    def state_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (one snapshot, one checkpoint)."""
        return self._state_bytes

    @property
    def extra_bytes(self) -> int:  # type: ignore[override]
        """The n_rs_seq snapshot rows libllama allocates, plus the checkpoints held now."""
        held = sum(c.nbytes for c in self._turns) + (self._checkpoint.nbytes if self._checkpoint else 0)
        return self.n_rs_seq * self._state_bytes + held

    def can_snapshot(self, n_tokens: int, n_keep: int) -> bool:
        """Whether rolling a just-decoded batch of n_tokens back to n_keep is a snapshot rollback."""
        return self.n_rs_seq > 0 and n_keep >= 1 and n_tokens - n_keep <= self.n_rs_seq

    # -- the interface ------------------------------------------------------------------------
    def truncate(self, n: int) -> int:
        t = self.target
        cached = t.pos_max(0) + 1
        self._verify = self._checkpoint = None
        self._prompt_pending = True
        if n >= cached:
            kept = cached  # the new prompt extends everything cached: nothing to roll back
        elif n <= 0:
            kept = 0
        else:
            kept = self._restore_turn(n, cached)
        if kept == 0:
            t.remove(0, 0)
        self._turns = [c for c in self._turns if c.pos <= kept]
        return kept

    def _restore_turn(self, n: int, cached: int) -> int:
        """Roll the cached sequence back to at most n positions; 0 when no mechanism reaches there."""
        t = self.target
        first = cached - t._n_last  # the last decode call covered [first, cached)
        if (
            self.n_rs_seq > 0 and t.decode_count != self._rolled_at and first < n
            and cached - n <= self.n_rs_seq and t.pos_max(0) + 1 == cached
        ):
            t.remove(0, n)  # snapshot: inside the last decode call, first rollback since it
            self._rolled_at = t.decode_count
            return n
        usable = [c for c in self._turns if 0 < c.pos <= n]
        if not usable:
            return 0
        load_state(t, usable[-1])
        self._rolled_at = t.decode_count
        return usable[-1].pos

    def before_verify(self, n_past: int, n_tokens: int, *, keep_min: int = 1) -> None:
        t = self.target
        if t.pos_max(0) + 1 != n_past:
            raise RuntimeError(f"verify at {n_past}, but the target holds {t.pos_max(0) + 1} positions")
        if self._prompt_pending:
            # the state at the end of the prompt: a later prompt sharing this prefix resumes here
            self._prompt_pending = False
            if n_past > 0:
                self._remember(save_state(t, n_past))
        self._verify = (n_past, n_tokens, t.decode_count)
        needs = n_past > 0 and n_tokens > keep_min and not self.can_snapshot(n_tokens, keep_min)
        self._checkpoint = save_state(t, n_past) if needs else None

    def keep(self, n_past: int, block: Sequence[int], n_keep: int) -> None:
        t = self.target
        n = len(block)
        if not 0 <= n_keep <= n:
            raise ValueError(f"n_keep must be in [0, {n}], got {n_keep}")
        if self._verify is None or self._verify[:2] != (n_past, n) or t.decode_count != self._verify[2] + 1:
            raise RuntimeError(
                "keep() must directly follow the verify decode announced by before_verify(n_past, len(block))"
            )
        self._verify = None
        checkpoint, self._checkpoint = self._checkpoint, None
        if n_keep == n:
            return
        if n_past == 0 and checkpoint is None:
            # the state before position 0 is empty: a full clear restores it exactly (calibration)
            t.remove(0, 0)
            if n_keep:
                t.decode(list(block[:n_keep]), 0, logits=False)
                self.replayed_tokens += n_keep
            self._rolled_at = t.decode_count
            return
        if checkpoint is None and self.can_snapshot(n, n_keep) and t.decode_count != self._rolled_at:
            t.remove(0, n_past + n_keep)
            self._rolled_at = t.decode_count
            self.rollbacks["snapshot"] += 1
            return
        if checkpoint is None:
            raise RuntimeError(
                f"cannot roll a {n}-token verify back to {n_keep}: no checkpoint was saved "
                f"(before_verify was told keep_min >= {n_keep + 1}, n_rs_seq={self.n_rs_seq})"
            )
        load_state(t, checkpoint)
        self.rollbacks["checkpoint"] += 1
        if n_keep:
            t.decode(list(block[:n_keep]), n_past, logits=False)  # replay: the state, and the features
            self.replayed_tokens += n_keep
        self._rolled_at = t.decode_count

    def end_of_turn(self, n_past: int) -> None:
        t = self.target
        if t.pos_max(0) + 1 == n_past and n_past > 0:
            self._remember(save_state(t, n_past))

    def restored(self, n: int) -> None:
        """A saved state replaced the sequence: the turn checkpoints were another sequence's, and the
        snapshot rows are not part of a saved state, so no snapshot rollback may reach into it."""
        t = self.target
        if t.pos_max(0) + 1 != n:
            raise RuntimeError(f"a restored state of {n} positions, but the target holds {t.pos_max(0) + 1}")
        self._verify = self._checkpoint = None
        self._turns = []
        self._prompt_pending = False
        self._rolled_at = t.decode_count

    @property
    def reaches_back(self) -> bool:
        return False

    def _remember(self, checkpoint: Checkpoint) -> None:
        turns = [c for c in self._turns if c.pos != checkpoint.pos] + [checkpoint]
        self._turns = sorted(turns, key=lambda c: c.pos)[-self._max_turn :]


def _state_size(target: Target) -> int:
    """Bytes of one sequence's recurrent state; an empty sequence is probed with one token, then cleared."""
    if target.pos_max(0) >= 0:
        return len(target.save_sequence(0, flags=PARTIAL))
    target.decode([max(0, target.vocab.bos_token())], 0, logits=False)
    try:
        return len(target.save_sequence(0, flags=PARTIAL))
    finally:
        target.remove(0, 0)


def memory_for(target: Target) -> TargetMemory:
    """The cheapest correct rollback for this target (NoRollback if there is none)."""
    if not target.recurrent:
        return KVTruncation(target)
    reason = rollback_unsupported(target)
    if reason is None:
        return HybridMemory(target)
    memory = NoRollback(target)
    memory.reason = reason
    return memory


def rollback_unsupported(target: Target) -> str | None:
    """Why neither snapshots nor checkpoints serve this target, or None when one does."""
    if target.n_rs_seq > 0:
        return None
    try:
        target.save_sequence(0, flags=PARTIAL)
    except RuntimeError:
        return f"{target.architecture}: libllama cannot save this target's recurrent state (no checkpoint)"
    return None
