#!/usr/bin/env bash
# Install the project with its test extras into .venv, then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
. .venv/bin/activate
# z-lab's reference implementation, the numerical oracle; --no-deps because it pins datasets and tqdm
python -m pip install -q --no-deps "dflash==0.1.0"
python -m pytest "$@"
