"""MTP heads as a draft source: the multi-token-prediction block a model ships, run by libllama's MTP context.

Upstream llama.cpp's driver (`common/speculative.cpp`, `common_speculative_impl_draft_mtp`) is the
reference, and `scripts/mtp_oracle.cpp` runs it: this source drafts the same tokens on the same context
(tests/test_mtp.py). The protocol, for one trained head (qwen35, qwen35moe, qwen3next, glm4_moe, ...):

- The target outputs, for every batch row, its last hidden state `h` (nextn rows, unmasked).
- The MTP context holds one KV entry per committed position p, computed from token x_p and h_{p-1}: each
  committed token is paired with the target's row one before it, the first token of a batch with the last
  row of the previous batch (the cross-batch carry).
- A draft after `last` at n_past decodes [last @ n_past, carry h_{n_past-1}], takes the argmax d1, then
  [d1 @ n_past+1, the head's own nextn row] for d2, and so on; afterwards the draft positions are removed
  from the MTP context (upstream removes them after every draft), so a verify's rejected tokens never
  reach it: only committed tokens are processed.

Upstream processes every target batch as it is decoded; here committed tokens wait (with their rows) and
are processed in one batch before the head next drafts, so plain cycles cost no MTP pass. At the end of a
prefill or a generation (`finish`) they are processed while the policy takes the head's offers; once it has
declined SET_ASIDE_AFTER in a row, they wait: a head set aside costs no pass for turns it never drafts in,
resets and cut follow-ups, and it offers nothing for a quiet spell (QUIET_CYCLES commits, doubling on every
offer declined again, up to QUIET_MAX), so the policy does not price it every cycle. It then holds at most
2 x MAX_WAITING waiting rows: past that the oldest are dropped, their positions held with no MTP state
(drafts then see less of the distant past, upstream's see it all; the output is the same).
Chained heads (step35: n trained heads, head i drafting token i + 1) follow upstream's driver too: every
head processes the committed positions, and draft step i re-decodes the draft prefix under head i (MTPHeads).
The shared-memory layout (gemma4's assistant, a heads model of its own reading the target's KV) processes
nothing and drafts every token at pos0, as upstream's driver does.
On a sequence of a shared target context (batching.SharedContext) the sequences share one MTP context, a
KV stream each, and its decodes are gathered with theirs (Stage.MTP), as upstream's driver batches them.
The prompt cache stores the whole state (`snapshot`: carry, waiting tokens and rows, the context's KV).
Greedy drafts are the head's argmax (as upstream's, whose drafts are its top token whatever the sampling);
sampled ones are drawn from the head's own distribution under the request's sampling settings, and
rejection sampling against it keeps the output exactly the target's.
"""

from __future__ import annotations

import ctypes
import os
import struct
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, Union

import numpy as np

from . import llama_ext
from .acceptance import AcceptanceProfile
from .batching import Request, SequenceTarget, SharedContext, Stage
from .lookup import MATCH_BUCKETS, lookup_profile
from .sampling import SamplingParams, probabilities, sample_token
from .sources import Candidate, Commit, DraftSource, Offer
from .schema import ARCH, Keys
from .target import (FeatureRows, NativeResource, SharedModel, Target, load_model, meta_str, new_context, state_seq_get,
                     state_seq_set)
from .target_gguf import field_value, open_gguf

MTP_SOURCE = "mtp"
DEFAULT_MAX_DRAFT = 3  # upstream's default draft n_max; one head chained on its own output rarely passes deeper
PRIOR_ACCEPTANCE = 0.6  # P(an MTP draft passes) before any evidence: a guess high enough that a head is tried;
# the commits' evidence replaces it (decayed counts, its AcceptanceProfile)
_DEPTH0 = MATCH_BUCKETS[0]  # its profile learns per bucket of this "length": draft slot j is learnt at _DEPTH0 + j
# committed tokens wait (with their rows) until the head next drafts; past twice this many, the oldest are dropped
# down to this many, held with no MTP state (see MTPSource): a head the policy has set aside costs no pass
MAX_WAITING = 1024
SET_ASIDE_AFTER = 16  # offers the policy declined in a row after which the head counts as set aside (see finish)
# a head set aside offers again only after this many cycles, twice as many after every offer declined again,
# up to QUIET_MAX: pricing an offer the policy keeps declining was most of what an idle head cost a cycle
QUIET_CYCLES, QUIET_MAX = 32, 256
_COUNT = struct.Struct("<I")  # a snapshot's count of waiting tokens


