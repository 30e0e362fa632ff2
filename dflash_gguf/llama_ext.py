"""ctypes bindings for the libllama functions that llama-cpp-python does not bind, and the MTP context's calls.

They live in llama.cpp's C++ staging header `src/llama-ext.h`, so they are exported
under C++-mangled names (Itanium on Linux/macOS, MSVC on Windows). This module is the
only place that knows those names. `MTPContext` is the C side of an MTP draft source (mtp.py): the
nextn calls and the extended batch it is fed through, behind the wall like the rest.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import llama_cpp
import numpy as np
from llama_cpp import llama_cpp as _capi

REQUIRED_VERSION = "0.3.36"


class MissingSymbolError(RuntimeError):
    """The loaded libllama lacks DFlash's layer-input API."""


def _bind(names: tuple[str, ...], argtypes: list[Any], restype: Any) -> Callable[..., Any]:
    lib = _capi._lib
    for name in names:
        func = getattr(lib, name, None)
        if func is not None:
            func.argtypes = argtypes
            func.restype = restype
            return func

    def missing(*_args: Any) -> Any:
        raise MissingSymbolError(
            f"libllama has no {names[0]} (looked for {', '.join(names)}): DFlash needs "
            f"llama-cpp-python>={REQUIRED_VERSION}, found {llama_cpp.__version__}; "
            f"run: pip install 'llama-cpp-python>={REQUIRED_VERSION}'"
        )

    return missing


_ctx = _capi.llama_context_p_ctypes
_model = _capi.llama_model_p_ctypes

# float * llama_get_logits(llama_context * ctx), bound a second time as an address: Target.output_logits
# compares it with the buffer its view was built on every cycle. lib[name] is a new function object, so
# llama-cpp-python's own binding (a typed pointer) is left as it is.
get_logits_address = _capi._lib["llama_get_logits"]
get_logits_address.argtypes = [_ctx]
get_logits_address.restype = ctypes.c_void_p

# void llama_set_embeddings_layer_inp(llama_context * ctx, uint32_t lid, bool value)
set_embeddings_layer_inp = _bind(
    (
        "llama_set_embeddings_layer_inp",
        "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
        "?llama_set_embeddings_layer_inp@@YAXPEAUllama_context@@I_N@Z",
    ),
    [_ctx, ctypes.c_uint32, ctypes.c_bool],
    None,
)

# float * llama_get_embeddings_layer_inp(llama_context * ctx, uint32_t lid); bound as an address (an int, or
# None for NULL): Target.features memmoves from it every cycle, and a typed pointer costs a cast there
get_embeddings_layer_inp = _bind(
    (
        "llama_get_embeddings_layer_inp",
        "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
        "?llama_get_embeddings_layer_inp@@YAPEAMPEAUllama_context@@I@Z",
    ),
    [_ctx, ctypes.c_uint32],
    ctypes.c_void_p,
)

# const int32_t * llama_model_target_layer_ids(const llama_model * model)
model_target_layer_ids = _bind(
    (
        "llama_model_target_layer_ids",
        "_Z28llama_model_target_layer_idsPK11llama_model",
        "?llama_model_target_layer_ids@@YAPEBHPEBUllama_model@@@Z",
    ),
    [_model],
    ctypes.POINTER(ctypes.c_int32),
)

# uint32_t llama_model_target_layer_ids_n(const llama_model * model)
model_target_layer_ids_n = _bind(
    (
        "llama_model_target_layer_ids_n",
        "_Z30llama_model_target_layer_ids_nPK11llama_model",
        "?llama_model_target_layer_ids_n@@YAIPEBUllama_model@@@Z",
    ),
    [_model],
    ctypes.c_uint32,
)

# int32_t llama_model_dflash_selector_top_k(const llama_model * model)
model_dflash_selector_top_k = _bind(
    (
        "llama_model_dflash_selector_top_k",
        "_Z33llama_model_dflash_selector_top_kPK11llama_model",
        "?llama_model_dflash_selector_top_k@@YAHPEBUllama_model@@@Z",
    ),
    [_model],
    ctypes.c_int32,
)

# void llama_set_embeddings_nextn(llama_context * ctx, bool value, bool masked)
set_embeddings_nextn = _bind(
    (
        "llama_set_embeddings_nextn",
        "_Z26llama_set_embeddings_nextnP13llama_contextbb",
        "?llama_set_embeddings_nextn@@YAXPEAUllama_context@@_N1@Z",
    ),
    [_ctx, ctypes.c_bool, ctypes.c_bool],
    None,
)

