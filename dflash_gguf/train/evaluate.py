"""τ of a drafter GGUF measured with the runtime's Session on held-out prompts, per category.

This is the number the product delivers: the Session drafts with the GGUF through llama.cpp and
the target verifies, greedy, at a fixed block size. The held-out ids come from OUT/split.json.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from tqdm import tqdm

from .errors import TrainError
from .prompts import Prompt, load_prompts


@dataclass
class TauReport:
    per_category: dict[str, float]  # mean τ over the prompts of a category
    overall: float  # tokens committed / cycles over all prompts
    n_prompts: dict[str, int]
    tokens_per_s: dict[str, float]
    seconds: float
    block_size: int
    max_tokens: int

    def lines(self) -> list[str]:
        cats = ", ".join(
            f"{c} {t:.2f} (n={self.n_prompts[c]}, {self.tokens_per_s[c]:.0f} tok/s)" for c, t in sorted(self.per_category.items())
        )
        return [f"session τ (greedy, block {self.block_size}, {self.max_tokens} tokens): {cats}; all {self.overall:.2f}"]


def held_out_prompts(run_dir: Path, prompts_file: Path, per_category: int, exclude: set[str] = frozenset()) -> list[Prompt]:
    """The first `per_category` test prompts of each category recorded in RUN/split.json."""
    split_path = Path(run_dir) / "split.json"
    if not split_path.is_file():
        raise TrainError(f"{split_path} not found: run the data stage first (it records the held-out split)")
    test = json.loads(split_path.read_text())["test"]
    by_id = {p.id: p for p in load_prompts(prompts_file)}
    chosen = []
    for category, ids in sorted(test.items()):
        kept = [by_id[i] for i in ids if i in by_id and i not in exclude][:per_category]
        chosen.extend(kept)
    return chosen


def session_tau(
    target: Path, drafter: Path, prompts: Sequence[Prompt], *, block_size: int = 16, max_tokens: int = 128,
    n_threads: int = 2, progress: bool = True,
) -> TauReport:
    """Greedy chat generations with a fixed block size; τ = committed tokens per draft/verify cycle."""
    from ..session import Session

    taus: dict[str, list[float]] = defaultdict(list)
    speed: dict[str, list[float]] = defaultdict(list)
    committed = cycles = 0
    t0 = time.time()
    with Session(target, drafter, n_threads=n_threads) as session:
        for p in tqdm(prompts, desc="session τ", unit="prompt", disable=not progress, dynamic_ncols=True):
            r = session.chat([{"role": "user", "content": p.prompt}], max_tokens=max_tokens, temperature=0.0, block_size=block_size)
            s = r.stats
            if s.cycles == 0:
                continue
            taus[p.category].append(s.acceptance_length)
            speed[p.category].append(s.decode_tokens_per_s)
            committed += s.acceptance_length * s.cycles
            cycles += s.cycles
    if not taus:
        raise TrainError("no generation ran a draft cycle: nothing to measure")
    return TauReport(
        per_category={c: sum(v) / len(v) for c, v in taus.items()},
        overall=committed / cycles,
        n_prompts={c: len(v) for c, v in taus.items()},
        tokens_per_s={c: sum(v) / len(v) for c, v in speed.items()},
        seconds=time.time() - t0,
        block_size=block_size,
        max_tokens=max_tokens,
    )
