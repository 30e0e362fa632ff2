"""What the data stage hands the training stage: the target's geometry, the feature caches and the prompt split.

Its own module so that the pipeline (which makes it) and the trainer (which reads it) import it from below,
not from each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from .data import FeatureCache
from .prompts import Prompt
from .target_spec import TargetSpec


@dataclass
class RunData:
    spec: TargetSpec
    layer_ids: list[int]  # HF ids
    train: FeatureCache
    eval: FeatureCache
    train_prompts: list[Prompt]
    test_prompts: list[Prompt]
