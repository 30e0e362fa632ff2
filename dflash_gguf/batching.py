"""One target context for many sequences: the decodes of concurrent generations go out as one llama_decode.

A server with N slots used to give each slot its own context, so N generations decoded side by side in N
small batches. Here the slots are sequences 0..N-1 of one context (a KV stream each), and each slot's
Session holds a `SequenceTarget`: a Target in every respect the decode loop, the memory and the draft
sources see (positions from 0, "sequence 0", its own logits rows and features), whose decodes are handed to
the `SharedContext`. It gathers them: when every generation that is inside a cycle has handed over its rows,
they are decoded together (continuous batching: a generation joins or leaves between cycles, and plain
steps, verify blocks and prefill chunks mix in one batch), and each caller reads its own rows after.

Why gather rather than schedule: every slot keeps running the same `decode_steps` in its own thread, with
its own grammar, sampling, stops, prompt-cache entry and rollback; only the C call is shared.

The rules that keep each sequence's outputs valid:
- a generation is *busy* while one of its cycles runs (`SequenceTarget.cycle()`, held by the Session); the
  gather waits for the busy ones only, so a generation whose consumer is slow (a client reading a stream)
  never holds the others back;
- the last batch's busy participants are *readers* until they hand over their next rows or leave the cycle:
  no batch is decoded while one of them may still read its logits or features (they live in libllama's
  buffers, overwritten by the next decode);
- a busy generation that has not handed over rows for `max_wait_s` (a grammar compiling, a cache file
  loading) is left out of that batch rather than waited for;
- a generation that handed over rows in the cycle it just left is *expected* back for `linger_s`: between two
  cycles its thread hands the Step to its consumer and enters the next one, and a batch that went meanwhile
  would leave it out and cost it (and everyone) a decode of its own; one that does not come back in time is
  no longer waited for;
- every C call on the shared context (decode, KV truncation, state save and load) is made under one lock.

Every batch is decoded by one thread of the context's own, the *decoder*, never by the slot threads that hand
rows over. ggml's CPU backend runs a graph as an OpenMP parallel region, and its barriers between operations are
OpenMP barriers: each thread that has ever decoded keeps its own team of OpenMP workers alive, and once those
outnumber the CPUs libgomp stops spinning at barriers and sleeps on a futex at each of the graph's hundreds
(docs/DESIGN.md, "One thread decodes"; `scripts/measure_batched_decode.py --caller thread` shows it).
"""

from __future__ import annotations

import ctypes
import enum
import threading
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import llama_cpp.llama_cpp as capi
import numpy as np

from . import llama_ext
from .target import ClosedError, Target

DEFAULT_MAX_WAIT_S = 0.05  # what a batch waits, at most, for a busy generation's rows
# what a batch waits, at most, for a generation between two of its cycles. The server's slot threads take
# ~0.2 ms there (hand the Step to the event loop, enter the next cycle) and a few ms when the GIL is contended;
# a batch that leaves one out costs an extra decode (>= 13 ms here), so 10 ms of patience is cheap, and a
# consumer that is slower (a caller iterating a stream by hand) costs the others at most this once per its cycle
DEFAULT_LINGER_S = 0.01
# From this many rows of one sequence on, ggml-cpu's flash attention takes its tiled kernel (GGML_FA_TILE_Q in
# ggml-cpu/common.h) instead of the row-by-row one, and a row's logits move by up to ~1 (docs/DESIGN.md). libllama
# cuts a batch of several sequences into micro-batches of as many rows from each, so a run this long (a prefill
# chunk) is decoded by itself: cut up, its rows would take the other kernel
KERNEL_ROWS = 64


@dataclass
class BatchRecord:
    """One gathered llama_decode: how many sequences, rows and seconds (the server's metrics, batch pricing)."""

    sequences: int
    rows: int
    seconds: float


