"""dflash-train: train a DFlash drafter for a GGUF target from a prompts JSONL.

    from dflash_gguf.train import TrainConfig, run
    result = run(TrainConfig(target=Path("model.gguf"), prompts=Path("prompts.jsonl"), out=Path("runs/x")))

Stages (`run(cfg, stage=...)`): "data" (self-distilled responses + feature cache), "train",
"export" (GGUF via dflash_gguf.convert), "tau" (Session τ on held-out prompts); "all" runs them in order.
torch is needed from the train stage on (the `train` extra).
"""

from .config import TrainConfig
from .errors import TrainError
from .pipeline import RunResult, run

__all__ = ["RunResult", "TrainConfig", "TrainError", "run"]
