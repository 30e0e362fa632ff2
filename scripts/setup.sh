#!/usr/bin/env bash
# Make .venv and install dflash-gguf into it (editable), with the extras named in $1 (e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# llama-cpp-python builds libllama from source: CPU by default, CMAKE_ARGS="-DGGML_CUDA=on" or "-DGGML_METAL=on" for GPUs.
# On x86-64, -march=native builds ggml's AMX kernels wherever the CPU advertises AMX; on virtual machines that
# advertise it without enabling the tiles (this project's CI machine) the first batched matmul dies with SIGILL.
# Desktop CPUs have no AMX, so leaving it out costs them nothing. Built without the wheel cache, so that a
# wheel built earlier without these flags is never reused.
if [ "$(uname -m)" = "x86_64" ]; then
    no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    export CFLAGS="${CFLAGS:-} $no_amx" CXXFLAGS="${CXXFLAGS:-} $no_amx"
fi
python -m pip install -q --no-cache-dir "llama-cpp-python==0.3.36"
python -m pip install -q -e ".${1:+[$1]}"
