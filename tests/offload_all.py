"""pytest plugin (`-p offload_all`): every model the test process loads goes onto the GPU, every layer.

scripts/test_vulkan.sh loads it so that the ordinary lossless tests run unchanged on a device backend:
targets, drafters and the llama_cpp.Llama references they compare with all pass through
llama_model_load_from_file, so greedy output is compared with plain decoding on the same backend.
With DFLASH_OFFLOAD_FLASH_ATTN=off every context is made without flash attention (lavapipe crashes in
its driver on some flash-attention batches: docs/BACKENDS.md), references and Sessions alike.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading

import pytest
from llama_cpp import llama_cpp as capi
from llama_cpp._logger import llama_log_callback

from dflash_gguf.backends import gpu_devices

ALL_LAYERS = 0x7FFFFFFF  # what n_gpu_layers=-1 becomes in llama-cpp-python and dflash_gguf.target
DEVICES = pytest.StashKey[list]()  # the GPU devices found, for the report header
MESA = pytest.StashKey["tuple[int, int, int] | None"]()  # the Mesa release of the Vulkan driver, None if not Mesa


_load = capi.llama_model_load_from_file
_log: list[str] = []
LOADED: list[tuple[str, str]] = []  # (path, "offloaded/offloadable") of every model loaded, in order
_loading = threading.Lock()
OFFLOADED = re.compile(r"offloaded (\d+)/(\d+) layers to GPU")


@capi.llama_log_callback
def _record(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    _log.append(text.decode("utf-8", errors="replace"))


def _load_offloaded(path_model: bytes, params: capi.llama_model_params) -> capi.llama_model_p:
    """llama_model_load_from_file with n_gpu_layers = all, failing unless libllama says it offloaded them all."""
    params = capi.llama_model_params.from_buffer_copy(params)
    params.n_gpu_layers = ALL_LAYERS
    with _loading:
        _log.clear()
        capi.llama_log_set(_record, ctypes.c_void_p(0))
        try:
            model = _load(path_model, params)
        finally:
            capi.llama_log_set(llama_log_callback, ctypes.c_void_p(0))
        text = "".join(_log)
    if model:
        m = OFFLOADED.search(text)
        if m is None or m[1] != m[2]:
            capi.llama_model_free(model)
            raise AssertionError(f"{path_model.decode()}: not every layer on the GPU ({m[0] if m else 'no offload line'})")
        LOADED.append((path_model.decode(), f"{m[1]}/{m[2]}"))
    return model


_init = capi.llama_init_from_model


def _init_without_flash_attn(model: capi.llama_model_p, params: capi.llama_context_params) -> capi.llama_context_p:
    params = capi.llama_context_params.from_buffer_copy(params)
    params.flash_attn_type = capi.LLAMA_FLASH_ATTN_TYPE_DISABLED
    return _init(model, params)


def mesa_version() -> tuple[int, int, int] | None:
    """The Mesa release behind the Vulkan driver (vulkaninfo's driverInfo), None without vulkaninfo or Mesa.

    lavapipe's faults depend on it (docs/BACKENDS.md), so the tests that pin them ask which one runs.
    """
    if shutil.which("vulkaninfo") is None:
        return None
    out = subprocess.run(["vulkaninfo", "--summary"], capture_output=True, text=True, timeout=120).stdout
    m = re.search(r"driverInfo\s*=\s*Mesa (\d+)\.(\d+)\.(\d+)", out)
    return (int(m[1]), int(m[2]), int(m[3])) if m else None


def pytest_configure(config: pytest.Config) -> None:
    devices = [d.label for d in gpu_devices()]
    if not devices:
        raise pytest.UsageError(
            "offload_all: this libllama has no GPU device (a Vulkan build on lavapipe needs GGML_VK_VISIBLE_DEVICES=0)"
        )
    config.stash[DEVICES] = devices
    config.stash[MESA] = mesa_version()
    capi.llama_model_load_from_file = _load_offloaded
    if os.environ.get("DFLASH_OFFLOAD_FLASH_ATTN") == "off":
        capi.llama_init_from_model = _init_without_flash_attn


def pytest_report_header(config: pytest.Config) -> str:
    flash = ", flash attention off" if os.environ.get("DFLASH_OFFLOAD_FLASH_ATTN") == "off" else ""
    mesa = config.stash[MESA]
    driver = f", Mesa {'.'.join(map(str, mesa))}" if mesa else ""
    vulkan = any(d.startswith("Vulkan") for d in config.stash[DEVICES])
    f16 = (", f16 off (GGML_VK_DISABLE_F16)" if "GGML_VK_DISABLE_F16" in os.environ else ", f16 on") if vulkan else ""
    return f"offload_all: every layer of every model on {', '.join(config.stash[DEVICES])}{driver}{flash}{f16}"

