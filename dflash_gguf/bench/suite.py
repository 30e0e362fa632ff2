"""Benchmark prompts: a JSONL file in the shared prompt format, or the built-in default suite.

The built-in suite is 18 prompts (6 math, 6 code, 6 chat) taken from the end of each source's range in
the training prompts, so that a benchmark can be run on prompts the drafter was not trained on, and 9
copy-heavy prompts (category "copy-heavy") where the answer re-emits text the prompt holds: code to fix,
rewrite or refactor (GPTeacher codegen, MIT; Open-Assistant eval, Apache-2.0) and pasted documents to
reformat, rewrite or extract from (Open-Assistant eval and self-instruct seed tasks, Apache-2.0), copied
verbatim with their source, origin and license in each line. They were chosen by what they ask (the text to
edit is in the prompt) before any lookup run, and may overlap the drafter's training prompts (it matters
for DFlash's tau only; lookup learns nothing offline).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Sequence

from dflash_gguf.train.prompts import Prompt, load_prompts

BUILTIN_SUITE = "bench_prompts.jsonl"


def builtin_suite_path() -> Path:
    return Path(str(resources.files("dflash_gguf") / "data" / BUILTIN_SUITE))


def load_suite(path: Path | None = None, *, categories: Sequence[str] = (), limit: int | None = None) -> list[Prompt]:
    """Prompts from `path` (None: the built-in suite), optionally only some categories, at most `limit` per category.

    Raises ValueError with a one-line message for a missing or malformed file or an empty selection.
    """
    prompts = load_prompts(builtin_suite_path() if path is None else Path(path))
    if categories:
        known = sorted({p.category for p in prompts})
        unknown = [c for c in categories if c not in known]
        if unknown:
            raise ValueError(f"no prompts in categories {unknown}; the file has {known}")
        prompts = [p for p in prompts if p.category in categories]
    if limit is not None:
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        taken: dict[str, int] = {}
        kept = []
        for p in prompts:
            if taken.get(p.category, 0) < limit:
                kept.append(p)
                taken[p.category] = taken.get(p.category, 0) + 1
        prompts = kept
    return prompts