def mtp_unusable_reason(target: Target) -> str | None:
    """Why this target's MTP heads cannot draft here, or None when they can."""
    if target.n_mtp_heads == 0:
        return "the target has no MTP heads loaded (none in the GGUF, or opened without load_mtp)"
    return _heads_reason()


def _heads_reason() -> str | None:
    if not llama_ext.mtp_api_present():
        return "this libllama lacks the nextn calls (llama_get_embeddings_nextn_ith, llama_set_nextn_layer_offset)"
    return None


def is_heads_file(path: str | os.PathLike[str]) -> bool:
    """Whether a GGUF given where a drafter is accepted holds MTP heads (read from its header, not its name):
    a model of any architecture but a DFlash drafter's that declares nextn layers, as upstream's converter
    writes them apart with --mtp (`mtp-*.gguf`: the heads, the embedding, the output norm and head) and as
    gemma4's assistant ships. A file that cannot be read is not: the drafter's loader then says why."""
    try:
        reader = open_gguf(Path(path))
    except (ValueError, OSError):
        return False
    arch = field_value(reader, Keys.ARCHITECTURE)
    if not isinstance(arch, str) or arch == ARCH:
        return False
    n = field_value(reader, f"{arch}.nextn_predict_layers")
    return isinstance(n, (int, np.integer)) and n > 0


def _load_heads(path: str | os.PathLike[str], target: Target) -> SharedModel:
    """An MTP heads file loaded for this target, or ValueError saying why it does not fit it."""
    model = load_model(path, n_gpu_layers=target.n_gpu_layers, load_mtp=True)
    shared = SharedModel(model, owned=True)
    arch = meta_str(model, Keys.ARCHITECTURE) or ""
    n_heads, n_vocab, n_embd = llama_ext.model_mtp_shape(model)
    target_embd = llama_ext.model_mtp_shape(target.model)[2]
    reason = (f"it is a {arch or 'GGUF without an architecture'}, the target a {target.architecture}"
              if ASSISTANT_OF.get(arch, arch) != target.architecture else
              "it holds no MTP heads" if n_heads == 0 else
              f"its vocabulary has {n_vocab} tokens, the target's {target.n_vocab}" if n_vocab != target.n_vocab else
              f"its rows are {n_embd} wide, the target's {target_embd}" if n_embd != target_embd else
              _heads_reason())
    if reason is not None:
        shared.release()
        raise ValueError(f"{path}: not MTP heads for this target: {reason}")
    return shared


class HeadsFile:
    """MTP heads shipped apart from their target (`mtp-*.gguf`, gemma4's assistant), loaded once and checked
    against it. A Session given one as its drafter drafts with these heads instead of the target's own;
    Sessions forked from it share the loaded weights (`fork`, as a Drafter's), each MTP context a share."""

    def __init__(self, path: str, model: SharedModel) -> None:
        self.path, self.model = path, model

    @classmethod
    def open(cls, path: str | os.PathLike[str], target: Target) -> "HeadsFile":
        """ValueError where the file is no MTP heads for this target (another architecture, vocabulary, width)."""
        return cls(os.fspath(path), _load_heads(path, target))

    def fork(self, target: Target) -> "HeadsFile":
        """Another share of the same loaded heads, for a Session forked onto `target` (the same model)."""
        return HeadsFile(self.path, self.model.share())

    def close(self) -> None:
        self.model.release()


# which heads draft: the target's own (None), a heads file's path, or a heads file loaded
Heads = Union[str, "os.PathLike[str]", HeadsFile, None]


def _heads_path(heads: Heads) -> str | None:
    return None if heads is None else heads.path if isinstance(heads, HeadsFile) else os.fspath(heads)


# heads shipped as a model of their own architecture, and the target architecture whose KV they read
ASSISTANT_OF = {"gemma4-assistant": "gemma4"}
Row = tuple[int, int, int]  # (token, position, address of the hidden-state row it is paired with)


