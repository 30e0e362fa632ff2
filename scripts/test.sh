#!/usr/bin/env bash
# Install the project with its test extras into .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
# z-lab's reference implementation, the numerical oracle; --no-deps because it pins datasets and tqdm
python -m pip install -q --no-deps "dflash==0.1.0"
# upstream llama.cpp's own converter (from the sdist of the llama-cpp-python we pin) is an oracle too:
# it builds the hybrid-target fixtures and the conformance references
src=".cache/upstream"
if [ ! -f "$src/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py" ]; then
    mkdir -p "$src"
    python -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$src"
    tar -xzf "$src/llama_cpp_python-0.3.36.tar.gz" -C "$src"
fi
export DFLASH_LLAMA_CPP_SRC="$PWD/$src/llama_cpp_python-0.3.36/vendor/llama.cpp"
# the real agent programs tests/test_agents.py runs against dflash-serve (npm and PyPI, pinned)
bash scripts/install_agents.sh
# one worker per core (at most 8), each taking whole files (--dist loadfile): a module's fixtures (its Sessions,
# servers, built checkpoints) are made once, in one worker. Arguments come after, so "-n 0" runs in one process.
python -m pytest -n auto --maxprocesses 8 --dist loadfile "$@"
