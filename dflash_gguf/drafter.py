"""The DFlash drafter, run natively by libllama next to its target.

The `dflash` model borrows the target's token embeddings and LM head through
`ctx_other`; target features are injected into its KV cache with an embd batch,
and a block `[last, mask x (B-1)]` is drafted in one non-causal pass
(upstream: `common_speculative_impl_draft_dflash`, common/speculative.cpp).
"""

from __future__ import annotations

import ctypes
import os
import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from llama_cpp import llama_cpp as capi

from . import drafter_gguf, llama_ext
from .backends import Placement, placement
from .batching import Request, SequenceTarget, SharedContext, Stage, settle_outputs
from .confidence import MarkovHead, load_markov_head
from .sampling import SamplingParams, probabilities, sample_token
from .kinds import DFLASH2, DSPARK
from .schema import ARCH, Keys
from .target import (
    ClosedError, NativeResource, SharedModel, Target, check_gguf_file, check_kv_types, describe_context, describe_model,
    load_model, meta_str, new_context, state_seq_get, state_seq_set,
)


class PairingError(ValueError):
    """The drafter was not made for this target (or is not a drafter at all)."""


@dataclass(frozen=True)
class Proposal:
    """Drafted tokens for block slots 1..n and the distribution each was drawn from.

    q is None for greedy drafts; dense (n, V) for DFlash; for DFlash2 sparse: q (n, k)
    over the candidate ids q_ids (n, k), as acceptance.accept_sampled takes it.
    """

    tokens: np.ndarray
    q: np.ndarray | None = None
    q_ids: np.ndarray | None = None
    confidences: np.ndarray | None = None  # predicted P(accepted) per slot, where the drafter has a head for it


def _meta_float(model: capi.llama_model_p, key: str) -> float:
    value = meta_str(model, key)
    return float(value) if value else 0.0


def check_pairing(model: capi.llama_model_p, path: Path, target: Target) -> None:
    """Refuse a drafter that cannot run with `target`, before any drafter context exists.

    Loading a GGUF is safe in libllama; building and running a graph with mismatched shapes is not.
    """
    arch = meta_str(model, Keys.ARCHITECTURE)
    if arch != ARCH:
        raise PairingError(f"{path}: architecture is {arch!r}, not a {ARCH!r} drafter")
    n_embd = capi.llama_model_n_embd(model)
    if n_embd != target.n_embd:
        raise PairingError(f"{path}: hidden size {n_embd} does not match the target's {target.n_embd}")
    n_vocab = capi.llama_vocab_n_tokens(capi.llama_model_get_vocab(model))
    if n_vocab != target.n_vocab:
        raise PairingError(f"{path}: vocabulary of {n_vocab} tokens does not match the target's {target.n_vocab}")
    layers = llama_ext.target_layer_ids(model)
    if not layers:
        raise PairingError(f"{path}: no {Keys.TARGET_LAYERS} in its metadata")
    try:
        target.check_layers(layers)
    except ValueError as e:
        raise PairingError(f"{path}: {e}") from None
    expected = meta_str(model, Keys.TARGET_FINGERPRINT)
    if expected is None:
        warnings.warn(f"{path}: no {Keys.TARGET_FINGERPRINT}; converted elsewhere, fingerprint not checked", stacklevel=3)
    elif expected != target.fingerprint():
        raise PairingError(
            f"{path}: made for a target with fingerprint {expected}, but this target's is {target.fingerprint()}"
        )


