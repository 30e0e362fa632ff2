"""The one exception the trainer raises for bad input, so the CLI can print it as one line."""

from __future__ import annotations


class TrainError(ValueError):
    """A problem with the trainer's input (target, prompts, disk, checkpoint) stated in one line."""
