#!/usr/bin/env bash
# Make .venv and install dflash-gguf into it (editable), with the extras named in $1 (e.g. "test").
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# llama-cpp-python builds libllama from source: CPU by default, CMAKE_ARGS="-DGGML_CUDA=on" or "-DGGML_METAL=on" for GPUs
python -m pip install -q -e ".${1:+[$1]}"
