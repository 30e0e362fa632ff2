"""ctypes bindings for the libllama functions that llama-cpp-python does not bind.

They live in llama.cpp's C++ staging header `src/llama-ext.h`, so they are exported
under C++-mangled names (Itanium on Linux/macOS, MSVC on Windows). This module is the
only place that knows those names.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable

import llama_cpp
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
    funcs = (set_embeddings_nextn, get_embeddings_nextn_ith, set_nextn_layer_offset)
    return all(getattr(f, "__name__", "") != "missing" for f in funcs)


def layer_input_api_present() -> bool:
    """Whether the loaded libllama has the layer-input API DFlash reads the target's features through."""
    return all(getattr(f, "__name__", "") != "missing" for f in (set_embeddings_layer_inp, get_embeddings_layer_inp))


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