class PassCosts:
    """What one more pass of a batch costs against one more row, fitted to the shared context's own batches
    of equal runs: seconds ~ a * passes + b * rows, least squares over recent batches (each weighs
    DECAY times the next one's). A pass is a graph run (its fixed cost: launching, weights streamed once, on a
    GPU nearly everything); a row is what the rows add (on this CPU most of it: 16 rows cost 11.5 steps)."""

    DECAY = 0.98

    def __init__(self) -> None:
        self._xx = np.zeros((2, 2))
        self._xy = np.zeros(2)

    def observe(self, ids: list[int], n: int, seconds: float) -> None:
        """A decode of n rows for each of the sorted sequence ids (a batch of unequal runs is cut by run length
        as well, so its passes are not these: not observed)."""
        x = np.array([1.0 + sum(b != a + 1 for a, b in zip(ids, ids[1:])), float(n * len(ids))])
        self._xx = self.DECAY * self._xx + np.outer(x, x)
        self._xy = self.DECAY * self._xy + x * seconds

    def per_pass_and_row(self) -> tuple[float, float] | None:
        """(a, b) in seconds, None until the batches seen tell them apart (one size only, or a negative fit)."""
        if abs(np.linalg.det(self._xx)) < 1e-9 * max(1.0, float(np.trace(self._xx))) ** 2:
            return None
        a, b = np.linalg.solve(self._xx, self._xy)
        return (float(a), float(b)) if a > 0 and b >= 0 else None

    def fill_pays(self, rows: int) -> bool:
        """Whether `rows` more rows cost less than the pass they save; before a fit, where they are one row
        per pass saved (on this CPU a pass costs ~1.5 rows, on a GPU many)."""
        fit = self.per_pass_and_row()
        if fit is None:
            return rows <= 1
        a, b = fit
        return rows * b < a


class Stage(enum.IntEnum):
    """What a gathered request decodes, in the order a cycle needs them: when every busy sequence has handed
    something over, the earliest stage goes first, so that the sequences drafting this cycle reach the target
    batch together with the ones stepping plainly."""

    INJECT = 0  # committed target features into the drafter's KV cache
    DRAFT = 1  # the drafter's block pass
    MTP = 2  # rows of the MTP heads: committed positions, or one draft step (mtp.MTPHeads)
    TARGET = 3  # target rows: a prefill chunk, a plain step, a verify block


# whose buffers a stage writes
_CONTEXT = {Stage.INJECT: "drafter", Stage.DRAFT: "drafter", Stage.MTP: "mtp", Stage.TARGET: "target"}


class Request:
    """One sequence's rows for one stage: what the stage's runner decodes, and where its rows landed."""

    __slots__ = ("seq", "stage", "n", "n_outputs", "payload", "t", "row", "out", "error", "done")

    def __init__(self, seq: int, stage: Stage, n: int, n_outputs: int, payload: Any) -> None:
        self.seq, self.stage, self.n, self.n_outputs, self.payload = seq, stage, n, n_outputs, payload
        self.t = time.monotonic()
        self.row = self.out = 0  # the first batch row and first output row that are this request's
        self.error: BaseException | None = None
        self.done = threading.Event()  # set by the decoder: only this request's thread wakes


@dataclass(frozen=True)
class Filler:
    """n rows of a sequence that is not in the batch, at positions start.. (after its cells), no outputs."""

    seq: int
    start: int
    n: int


Runner = Callable[[list[Request]], None]  # decodes the requests of one stage at once (the gather's lock held)
Joins = Callable[[list[Request], Request], bool]  # whether a request can join those already taken


def settle_outputs(ctx: capi.llama_context_p) -> None:
    """Wait for a decode and put its output rows in batch order now, under the gather's lock.

    libllama computes a batch of several sequences in micro-batches and sorts their logits, nextn rows and layer
    inputs back into batch order on the first read after the decode (llama_context::output_reorder, a cycle sort
    in place). Left to the readers, two sequences reading their rows at once would run that sort together on the
    same buffers (seen: a reader spinning in output_reorder for minutes over a broken permutation); done here it
    is done once, and every later read only reads."""
    capi.llama_get_logits(ctx)