# float * llama_get_embeddings_nextn(llama_context * ctx)
get_embeddings_nextn = _bind(
    (
        "llama_get_embeddings_nextn",
        "_Z26llama_get_embeddings_nextnP13llama_context",
        "?llama_get_embeddings_nextn@@YAPEAMPEAUllama_context@@@Z",
    ),
    [_ctx],
    ctypes.POINTER(ctypes.c_float),
)


# float * llama_get_embeddings_nextn_ith(llama_context * ctx, int32_t i): batch row i's nextn row (the hidden
# state an MTP head reads); bound as an address (None for NULL, which libllama returns for a bad i)
get_embeddings_nextn_ith = _bind(
    (
        "llama_get_embeddings_nextn_ith",
        "_Z30llama_get_embeddings_nextn_ithP13llama_contexti",
        "?llama_get_embeddings_nextn_ith@@YAPEAMPEAUllama_context@@H@Z",
    ),
    [_ctx, ctypes.c_int32],
    ctypes.c_void_p,
)

# void llama_set_nextn_layer_offset(llama_context * ctx, int32_t offset): which trained head (block
# n_layer + offset) an MTP context's graph runs; chained heads (step35) step it once per draft position
set_nextn_layer_offset = _bind(
    (
        "llama_set_nextn_layer_offset",
        "_Z28llama_set_nextn_layer_offsetP13llama_contexti",
        "?llama_set_nextn_layer_offset@@YAXPEAUllama_context@@H@Z",
    ),
    [_ctx, ctypes.c_int32],
    None,
)


# llama_context * llama_get_ctx_other(llama_context * ctx): the context whose memory this one's shares (libllama
# keeps ctx_other only where a model reads another's KV: gemma4's assistant); bound as an address (NULL: None)
get_ctx_other = _bind(
    ("llama_get_ctx_other", "_Z19llama_get_ctx_otherP13llama_context",
     "?llama_get_ctx_other@@YAPEAUllama_context@@PEAU1@@Z"),
    [_ctx],
    ctypes.c_void_p,
)


def shares_memory_with(ctx: Any, other: Any) -> bool:
    """Whether context `ctx` attends to `other`'s KV instead of a memory of its own (gemma4's MTP assistant)."""
    return (get_ctx_other(ctx) or 0) == (ctypes.cast(other, ctypes.c_void_p).value or 0)


# int32_t llama_model_n_devices(const llama_model * model): the devices libllama offloads this model's layers to
model_n_devices = _bind(
    (
        "llama_model_n_devices",
        "_Z21llama_model_n_devicesPK11llama_model",
        "?llama_model_n_devices@@YAHPEBUllama_model@@@Z",
    ),
    [_model],
    ctypes.c_int32,
)

# ggml_backend_dev_t llama_model_get_device(const llama_model * model, int i); bound as an address (NULL: None)
model_get_device = _bind(
    (
        "llama_model_get_device",
        "_Z22llama_model_get_devicePK11llama_modeli",
        "?llama_model_get_device@@YAPEAUggml_backend_device@@PEBUllama_model@@H@Z",
    ),
    [_model, ctypes.c_int],
    ctypes.c_void_p,
)

def target_layer_ids(model: Any) -> list[int]:
    """The drafter's `dflash.target_layers` as libllama loaded them."""
    n = model_target_layer_ids_n(model)
    ptr = model_target_layer_ids(model)
    return [int(ptr[i]) for i in range(n)] if n and ptr else []


# uint32_t llama_model_get_tok_embd(const llama_model * model, float * out)
model_get_tok_embd = _bind(
    (
        "llama_model_get_tok_embd",
        "_Z24llama_model_get_tok_embdPK11llama_modelPf",
        "?llama_model_get_tok_embd@@YAIPEBUllama_model@@PEAM@Z",
    ),
    [_model, ctypes.POINTER(ctypes.c_float)],
    ctypes.c_uint32,
)


def mtp_api_present() -> bool:
    """Whether the loaded libllama has the nextn calls an MTP draft source drives its heads through."""
    funcs = (set_embeddings_nextn, get_embeddings_nextn_ith, set_nextn_layer_offset, get_ctx_other)
    return all(getattr(f, "__name__", "") != "missing" for f in funcs)


def layer_input_api_present() -> bool:
    """Whether the loaded libllama has the layer-input API DFlash reads the target's features through."""
    return all(getattr(f, "__name__", "") != "missing" for f in (set_embeddings_layer_inp, get_embeddings_layer_inp))


