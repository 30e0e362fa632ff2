"""Every setting of a `dflash-train` run, with the defaults chosen for small CPU-trained drafters."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..defaults import FLASH_ATTN
from ..kinds import DFLASH, kind_named, kind_names
from .errors import TrainError


@dataclass
class TrainConfig:
    target: Path
    prompts: Path
    out: Path  # run directory: caches, checkpoints, metrics, the GGUF
    # prompts
    test_per_category: int = 40  # held back, never trained on
    hold_out: Path | None = None  # JSONL whose prompt ids are never trained on (e.g. a benchmark)
    category_weights: dict[str, float] = field(default_factory=dict)  # missing categories weigh 1
    max_prompts: int | None = None  # training prompts to answer (None: all)
    eval_prompts_per_category: int = 8  # held-out prompts answered for the periodic τ evaluation
    # generation (self-distillation)
    generate_minutes: float | None = None  # stop generating after this long (resume extends)
    max_new_tokens: int = 256
    max_seq_len: int = 384
    parallel: int = 16
    temperature: float = 0.0
    threads: int = 2
    flash_attn: bool = FLASH_ATTN
    top_k: int = 16  # target logits kept per response token for soft labels (0: none)
    from_archive: Path | None = None  # data stage: rebuild the caches from this token archive by prefill
    archive: Path | None = None  # archive stage output (None: OUT/tokens.npz)
    prefill_batch: int = 512  # rows per prefill decode when rebuilding from an archive
    # model
    kind: str = DFLASH.name  # a registered kind's name (kinds.kind_names)
    draft_layers: int = 1
    feature_layers: int = 5  # how many target layers the drafter reads
    target_layer_ids: list[int] | None = None  # HF ids (layer outputs); None: spread over the target
    block_size: int = 16
    draft_vocab: int | None = 8192  # None: the full target vocabulary
    mask_token_id: int | None = None
    init_from_target: bool = False  # draft layers from the target's top layers, final norm from its output norm
    # DFlash 2
    conv_kernel_size: int = 2  # taps of the grouped dynamic convolutions
    conv_group_size: int = 64  # channels per convolution group
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_weight: float = 1.0  # weight of the path-selector loss
    # DSpark
    markov_rank: int = 64
    ce_weight: float | None = None  # DSpark: cross-entropy weight (None: 0.1, DeepSpec's)
    l1_weight: float = 0.9  # DSpark: total-variation weight against the target distribution
    confidence_weight: float = 1.0  # DSpark: confidence-head BCE weight
    # training
    steps: int = 2000
    lr: float = 6e-4
    warmup: int = 50
    weight_decay: float = 0.01
    batch_sequences: int = 4
    blocks_per_sequence: int = 32
    gamma: float | None = None  # None: the paper's value for the block size
    soft_labels: float = 0.0  # weight of the soft (target top-k) cross-entropy; 1-w stays on the hard label
    eval_every: int = 200
    save_every: int = 100
    seed: int = 0
    device: str = "auto"
    dtype: str = "auto"
    # output
    gguf: Path | None = None  # None: OUT/drafter.gguf
    outtype: str = "f16"
    # Session τ on held-out prompts (stage "tau")
    tau_prompts_per_category: int = 10
    tau_max_tokens: int = 128

    def validate(self) -> None:
        """TrainError for values no run could use."""
        positive = {
            "parallel": self.parallel, "max_new_tokens": self.max_new_tokens, "max_seq_len": self.max_seq_len,
            "threads": self.threads, "draft_layers": self.draft_layers, "feature_layers": self.feature_layers,
            "batch_sequences": self.batch_sequences, "blocks_per_sequence": self.blocks_per_sequence,
            "eval_every": self.eval_every, "save_every": self.save_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise TrainError(f"{name} must be >= 1, got {value}")
        if self.block_size < 2:
            raise TrainError(f"block_size must be >= 2, got {self.block_size}")
        if self.steps < 0 or self.test_per_category < 0 or self.warmup < 0:
            raise TrainError("steps, test_per_category and warmup must be >= 0")
        if self.lr <= 0:
            raise TrainError(f"lr must be > 0, got {self.lr}")
        if self.draft_vocab is not None and self.draft_vocab < 2:
            raise TrainError(f"draft_vocab must be >= 2, got {self.draft_vocab}")
        if self.device not in ("auto", "cpu", "cuda", "mps"):
            raise TrainError(f"device must be auto, cpu, cuda or mps, got {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise TrainError(f"dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.kind not in kind_names():
            raise TrainError(f"kind must be one of {', '.join(kind_names())}, got {self.kind!r}")
        if not kind_named(self.kind).reduced_vocab and self.draft_vocab is not None:
            raise TrainError(f"--kind {self.kind} needs the full vocabulary (--draft-vocab 0): its path selector spans the target vocabulary")
        if not 0.0 <= self.soft_labels <= 1.0:
            raise TrainError(f"soft_labels must be in [0, 1], got {self.soft_labels}")
        if self.soft_labels > 0 and self.top_k < 1:
            raise TrainError("soft labels need the target's top-k logits in the cache (--top-k >= 1)")
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "markov_rank", "prefill_batch"):
            if getattr(self, name) < 1:
                raise TrainError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.top_k < 0:
            raise TrainError(f"top_k must be >= 0, got {self.top_k}")
        if self.outtype not in ("f32", "f16", "bf16", "q8_0"):
            raise TrainError(f"outtype must be f32, f16, bf16 or q8_0, got {self.outtype!r}")

    @property
    def archive_path(self) -> Path:
        return Path(self.archive) if self.archive else Path(self.out) / "tokens.npz"

    @property
    def gguf_path(self) -> Path:
        return Path(self.gguf) if self.gguf else Path(self.out) / "drafter.gguf"

    def to_json(self) -> str:
        d = asdict(self)
        return json.dumps({k: str(v) if isinstance(v, Path) else v for k, v in d.items()}, indent=2)
