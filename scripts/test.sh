#!/usr/bin/env bash
# Install the project and its test dependencies into .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# llama-cpp-python builds libllama from source (CPU by default; set CMAKE_ARGS for CUDA/Metal)
python -m pip install -q -e ".[test]"
# z-lab's reference implementation, the numerical oracle; --no-deps because it pins datasets/tqdm
python -m pip install -q --no-deps "dflash==0.1.0"
python -m pytest "$@"