class Drafter(NativeResource):
    """One `dflash` drafter model + context tied to a Target's context.

    Its graph reads the target context's embeddings and LM head (`ctx_other`), so every entry that
    reaches C checks that both are open: closing the target first leaves a drafter that raises.
    """

    def described(self) -> dict[str, Any]:
        """What this drafter's model and context are, as a measured cost depends on them."""
        self._check_open()
        return {**describe_model(self._model), **describe_context(self._ctx)}

    def placement(self) -> Placement:
        """Where libllama put this drafter's layers."""
        self._check_open()
        return placement(self._model, self.n_gpu_layers)

    def _check_open(self) -> None:
        """ClosedError when this drafter or its target is closed (two attribute tests)."""
        if self._ctx is None:
            raise self._closed_error()
        if self.target.closed:
            raise ClosedError(f"the target of this Drafter ({self.path}) is closed")

    def __init__(
        self,
        path: str | os.PathLike[str],
        target: Target,
        *,
        n_gpu_layers: int | None = None,
        n_threads: int | None = None,
        type_k: str | None = None,
        type_v: str | None = None,
    ) -> None:
        self.path = check_gguf_file(path)
        self.target = target
        # the KV cache of the injected features: the target's element types unless told otherwise
        self.type_k = target.type_k if type_k is None else type_k
        self.type_v = target.type_v if type_v is None else type_v
        check_kv_types(self.type_k, self.type_v, target.flash_attn)
        # every value libllama would abort on, before it reads the file; and the drafter's kind, decided once
        self.file = drafter_gguf.check_drafter_gguf(self.path)
        self.n_gpu_layers = target.n_gpu_layers if n_gpu_layers is None else n_gpu_layers  # on the GPU with the target
        self._model = load_model(self.path, n_gpu_layers=self.n_gpu_layers)
        self._shared = SharedModel(self._model, owned=True)
        try:
            check_pairing(self._model, self.path, target)
            self._setup(n_threads)
        except BaseException:
            self.close()
            raise

    def fork(self, target: Target) -> "Drafter":
        """A drafter context for another context of the same target model, on this drafter's loaded model."""
        if self._ctx is None:
            raise self._closed_error()
        if target.closed:
            raise ClosedError("cannot fork a Drafter onto a closed Target")
        other = Drafter.__new__(Drafter)
        other.path, other.target, other.file, other.n_gpu_layers = self.path, target, self.file, self.n_gpu_layers
        other.type_k, other.type_v = self.type_k, self.type_v
        other._shared = self._shared.share()
        other._model = self._model
        try:
            other._setup(capi.llama_n_threads(self._ctx))
        except BaseException:
            other.close()
            raise
        return other

    def _setup(self, n_threads: int | None) -> None:
        model, target = self._model, self.target
        self.layers = llama_ext.target_layer_ids(model)
        file = self.file  # a GGUF of another architecture (no DrafterFile) was refused by check_pairing
        self.block_size = file.block_size
        if self.block_size < 2:
            raise PairingError(f"{self.path}: block size {self.block_size} leaves no room for a draft")
        self.causal = meta_str(model, Keys.CAUSAL) == "true"
        self.selector_top_k = int(llama_ext.model_dflash_selector_top_k(model))
        self.is_dflash2 = file.kind is DFLASH2
        self.is_dspark = file.kind is DSPARK
        self.n_embd = capi.llama_model_n_embd(model)
        # DSpark: a Markov head (libllama builds it when markov_w1 is present); its weights on the host too,
        # to re-condition sampled drafts on the token drawn rather than the graph's argmax
        self.markov: MarkovHead | None = load_markov_head(self.path, self.n_embd) if self.is_dspark else None
        self.has_confidence_head = self.is_dspark and meta_str(model, Keys.HAS_CONFIDENCE_HEAD) != "false" and (
            self.markov.conf_markov is not None
        )
        # anchor-first (DSpark default): slot 0 already predicts, so a block of B drafts B tokens;
        # the bonus-anchor layout (and DFlash) spend slot 0 on the last committed token
        self.sample_from_anchor = file.anchor_first
        self._lead = file.lead
        self.kind = file.kind.name  # source name in Steps
        self.max_draft = file.max_draft
        self.last_confidences: np.ndarray | None = None  # the last draft's per-slot confidences (DSpark head)
        self.n_vocab = target.n_vocab
        self._logit_scale = _meta_float(model, Keys.LOGIT_SCALE)
        self._softcap = _meta_float(model, Keys.FINAL_LOGIT_SOFTCAPPING)
        mask = capi.llama_vocab_mask(capi.llama_model_get_vocab(model))
        if mask < 0:
            mask = int(meta_str(model, Keys.MASK_TOKEN_ID) or -1)
        if not 0 <= mask < self.n_vocab:
            raise PairingError(f"{self.path}: no usable mask token id (got {mask})")
        self.mask_token_id = mask

        target.capture(self.layers)
        self.n_features = len(self.layers) * target.n_embd
        self._pos = (capi.llama_pos * 4)()
        # a sequence of a shared target context drafts in one drafter context shared the same way: its passes
        # and injections are gathered with the other sequences' (batching.Stage.DRAFT / INJECT)
        self._gather: SharedContext | None = target.shared if isinstance(target, SequenceTarget) else None
        self.seq = target.seq_id if self._gather is not None else 0  # its sequence in the drafter context
        shared = None if self._gather is None else self._gather.drafter_context
        if shared is not None:
            shared.users += 1
            self._ctx, self._batch, self._context = shared.ctx, shared.batch, shared
        else:
            threads = capi.llama_n_threads(target.ctx) if n_threads is None else n_threads
            n_seq = 1 if self._gather is None else self._gather.n_sequences
            # unified: every sequence's block is one micro-batch (a non-causal block must not be cut), and the
            # drafts' numerics decide only speed, never the output
            self._ctx = new_context(
                model,
                n_ctx=target.n_ctx_seq * n_seq,
                n_batch=target.n_batch,
                n_seq_max=n_seq,
                kv_unified=n_seq > 1,
                n_threads=threads,
                flash_attn=target.flash_attn,
                ctx_other=target.ctx,
                type_k=self.type_k,
                type_v=self.type_v,
            )
            capi.llama_set_causal_attn(self._ctx, self.causal)
            if self.is_dflash2 or self.has_confidence_head:
                # the selector lattice / DSpark's confidences come back through the unmasked nextn rows, one per block token
                llama_ext.set_embeddings_nextn(self._ctx, True, False)
            self._batch = capi.llama_batch_ext_init(self._ctx)
            self._context = None
            if self._gather is not None:
                self._context = SharedDraftContext(self._ctx, self._batch, self.mask_token_id, self.is_dflash2)
                self._gather.drafter_context = self._context
                self._gather.serve(Stage.INJECT, self._context.inject, self._context.joins_inject)
                self._gather.serve(Stage.DRAFT, self._context.draft, self._context.joins_draft)
        self._mem = capi.llama_get_memory(self._ctx)
        # positions of one sequence (a shared context holds every sequence's, unified)
        self.n_ctx = capi.llama_n_ctx(self._ctx) if self._gather is None else target.n_ctx_seq
        self.n_ubatch = capi.llama_n_ubatch(self._ctx)

    # -- KV cache injection ----------------------------------------------------------------
    def inject(self, features: np.ndarray, positions: int) -> None:
        """Write K/V for target features at positions `positions`.. (an embd batch per n_ubatch chunk)."""
        self._check_open()
        feats = np.ascontiguousarray(features, dtype=np.float32)
        if feats.ndim != 2 or feats.shape[1] != self.n_features:
            raise ValueError(f"features must have shape (n, {self.n_features}), got {feats.shape}")
        n = feats.shape[0]
        if n == 0:
            return
        start = int(positions)
        if start < 0 or start + n > self.n_ctx:
            raise ValueError(f"positions [{start}, {start + n}) outside the drafter context of {self.n_ctx}")
        if self._gather is not None:
            self._gather.submit(self.seq, Stage.INJECT, n, 0, (feats, start))
            return
        row_bytes = self.n_features * 4
        base = feats.ctypes.data
        for off in range(0, n, self.n_ubatch):
            capi.llama_batch_ext_clear(self._batch)
            for i in range(off, min(n, off + self.n_ubatch)):
                embd = capi.llama_embd(ctypes.cast(base + i * row_bytes, ctypes.POINTER(ctypes.c_float)), 1, self.n_features)
                idx = capi.llama_batch_ext_add_embd(self._batch, 0, embd)
                if idx < 0:
                    raise RuntimeError(f"could not add feature row {i} to the drafter batch ({idx})")
                self._set_pos(idx, start + i)
            self._process("inject features")

    def _set_pos(self, idx: int, pos: int) -> None:
        self._pos[0] = self._pos[1] = self._pos[2] = pos
        capi.llama_batch_ext_set_pos(self._batch, idx, self._pos)

    def _process(self, what: str) -> None:
        rc = capi.llama_process(self._ctx, capi.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise RuntimeError(f"drafter llama_process failed to {what} (code {rc})")

    # -- drafting --------------------------------------------------------------------------
    def draft(self, last_token: int, pos: int, n_draft: int) -> np.ndarray:
        """One non-causal pass over [last, mask x n_draft] at positions pos..; the noise K/V is dropped after.

        Returns a view valid until the next drafter call: DFlash -> logits (n_draft, V) of slots 1..n_draft;
        DFlash2 -> selector lattice rows (n_draft, n_embd) of those slots; DSpark -> the Markov-biased logits
        of its n_draft prediction slots (anchor-first: [last, mask x (n_draft - 1)], slots 0..n_draft-1;
        bonus anchor: as DFlash), with `last_confidences` set from its confidence head (else None).
        """
        self._check_open()
        lead = self._lead
        if not 1 <= n_draft <= self.max_draft:
            raise ValueError(f"n_draft must be in [1, {self.max_draft}] for block size {self.block_size}, got {n_draft}")
        if not 0 <= last_token < self.n_vocab:
            raise ValueError(f"token id must be in [0, {self.n_vocab}), got {last_token}")
        n_block = n_draft + lead
        if pos < 0 or pos + n_block > self.n_ctx:
            raise ValueError(f"block [{pos}, {pos + n_block}) outside the drafter context of {self.n_ctx}")
        self.last_confidences = None
        if self._gather is not None:
            done = self._gather.submit(self.seq, Stage.DRAFT, n_block, n_block, (last_token, pos))
            row, out = done.row, done.out
        else:
            row = out = 0
            capi.llama_batch_ext_clear(self._batch)
            _add_block(self._batch, 0, last_token, pos, n_block, self.mask_token_id, self.is_dflash2, self._pos)
            try:
                self._process("draft a block")
            finally:
                capi.llama_memory_seq_rm(self._mem, 0, pos, -1)
        if self.is_dflash2:
            ptr = llama_ext.get_embeddings_nextn(self._ctx)
            if not ptr:
                raise RuntimeError("DFlash2 selector produced no lattice")
            return np.ctypeslib.as_array(ptr, shape=(row + n_draft + 1, self.n_embd))[row + 1 :]
        logits = np.ctypeslib.as_array(capi.llama_get_logits(self._ctx), shape=(out + n_block, self.n_vocab))[out + lead :]
        if self.has_confidence_head:
            ptr = llama_ext.get_embeddings_nextn(self._ctx)
            if not ptr:
                raise RuntimeError("DSpark confidence head produced no output")
            # each confidence is broadcast across an n_embd-wide row (dflash.cpp reuses the nextn output)
            self.last_confidences = np.ctypeslib.as_array(ptr, shape=(row + n_block, self.n_embd))[row + lead :, 0].copy()
        if self.is_dspark:
            return logits  # the Markov chain needs the untransformed rows; propose() applies the transforms
        return self.output_transforms(logits)

    def output_transforms(self, logits: np.ndarray) -> np.ndarray:
        """DFlash1's graph leaves the z-lab output_multiplier and softcap to the reader (dflash.cpp)."""
        if self._logit_scale:
            logits = logits * self._logit_scale
        if self._softcap > 0:
            logits = np.tanh(logits / self._softcap) * self._softcap
        return logits

    def propose(
        self, last_token: int, pos: int, n_draft: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """Draft n_draft tokens after last_token: argmax when greedy, else sampled with the q it returns."""
        out = self.draft(last_token, pos, n_draft)
        if self.is_dflash2:
            return self._walk_lattice(out, params, rng)
        if self.is_dspark:
            return self._walk_markov(out, last_token, params, rng)
        if params.greedy:
            return Proposal(tokens=out.argmax(axis=1))
        q = probabilities(out, params)
        return Proposal(tokens=np.array([sample_token(row, rng) for row in q]), q=q)

    def _walk_markov(
        self, rows: np.ndarray, last_token: int, params: SamplingParams, rng: np.random.Generator
    ) -> Proposal:
        """DSpark: the graph chained each slot's Markov bias on the previous slot's argmax (the anchor first).

        Greedy drafts are that chain. A sampled draft re-conditions each slot on the token actually drawn
        before it (DeepSpec's semantics), and the row it is then drawn from is the q it reports, so rejection
        sampling sees exactly the proposal used. Confidences are rescored the same way.
        """
        conf = self.last_confidences
        if params.greedy:
            tokens = rows.argmax(axis=1)
            return Proposal(tokens=tokens, confidences=None if conf is None else conf.copy())
        head = self.markov
        n = rows.shape[0]
        tokens = np.empty(n, dtype=np.int64)
        q = np.empty((n, self.n_vocab), dtype=np.float64)
        confidences = None if conf is None else np.empty(n, dtype=np.float64)
        graph_prev = prev = int(last_token)
        for i in range(n):
            row = head.correct(rows[i], graph_prev, prev)
            if confidences is not None:
                confidences[i] = head.correct_confidence(conf[i], graph_prev, prev)
            q[i] = probabilities(self.output_transforms(row[None]), params)[0]
            tokens[i] = sample_token(q[i], rng)
            graph_prev, prev = int(rows[i].argmax()), int(tokens[i])
        return Proposal(tokens=tokens, q=q, confidences=confidences)

    def _walk_lattice(self, lattice: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> Proposal:
        """DFlash2: pick one candidate per slot given the previous pick, as upstream decodes the lattice."""
        k = self.selector_top_k
        n = lattice.shape[0]
        ids = lattice[:, :k].astype(np.int64)
        tokens = np.empty(n, dtype=np.int64)
        q = None if params.greedy else np.empty((n, k), dtype=np.float64)
        prev = 0
        for i in range(n):
            scores = lattice[i, k + prev * k : k + (prev + 1) * k].astype(np.float64)
            if q is None:
                prev = int(scores.argmax())
            else:
                z = scores / params.temperature
                p = np.exp(z - z.max())
                q[i] = p / p.sum()
                prev = sample_token(q[i], rng)
            tokens[i] = ids[i, prev]
        return Proposal(tokens=tokens, q=q, q_ids=None if q is None else ids)

    # -- cache management ------------------------------------------------------------------
    def _native(self) -> Any:
        """Held around a C call on the drafter context: the gather's lock where sequences share it."""
        return nullcontext() if self._gather is None else self._gather.native()

    def remove(self, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) from the drafter KV cache."""
        self._check_open()
        with self._native():
            if not capi.llama_memory_seq_rm(self._mem, self.seq, p0, p1):
                raise RuntimeError(f"drafter llama_memory_seq_rm([{p0}, {p1})) failed")

    def pos_max(self) -> int:
        self._check_open()
        with self._native():
            return int(capi.llama_memory_seq_pos_max(self._mem, self.seq))

    def clear(self) -> None:
        self._check_open()
        if self._gather is not None:
            self.remove(0, -1)  # this sequence's cells only
            return
        capi.llama_memory_clear(self._mem, True)

    def save_state(self) -> bytes:
        """The drafter's KV cache (the injected target features' K/V), as llama_state_seq bytes."""
        self._check_open()
        with self._native():
            return state_seq_get(self._ctx, self.seq)

    def load_state(self, data: bytes) -> None:
        """Replace the drafter's KV cache with what save_state returned on a drafter like this one.

        RuntimeError when libllama refuses it; the cache is then empty.
        """
        self._check_open()
        with self._native():
            try:
                state_seq_set(self._ctx, data, self.seq)
            except RuntimeError:
                capi.llama_memory_seq_rm(self._mem, self.seq, 0, -1)
                raise

    def close(self) -> None:
        """Free batch, context and this drafter's share of the model; a second call does nothing.

        The target stays open; the model is freed with its last user (a fork keeps it alive). A drafter
        context shared by sequences goes with its last user; a sequence's cells go with it.
        """
        batch, ctx, model = getattr(self, "_batch", None), self._ctx, getattr(self, "_model", None)
        context: SharedDraftContext | None = getattr(self, "_context", None)
        mem, seq = getattr(self, "_mem", None), getattr(self, "seq", 0)
        self._batch = self._ctx = self._model = self._mem = None  # first, so no entry reaches freed memory
        if context is not None:
            with self._native():
                if ctx is not None:
                    capi.llama_memory_seq_rm(mem, seq, 0, -1)
                context.users -= 1
                last = context.users == 0
            if last:
                self._gather.drafter_context = None
            else:
                batch = ctx = None  # others still draft in it
        if batch:
            capi.llama_batch_ext_free(batch)
        if ctx is not None:
            capi.llama_free(ctx)
        if model:
            self._shared.release()


def _add_block(batch: Any, seq: int, last_token: int, pos: int, n_block: int, mask_token: int, lattice: bool,
               pos_buf: Any) -> None:
    """[last, mask x (n_block - 1)] of one sequence at positions pos.. into an ext batch; logits for every slot
    (DFlash2 reads its lattice from the nextn rows instead)."""
    for i in range(n_block):
        idx = capi.llama_batch_ext_add_token(batch, seq, last_token if i == 0 else mask_token)
        if idx < 0:
            raise RuntimeError(f"could not add block slot {i} to the drafter batch ({idx})")
        pos_buf[0] = pos_buf[1] = pos_buf[2] = pos + i
        capi.llama_batch_ext_set_pos(batch, idx, pos_buf)
        capi.llama_batch_ext_set_output_logits(batch, idx, not lattice)


class SharedDraftContext:
    """One drafter context for every sequence of a shared target context (issue 37): the runners of the
    gather's DRAFT and INJECT stages, which put every sequence's block, or feature rows, in one pass."""

    def __init__(self, ctx: Any, batch: Any, mask_token: int, lattice: bool) -> None:
        self.ctx, self.batch, self.mask_token, self.lattice = ctx, batch, mask_token, lattice
        self.mem = capi.llama_get_memory(ctx)
        self.n_ubatch = capi.llama_n_ubatch(ctx)
        self.users = 1
        self._pos = (capi.llama_pos * 4)()

    def joins_draft(self, taken: list[Request], r: Request) -> bool:
        """A non-causal block must not be cut across micro-batches: all blocks of a pass fit one."""
        return sum(t.n for t in taken) + r.n <= self.n_ubatch

    @staticmethod
    def joins_inject(taken: list[Request], r: Request) -> bool:
        return True  # feature rows are cut into micro-batches anyway

    def draft(self, requests: list[Request]) -> None:
        capi.llama_batch_ext_clear(self.batch)
        row = 0
        for r in requests:
            last, pos = r.payload
            _add_block(self.batch, r.seq, last, pos, r.n, self.mask_token, self.lattice, self._pos)
            r.row = r.out = row  # every slot has an output row (logits, or the nextn row of a lattice)
            row += r.n
        try:
            rc = capi.llama_process(self.ctx, capi.LLAMA_PROCESS_TYPE_DECODE, self.batch)
            if rc != 0:
                raise RuntimeError(f"drafter llama_process failed to draft {len(requests)} blocks (code {rc})")
            settle_outputs(self.ctx)  # the sequences read their rows at once: sorted here, once
        finally:
            for r in requests:  # the noise K/V goes, every sequence's
                capi.llama_memory_seq_rm(self.mem, r.seq, r.payload[1], -1)

    def inject(self, requests: list[Request]) -> None:
        rows = [(r.seq, feats, start, i) for r in requests for feats, start in [r.payload] for i in range(r.n)]
        for off in range(0, len(rows), self.n_ubatch):
            capi.llama_batch_ext_clear(self.batch)
            for seq, feats, start, i in rows[off : off + self.n_ubatch]:
                row_ptr = ctypes.cast(feats.ctypes.data + i * feats.shape[1] * 4, ctypes.POINTER(ctypes.c_float))
                idx = capi.llama_batch_ext_add_embd(self.batch, seq, capi.llama_embd(row_ptr, 1, feats.shape[1]))
                if idx < 0:
                    raise RuntimeError(f"could not add feature row {i} to the drafter batch ({idx})")
                self._pos[0] = self._pos[1] = self._pos[2] = start + i
                capi.llama_batch_ext_set_pos(self.batch, idx, self._pos)
            rc = capi.llama_process(self.ctx, capi.LLAMA_PROCESS_TYPE_DECODE, self.batch)
            if rc != 0:
                raise RuntimeError(f"drafter llama_process failed to inject features (code {rc})")
