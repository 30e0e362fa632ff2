"""The machine and build a benchmark ran on, so figures can be compared with the conditions they came from."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
from pathlib import Path

import llama_cpp

from dflash_gguf.backends import backends
from dflash_gguf.target import system_info


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ggml_version() -> str | None:
    """libggml's version from the shared object llama-cpp-python loaded (its file name carries it)."""
    lib = Path(llama_cpp.__file__).parent / "lib"
    versions = sorted(re.findall(r"libggml\.so\.(\d+\.\d+\.\d+)", " ".join(p.name for p in lib.glob("libggml.so.*"))))
    return versions[-1] if versions else None


def machine_info(n_threads: int) -> dict:
    info = system_info()
    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "n_threads": n_threads,
        "backend": backends(),
        "system_info": info,
        "llama_cpp_python": importlib.metadata.version("llama-cpp-python"),
        "ggml": ggml_version(),
        # the installed wheel records no llama.cpp commit; each llama-cpp-python release vendors one
        "llama_cpp_commit": "not recorded by the installed build (fixed by the llama-cpp-python version)",
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