class _HeadsContext:
    """An MTP context and the model share it runs on, with its users: one per target context, or one for
    every sequence of a shared target context (issue 37), each sequence a sequence of it. As the gather's
    runner of Stage.MTP it decodes every sequence's rows of one head in one pass."""

    def __init__(self, model: SharedModel, ctx: llama_ext.MTPContext, heads: str | None, n_heads: int,
                 mem_shared: bool) -> None:
        self.model, self.ctx, self.heads, self.n_heads, self.mem_shared = model, ctx, heads, n_heads, mem_shared
        self.n_batch = ctx.n_batch
        self.users = 1

    @staticmethod
    def open(target: Target, heads: Heads, n_threads: int | None,
             n_seq: int) -> "_HeadsContext":
        if heads is None:
            reason = mtp_unusable_reason(target)
            if reason is not None:
                raise ValueError(f"cannot draft with MTP heads: {reason}")
            model = target.shared_model()
        else:
            model = heads.model.share() if isinstance(heads, HeadsFile) else _load_heads(heads, target)
        try:
            # one KV stream per sequence (not unified): each keeps its cells in its own order, as alone, which
            # chained heads' per-head KV relies on (see MTPHeads.process)
            ctx = new_context(
                model.ptr, n_ctx=target.n_ctx_seq * n_seq, n_batch=target.n_batch, n_seq_max=n_seq,
                n_threads=target.n_threads if n_threads is None else n_threads, flash_attn=target.flash_attn,
                ctx_other=target.ctx, ctx_type=llama_ext.CONTEXT_TYPE_MTP,
            )
            n_heads, n_vocab, n_embd = llama_ext.model_mtp_shape(model.ptr)
            return _HeadsContext(model, llama_ext.MTPContext(ctx, n_embd, n_vocab),
                                 _heads_path(heads), n_heads,
                                 llama_ext.shares_memory_with(ctx, target.ctx))
        except BaseException:
            model.release()
            raise

    def joins(self, taken: list[Request], r: Request) -> bool:
        """Rows of one head, as many as one batch holds."""
        return r.payload[1] == taken[0].payload[1] and sum(t.n for t in taken) + r.n <= self.n_batch

    def run(self, requests: list[Request]) -> None:
        """One decode of every request's rows (payload: rows, head, forget-from, whether the last is an output),
        after forgetting each sequence's positions from where it asks."""
        c = self.ctx
        for r in requests:
            if r.payload[2] is not None:
                c.remove(r.payload[2], r.seq)
        c.set_head(requests[0].payload[1])
        c.clear()
        for r in requests:
            rows, _, _, output = r.payload
            r.row = r.out = c.add(*rows[0], output and len(rows) == 1, r.seq)
            for k in range(1, len(rows)):
                c.add(*rows[k], output and k == len(rows) - 1, r.seq)
        c.decode(settle=True)  # the sequences read their rows at once: sorted here, once

    def release(self) -> bool:
        """One user fewer; the last frees the context and its model share (True)."""
        self.users -= 1
        if self.users:
            return False
        self.ctx.free()
        self.model.release()
        return True


