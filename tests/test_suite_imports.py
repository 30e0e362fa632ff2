"""The suite's helpers import torch and transformers only where a test needs them (a few seconds per process)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_importing_the_shared_helpers_loads_no_torch_or_transformers() -> None:
    code = (
        "import sys; import conftest, checkpoints, upstream, test_seams, test_session; "
        "print(sorted(m for m in ('torch', 'transformers', 'dflash') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=TESTS, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
