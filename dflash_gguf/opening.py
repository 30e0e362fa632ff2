"""Opening and forking a Session's native parts: the one place SessionOptions become the target's context
settings (the context spec: the trained context where n_ctx is None, recurrent-state snapshots sized for the
drafter's blocks, one sequence per tree leaf, the model's MTP heads loaded), and the embedded defaults.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from . import defaults
from .batching import SharedContext
from .config import SessionOptions
from .drafter import Drafter
from .memory import rs_seq_for
from .target import Target
from .target_gguf import drafter_verify_tokens, trained_context

__all__ = ["default_drafter", "fork_native", "open_target"]


def open_target(target: str | os.PathLike[str] | None, drafter: str | os.PathLike[str] | None,
                options: SessionOptions) -> Target:
    """The target GGUF (None: the embedded one) opened with the context `options` ask for, sized for `drafter`:
    a context of its own, or (sequences > 1) sequence 0 of a shared context whose other sequences fork() hands
    out (issue 37), recurrent targets included: each sequence's state snapshots and checkpoints are its own."""
    o = options
    path = defaults.embedded_target() if target is None else target
    n_ctx = o.n_ctx or _trained_context(path)
    settings: dict[str, Any] = dict(
        n_batch=o.n_batch, n_gpu_layers=o.n_gpu_layers, n_threads=o.n_threads, flash_attn=o.flash_attn,
        verbose=o.verbose, n_rs_seq=_rs_seq(drafter, o.n_batch) if o.n_rs_seq is None else o.n_rs_seq,
        type_k=o.type_k, type_v=o.type_v, rpc_servers=o.rpc_servers,
        load_mtp=o.mtp,  # the model's own MTP heads, where it has them, draft beside the other sources
    )
    if o.sequences == 1:
        return Target.open(path, n_ctx=n_ctx, **settings,
                           n_seq_max=max(1, o.tree_nodes - 1),  # a tree of n rows has at most n - 1 leaves
                           kv_unified=o.tree_nodes > 0)
    # one KV stream per sequence (not unified): each sequence's cells stay in its own order, as in a context of
    # its own, so its logits are bit for bit what it would get alone (docs/DESIGN.md)
    owner = Target.open(path, n_ctx=n_ctx * o.sequences, n_seq_max=o.sequences, kv_unified=False, **settings)
    try:
        return SharedContext(owner).sequence()
    except BaseException:
        owner.close()
        raise


def fork_native(target: Target, drafter: Drafter | None) -> tuple[Target, Drafter | None]:
    """New contexts on the same loaded target and drafter weights (the caller holds the Session's native lock);
    on a shared context, its next sequence."""
    forked = target.fork()
    try:
        return forked, drafter.fork(forked) if drafter is not None else None
    except BaseException:
        forked.close()
        raise


def default_drafter() -> Path | None:
    """The drafter shipped for the embedded target, once the package carries one."""
    find = getattr(defaults, "embedded_drafter", None)
    return find() if find is not None else None


def _rs_seq(drafter: str | os.PathLike[str] | None, n_batch: int) -> int:
    """Recurrent-state snapshots a hybrid target needs to roll back any block of this drafter (0: none).

    libllama ignores it for targets without recurrent state. A drafter file that cannot be read gets 0
    here; the Drafter then says what is wrong with it.
    """
    if drafter is None or not isinstance(n_batch, int):
        return 0
    try:
        return rs_seq_for(drafter_verify_tokens(drafter), n_batch)
    except Exception:  # noqa: BLE001 - reported by Drafter with the file and field
        return 0


def _trained_context(target: str | os.PathLike[str]) -> int:
    """The context a target was trained for (n_ctx None), or SessionOptions' default where its GGUF does not say;
    a file that cannot be read gets the default here and Target.open says what is wrong with it."""
    fallback = int(SessionOptions().n_ctx)  # the field's default is a size; None is what a command asks for
    try:
        return trained_context(target) or fallback
    except (ValueError, OSError):
        return fallback
