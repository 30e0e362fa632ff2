"""The ggml backends and devices the loaded libllama has, and which of them hold a model's layers.

One place for what dflash-doctor, Session stats, the chat's title, the server's /health, the saved
calibration's key and the offload test plugin say about the hardware. The build says which backends exist;
only the model's own device list and its n_gpu_layers say where its layers are: a Vulkan build with
n_gpu_layers=0 still runs on the CPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import llama_cpp
from llama_cpp import llama_cpp as capi

from . import llama_ext
from .target import init_backend, system_info

# enum ggml_backend_dev_type (ggml-backend.h), in order
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")
GPU_KINDS = ("gpu", "igpu")


@dataclass(frozen=True)
class Device:
    """One ggml device: its name (CPU, CUDA0, Vulkan0, MTL0), what the backend calls it, its type, its backend."""

    name: str
    description: str
    kind: str  # cpu, gpu, igpu, accel, meta
    backend: str  # the backend registry's name: CPU, CUDA, Vulkan, MTL (Metal), BLAS, ...

    @property
    def label(self) -> str:
        """'CUDA0 (NVIDIA GeForce RTX 4090)'; the CPU is 'CPU' (its description is the CPU model, which
        the benchmark's machine record carries)."""
        return "CPU" if self.kind == "cpu" else f"{self.name} ({self.description})"

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def _text(raw: bytes | None) -> str:
    return raw.decode("utf-8", errors="replace") if raw else ""


def _device(dev: int) -> Device:
    kind = llama_ext.dev_type(dev)
    return Device(name=_text(llama_ext.dev_name(dev)), description=_text(llama_ext.dev_description(dev)),
                  kind=DEVICE_KINDS[kind] if 0 <= kind < len(DEVICE_KINDS) else f"type {kind}",
                  backend=_text(llama_ext.reg_name(llama_ext.dev_backend_reg(dev))))


def devices() -> list[Device]:
    """Every device ggml registered, in its order (the CPU, accelerators like BLAS, GPUs)."""
    init_backend()  # loads the backends of a GGML_BACKEND_DL build; once per process
    return [_device(llama_ext.dev_get(i)) for i in range(llama_ext.dev_count())]


def gpu_devices() -> list[Device]:
    """The devices libllama offloads layers to when n_gpu_layers asks it to (discrete and integrated GPUs)."""
    return [d for d in devices() if d.kind in GPU_KINDS]


def backends() -> str:
    """The ggml backends registered (built in, or loaded by a GGML_BACKEND_DL build), e.g. 'Vulkan, CPU'.

    From ggml's registry: libllama's system info lists only backends with features to show (the CPU's).
    """
    init_backend()
    return ", ".join(_text(llama_ext.reg_name(llama_ext.reg_get(i))) for i in range(llama_ext.reg_count())) or "unknown"


def build() -> dict[str, Any]:
    """What identifies the loaded libllama build: its package version, the shared object, its system info
    (the CPU features compiled in), its backends and the devices they found."""
    lib = Path(capi._lib._name)
    try:
        stat = lib.stat()
        file = {"path": str(lib), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    except OSError:
        file = {"path": str(lib)}
    return {"llama_cpp_python": llama_cpp.__version__, "libllama": file, "system_info": system_info(),
            "backends": backends(), "devices": [d.as_dict() for d in devices()]}


@dataclass(frozen=True)
class Placement:
    """Where one model's layers are: libllama puts the last `n_offloaded` of its `n_layers` (the output
    layer counted, as its 'offloaded n/m layers' log line does) on its devices, the rest on the CPU."""

    gpus: tuple[Device, ...]  # the model's offload devices, sharing the offloaded layers (none when none is)
    n_offloaded: int
    n_layers: int

    @property
    def on_cpu(self) -> bool:
        """Whether any layer runs on the CPU."""
        return self.n_offloaded < self.n_layers

    @property
    def backend(self) -> str:
        """'CPU', 'Vulkan', or 'CUDA, CPU' for a partial offload."""
        names = [d.backend for d in self.gpus] + (["CPU"] if self.on_cpu else [])
        return ", ".join(dict.fromkeys(names))

    @property
    def device(self) -> str:
        """'CPU', 'Vulkan0 (llvmpipe ...)', or 'CUDA0 (...) 20/31 layers, CPU' for a partial offload."""
        if not self.gpus:
            return "CPU"
        gpus = ", ".join(d.label for d in self.gpus)
        return f"{gpus} {self.n_offloaded}/{self.n_layers} layers, CPU" if self.on_cpu else gpus

    def as_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "device": self.device, "layers_offloaded": f"{self.n_offloaded}/{self.n_layers}",
                "devices": [d.as_dict() for d in self.gpus]}


def placement(model: capi.llama_model_p, n_gpu_layers: int) -> Placement:
    """Where libllama put this loaded model's layers, asked for with n_gpu_layers (-1 or more than it has: all).

    The devices are the model's own list (libllama's choice from the build's GPUs, after *_VISIBLE_DEVICES);
    with none, or n_gpu_layers=0, every layer is on the CPU whatever the build has.
    """
    n_layers = capi.llama_model_n_layer(model) + 1
    gpus = []
    for i in range(llama_ext.model_n_devices(model)):
        dev = llama_ext.model_get_device(model, i)
        if dev:
            gpus.append(_device(dev))
    wanted = n_layers if n_gpu_layers < 0 else n_gpu_layers
    offloaded = min(wanted, n_layers) if gpus else 0
    return Placement(tuple(gpus) if offloaded else (), offloaded, n_layers)