class MTPHeads(NativeResource):
    """libllama's MTP context on a target's model (or on a heads file shipped apart from it, `heads`): its own
    KV cache of the heads' attention layers, fed the target's rows. On a sequence of a shared target context
    the sequences share one MTP context, a sequence of it each, and their decodes are gathered (Stage.MTP).

    `process` adds committed positions (token + the target's row before it), `draft` runs the heads
    autoregressively after `last` and removes what it added. Chained heads (step35: n_heads trained heads,
    head i drafting token i + 1) are driven as upstream's driver drives them: every head processes the
    committed positions (its own layer's KV), and draft step i re-decodes the whole draft prefix under head i.
    The shared-memory layout (gemma4's assistant, `mem_shared`) attends to the target's KV: it processes
    nothing, and every draft step is at pos0.
    """

    def __init__(self, target: Target, *, heads: Heads = None, n_threads: int | None = None) -> None:
        self._gather: SharedContext | None = target.shared if isinstance(target, SequenceTarget) else None
        self.seq = 0 if self._gather is None else target.seq_id
        with nullcontext() if self._gather is None else self._gather.setup:  # one context, however many ask
            context = self._join_shared(heads) if self._gather is not None else None
            if context is None:
                context = _HeadsContext.open(target, heads, n_threads, 1 if self._gather is None else
                                             self._gather.n_sequences)
                if self._gather is not None:
                    self._gather.mtp_context = context
                    self._gather.serve(Stage.MTP, context.run, context.joins)
        self._ctx: _HeadsContext | None = context
        self.path = context.heads  # the heads file's, None for the target's own
        self.n_embd, self.n_vocab, self.n_heads = context.ctx.n_embd, context.ctx.n_vocab, context.n_heads
        # the shared-memory layout (gemma4's assistant): its layers attend to the target's own KV, so it keeps
        # no positions of its own (nothing to process), and all its layers run in one graph
        self.mem_shared = context.mem_shared
        self.chained = self.n_heads > 1 and not self.mem_shared
        self.n_batch = target.n_batch
        self._chain = np.zeros((2, self.n_embd), np.float32)  # draft step rows: the carry, then the heads' own
        target.output_nextn()

    def _join_shared(self, heads: Heads) -> _HeadsContext | None:
        """The MTP context the shared target's sequences already draft in, now this one's too (None: none yet)."""
        context = self._gather.mtp_context
        if context is None:
            return None
        wanted = _heads_path(heads)
        if context.heads != wanted:
            own = "the target's own"
            raise ValueError(f"the shared context's MTP heads are {context.heads or own}, not {wanted or own}")
        with self._native():
            context.users += 1
        return context

    def _native(self) -> Any:
        """Held around a C call on the MTP context: the gather's lock where sequences share it."""
        return nullcontext() if self._gather is None else self._gather.native()

    def _live(self) -> llama_ext.MTPContext:
        if self._ctx is None:
            raise self._closed_error()
        return self._ctx.ctx

    def _decode(self, rows: list[Row], head: int, forget: int | None, output: bool) -> int:
        """Decode this sequence's rows under `head` after forgetting its positions >= forget (None: none);
        returns the batch index of the last row (an output when `output`)."""
        c = self._live()
        if self._gather is not None:
            return self._gather.submit(self.seq, Stage.MTP, len(rows), int(output), (rows, head, forget, output)).row \
                + len(rows) - 1
        if forget is not None:
            c.remove(forget)
        c.set_head(head)
        c.clear()
        for k, row in enumerate(rows):
            c.add(*row, output and k == len(rows) - 1)
        c.decode()
        return len(rows) - 1

    def process(self, tokens: list[int], start: int, rows: np.ndarray) -> None:
        """KV entries for tokens at positions start.., token i paired with rows[i] (the target's h one before).
        Chained heads: each head in turn, after forgetting the positions from `start` (as upstream's driver:
        the cells come back in the same order, so each head's layer keeps what the head before it wrote)."""
        if self.mem_shared:
            return  # its attention reads the target's KV, which already holds them
        base, stride = rows.ctypes.data, self.n_embd * 4
        for head in range(self.n_heads):
            for lo in range(0, len(tokens), self.n_batch):
                hi = min(lo + self.n_batch, len(tokens))
                batch = [(tokens[i], start + i, base + i * stride) for i in range(lo, hi)]
                self._decode(batch, head, start if self.chained and lo == 0 else None, False)

    def draft(self, last: int, n_past: int, carry: int, n: int,
              pick: Callable[[int, np.ndarray], int] | None = None) -> list[int]:
        """n drafts after `last` at n_past, whose target row before is at address `carry`; the context keeps
        none. Each is the argmax of the head's logits, or pick(i, logits) (a view, valid during the call).
        Chained heads draft at most n_heads (draft i is head i's)."""
        c = self._live()
        if self.chained:
            n = min(n, self.n_heads)
        if self._chain.shape[0] < n + 1:
            self._chain = np.zeros((n + 1, self.n_embd), np.float32)
        chain, stride = self._chain.ctypes.data, self.n_embd * 4
        out: list[int] = []
        rows: list[Row] = [(int(last), n_past, carry)]
        try:
            for i in range(n):
                if self.chained:  # head i re-decodes the whole prefix: its layer holds no draft position yet
                    idx = self._decode(rows, i, n_past, True)
                else:
                    idx = self._decode(rows[-1:], 0, None, True)
                row = c.logits(idx)
                token = int(row.argmax()) if pick is None else pick(i, row)
                out.append(token)
                if i + 1 < n:  # the head's own row, copied: the next decode may overwrite its buffer
                    ctypes.memmove(chain + (i + 1) * stride, c.nextn_row(idx), stride)
                    # the shared-memory layout drafts every token at pos0 (upstream's driver, as gemma4's
                    # assistant was trained): its attention sees the target's positions before it only
                    rows.append((token, n_past if self.mem_shared else n_past + i + 1, chain + (i + 1) * stride))
        finally:
            with self._native():
                c.remove(n_past, self.seq)
        return out

    def remove(self, n: int) -> None:
        """Forget positions >= n."""
        c = self._live()
        with self._native():
            c.remove(n, self.seq)

    def pos_max(self) -> int:
        """The highest position the context holds (-1: none)."""
        c = self._live()
        with self._native():
            return c.pos_max(self.seq)

    def save_state(self) -> bytes:
        """The MTP context's KV (every position it holds), as llama_state_seq bytes (none where the heads read
        the target's KV: the target's own state holds it)."""
        c = self._live()
        if self.mem_shared:
            return b""
        with self._native():
            return state_seq_get(c.ctx, self.seq)

    def load_state(self, data: bytes, n: int) -> None:
        """Replace the MTP context's KV with save_state's bytes of positions below n (some may be holes);
        RuntimeError when libllama refuses them or they reach past n, ValueError for bytes that are no state
        (the context is then empty either way)."""
        c = self._live()
        if self.mem_shared:
            if data:
                raise ValueError(f"heads that read the target's KV hold no state, got {len(data)} bytes")
            return
        with self._native():
            try:
                state_seq_set(c.ctx, data, self.seq)
                if c.pos_max(self.seq) + 1 > n:
                    raise RuntimeError(f"the MTP context holds positions up to {c.pos_max(self.seq)} after "
                                       f"restoring {n}")
            except BaseException:
                c.clear_memory(self.seq)
                raise

    def close(self) -> None:
        context, self._ctx = self._ctx, None
        if context is None:
            return
        if self._gather is None:
            context.release()
            return
        with self._native():
            if not self._gather.owner.closed:
                context.ctx.remove(0, self.seq)
            if context.release():
                self._gather.mtp_context = None


