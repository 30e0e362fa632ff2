"""Training prompts: load and validate the JSONL file, split off a held-out test set, order by weight.

The format is that of `train_prompts.jsonl`: one JSON object a line with at least `prompt` and
`category` (`id` and `source` are kept when present). Errors name the file and the line.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Collection, Mapping, Sequence

from .errors import TrainError


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    prompt: str
    source: str = ""
    schema: dict | None = None  # a JSON schema the reply must follow (the bench's json category)


def load_prompts(path: Path) -> list[Prompt]:
    """Every prompt in `path`; TrainError naming the line if one is malformed, or if there are none."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"prompts file not found: {path}")
    prompts: list[Prompt] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise TrainError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TrainError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            text, category = obj.get("prompt"), obj.get("category")
            if not isinstance(text, str) or not text.strip():
                raise TrainError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
            if not isinstance(category, str) or not category.strip():
                raise TrainError(f"{path}:{lineno}: 'category' must be a non-empty string")
            schema = obj.get("schema")
            if schema is not None and not isinstance(schema, dict):
                raise TrainError(f"{path}:{lineno}: 'schema' must be a JSON schema object")
            prompts.append(
                Prompt(
                    id=str(obj.get("id", f"line-{lineno}")),
                    category=category,
                    prompt=text,
                    source=str(obj.get("source", "")),
                    schema=schema,
                )
            )
    if not prompts:
        raise TrainError(f"{path}: no prompts (the file is empty)")
    return prompts


def split_prompts(
    prompts: Sequence[Prompt], n_test_per_category: int, seed: int, hold_out: Collection[str] = ()
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, test): each category shuffled with `seed`, its first `n_test_per_category` held out;
    prompts whose id is in `hold_out` (e.g. a benchmark's) are never trained on either.

    The split depends only on the file and the seed, so a resumed run holds out the same prompts.
    """
    by_category: dict[str, list[Prompt]] = defaultdict(list)
    excluded = [p for p in prompts if p.id in hold_out]
    for p in prompts:
        if p.id not in hold_out:
            by_category[p.category].append(p)
    train: list[Prompt] = []
    test: list[Prompt] = []
    for category in sorted(by_category):
        items = list(by_category[category])
        random.Random(f"{seed}:{category}").shuffle(items)
        n_test = min(n_test_per_category, len(items) - 1) if len(items) > 1 else 0
        test.extend(items[:n_test])
        train.extend(items[n_test:])
    return train, test + excluded


def weighted_order(prompts: Sequence[Prompt], weights: Mapping[str, float], seed: int) -> list[Prompt]:
    """All prompts, interleaved so that any prefix holds the categories in proportion to `weights`.

    Generation is cut short by time, so the order decides the mix actually trained on. Categories
    missing from `weights` get weight 1; a category that runs out drops out of the mix.
    """
    queues: dict[str, list[Prompt]] = defaultdict(list)
    for p in prompts:
        queues[p.category].append(p)
    rng = random.Random(seed)
    for q in queues.values():
        rng.shuffle(q)
    for category, w in weights.items():
        if w < 0:
            raise TrainError(f"category weight for {category!r} must be >= 0, got {w}")
    # deterministic weighted round robin: always take from the category furthest behind its share
    taken = {c: 0 for c in queues}
    order: list[Prompt] = []
    active = [c for c in sorted(queues) if weights.get(c, 1.0) > 0]
    while active:
        c = min(active, key=lambda c: (taken[c] + 1) / weights.get(c, 1.0))
        order.append(queues[c][taken[c]])
        taken[c] += 1
        if taken[c] == len(queues[c]):
            active.remove(c)
    return order
