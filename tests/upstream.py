"""Where the tests find upstream llama.cpp's sources (its converter is an oracle): scripts/test.sh unpacks
the pinned llama-cpp-python sdist into .cache/upstream and exports DFLASH_LLAMA_CPP_SRC."""

from __future__ import annotations

import os
from pathlib import Path

LLAMA_CPP_SRC = Path(
    os.environ.get(
        "DFLASH_LLAMA_CPP_SRC",
        Path(__file__).resolve().parent.parent / ".cache/upstream/llama_cpp_python-0.3.36/vendor/llama.cpp",
    )
)