class MTPSource(DraftSource):
    """A model's own MTP head as a draft source (see the module's docstring for the protocol).

    Its acceptance is learnt per draft slot from the commits (`stats`), and `offer` says what each length
    is expected to commit for the policy to price against the other sources and plain decoding.
    """

    name = MTP_SOURCE
    needs_features = False
    state_part = "mtp"  # snapshot(): the carry, the waiting tokens and rows, the MTP context's KV

    def __init__(self, target: Target, *, heads: Heads = None, max_draft: int = DEFAULT_MAX_DRAFT,
                 n_threads: int | None = None, stats: AcceptanceProfile | None = None) -> None:
        """heads: MTP heads shipped apart from the target (`mtp-*.gguf`, gemma4's assistant: a path or a
        HeadsFile), None for the target's own, loaded with it."""
        if not isinstance(max_draft, int) or isinstance(max_draft, bool) or max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1, got {max_draft!r}")
        self.heads = MTPHeads(target, heads=heads, n_threads=n_threads)
        self.target = target
        self.max_draft = min(max_draft, target.n_batch - 1, self.heads.n_heads if self.heads.chained else max_draft)
        self.stats = stats or lookup_profile(prior=PRIOR_ACCEPTANCE)
        self._n = 0  # positions the MTP context holds, or dropped while waiting (held with no state)
        self._tokens: list[int] = []  # committed since, positions _n.., waiting for the next draft
        # the target row each waiting token is paired with (the one before it), then the carry: the target's
        # row of the last committed token, which the next one pairs with. A commit appends its rows (one copy)
        self._rows = FeatureRows(self.heads.n_embd)
        self._rows.extend(np.zeros((1, self.heads.n_embd), np.float32))
        self._stride = self.heads.n_embd * 4  # bytes per row
        self._proposed: tuple[int, list[int]] | None = None  # (n_past, tokens) of the last proposal
        self._offered = False  # whether it offered since the last commit
        self._declined = 0  # offers the policy declined since it last took one
        self._quiet = 0  # cycles left before it offers again (set aside)
        self._quiet_next = QUIET_CYCLES  # how many the next quiet spell lasts
        self._offer = Offer(self.name, 0)  # the last offer, reused until n_max or what was learnt changes

    def described(self) -> dict[str, Any]:
        """What drafts (dflash-doctor's report): how many heads and how they are driven, from which file."""
        h = self.heads
        layout = "shared-memory" if h.mem_shared else "chained" if h.chained else "one"
        return {"heads": h.n_heads, "layout": layout, "max_draft": self.max_draft, "file": h.path}

    def cached(self) -> int:
        return self._n + len(self._tokens)

    def truncate(self, n: int) -> None:
        """Forget positions >= n. Cut inside the waiting tokens, the carry is the row the cut token was paired
        with (exact); cut below them it stays the last one seen, as in upstream's driver (a prompt sharing
        only a prefix pairs its first new token with a row from the end of the previous turn)."""
        self._proposed = None
        if n >= self.cached():
            return
        waiting = n - self._n
        if waiting >= 0:
            del self._tokens[waiting:]
            self._keep_rows(0, waiting + 1)  # row `waiting`, the cut token's pair, is the carry now
            return
        self._tokens.clear()
        self._keep_rows(-1, None)
        self.heads.remove(n)
        self._n = n

    def available(self, last: int, n_past: int) -> int:
        """Nothing while quiet (set aside: see observe), else up to max_draft."""
        return 0 if self._quiet else self.max_draft

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        self._offered = True
        if self._offer.n_max != n_max:
            self._offer = Offer(self.name, n_max, self.stats.expected_tokens(_DEPTH0, min(n_max, self.max_draft)))
        return self._offer

    def propose(
        self, last: int, n_past: int, n_draft: int, params: SamplingParams, rng: np.random.Generator
    ) -> Candidate:
        self._catch_up()
        n_draft = min(n_draft, self.max_draft)
        if n_past != self._n:
            raise RuntimeError(f"MTP context holds {self._n} positions, the loop is at {n_past}")
        if params.greedy:
            tokens = self.heads.draft(last, n_past, self._carry_address(), n_draft)
            self._proposed = (n_past, tokens)
            return Candidate(self.name, np.asarray(tokens, dtype=np.int64))
        q = np.empty((n_draft, self.heads.n_vocab), dtype=np.float64)

        def pick(i: int, logits: np.ndarray) -> int:
            q[i] = probabilities(logits[None], params)[0]
            return sample_token(q[i], rng)

        tokens = self.heads.draft(last, n_past, self._carry_address(), n_draft, pick)
        self._proposed = (n_past, tokens)
        return Candidate(self.name, np.asarray(tokens, dtype=np.int64), q=q)

    def observe(self, commit: Commit) -> None:
        n = len(commit.tokens)
        if commit.start != self.cached():
            raise RuntimeError(f"MTP source out of order: commit at {commit.start}, source at {self.cached()}")
        if self._proposed is not None and self._proposed[0] == commit.start:
            drafted = self._proposed[1]
            got = commit.tokens[1:]
            k = 0
            while k < min(len(drafted), len(got)) and drafted[k] == got[k]:
                k += 1
            self.stats.observe(_DEPTH0, len(drafted), k)
            self._offer = Offer(self.name, 0)
        if self._proposed is not None:
            self._declined, self._quiet_next = 0, QUIET_CYCLES
        elif self._offered:
            self._declined += 1
            if self._declined >= SET_ASIDE_AFTER:  # set aside: offer again after a quiet spell, doubling
                self._quiet, self._quiet_next = self._quiet_next, min(2 * self._quiet_next, QUIET_MAX)
        elif self._quiet:
            self._quiet -= 1
        self._proposed = None
        self._offered = False
        if self.target.nextn_rows < n:
            raise RuntimeError(f"MTP source told of {n} tokens the target's last decode holds no rows for")
        # token i is paired with the target's row i - 1 of this batch, the first with the carry (the last row
        # held): appending the batch's rows pairs them all and leaves its last row the carry
        ctypes.memmove(self._rows.reserve(n), self.target.nextn_address(n), n * self._stride)
        self._tokens += commit.tokens
        if len(self._tokens) > 2 * MAX_WAITING:
            self._drop_waiting(len(self._tokens) - MAX_WAITING)

    def _drop_waiting(self, k: int) -> None:
        """Hold the k oldest waiting positions with no MTP state. The head attends to what it holds (holes are
        only fewer cells), so drafts after a long streak without one see less of the distant past; lossless."""
        self._keep_rows(k, None)
        del self._tokens[:k]
        self._n += k

    def snapshot(self) -> bytes:
        """Its whole state, for the prompt cache: the carry row, the waiting tokens and their rows, and the MTP
        context's KV. Nothing is processed here: a restore resumes exactly where this source stood."""
        n = len(self._tokens)
        rows = self._rows.view()
        return (rows[-1].tobytes() + _COUNT.pack(n) + np.asarray(self._tokens, np.int32).tobytes()
                + rows[:-1].tobytes() + self.heads.save_state())

    def save_state(self) -> bytes:
        return self.snapshot()

    def restore_state(self, data: bytes | None, commit: Commit) -> None:
        self.restore(data, commit.start + len(commit.tokens))

    def restore(self, data: bytes, n: int) -> None:
        """The state snapshot() returned after n positions: the next commit pairs with the same carry and the
        head attends to the same KV after the same waiting tokens, so it drafts what it would have drafted.
        RuntimeError (ValueError for bytes that are no such state) leaves it holding nothing."""
        self._proposed = None
        self._tokens.clear()
        self._keep_rows(-1, None)  # holding nothing: the carry alone
        self._n = 0
        head = self._stride + _COUNT.size
        count = _COUNT.unpack_from(data, self._stride)[0] if len(data) >= head else -1
        state = head + count * (4 + self._stride)
        if count < 0 or count > n or len(data) < state or (len(data) == state and not self.heads.mem_shared):
            self.heads.remove(0)
            raise ValueError(f"not an MTP state of {n} positions ({len(data)} bytes)")
        self.heads.load_state(data[state:], n - count)
        self._tokens += np.frombuffer(data, np.int32, count, head).tolist()
        self._rows.clear()
        self._rows.extend(np.frombuffer(data, np.float32, count * self.heads.n_embd, head + 4 * count)
                          .reshape(count, self.heads.n_embd))
        self._rows.extend(np.frombuffer(data, np.float32, self.heads.n_embd).reshape(1, -1))  # the carry
        self._n = n - count

    def finish(self) -> None:
        """Process the waiting tokens while the policy takes the head's offers, so the next draft's time (which
        prices the head) is the draft's alone: after a prompt, a first draft would otherwise carry the whole
        prompt's pass. Once it has declined SET_ASIDE_AFTER in a row they wait, and cost nothing unless it
        drafts again."""
        if self._declined < SET_ASIDE_AFTER:
            self._catch_up()

    def _catch_up(self) -> None:
        """Process the waiting tokens: their KV entries, in batches, before the head drafts."""
        if self._tokens:
            self.heads.process(self._tokens, self._n, self._rows.view())
            self._n += len(self._tokens)
            self._tokens.clear()
            self._keep_rows(-1, None)

    def _keep_rows(self, start: int, stop: int | None) -> None:
        """Hold rows[start:stop] only (the carry stays the last row held)."""
        rows = self._rows.view()[start:stop].copy()
        self._rows.clear()
        self._rows.extend(rows)

    def _carry_address(self) -> int:
        """Where the carry is: valid until the next commit or truncation."""
        return self._rows.view()[-1].ctypes.data

    def close(self) -> None:
        """Free the MTP context (before the target's model goes)."""
        self.heads.close()
