"""dflash-bench: plain decoding against DFlash on the same target, prompts and settings.

Python API: `run_benchmark(BenchConfig(prompts=load_suite(), drafter=...))` returns a BenchResult, which
`write_json`, `write_markdown` and `write_plot` turn into the files the CLI writes.
"""

from .report import to_markdown, write_json, write_markdown, write_plot
from .results import BenchResult
from .runner import BenchConfig, run_benchmark
from .suite import load_suite

__all__ = [
    "BenchConfig",
    "BenchResult",
    "load_suite",
    "run_benchmark",
    "to_markdown",
    "write_json",
    "write_markdown",
    "write_plot",
]
