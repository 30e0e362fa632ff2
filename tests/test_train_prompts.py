"""Prompt loading (one-line errors naming the line), the held-out split and the category mix."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from dflash_gguf.train.errors import TrainError
from dflash_gguf.train.prompts import Prompt, load_prompts, split_prompts, weighted_order


def write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines))
    return path


def row(i, category="math", prompt=None):
    return json.dumps({"id": f"p{i}", "category": category, "prompt": prompt or f"question {i}"})


def test_loads_rows_and_skips_blank_lines(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [row(0), "", row(1, "code")])
    prompts = load_prompts(path)
    assert [(p.id, p.category) for p in prompts] == [("p0", "math"), ("p1", "code")]


@pytest.mark.parametrize(
    "bad, message",
    [
        ("{not json", "p.jsonl:2: not valid JSON"),
        ('["a list"]', "p.jsonl:2: expected a JSON object"),
        ('{"category": "math"}', "p.jsonl:2: 'prompt' must be a non-empty string"),
        ('{"prompt": "hi", "category": ""}', "p.jsonl:2: 'category' must be a non-empty string"),
    ],
)
def test_malformed_line_is_named(tmp_path, bad, message):
    path = write_lines(tmp_path / "p.jsonl", [row(0), bad])
    with pytest.raises(TrainError, match=message):
        load_prompts(path)


def test_empty_and_missing_files(tmp_path):
    empty = write_lines(tmp_path / "e.jsonl", ["", "  "])
    with pytest.raises(TrainError, match="no prompts"):
        load_prompts(empty)
    with pytest.raises(TrainError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")


def test_split_holds_back_per_category_deterministically_and_excludes_hold_out():
    prompts = [Prompt(f"m{i}", "math", "x") for i in range(20)] + [Prompt(f"c{i}", "chat", "x") for i in range(5)]
    train, test = split_prompts(prompts, 3, seed=1, hold_out={"m0"})
    assert Counter(p.category for p in test if p.id != "m0") == {"math": 3, "chat": 3}
    assert "m0" in {p.id for p in test} and "m0" not in {p.id for p in train}
    assert not {p.id for p in train} & {p.id for p in test}
    assert len(train) + len(test) == len(prompts)
    again_train, again_test = split_prompts(prompts, 3, seed=1, hold_out={"m0"})
    assert [p.id for p in again_test] == [p.id for p in test]
    _, other = split_prompts(prompts, 3, seed=2, hold_out={"m0"})
    assert [p.id for p in other] != [p.id for p in test]


def test_weighted_order_keeps_the_mix_in_every_prefix():
    prompts = [Prompt(f"m{i}", "math", "x") for i in range(100)] + [Prompt(f"c{i}", "chat", "x") for i in range(10)]
    order = weighted_order(prompts, {"math": 2.0, "chat": 1.0}, seed=0)
    head = Counter(p.category for p in order[:30])
    assert head == {"math": 20, "chat": 10}
    assert len(order) == 110  # chat runs out, math continues