# -- the MTP context (mtp.py drives it) ----------------------------------------------------------------------
CONTEXT_TYPE_MTP = _capi.LLAMA_CONTEXT_TYPE_MTP  # llama_context_params.ctx_type of a context that runs MTP heads


class _EmbdRow(ctypes.Structure):
    """struct llama_embd with its data bound as an address: a row's address is set without a cast."""
    _fields_ = [("data", ctypes.c_void_p), ("n_rows", ctypes.c_size_t), ("n_embd", ctypes.c_size_t)]


# bool llama_batch_ext_set_embd_token(llama_batch_ext * batch, int32_t idx, struct llama_embd embd), with _EmbdRow
_set_embd_row = _capi._lib["llama_batch_ext_set_embd_token"]
_set_embd_row.argtypes = [_capi.llama_batch_ext_p_ctypes, ctypes.c_int32, _EmbdRow]
_set_embd_row.restype = ctypes.c_bool

# float * llama_get_logits_ith(llama_context * ctx, int32_t i), bound as an address (None for NULL)
_get_logits_ith_address = _capi._lib["llama_get_logits_ith"]
_get_logits_ith_address.argtypes = [_ctx, ctypes.c_int32]
_get_logits_ith_address.restype = ctypes.c_void_p


def model_mtp_shape(model: Any) -> tuple[int, int, int]:
    """(MTP heads, vocabulary size, output row width) of a loaded model: what an MTP context on it needs."""
    vocab = _capi.llama_model_get_vocab(model)
    return (int(_capi.llama_model_n_layer_nextn(model)), int(_capi.llama_vocab_n_tokens(vocab)),
            int(_capi.llama_model_n_embd_out(model)))


class MTPContext:
    """An MTP context (made by target.new_context with ctx_type CONTEXT_TYPE_MTP), owned from here on, and
    the one extended batch it is fed through: each row is a token of a sequence at a position with a
    hidden-state row (an address of n_embd floats). `free()` frees both; the model is its owner's to release.

    The calls per row are the cycle's hot path: the position and the row go through ctypes objects made
    once, and the logits come back as a view built once per address.
    """

    def __init__(self, ctx: Any, n_embd: int, n_vocab: int) -> None:
        batch = _capi.llama_batch_ext_init(ctx)
        if not batch:
            _capi.llama_free(ctx)
            raise RuntimeError("libllama could not make a batch for the MTP context")
        self.ctx, self.n_embd, self.n_vocab = ctx, n_embd, n_vocab
        self._batch = batch
        self._mem = _capi.llama_get_memory(ctx)
        self._pos = ctypes.c_int32(0)
        self._pos_ref = ctypes.byref(self._pos)
        self._embd = _EmbdRow(None, 1, n_embd)  # its data address is set per row
        self._logits: tuple[int, np.ndarray] = (0, np.empty(0, np.float32))  # (address, view) of the last logits
        self._head = 0  # the trained head (nextn layer offset) the next decode runs
        self.n_batch = int(_capi.llama_n_batch(ctx))  # rows one decode takes
        set_embeddings_nextn(ctx, True, True)  # the head's own row of each output, for chaining

    def clear(self) -> None:
        _capi.llama_batch_ext_clear(self._batch)

    def add(self, token: int, pos: int, row_address: int, output: bool, seq: int = 0) -> int:
        """One batch row: `token` of sequence `seq` at `pos`, paired with the hidden-state row at `row_address`;
        returns its batch index."""
        idx = _capi.llama_batch_ext_add_token(self._batch, seq, token)
        if idx < 0:
            raise RuntimeError(f"the MTP batch refused token {token} (error {idx})")
        self._pos.value = pos
        self._embd.data = row_address
        if not _capi.llama_batch_ext_set_pos(self._batch, idx, self._pos_ref) or \
                not _set_embd_row(self._batch, idx, self._embd):
            raise RuntimeError(f"the MTP batch refused the position or the row of token {token}")
        if output:
            _capi.llama_batch_ext_set_output_logits(self._batch, idx, True)
        return idx

    def set_head(self, head: int) -> None:
        """Which trained head the next decode runs (chained heads, step35: one per draft step)."""
        if head != self._head:
            set_nextn_layer_offset(self.ctx, head)
            self._head = head

    def decode(self, settle: bool = False) -> None:
        """settle: put the outputs of several sequences in batch order now (batching.settle_outputs says why)."""
        rc = _capi.llama_process(self.ctx, _capi.LLAMA_PROCESS_TYPE_DECODE, self._batch)
        if rc != 0:
            raise RuntimeError(f"the MTP context's decode failed with code {rc}")
        if settle:
            _capi.llama_get_logits(self.ctx)

    def logits(self, i: int = 0) -> np.ndarray:
        """The logits of the last decode's batch row i, an output (a view, valid until the next decode)."""
        address = _get_logits_ith_address(self.ctx, i)
        if not address:
            raise RuntimeError(f"the MTP context returned no logits for batch row {i}")
        cached = self._logits  # one read: sequences of a shared context call this from their own threads
        if address != cached[0]:
            cached = (address, np.ctypeslib.as_array(ctypes.cast(address, ctypes.POINTER(ctypes.c_float)),
                                                     shape=(self.n_vocab,)))
            self._logits = cached
        return cached[1]

    def nextn_row(self, i: int = 0) -> int:
        """The address of the head's own hidden state at the last decode's batch row i (an output)."""
        address = get_embeddings_nextn_ith(self.ctx, i)
        if not address:
            raise RuntimeError(f"the MTP context returned no nextn row for batch row {i}")
        return address

    def remove(self, p0: int, seq: int = 0) -> None:
        """Forget the sequence's positions >= p0."""
        if not _capi.llama_memory_seq_rm(self._mem, seq, p0, -1):
            raise RuntimeError(f"could not remove MTP positions >= {p0}")

    def clear_memory(self, seq: int = -1) -> None:
        """Forget every position of the sequence (-1: of every sequence)."""
        if seq < 0:
            _capi.llama_memory_clear(self._mem, True)
        else:
            self.remove(0, seq)

    def pos_max(self, seq: int = 0) -> int:
        """The highest position the context holds of the sequence (-1: none)."""
        return int(_capi.llama_memory_seq_pos_max(self._mem, seq))

    def free(self) -> None:
        _capi.llama_batch_ext_free(self._batch)
        _capi.llama_free(self.ctx)
        self.ctx = self._batch = self._mem = None