class SharedContext:
    """The owner of one target context with N sequences; hands them out as SequenceTargets and gathers
    their decodes. The context is freed when the last SequenceTarget closes."""

    def __init__(self, owner: Target, *, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 linger_s: float = DEFAULT_LINGER_S) -> None:
        if owner.kv_unified or owner.n_seq_max < 2:
            raise ValueError("a shared context keeps one KV stream per sequence: Target.open(..., n_seq_max=N, "
                             "kv_unified=False) with N >= 2")
        self.owner = owner
        self.n_sequences = owner.n_seq_max
        self.max_wait_s = max_wait_s
        self.linger_s = linger_s
        self.kernel_rows = KERNEL_ROWS
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._free = list(range(self.n_sequences))
        self._open: set[int] = set()
        self._busy: dict[int, int] = {}  # sequence -> cycles it is inside (nested holds count)
        self._handed: set[int] = set()  # busy sequences that have handed over rows in the cycle they are in
        self._expected: dict[int, float] = {}  # sequence -> when it left a cycle in which it handed over rows
        self._readers: dict[str, set[int]] = {name: set() for name in _CONTEXT.values()}  # by whose buffers they read
        self._pending: list[Request] = []
        self._stages: dict[Stage, tuple[Runner, Joins]] = {Stage.TARGET: (self._decode_target, self._joins)}
        self.drafter_context: Any = None  # the drafter context its sequences share (drafter.SharedDraftContext)
        self.mtp_context: Any = None  # the MTP context its sequences share (mtp._HeadsContext)
        self.setup = threading.Lock()  # held while a sequence finds or makes a context its sequences share
        self._stopping = False
        self._decoder = threading.Thread(target=self._decode_batches, name="dflash-decoder", daemon=True)
        self.last: BatchRecord | None = None
        self.batches = 0  # decodes so far
        self.batched_rows = 0  # their rows
        self.shared_batches = 0  # those that held rows of two sequences or more
        self.filler_rows = 0  # rows decoded only to join runs of sequence ids into one pass (_fillers)
        self.passes = PassCosts()
        self.decode_s = 0.0  # their seconds in llama_decode
        self.shared_passes: dict[Stage, int] = {stage: 0 for stage in Stage}  # passes of each stage with 2+ sequences
        self._decoder.start()

    # -- sequences -------------------------------------------------------------------------
    def sequence(self) -> "SequenceTarget":
        """A free sequence of this context as a Target; RuntimeError when all are taken."""
        with self._lock:
            if self.owner.closed:
                raise ClosedError("the shared context is closed")
            if not self._free:
                raise RuntimeError(f"all {self.n_sequences} sequences of the shared context are in use")
            seq = self._free.pop(0)
            self._open.add(seq)
        try:
            return SequenceTarget(self, seq)
        except BaseException:
            self._release(seq)
            raise

    def serve(self, stage: Stage, runner: Runner, joins: Joins) -> None:
        """Gather this stage's requests too (a drafter context shared by the same sequences)."""
        with self._lock:
            self._stages[stage] = (runner, joins)

    def _release(self, seq: int) -> None:
        """A sequence closed: its cells are freed, its id can be handed out again; the last one frees the context."""
        with self._changed:
            self._busy.pop(seq, None)
            self._handed.discard(seq)
            self._expected.pop(seq, None)
            for readers in self._readers.values():
                readers.discard(seq)
            if seq in self._open:
                self._open.discard(seq)
                if not self.owner.closed:
                    capi.llama_memory_seq_rm(capi.llama_get_memory(self.owner.ctx), seq, 0, -1)
                self._free.append(seq)
                self._free.sort()
            last = not self._open
            self._stopping = last
            self._changed.notify()
        if last:
            self._decoder.join()
            self.owner.close()

    @property
    def busy(self) -> int:
        """Generations decoding now: inside a cycle, or between two of them (expected back)."""
        with self._lock:
            now = time.monotonic()
            return len(self._busy.keys() | {s for s, t in self._expected.items() if now - t < self.linger_s})

    # -- the gather ------------------------------------------------------------------------
    def enter(self, seq: int) -> None:
        with self._changed:
            self._busy[seq] = self._busy.get(seq, 0) + 1
            self._expected.pop(seq, None)

    def leave(self, seq: int) -> None:
        with self._changed:
            left = self._busy.get(seq, 0) - 1
            if left > 0:
                self._busy[seq] = left
                return
            self._busy.pop(seq, None)
            if seq in self._handed:  # it decoded this cycle: its next one is coming
                self._handed.discard(seq)
                self._expected[seq] = time.monotonic()
            for readers in self._readers.values():
                readers.discard(seq)
            self._changed.notify()

    def decode(self, view: "SequenceTarget", n: int, n_outputs: int) -> tuple[int, int]:
        """Decode the n rows staged in `view`'s batch buffers together with whatever else is gathered; returns
        (the first batch row, the first output row) that are this view's in that decode."""
        req = self.submit(view.seq_id, Stage.TARGET, n, n_outputs, view)
        return req.row, req.out

    def submit(self, seq: int, stage: Stage, n: int, n_outputs: int, payload: Any) -> Request:
        """Hand over one sequence's rows for a stage and wait until the decoder has decoded them with the
        others'; raises what the decode raised."""
        req = Request(seq, stage, n, n_outputs, payload)
        with self._changed:
            if stage not in self._stages:
                raise RuntimeError(f"nothing decodes {stage.name} requests on this shared context")
            self._pending.append(req)
            self._expected.pop(seq, None)  # back (a decode outside a cycle too)
            if seq in self._busy:
                self._handed.add(seq)
            self._changed.notify()  # the decoder; the other callers wait on their own requests
        req.done.wait()
        if req.error is not None:
            raise req.error
        return req

    def _decode_batches(self) -> None:
        """The decoder thread: each batch as soon as `_next` lets it go, until the last sequence closes."""
        with self._changed:
            while not self._stopping:
                stage, wait = self._next()
                if wait == 0.0:
                    self._flush(stage)
                else:
                    self._changed.wait(wait)
            for r in self._pending:  # none can be left (its sequence would be open), but never leave a caller waiting
                r.error = ClosedError("the shared context is closed")
                r.done.set()

    def _next(self) -> tuple[Stage | None, float | None]:
        """The stage whose batch should go now and 0; else (None, how long to wait before looking again,
        None: until told)."""
        if not self._pending:
            return None, None
        handed = {r.seq for r in self._pending}
        free = sorted({r.stage for r in self._pending if not self._readers[_CONTEXT[r.stage]] - handed})
        if not free:
            return None, None  # someone still reads the outputs those batches would overwrite: they will notify
        now = time.monotonic()
        if set(self._busy) - handed:  # a busy sequence has not handed anything over yet
            left = min(r.t for r in self._pending) + self.max_wait_s - now
            if left > 0:
                return None, left
        if self._expected:  # a sequence between two cycles: wait for it, up to linger_s after it left
            late = [seq for seq, t in self._expected.items() if now - t >= self.linger_s]
            for seq in late:  # not waited for again until it has been through a cycle
                del self._expected[seq]
            if self._expected:
                return None, min(self._expected.values()) + self.linger_s - now
        return free[0], 0.0

    def _flush(self, stage: Stage) -> None:
        """One batch of this stage's pending requests, in the order they came as far as they join (lock held)."""
        runner, joins = self._stages[stage]
        taken: list[Request] = []
        for r in self._pending:
            if r.stage == stage and (not taken or joins(taken, r)):
                taken.append(r)
        self._pending = [r for r in self._pending if r not in taken]
        taken.sort(key=lambda r: r.seq)  # libllama puts runs of consecutive ids in one micro-batch
        self.shared_passes[stage] += len(taken) > 1
        try:
            runner(taken)
        except BaseException as e:
            for r in taken:
                r.error = e
        self._readers[_CONTEXT[stage]] = {r.seq for r in taken if r.seq in self._busy and r.error is None}
        for r in taken:
            r.done.set()

    def _decode_target(self, taken: list[Request]) -> None:
        """The target stage: one llama_decode of every request's staged rows, and of the filler rows that join
        their runs of sequence ids where that pays (`_fillers`)."""
        owner = self.owner
        fillers = self._fillers(taken)
        out = 0
        row = 0
        for r in sorted([*taken, *fillers], key=lambda r: r.seq):
            if isinstance(r, Filler):
                owner._tok[row : row + r.n] = 0
                owner._pos[row : row + r.n] = np.arange(r.start, r.start + r.n)
                owner._seq[row : row + r.n, 0] = r.seq
                owner._out[row : row + r.n] = 0
                row += r.n
                continue
            v: SequenceTarget = r.payload
            owner._tok[row : row + r.n] = v._tok[: r.n]
            owner._pos[row : row + r.n] = v._pos[: r.n]
            owner._seq[row : row + r.n, 0] = v.seq_id
            owner._out[row : row + r.n] = v._out[: r.n]
            r.row, r.out = row, out
            row += r.n
            out += r.n_outputs
        rows = row
        owner._nseq[:rows] = 1
        owner._batch.n_tokens = rows
        t0 = time.perf_counter()
        try:
            if owner.closed:
                raise ClosedError("the shared context is closed")
            rc = capi.llama_decode(owner.ctx, owner._batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode failed with code {rc} (1: no KV slot, -1: invalid batch, "
                                   "<-1: fatal)")
            settle_outputs(owner.ctx)
        finally:
            seconds = time.perf_counter() - t0
            memory = capi.llama_get_memory(owner.ctx) if not owner.closed else None
            for f in fillers:  # their cells go at once: the sequence holds what it held, in the cells it held
                if memory is not None:
                    capi.llama_memory_seq_rm(memory, f.seq, f.start, -1)
            if all(r.n == taken[0].n for r in taken):
                self.passes.observe(sorted([r.seq for r in taken] + [f.seq for f in fillers]), taken[0].n, seconds)
            self.last = BatchRecord(len(taken), rows, seconds)
            self.decode_s += seconds
            self.batches += 1
            self.batched_rows += rows
            self.filler_rows += sum(f.n for f in fillers)
            self.shared_batches += len(taken) > 1

    def _fillers(self, taken: list[Request]) -> list[Filler]:
        """Rows for the sequences missing between the batch's runs of consecutive ids, where a pass saved is
        worth more than the rows added (`PassCosts`).

        libllama decodes a batch of a context with a stream per sequence as one pass per run of consecutive
        sequence ids (llama_batch_allocr::split_equal), so sequences 2, 5, 6, 7 cost two passes. A filler is n
        rows of a sequence in the gap, at the positions after its cells, that decode nothing anyone reads and
        are removed right after: 2, 3, 4, 5, 6, 7 in one pass. Only where every request has the same n (a
        batch of unequal runs is cut by run length anyway) and never on a recurrent target (a row moves its
        state, which removing cells does not undo)."""
        n = taken[0].n
        if len(taken) < 2 or self.owner.recurrent or any(r.n != n for r in taken):
            return []
        memory = capi.llama_get_memory(self.owner.ctx)
        ids = sorted(r.seq for r in taken)
        fillers: list[Filler] = []
        rows = n * len(taken)
        for a, b in zip(ids, ids[1:]):
            gap = range(a + 1, b)
            if not gap or rows + len(gap) * n > self.owner.n_batch or not self.passes.fill_pays(len(gap) * n):
                continue
            ends = [capi.llama_memory_seq_pos_max(memory, g) + 1 for g in gap]
            if max(ends) + n > self.owner.n_ctx_seq:
                continue  # a full sequence has no cell to lend
            fillers += [Filler(g, end, n) for g, end in zip(gap, ends)]
            rows += len(gap) * n
        return fillers

    def _joins(self, taken: list[Request], r: Request) -> bool:
        """Whether target rows can join the batch: they fit, and neither they nor the batch are a run of
        KERNEL_ROWS rows or more (a prefill chunk), which libllama would split across micro-batches with
        the others' rows and so compute with another kernel than alone."""
        if sum(t.n for t in taken) + r.n > self.owner.n_batch:
            return False
        return r.n < self.kernel_rows and all(t.n < self.kernel_rows for t in taken)

    @contextmanager
    def native(self) -> Iterator[None]:
        """Held around every other C call on the shared context (KV truncation, state save and load)."""
        with self._lock:
            yield


class SequenceTarget(Target):
    """One sequence of a SharedContext, as a Target: positions from 0, "sequence 0" for every caller, its own
    logits rows and features; its decodes are gathered with the other sequences'."""

    def __init__(self, shared: SharedContext, seq_id: int) -> None:
        owner = shared.owner
        super().__init__(owner.model, owner.ctx, owned=False, path=owner.path, n_gpu_layers=owner.n_gpu_layers,
                         flash_attn=owner.flash_attn, shared=owner.shared_model(), type_k=owner.type_k,
                         type_v=owner.type_v, mtp_loaded=owner.n_mtp_heads > 0)
        self.shared = shared
        self.seq_id = seq_id
        self.n_seq_max = 1  # callers see one sequence; a draft tree's branches would need ids of their own
        self._row_base = 0  # this sequence's first batch row and first output row in the last gathered decode
        self._out_base = 0
        self._nextn_stride = capi.llama_model_n_embd_out(owner.model) * ctypes.sizeof(ctypes.c_float)

    @contextmanager
    def cycle(self) -> Iterator[None]:
        """Held while a cycle of this sequence's generation runs: batches wait for its rows, and nothing
        overwrites its outputs until it hands over its next rows or the cycle ends."""
        self.shared.enter(self.seq_id)
        try:
            yield
        finally:
            self.shared.leave(self.seq_id)

    def _submit(self, n: int, out: np.ndarray | int, out_index: np.ndarray | int, n_outputs: int) -> None:
        self._out[:n] = out
        self._features_ready = False
        self._n_outputs = 0
        self._n_last = 0
        self._row_base, self._out_base = self.shared.decode(self, n, n_outputs)
        self._n_last = n
        self.decode_count += 1
        self._out_index[:n] = out_index
        self._n_outputs = n_outputs
        self._features_ready = bool(self._layers)

    def output_logits(self) -> np.ndarray:
        if self._ctx is None:
            raise self._closed_error()
        if self._n_outputs == 0:
            raise IndexError("the last decode produced no logits")
        address = llama_ext.get_logits_address(self._ctx)
        if not address:
            raise RuntimeError("libllama returned no logits")
        address += self._out_base * self.n_vocab * ctypes.sizeof(ctypes.c_float)
        key = (address, self._n_outputs)
        if self._logits_view is None or self._logits_key != key:
            ptr = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
            self._logits_view = np.ctypeslib.as_array(ptr, shape=(self._n_outputs, self.n_vocab))
            self._logits_view.flags.writeable = False
            self._logits_key = key
        return self._logits_view

    def _row_view(self, i: int) -> np.ndarray:
        if self._ctx is None:
            raise self._closed_error()
        if not 0 <= i < self._n_last or self._out_index[i] < 0:
            raise IndexError(f"batch row {i} of the last decode has no logits")
        ptr = capi.llama_get_logits_ith(self._ctx, self._row_base + i)
        if not ptr:
            raise RuntimeError(f"libllama returned no logits for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def _layer_input(self, lid: int) -> int:
        return super()._layer_input(lid) + self._row_base * self.n_embd * ctypes.sizeof(ctypes.c_float)

    def output_nextn(self) -> None:
        """Every decode of the shared context outputs its rows' nextn hidden states from now on (each sequence
        reads its own: nextn_address)."""
        with self.shared.native():
            super().output_nextn()

    def nextn_address(self, n_tokens: int) -> int:
        return super().nextn_address(n_tokens) + self._row_base * self._nextn_stride

    def fork(self, *, n_ctx: int | None = None, n_seq_max: int | None = None,
             kv_unified: bool | None = None) -> "SequenceTarget":
        """Another sequence of the same shared context (RuntimeError when none is free): its settings are the
        context's, so none can be given."""
        if self._ctx is None:
            raise self._closed_error()
        if (n_ctx, n_seq_max, kv_unified) != (None, None, None):
            raise ValueError("a shared sequence forks into another sequence of its context, with its settings")
        return self.shared.sequence()

    # -- this sequence's memory: "sequence 0" (or -1, all) to callers, seq_id in the context --------------
    def _context_seq(self, seq_id: int, *, all_ok: bool = False) -> int:
        if self._ctx is None:
            raise self._closed_error()
        if seq_id == 0 or (all_ok and seq_id == -1):
            return self.seq_id
        raise ValueError(f"a shared sequence is sequence 0 to its callers, got {seq_id}")

    def _native_calls(self) -> AbstractContextManager[None]:
        return self.shared.native()

    def copy_sequence(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        raise ValueError("a shared sequence has no other sequence to copy to")

    def clear(self) -> None:
        self.remove(0, 0, -1)  # this sequence's cells, not the context's

    def close(self) -> None:
        """Free this sequence's cells and give its id back; the context goes with the last sequence."""
        if self._ctx is None:
            return
        super().close()
        self.shared._release(self.seq_id)

