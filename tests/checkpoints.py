"""Real DFlash checkpoints for tests, built with z-lab's reference package.

`dflash.model.DFlashDraftModel` / `DFlash2DraftModel` with the geometry of the embedded
target (SmolLM2-135M), random weights from a seed, written by `save_pretrained`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from transformers import Qwen3Config

# SmolLM2-135M-Instruct, the embedded target
HIDDEN_SIZE = 576
INTERMEDIATE_SIZE = 1536
NUM_HEADS = 9
NUM_KV_HEADS = 3
HEAD_DIM = 64
VOCAB_SIZE = 49152
RMS_NORM_EPS = 1e-5
ROPE_THETA = 100000.0
NUM_TARGET_LAYERS = 30

TARGET_LAYER_IDS = (1, 8, 15, 22, 27)
BLOCK_SIZE = 16
MASK_TOKEN_ID = 16
"""`<empty_output>` in SmolLM2's vocabulary: a special token that ordinary text never produces."""

# DFlash2 extras: conv kernel 3 over groups of 64 channels, a rank-16 selector over the top 4
DFLASH2_CONFIG = {"conv_kernel_size": 3, "conv_group_size": 64, "selector_rank": 16, "selector_top_k": 4}


def reference_config(
    *,
    kind: str = "dflash",
    num_layers: int = 1,
    target_layer_ids: Sequence[int] = TARGET_LAYER_IDS,
    block_size: int = BLOCK_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
) -> Qwen3Config:
    """A Qwen3Config shaped like z-lab's published drafters, sized for the embedded target."""
    dflash_config = {
        "block_size": block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": list(target_layer_ids),
    }
    if kind == "dflash2":
        dflash_config.update(DFLASH2_CONFIG)
    elif kind != "dflash":
        raise ValueError(f"kind must be 'dflash' or 'dflash2', got {kind!r}")
    config = Qwen3Config(
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=num_layers,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB_SIZE,
        rms_norm_eps=RMS_NORM_EPS,
        rope_theta=ROPE_THETA,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
    )
    config.num_target_layers = NUM_TARGET_LAYERS
    config.dflash_config = dflash_config
    return config


def make_reference_checkpoint(
    directory: Path,
    *,
    kind: str = "dflash",
    num_layers: int = 1,
    seed: int = 0,
    target_layer_ids: Sequence[int] = TARGET_LAYER_IDS,
    block_size: int = BLOCK_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: str | None = None,
) -> Path:
    """Save a random-weight reference drafter to `directory` (config.json + safetensors) and return it.

    Every parameter is drawn from the seed (the reference leaves DFlash2's conv bases
    uninitialised): matrices ~ N(0, 0.02), norm weights ~ 1 + N(0, 0.02).
    `max_shard_size` (e.g. "5MB") makes a sharded checkpoint with an index.
    """
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    config = reference_config(
        kind=kind, num_layers=num_layers, target_layer_ids=target_layer_ids,
        block_size=block_size, mask_token_id=mask_token_id,
    )
    model_class = DFlash2DraftModel if kind == "dflash2" else DFlashDraftModel
    model = model_class(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.02
            param.copy_(1.0 + noise if "norm" in name else noise)
    model = model.to(dtype)
    directory = Path(directory)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory
