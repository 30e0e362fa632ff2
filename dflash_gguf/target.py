"""The target model: one libllama model + context, with layer-input capture; its vocabulary is
`Target.vocab` (vocabulary.Vocabulary).

Everything that reaches C is validated here first, because libllama answers bad
input with GGML_ASSERT, which aborts the whole process.
"""

from __future__ import annotations

import ctypes
import os
import threading
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, Sequence, Union

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as capi
from llama_cpp._logger import set_verbose

from . import llama_ext, rpc
from .defaults import FLASH_ATTN
from .schema import Keys
from .target_gguf import check_feature_layers
from .target_gguf import fingerprint as gguf_fingerprint
from .vocabulary import TokenizerCache, Vocabulary

GGUF_MAGIC = b"GGUF"
LLAMA_MAX_SEQ = 256  # src/llama-cparams.h; libllama rejects more sequences
# KV cache element types as llama.cpp's --cache-type-k/-v name them (common/arg.cpp's kv_cache_types)
KV_TYPES = {
    "f32": capi.GGML_TYPE_F32, "f16": capi.GGML_TYPE_F16, "bf16": 30,  # ggml.h GGML_TYPE_BF16 (not re-exported)
    "q8_0": capi.GGML_TYPE_Q8_0, "q4_0": capi.GGML_TYPE_Q4_0, "q4_1": capi.GGML_TYPE_Q4_1,
    "iq4_nl": capi.GGML_TYPE_IQ4_NL, "q5_0": capi.GGML_TYPE_Q5_0, "q5_1": capi.GGML_TYPE_Q5_1,
}
QUANTIZED_KV_TYPES = frozenset(KV_TYPES) - {"f32", "f16", "bf16"}
STATE_SEQ_MAGIC = 0xAF143CD8  # src/llama-context.cpp io_magic: the first 4 bytes of every llama_state_seq blob

LogitsSpec = Union[bool, str, Sequence[bool]]

_backend_ready = False


def init_backend(verbose: bool = False) -> None:
    """Initialise libllama once per process and route its log through llama-cpp-python's logger."""
    global _backend_ready
    set_verbose(verbose)
    if not _backend_ready:
        capi.llama_backend_init()
        _backend_ready = True


def default_threads() -> int:
    """Half the cores, as llama_cpp.Llama does: the other half keeps the machine responsive."""
    return max(1, (os.cpu_count() or 2) // 2)


def check_gguf_file(path: str | os.PathLike[str]) -> Path:
    """A readable file that starts with the GGUF magic, else a clear exception (before libllama sees it)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    if not p.is_file():
        raise ValueError(f"{p}: not a regular file")
    with p.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise ValueError(f"{p}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    return p


def load_model(path: str | os.PathLike[str], *, n_gpu_layers: int = 0, load_mtp: bool = False,
               rpc_servers: Sequence[str] = ()) -> capi.llama_model_p:
    """llama_model_load_from_file with the file checked first and NULL turned into ValueError.

    load_mtp: also load the model's MTP (nextn) heads, if it has any, for an MTP draft context (mtp.py).
    rpc_servers: 'host:port' of rpc-servers whose devices take the offloaded layers, with the local GPUs
    (each probed first: rpc.connect). Once any server is registered in the process, a model given none
    gets the local devices only, so a drafter never lands on a target's servers.
    """
    p = check_gguf_file(path)
    if not isinstance(n_gpu_layers, int) or n_gpu_layers < -1:
        raise ValueError(f"n_gpu_layers must be an integer >= -1 (-1 = all), got {n_gpu_layers!r}")
    params = capi.llama_model_default_params()
    params.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers == -1 else n_gpu_layers
    params.load_mtp = bool(load_mtp)
    devices = rpc.model_devices(rpc_servers)
    if devices is not None:
        listed = (ctypes.c_void_p * (len(devices) + 1))(*devices, None)  # NULL-terminated; alive during the load
        params.devices = ctypes.addressof(listed)
    model = capi.llama_model_load_from_file(str(p).encode(), params)
    if not model:
        raise ValueError(f"{p}: libllama could not load this GGUF (corrupt, truncated or unsupported architecture)")
    rpc.hold(model, rpc_servers)
    return model


def new_context(
    model: capi.llama_model_p,
    *,
    n_ctx: int,
    n_batch: int,
    n_seq_max: int = 1,
    n_threads: int | None = None,
    flash_attn: bool = FLASH_ATTN,
    ctx_other: capi.llama_context_p | None = None,
    n_rs_seq: int = 0,
    type_k: str = "f16",
    type_v: str = "f16",
    ctx_type: int = capi.LLAMA_CONTEXT_TYPE_DEFAULT,
    kv_unified: bool = False,
) -> capi.llama_context_p:
    """llama_init_from_model with validated sizes; n_ubatch = n_batch so one decode is one graph.

    kv_unified: one KV buffer for all n_seq_max sequences, each of them n_ctx long; a token may then carry
    several sequence ids (a draft tree's shared nodes), which a split cache refuses.

    flash_attn: defaults.FLASH_ATTN unless given (the context's other users pass their target's).
    type_k / type_v: the KV cache's element type (KV_TYPES); a quantized V cache needs flash attention.
    """
    check_kv_types(type_k, type_v, flash_attn)
    for name, value, lo in (("n_ctx", n_ctx, 8), ("n_batch", n_batch, 1), ("n_seq_max", n_seq_max, 1)):
        if not isinstance(value, int) or value < lo:
            raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")
    if n_seq_max > LLAMA_MAX_SEQ:
        raise ValueError(f"n_seq_max must be <= {LLAMA_MAX_SEQ}, got {n_seq_max}")
    if not isinstance(n_rs_seq, int) or isinstance(n_rs_seq, bool) or n_rs_seq < 0:
        raise ValueError(f"n_rs_seq must be an integer >= 0, got {n_rs_seq!r}")
    if n_rs_seq and n_rs_seq + 1 >= n_batch:
        # libllama keeps the last n_rs_seq + 1 tokens of a sequence in one ubatch and aborts otherwise
        raise ValueError(f"n_rs_seq must be <= n_batch - 2 = {n_batch - 2}, got {n_rs_seq}")
    threads = default_threads() if n_threads is None else n_threads
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
    params = capi.llama_context_default_params()
    params.n_ctx = n_ctx
    params.n_batch = n_batch
    params.n_ubatch = n_batch
    params.n_seq_max = n_seq_max
    params.n_threads = threads
    params.n_threads_batch = threads
    params.no_perf = True
    params.flash_attn_type = capi.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else capi.LLAMA_FLASH_ATTN_TYPE_DISABLED
    if ctx_other is not None:
        params.ctx_other = ctx_other
    params.n_rs_seq = n_rs_seq  # recurrent-state snapshots per sequence; libllama clamps it to 0 where unsupported
    params.type_k = KV_TYPES[type_k]
    params.type_v = KV_TYPES[type_v]
    params.ctx_type = ctx_type  # LLAMA_CONTEXT_TYPE_MTP: a context that runs the model's MTP heads (mtp.py)
    params.kv_unified = bool(kv_unified)
    ctx = capi.llama_init_from_model(model, params)
    if not ctx:
        kv = "" if (type_k, type_v) == ("f16", "f16") else (
            f", type_k={type_k}, type_v={type_v}: a quantized KV cache needs head sizes its block size divides")
        raise RuntimeError(
            f"libllama could not create a context (n_ctx={n_ctx}, n_batch={n_batch}, n_seq_max={n_seq_max}{kv})")
    return ctx


def check_kv_types(type_k: object, type_v: object, flash_attn: bool) -> None:
    """ValueError for a KV type libllama does not know, or a quantized V cache without flash attention
    (libllama refuses that context: its V is read transposed, which quantized blocks cannot be)."""
    for name, value in (("type_k", type_k), ("type_v", type_v)):
        if value not in KV_TYPES:
            raise ValueError(f"{name} must be one of {', '.join(KV_TYPES)}, got {value!r}")
    if type_v in QUANTIZED_KV_TYPES and not flash_attn:
        raise ValueError(f"type_v={type_v}: a quantized V cache needs flash attention (flash_attn=True)")


def state_seq_get(ctx: capi.llama_context_p, seq_id: int, flags: int = 0) -> bytes:
    """llama_state_seq_get_data_ext: one sequence's memory (KV cells, recurrent state) as bytes."""
    size = int(capi.llama_state_seq_get_size_ext(ctx, seq_id, flags))
    if size <= 0:
        raise RuntimeError(f"libllama cannot save the state of sequence {seq_id}")
    out = bytearray(size)
    n = capi.llama_state_seq_get_data_ext(ctx, (ctypes.c_uint8 * size).from_buffer(out), size, seq_id, flags)
    if n != size:
        raise RuntimeError(f"llama_state_seq_get_data_ext wrote {n} of {size} bytes")
    return bytes(out)


def state_seq_set(ctx: capi.llama_context_p, data: bytes, seq_id: int, flags: int = 0) -> None:
    """llama_state_seq_set_data_ext for a blob state_seq_get wrote; RuntimeError when libllama refuses it.

    Checked first: bytes, its magic, and no device-storage flag (those paths assert). libllama parses
    the rest defensively (a mismatch is an error return) but trusts the tensor bytes, so a caller
    holding data from outside (prompt_cache) verifies its checksum before this.
    """
    if not isinstance(data, bytes) or len(data) < 8:
        raise ValueError("a sequence state must be bytes of at least 8 (magic and sequence id)")
    if int.from_bytes(data[:4], "little") != STATE_SEQ_MAGIC:
        raise ValueError("not a libllama sequence state (wrong magic)")
    if flags & capi.LLAMA_STATE_SEQ_FLAGS_ON_DEVICE:
        raise ValueError("device-stored sequence states are not supported here")
    src = ctypes.cast(ctypes.c_char_p(data), ctypes.POINTER(ctypes.c_uint8))  # no copy: data outlives the call
    n = capi.llama_state_seq_set_data_ext(ctx, src, len(data), seq_id, flags)
    if n != len(data):
        raise RuntimeError(f"libllama refused the sequence state ({n} of {len(data)} bytes read)")


def quantize(src: Path, dst: Path, ftype: int, *, n_threads: int = 2) -> None:
    """llama_model_quantize src -> dst (a llama_ftype), keeping the token embedding / tied LM head at Q8_0."""
    init_backend()
    params = capi.llama_model_quantize_default_params()
    params.nthread = n_threads
    params.ftype = ftype
    params.allow_requantize = True
    params.token_embedding_type = capi.GGML_TYPE_Q8_0
    params.output_tensor_type = capi.GGML_TYPE_Q8_0
    rc = capi.llama_model_quantize(str(src).encode(), str(dst).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize({Path(src).name}) failed with code {rc}")


def system_info() -> str:
    """The backends and CPU features the loaded libllama reports."""
    return capi.llama_print_system_info().decode(errors="replace").strip()


def meta_str(model: capi.llama_model_p, key: str) -> str | None:
    """One GGUF metadata value as libllama stores it (arrays are summarised), or None if absent."""
    size = 256
    while True:
        buf = ctypes.create_string_buffer(size)
        n = capi.llama_model_meta_val_str(model, key.encode(), buf, size)
        if n < 0:
            return None
        if n < size:
            return buf.value.decode("utf-8", errors="replace")
        size = n + 1


class ClosedError(RuntimeError):
    """A Target or Drafter was used after close(): its native memory is gone, so nothing reaches C."""


class NativeResource(ABC):
    """Something holding libllama memory: a context manager, and freed when garbage-collected.

    Its context handle `_ctx` is None once closed, and every public method that reaches C tests it
    first (one attribute test), so a stale pointer is never handed to libllama.
    """

    _ctx: object = None

    @property
    def closed(self) -> bool:
        return self._ctx is None

    def _closed_error(self) -> ClosedError:
        where = getattr(self, "path", None)
        return ClosedError(f"this {type(self).__name__}{f' ({where})' if where else ''} is closed")

    @abstractmethod
    def close(self) -> None:
        """Free the native memory; must be safe to call more than once."""

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class SharedModel:
    """One loaded llama_model behind every context made on it (server slots); freed with the last user."""

    def __init__(self, model: capi.llama_model_p, *, owned: bool) -> None:
        self.ptr = model
        self._owned = owned
        self._users = 1
        self._lock = threading.Lock()
        self.tokenizers = TokenizerCache()  # llguidance's view of the vocabulary, built on first use

    def share(self) -> "SharedModel":
        with self._lock:
            if self._users == 0:
                raise ClosedError("the model was already freed")
            self._users += 1
        return self

    def release(self) -> None:
        """Drop one user's share; the last one frees the model. Never frees twice."""
        with self._lock:
            if self._users == 0:
                return
            self._users -= 1
            last = self._users == 0
        if last and self._owned:
            capi.llama_model_free(self.ptr)
            rpc.release(self.ptr)
        if last:
            self.ptr = None

    @property
    def users(self) -> int:
        return self._users


class FeatureRows:
    """Feature rows gathered decode by decode into one growing float32 buffer, for a drafter to take at once.

    Target.append_features writes at an address computed here, so a decode cycle allocates nothing (numpy
    allocations and address lookups were most of what a plain cycle cost on top of plain decoding).
    """

    def __init__(self, width: int, capacity: int = 64) -> None:
        if width < 1:
            raise ValueError(f"feature width must be >= 1, got {width}")
        self.width = width
        self._capacity = max(1, capacity)
        self._data = np.empty((self._capacity, width), np.float32)
        self._address = self._data.ctypes.data
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def reserve(self, n: int) -> int:
        """Room for n more rows, counted as held; returns the address of the first of them."""
        if self._n + n > len(self._data):
            grown = np.empty((max(2 * len(self._data), self._n + n), self.width), np.float32)
            grown[: self._n] = self._data[: self._n]
            self._data, self._address = grown, grown.ctypes.data
        address = self._address + self._n * self.width * 4
        self._n += n
        return address

    def extend(self, block: np.ndarray) -> None:
        start = self._n
        self.reserve(len(block))
        self._data[start : self._n] = block

    def view(self) -> np.ndarray:
        """The rows held, as a view: valid until the next reserve or clear."""
        return self._data[: self._n]

    def clear(self) -> None:
        """Hold no rows; storage a long prompt grew is given back (a plain streak's is kept for the next)."""
        self._n = 0
        if len(self._data) > 4 * self._capacity:
            self._data = np.empty((self._capacity, self.width), np.float32)
            self._address = self._data.ctypes.data



def describe_model(model: capi.llama_model_p) -> dict[str, Any]:
    """A loaded model as libllama describes it: architecture, size and quantisation; bytes; parameters."""
    buf = ctypes.create_string_buffer(256)
    capi.llama_model_desc(model, buf, len(buf))
    return {"desc": buf.value.decode("utf-8", errors="replace"), "bytes": int(capi.llama_model_size(model)),
            "params": int(capi.llama_model_n_params(model))}


def describe_context(ctx: capi.llama_context_p) -> dict[str, int]:
    """A context's sizes and threads, as libllama made them."""
    return {"n_ctx": int(capi.llama_n_ctx(ctx)), "n_batch": int(capi.llama_n_batch(ctx)),
            "n_ubatch": int(capi.llama_n_ubatch(ctx)), "n_seq_max": int(capi.llama_n_seq_max(ctx)),
            "n_threads": int(capi.llama_n_threads(ctx)), "n_threads_batch": int(capi.llama_n_threads_batch(ctx))}

class Target(NativeResource):
    """Owner of one llama model + context; decodes batches and hands out logits and layer features."""

    def __init__(
        self,
        model: capi.llama_model_p,
        ctx: capi.llama_context_p,
        *,
        owned: bool = False,
        path: str | os.PathLike[str] | None = None,
        n_gpu_layers: int = 0,
        flash_attn: bool,
        shared: SharedModel | None = None,
        type_k: str = "f16",
        type_v: str = "f16",
        mtp_loaded: bool = False,
        kv_unified: bool = False,
    ) -> None:
        if not model or not ctx:
            raise ValueError("Target needs a loaded llama model and context")
        self.path: Path | None = Path(path) if path is not None else None
        self.n_gpu_layers = n_gpu_layers
        self.flash_attn = flash_attn
        self.type_k, self.type_v = type_k, type_v  # KV cache element types (KV_TYPES names)
        self.kv_unified = kv_unified  # one KV buffer shared by every sequence: a token may carry several ids
        self._model = model
        self._ctx = ctx
        self._owned = owned  # the context is ours to free
        self._shared = shared or SharedModel(model, owned=owned)
        # its vocabulary, closed with it: text to tokens and back, the chat template, llguidance's tokenizer
        self.vocab = Vocabulary(model, self._shared.tokenizers, self._closed_error)
        self._mem = capi.llama_get_memory(ctx)
        self.n_embd: int = capi.llama_model_n_embd(model)
        self.n_layer: int = capi.llama_model_n_layer(model)
        self.n_vocab: int = self.vocab.n_vocab  # the width of its logits rows
        self.n_ctx: int = capi.llama_n_ctx(ctx)
        self.n_ctx_seq: int = capi.llama_n_ctx_seq(ctx)
        self.n_ctx_train: int = capi.llama_model_n_ctx_train(model)  # the context the model was trained for
        self.n_batch: int = capi.llama_n_batch(ctx)
        self.n_seq_max: int = capi.llama_n_seq_max(ctx)
        self.architecture: str = meta_str(model, Keys.ARCHITECTURE) or ""
        self.recurrent: bool = bool(capi.llama_model_is_recurrent(model) or capi.llama_model_is_hybrid(model))
        # MTP heads libllama loaded with the model (load_mtp): an MTP draft context can run them
        self.n_mtp_heads: int = int(capi.llama_model_n_layer_nextn(model)) if mtp_loaded else 0
        self._nextn = False  # whether decodes output every row's nextn hidden state (an MTP source reads it)
        self.n_rs_seq: int = int(capi.llama_n_rs_seq(ctx))  # snapshots libllama really keeps (0: none)
        self._layers: list[int] = []
        self._fingerprint: str | None = None
        self._features_ready = False
        self._n_last = 0
        self.decode_count = 0  # successful llama_decode calls: memory.py guards its rollbacks with it
        self._out_index = np.full(self.n_batch, -1, dtype=np.int64)
        self._n_outputs = 0
        self._logits_view: np.ndarray | None = None  # output_logits' view, while libllama's buffer stays put
        self._logits_key: tuple[int, int] = (0, 0)  # (buffer address, rows) the view was built for
        self._init_batch()

    def _init_batch(self) -> None:
        """A llama_batch whose arrays are numpy buffers, so a decode fills them with slice copies."""
        n = self.n_batch
        self._tok = np.zeros(n, dtype=np.int32)
        self._pos = np.zeros(n, dtype=np.int32)
        self._nseq = np.ones(n, dtype=np.int32)
        width = self.n_seq_max if self.kv_unified else 1  # ids a token may carry (decode_tree)
        self._seq = np.zeros((n, width), dtype=np.int32)
        self._out = np.zeros(n, dtype=np.int8)
        self._arange = np.arange(n, dtype=np.int32)
        self._last_only = np.zeros(n, dtype=np.int8)  # [-k:]: logits for the last of k tokens
        self._last_only[-1] = 1
        self._last_index = np.full(n, -1, dtype=np.int64)
        self._last_index[-1] = 0
        seq_ptr_t = ctypes.POINTER(capi.llama_seq_id)
        base = self._seq.ctypes.data
        self._seq_ptrs = (seq_ptr_t * n)(*[ctypes.cast(base + 4 * width * i, seq_ptr_t) for i in range(n)])
        b = capi.llama_batch()
        b.token = self._tok.ctypes.data_as(ctypes.POINTER(capi.llama_token))
        b.embd = ctypes.POINTER(ctypes.c_float)()
        b.pos = self._pos.ctypes.data_as(ctypes.POINTER(capi.llama_pos))
        b.n_seq_id = self._nseq.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))
        b.seq_id = self._seq_ptrs
        b.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self._batch = b

    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        *,
        n_ctx: int = 4096,
        n_batch: int = 512,
        n_seq_max: int = 1,
        n_gpu_layers: int = 0,
        n_threads: int | None = None,
        flash_attn: bool = FLASH_ATTN,
        verbose: bool = False,
        n_rs_seq: int = 0,
        type_k: str = "f16",
        type_v: str = "f16",
        load_mtp: bool = False,
        rpc_servers: Sequence[str] = (),
        kv_unified: bool = False,
    ) -> "Target":
        """Load a GGUF and create its context; the Target owns both.

        n_rs_seq: recurrent-state snapshots per sequence, so hybrid targets can roll back that many
        tokens (memory.rs_seq_for sizes it); ignored by attention-only targets.

        flash_attn: defaults.FLASH_ATTN (on: batched and single-token decodes give bit-identical logits on CPU).
        type_k / type_v: the KV cache's element types (KV_TYPES: f16, q8_0, q4_0, ...).
        load_mtp: load the model's MTP heads too, where it has them (`n_mtp_heads`; mtp.MTPSource drafts with them).
        rpc_servers: rpc-servers ('host:port') lending devices for the offloaded layers (load_model).
        """
        check_kv_types(type_k, type_v, flash_attn)  # before the weights load
        init_backend(verbose)
        model = load_model(path, n_gpu_layers=n_gpu_layers, load_mtp=load_mtp, rpc_servers=rpc_servers)
        try:
            ctx = new_context(
                model, n_ctx=n_ctx, n_batch=n_batch, n_seq_max=n_seq_max, n_threads=n_threads, flash_attn=flash_attn,
                n_rs_seq=n_rs_seq, type_k=type_k, type_v=type_v, kv_unified=kv_unified,
            )
        except BaseException:
            capi.llama_model_free(model)
            raise
        return cls(model, ctx, owned=True, path=path, n_gpu_layers=n_gpu_layers, flash_attn=flash_attn,
                   type_k=type_k, type_v=type_v, mtp_loaded=load_mtp, kv_unified=kv_unified)

    @classmethod
    def from_llama(cls, llama: llama_cpp.Llama) -> "Target":
        """Share an existing llama_cpp.Llama's model and context; closing the Target frees nothing."""
        names = {v: k for k, v in KV_TYPES.items()}
        params = llama.context_params
        return cls(
            llama.model,
            llama.ctx,
            owned=False,
            path=llama.model_path,
            n_gpu_layers=llama.model_params.n_gpu_layers,
            flash_attn=params.flash_attn_type == capi.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            type_k=names.get(params.type_k, f"ggml type {params.type_k}"),
            type_v=names.get(params.type_v, f"ggml type {params.type_v}"),
            mtp_loaded=bool(llama.model_params.load_mtp),
            kv_unified=bool(params.kv_unified),
        )

    # -- raw handles for the drafter (same package, same C boundary) -------------------------
    @property
    def model(self) -> capi.llama_model_p:
        if self._ctx is None:
            raise self._closed_error()
        return self._model

    @property
    def ctx(self) -> capi.llama_context_p:
        if self._ctx is None:
            raise self._closed_error()
        return self._ctx

    def described(self) -> dict[str, Any]:
        """What this model and context are, as a measured cost depends on them (the saved calibration's key)."""
        return {**describe_model(self.model), **describe_context(self.ctx)}

    @property
    def layers(self) -> list[int]:
        """Captured layer-input ids, in capture() order."""
        return list(self._layers)

    def fingerprint(self) -> str:
        """target_gguf's quantisation-independent identity, computed from the vocabulary libllama loaded.

        Same value as read_target_info(path).fingerprint without re-parsing the GGUF (seconds for 49k tokens).
        """
        if self._fingerprint is None:
            if self._ctx is None:
                raise self._closed_error()
            self._fingerprint = gguf_fingerprint(self.architecture, self.n_embd, self.n_layer, self.vocab.texts())
        return self._fingerprint

    def meta(self, key: str) -> str | None:
        if self._ctx is None:
            raise self._closed_error()
        return meta_str(self._model, key)

    # -- layer capture ---------------------------------------------------------------------
    def check_layers(self, layers: Sequence[int]) -> list[int]:
        """The layer-input ids as ints, or ValueError if libllama cannot capture them on this target."""
        ids = [int(i) for i in layers]
        if not ids:
            raise ValueError("capture() needs at least one layer id")
        check_feature_layers(self.architecture, self.n_layer, ids)
        return ids

    def capture(self, layers: Sequence[int]) -> None:
        """Extract these layer inputs (GGUF `dflash.target_layers` ids) on every later decode."""
        if self._ctx is None:
            raise self._closed_error()
        ids = self.check_layers(layers)
        if ids == self._layers:
            return
        for lid in set(self._layers) - set(ids):
            llama_ext.set_embeddings_layer_inp(self._ctx, lid, False)
        for lid in ids:
            llama_ext.set_embeddings_layer_inp(self._ctx, lid, True)
        self._layers = ids
        self._features_ready = False

    # -- decoding --------------------------------------------------------------------------
    def cycle(self) -> AbstractContextManager[None]:
        """Held by the Session while one cycle of a generation runs. Nothing to do for a context of its own;
        a sequence of a shared context (batching.SequenceTarget) is waited for and its outputs kept meanwhile."""
        return nullcontext()

    def decode(
        self,
        tokens: Sequence[int] | np.ndarray,
        positions: int | Sequence[int] | np.ndarray,
        seq_ids: int | Sequence[int] | np.ndarray = 0,
        logits: LogitsSpec = "last",
    ) -> None:
        """One llama_decode of `tokens` at `positions` (a start position or one per token)."""
        if self._ctx is None:
            raise self._closed_error()
        # the decode loop's own call (a short list at one start position, one sequence) is checked without
        # numpy: a dozen numpy calls on Python that runs cache-cold after each decode cost ~0.1 ms a token
        if type(tokens) is list and type(positions) is int and type(seq_ids) is int:
            n = self._check_run(tokens, positions, seq_ids)
            pos: int | np.ndarray = positions + self._arange[:n]
        else:
            tokens, pos, seq_ids = self._check_batch(tokens, positions, seq_ids)
            n = len(tokens)
        out, out_index, n_outputs = self._output_rows(logits, n)

        self._tok[:n] = tokens
        self._pos[:n] = pos
        self._seq[:n, 0] = seq_ids
        self._submit(n, out, out_index, n_outputs)

    def decode_tree(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ranges: Sequence[tuple[int, int]]
    ) -> None:
        """One llama_decode of a draft tree, logits for every row: row i carries sequence ids
        range(*seq_ranges[i]) (each root-to-leaf path is one sequence, a shared node carries all of its leaves').

        libllama's rules are checked here first: a token with several ids needs a unified KV cache, and each
        sequence's rows must come in rising positions that follow what that sequence holds (the caller copied
        the committed prefix to every sequence) and never leave a set of ids once they narrowed it.
        """
        if self._ctx is None:
            raise self._closed_error()
        tok, pos, _ = self._check_batch(tokens, positions, 0)
        n = len(tok)
        if len(seq_ranges) != n:
            raise ValueError(f"{len(seq_ranges)} sequence ranges for {n} tokens")
        for i, (first, end) in enumerate(seq_ranges):
            if end - first > 1 and not self.kv_unified:
                raise ValueError(f"row {i} carries {end - first} sequence ids: a shared node needs a Target opened "
                                 "with kv_unified=True")
            if not 0 <= first < end <= self.n_seq_max:
                raise ValueError(f"row {i}: sequence ids [{first}, {end}) outside [0, {self.n_seq_max})")
        last: dict[int, tuple[int, tuple[int, int]]] = {}  # sequence -> (position, range) of its last row so far
        for i, r in enumerate(seq_ranges):
            for s in range(*r):
                if s in last and not (pos[i] == last[s][0] + 1 and last[s][1][0] <= r[0] and r[1] <= last[s][1][1]):
                    raise ValueError(f"row {i}: sequence {s} does not continue its path (position {pos[i]})")
                last[s] = (int(pos[i]), r)
        self._tok[:n] = tok
        self._pos[:n] = pos
        for i, (first, end) in enumerate(seq_ranges):
            self._nseq[i] = end - first
            self._seq[i, : end - first] = np.arange(first, end, dtype=np.int32)
        try:
            self._submit(n, 1, self._arange[:n], n)
        finally:
            self._nseq[:n] = 1  # the loop's own decode sets one id per token and leaves the counts alone

    def _submit(self, n: int, out: np.ndarray | int, out_index: np.ndarray | int, n_outputs: int) -> None:
        """llama_decode of the n tokens already written to the batch buffers."""
        self._out[:n] = out
        self._batch.n_tokens = n
        self._features_ready = False
        rc = capi.llama_decode(self._ctx, self._batch)
        if rc != 0:
            self._n_outputs = 0
            raise RuntimeError(f"llama_decode failed with code {rc} (1: no KV slot, -1: invalid batch, <-1: fatal)")
        self._n_last = n
        self.decode_count += 1
        self._out_index[:n] = out_index
        self._n_outputs = n_outputs
        self._features_ready = bool(self._layers)

    def _check_run(self, tokens: list, p0: int, seq_id: int) -> int:
        """Validate consecutive positions p0.. of one sequence; returns the token count."""
        n = len(tokens)
        if n == 0:
            raise ValueError("decode() needs at least one token")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        lo, hi = min(tokens), max(tokens)
        if lo < 0 or hi >= self.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.n_vocab}), got range [{lo}, {hi}]")
        if p0 < 0 or p0 + n > self.n_ctx_seq:
            raise ValueError(f"positions must be in [0, {self.n_ctx_seq}) (context per sequence), got [{p0}, {p0 + n - 1}]")
        if not 0 <= seq_id < self.n_seq_max:
            raise ValueError(f"sequence ids must be in [0, {self.n_seq_max}), got [{seq_id}, {seq_id}]")
        return n

    def _check_batch(
        self, tokens: Sequence[int] | np.ndarray, positions: int | Sequence[int] | np.ndarray,
        seq_ids: int | Sequence[int] | np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Any batch: tokens, positions and sequence ids as validated int64 arrays of one length."""
        tok = np.asarray(tokens, dtype=np.int64).reshape(-1)
        n = tok.size
        if n == 0:
            raise ValueError("decode() needs at least one token")
        if n > self.n_batch:
            raise ValueError(f"batch of {n} tokens exceeds n_batch={self.n_batch}")
        if tok.min() < 0 or tok.max() >= self.n_vocab:
            raise ValueError(f"token ids must be in [0, {self.n_vocab}), got range [{tok.min()}, {tok.max()}]")
        if np.isscalar(positions) or np.ndim(positions) == 0:
            pos = int(positions) + np.arange(n, dtype=np.int64)
        else:
            pos = np.asarray(positions, dtype=np.int64).reshape(-1)
            if pos.size != n:
                raise ValueError(f"{pos.size} positions for {n} tokens")
        if pos.min() < 0 or pos.max() >= self.n_ctx_seq:
            raise ValueError(
                f"positions must be in [0, {self.n_ctx_seq}) (context per sequence), got [{pos.min()}, {pos.max()}]"
            )
        seq = np.broadcast_to(np.asarray(seq_ids, dtype=np.int64), (n,)) if np.ndim(seq_ids) == 0 else np.asarray(seq_ids, dtype=np.int64).reshape(-1)
        if seq.size != n:
            raise ValueError(f"{seq.size} sequence ids for {n} tokens")
        if seq.min() < 0 or seq.max() >= self.n_seq_max:
            raise ValueError(f"sequence ids must be in [0, {self.n_seq_max}), got [{seq.min()}, {seq.max()}]")
        return tok, pos, seq

    def _output_rows(self, logits: LogitsSpec, n: int) -> tuple[np.ndarray | int, np.ndarray | int, int]:
        """(the batch's logits flags, each row's output index or -1, outputs) for a LogitsSpec over n tokens."""
        if logits is True:
            return 1, self._arange[:n], n
        if logits is False:
            return 0, -1, 0
        if isinstance(logits, str):
            if logits != "last":
                raise ValueError(f"logits must be True, False, 'last' or a sequence of bools, got {logits!r}")
            return self._last_only[-n:], self._last_index[-n:], 1
        mask = np.asarray(logits, dtype=bool).reshape(-1)
        if mask.size != n:
            raise ValueError(f"{mask.size} logits flags for {n} tokens")
        return mask.astype(np.int8), np.where(mask, np.cumsum(mask) - 1, -1), int(mask.sum())

    def logits(self, i: int) -> np.ndarray:
        """(n_vocab,) float32 copy of the logits of batch row i of the last decode."""
        return self._row_view(i).copy()

    def _row_view(self, i: int) -> np.ndarray:
        if self._ctx is None:
            raise self._closed_error()
        if not 0 <= i < self._n_last or self._out_index[i] < 0:
            raise IndexError(f"batch row {i} of the last decode has no logits")
        ptr = capi.llama_get_logits_ith(self._ctx, i)
        if not ptr:
            raise RuntimeError(f"libllama returned no logits for batch row {i}")
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def output_logits(self) -> np.ndarray:
        """(n_outputs, n_vocab) read-only view of every output row of the last decode, in batch order.

        No copy: valid until the next decode. Greedy decoding takes argmax straight from it. The view is
        rebuilt only when libllama moves its logits buffer or the row count changes.
        """
        if self._ctx is None:
            raise self._closed_error()
        if self._n_outputs == 0:
            raise IndexError("the last decode produced no logits")
        address = llama_ext.get_logits_address(self._ctx)  # also waits for the decode (llama_synchronize)
        if not address:
            raise RuntimeError("libllama returned no logits")
        key = (address, self._n_outputs)
        if self._logits_view is None or self._logits_key != key:
            ptr = ctypes.cast(address, ctypes.POINTER(ctypes.c_float))
            self._logits_view = np.ctypeslib.as_array(ptr, shape=(self._n_outputs, self.n_vocab))
            self._logits_view.flags.writeable = False
            self._logits_key = key
        return self._logits_view

    @property
    def feature_width(self) -> int:
        """Floats per token in captured features: every captured layer's input, in capture() order."""
        return len(self._layers) * self.n_embd

    def features(self, n_tokens: int, offset: int = 0) -> np.ndarray:
        """(n_tokens, len(layers)*n_embd) float32 copy of captured layer inputs for batch rows offset.. of the last decode."""
        rows = FeatureRows(self.feature_width if self._layers else 1, capacity=n_tokens)
        self.append_features(rows, n_tokens, offset)
        return rows.view()

    def append_features(self, rows: "FeatureRows", n_tokens: int, offset: int = 0) -> None:
        """Append what features(n_tokens, offset) returns to `rows`, without allocating (the loop's path)."""
        if self._ctx is None:
            raise self._closed_error()
        if not self._layers:
            raise RuntimeError("no layers captured: call capture(layers) before decode()")
        if not self._features_ready:
            raise RuntimeError("no features: decode() a batch after capture()")
        if n_tokens < 0 or offset < 0 or offset + n_tokens > self._n_last:
            raise ValueError(f"rows [{offset}, {offset + n_tokens}) outside the last batch of {self._n_last} tokens")
        if rows.width != self.feature_width:
            raise ValueError(f"feature rows of width {rows.width}, but this target captures {self.feature_width}")
        # memmoves, not numpy views over ctypes pointers: this runs every cycle, and the views cost more than the copy
        n_layers, row_bytes = len(self._layers), self.n_embd * ctypes.sizeof(ctypes.c_float)
        if n_tokens == 1 or n_layers == 1:  # each layer's rows are one contiguous run of the output
            dst = rows.reserve(n_tokens)
            for k, lid in enumerate(self._layers):
                ctypes.memmove(dst + k * row_bytes, self._layer_input(lid) + offset * row_bytes, n_tokens * row_bytes)
            return
        by_layer = np.empty((n_layers, n_tokens, self.n_embd), np.float32)
        dst = by_layer.ctypes.data
        for k, lid in enumerate(self._layers):
            ctypes.memmove(dst + k * n_tokens * row_bytes, self._layer_input(lid) + offset * row_bytes, n_tokens * row_bytes)
        rows.extend(by_layer.transpose(1, 0, 2).reshape(n_tokens, n_layers * self.n_embd))

    def append_feature_rows(self, rows: "FeatureRows", indices: Sequence[int]) -> None:
        """Append the features of these batch rows of the last decode, in that order (a draft tree's path)."""
        i = 0
        while i < len(indices):  # runs of consecutive rows go in one call
            j = i + 1
            while j < len(indices) and indices[j] == indices[j - 1] + 1:
                j += 1
            self.append_features(rows, j - i, int(indices[i]))
            i = j

    def _layer_input(self, lid: int) -> int:
        address = llama_ext.get_embeddings_layer_inp(self._ctx, lid)
        if not address:
            raise RuntimeError(f"libllama captured no input for layer {lid}")
        return address

    def output_nextn(self) -> None:
        """From the next decode on, output every batch row's nextn hidden state (what an MTP head reads),
        whatever its logits flag, as upstream's MTP driver sets its target context."""
        if self._ctx is None:
            raise self._closed_error()
        llama_ext.set_embeddings_nextn(self._ctx, True, False)
        self._nextn = True

    @property
    def nextn_rows(self) -> int:
        """Batch rows of the last decode whose nextn row libllama holds (0 after a restored state)."""
        return self._n_last if self._nextn and self._ctx is not None else 0

    def nextn_address(self, n_tokens: int) -> int:
        """Address of the nextn rows (n_embd floats each, row i at i * n_embd) of batch rows 0..n_tokens-1
        of the last decode; valid until the next decode."""
        if self._ctx is None:
            raise self._closed_error()
        if not self._nextn:
            raise RuntimeError("no nextn rows: call output_nextn() before decode()")
        if not 0 < n_tokens <= self._n_last:
            raise ValueError(f"{n_tokens} nextn rows asked of a last batch of {self._n_last} tokens")
        address = llama_ext.get_embeddings_nextn_ith(self._ctx, 0)
        if not address:
            raise RuntimeError("libllama returned no nextn rows for the last decode")
        return address

    def shared_model(self) -> SharedModel:
        """A share of the loaded model, for another context on it (an MTP context); release() it when done."""
        if self._ctx is None:
            raise self._closed_error()
        return self._shared.share()

    def token_embeddings(self) -> np.ndarray:
        """(n_vocab, n_embd) float32 copy of the token embedding matrix, dequantised by libllama."""
        if self._ctx is None:
            raise self._closed_error()
        n = llama_ext.model_get_tok_embd(self._model, None)
        if n != self.n_vocab * self.n_embd:
            raise RuntimeError(f"libllama returned {n} embedding values, expected {self.n_vocab * self.n_embd}")
        out = np.empty((self.n_vocab, self.n_embd), dtype=np.float32)
        llama_ext.model_get_tok_embd(self._model, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
        return out

    # -- KV cache --------------------------------------------------------------------------
    def _context_seq(self, seq_id: int, *, all_ok: bool = False) -> int:
        """The context's id of a caller's sequence (-1, every sequence, where all_ok), checked; the KV calls
        below go through it and _native_calls, which a sequence of a shared context overrides."""
        if self._ctx is None:
            raise self._closed_error()
        if not (-1 if all_ok else 0) <= seq_id < self.n_seq_max:
            raise ValueError(f"seq_id must be in [{-1 if all_ok else 0}, {self.n_seq_max}), got {seq_id}")
        return seq_id

    def _native_calls(self) -> AbstractContextManager[None]:
        """Held around a KV or state call: nothing for a context of its own."""
        return nullcontext()

    def remove(self, seq_id: int, p0: int, p1: int = -1) -> None:
        """Drop positions [p0, p1) of a sequence (-1: all sequences / to the end) from the KV cache."""
        seq = self._context_seq(seq_id, all_ok=True)
        with self._native_calls():
            if not capi.llama_memory_seq_rm(self._mem, seq, p0, p1):
                raise RuntimeError(f"llama_memory_seq_rm(seq={seq}, [{p0}, {p1})) failed")

    def copy_sequence(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make positions [p0, p1) of sequence src part of sequence dst too (in a unified cache: the same cells)."""
        if self._ctx is None:
            raise self._closed_error()
        for name, s in (("src", src), ("dst", dst)):
            if not 0 <= s < self.n_seq_max:
                raise ValueError(f"{name} must be in [0, {self.n_seq_max}), got {s}")
        capi.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def pos_max(self, seq_id: int = 0) -> int:
        """Largest cached position of a sequence, -1 when empty."""
        seq = self._context_seq(seq_id)
        with self._native_calls():
            return int(capi.llama_memory_seq_pos_max(self._mem, seq))

    def clear(self) -> None:
        if self._ctx is None:
            raise self._closed_error()
        capi.llama_memory_clear(self._mem, True)

    def save_sequence(self, seq_id: int = 0, *, flags: int = 0) -> bytes:
        """The whole memory of a sequence (attention KV and, on hybrid targets, the recurrent state); with
        LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY its recurrent state only (memory.py's checkpoints)."""
        seq = self._context_seq(seq_id)
        with self._native_calls():
            return state_seq_get(self._ctx, seq, flags)

    def load_sequence(self, data: bytes, seq_id: int = 0, *, flags: int = 0) -> None:
        """Replace a sequence's memory with what save_sequence returned, with the same flags, on a context like
        this one.

        RuntimeError when libllama refuses it (another layout, too many cells); the sequence is then empty.
        The recurrent-state snapshots (n_rs_seq) are not part of a saved state: no rollback reaches behind it.
        """
        seq = self._context_seq(seq_id)
        with self._native_calls():
            try:
                state_seq_set(self._ctx, data, seq, flags)
            except RuntimeError:
                capi.llama_memory_seq_rm(self._mem, seq, 0, -1)
                raise
        self._features_ready = False
        self._n_last = 0
        self._n_outputs = 0

    # -- lifetime --------------------------------------------------------------------------
    def fork(self, *, n_ctx: int | None = None, n_seq_max: int | None = None, kv_unified: bool | None = None) -> "Target":
        """A new context with this one's settings (or those given) on the same loaded model (weights are not
        loaded twice)."""
        if self._ctx is None:
            raise self._closed_error()
        kv_unified = self.kv_unified if kv_unified is None else kv_unified
        shared = self._shared.share()
        try:
            ctx = new_context(
                self._model,
                n_ctx=self.n_ctx if n_ctx is None else n_ctx,
                n_batch=self.n_batch,
                n_seq_max=self.n_seq_max if n_seq_max is None else n_seq_max,
                n_threads=capi.llama_n_threads(self._ctx),
                flash_attn=self.flash_attn,
                n_rs_seq=self.n_rs_seq,
                type_k=self.type_k,
                type_v=self.type_v,
                kv_unified=kv_unified,
            )
        except BaseException:
            shared.release()
            raise
        forked = Target(
            self._model, ctx, owned=True, path=self.path, n_gpu_layers=self.n_gpu_layers,
            flash_attn=self.flash_attn, shared=shared, type_k=self.type_k, type_v=self.type_v,
            mtp_loaded=self.n_mtp_heads > 0,
            kv_unified=kv_unified,
        )
        return forked

    def set_threads(self, n_threads: int) -> None:
        """Threads for single-token and batch decodes of this context."""
        if self._ctx is None:
            raise self._closed_error()
        if not isinstance(n_threads, int) or isinstance(n_threads, bool) or n_threads < 1:
            raise ValueError(f"n_threads must be a positive integer, got {n_threads!r}")
        capi.llama_set_n_threads(self._ctx, n_threads, n_threads)

    @property
    def n_threads(self) -> int:
        if self._ctx is None:
            raise self._closed_error()
        return int(capi.llama_n_threads(self._ctx))

    def close(self) -> None:
        """Free the context if this Target owns it, and its share of the model; a second call does nothing.

        The model itself is freed with its last user: a fork keeps it alive after its parent closes.
        """
        ctx = self._ctx
        if ctx is None:
            return
        self._ctx = None  # first, so nothing can reach the context while it is freed
        self.vocab.close()
        self._mem = self._model = None
        if self._owned:
            capi.llama_free(ctx)
        self._shared.release()