# -- ggml's backend registry (ggml-backend.h), which llama-cpp-python does not bind ---------------------------
def ggml_function(name: str, argtypes: list[Any], restype: Any) -> Callable[..., Any]:
    """A libggml function with its C signature; libggml[name] is a new function object, so nobody else's
    binding of the same symbol is changed."""
    from llama_cpp._ggml import libggml

    func = libggml[name]
    func.argtypes, func.restype = argtypes, restype
    return func


_p = ctypes.c_void_p  # ggml_backend_dev_t, ggml_backend_reg_t: opaque handles, bound as addresses
dev_count = ggml_function("ggml_backend_dev_count", [], ctypes.c_size_t)
dev_get = ggml_function("ggml_backend_dev_get", [ctypes.c_size_t], _p)
dev_name = ggml_function("ggml_backend_dev_name", [_p], ctypes.c_char_p)
dev_description = ggml_function("ggml_backend_dev_description", [_p], ctypes.c_char_p)
dev_type = ggml_function("ggml_backend_dev_type", [_p], ctypes.c_int)
dev_backend_reg = ggml_function("ggml_backend_dev_backend_reg", [_p], _p)
reg_name = ggml_function("ggml_backend_reg_name", [_p], ctypes.c_char_p)
reg_count = ggml_function("ggml_backend_reg_count", [], ctypes.c_size_t)
reg_get = ggml_function("ggml_backend_reg_get", [ctypes.c_size_t], _p)
reg_by_name = ggml_function("ggml_backend_reg_by_name", [ctypes.c_char_p], _p)
reg_dev_count = ggml_function("ggml_backend_reg_dev_count", [_p], ctypes.c_size_t)
reg_dev_get = ggml_function("ggml_backend_reg_dev_get", [_p, ctypes.c_size_t], _p)
reg_get_proc_address = ggml_function("ggml_backend_reg_get_proc_address", [_p, ctypes.c_char_p], _p)
register = ggml_function("ggml_backend_register", [_p], None)


class DevCaps(ctypes.Structure):
    """struct ggml_backend_dev_caps"""
    _fields_ = [("async_", ctypes.c_bool), ("host_buffer", ctypes.c_bool), ("buffer_from_host_ptr", ctypes.c_bool),
                ("events", ctypes.c_bool)]


class DevProps(ctypes.Structure):
    """struct ggml_backend_dev_props"""
    _fields_ = [("name", ctypes.c_char_p), ("description", ctypes.c_char_p), ("memory_free", ctypes.c_size_t),
                ("memory_total", ctypes.c_size_t), ("type", ctypes.c_int), ("device_id", ctypes.c_char_p),
                ("caps", DevCaps)]


dev_get_props = ggml_function("ggml_backend_dev_get_props", [_p, ctypes.POINTER(DevProps)], None)
