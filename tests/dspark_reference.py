"""DSpark drafters for tests: checkpoints in DeepSpec's layout, and a numpy forward written from its semantics.

The checkpoint is DeepSpec's `Qwen3DSparkModel` state: a DFlash backbone (built by z-lab's reference package,
as tests/checkpoints.py does) plus `markov_head.markov_w1` (an embedding of the previous token, vocab x rank),
`markov_head.markov_w2` (rank -> draft vocab) and, optionally, `confidence_head.proj` over
[hidden; markov_w1[prev]]. Its config follows DeepSpec's `build_draft_config` (top-level block_size,
mask_token_id, target_layer_ids, markov_rank, markov_head_type, enable_confidence_head), or the
speculators export's nested `transformer_layer_config` + `aux_hidden_state_layer_ids`.

`reference_block` recomputes one drafted block the way DeepSpec's evaluator does
(`forward_dspark_draft_block` + `sample_draft_tokens` + `_predict_confidence_logits`), in float64.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    HIDDEN_SIZE, MASK_TOKEN_ID, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, RMS_NORM_EPS, ROPE_THETA, TARGET_LAYER_IDS,
    VOCAB_SIZE, make_reference_checkpoint,
)

MARKOV_RANK = 32
DRAFT_VOCAB = 4096


def make_dspark_checkpoint(
    directory: Path,
    *,
    anchor_first: bool = True,
    confidence: bool = True,
    draft_vocab: int | None = None,
    schema: str = "deepspec",
    block_size: int = 8,
    rank: int = MARKOV_RANK,
    seed: int = 0,
    markov_scale: float = 2.0,
    extra_config: dict | None = None,
) -> Path:
    """A random-weight DSpark checkpoint (bf16) for the embedded target. schema: "deepspec" | "speculators".

    `draft_vocab` gives it a reduced vocabulary: d2t (offsets, DeepSpec/EAGLE's convention) over a seeded
    random subset of the target tokens, and its own lm_head. Markov weights are scaled so the bias moves
    the argmax often (the chain then matters).
    """
    directory = Path(directory)
    make_reference_checkpoint(directory, kind="dflash", seed=seed, block_size=block_size)
    return add_dspark_heads(
        directory, vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, anchor_first=anchor_first, confidence=confidence,
        draft_vocab=draft_vocab, schema=schema, rank=rank, seed=seed, markov_scale=markov_scale,
        extra_config=extra_config,
    )


def add_dspark_heads(
    directory: Path,
    *,
    vocab_size: int,
    hidden_size: int,
    anchor_first: bool = True,
    confidence: bool = True,
    draft_vocab: int | None = None,
    schema: str = "deepspec",
    rank: int = MARKOV_RANK,
    seed: int = 0,
    markov_scale: float = 2.0,
    extra_config: dict | None = None,
) -> Path:
    """Turn a reference DFlash checkpoint folder (any target geometry) into a DSpark one, in place."""
    directory = Path(directory)
    config = json.loads((directory / "config.json").read_text())
    state = load_file(directory / "model.safetensors")
    g = torch.Generator().manual_seed(1000 + seed)
    n_rows = draft_vocab or vocab_size
    state["markov_head.markov_w1.weight"] = (torch.randn(vocab_size, rank, generator=g) * markov_scale).to(torch.bfloat16)
    state["markov_head.markov_w2.weight"] = (torch.randn(n_rows, rank, generator=g) * markov_scale).to(torch.bfloat16)
    if confidence:
        state["confidence_head.proj.weight"] = (torch.randn(1, hidden_size + rank, generator=g) * 0.1).to(torch.bfloat16)
        state["confidence_head.proj.bias"] = torch.tensor([0.5], dtype=torch.bfloat16)
    if draft_vocab:
        ids = np.sort(np.random.default_rng(seed).choice(vocab_size, size=draft_vocab, replace=False))
        state["d2t"] = torch.from_numpy(ids - np.arange(draft_vocab)).to(torch.int64)
        state["t2d"] = torch.zeros(vocab_size, dtype=torch.bool)  # ignored, as upstream does
        state["lm_head.weight"] = (torch.randn(draft_vocab, hidden_size, generator=g) * 0.02).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")

    dflash_config = config.pop("dflash_config")
    config.pop("num_target_layers", None)
    config.update(
        markov_rank=rank, markov_head_type="vanilla", enable_confidence_head=confidence,
        num_anchors=512, block_size=dflash_config["block_size"],
    )
    if confidence:
        config["confidence_head_with_markov"] = True
    if draft_vocab:
        config["draft_vocab_size"] = draft_vocab
    if schema == "deepspec":
        config.update(architectures=["Qwen3DSparkModel"], mask_token_id=dflash_config["mask_token_id"],
                      target_layer_ids=list(dflash_config["target_layer_ids"]))
        if not anchor_first:
            config["sample_from_anchor"] = False
    elif schema == "speculators":
        backbone = {k: config.pop(k) for k in list(config) if k not in ("markov_rank", "markov_head_type",
                    "enable_confidence_head", "confidence_head_with_markov", "draft_vocab_size", "block_size")}
        backbone.pop("architectures", None)
        config = {
            "architectures": ["DSparkSpeculator"],
            "transformer_layer_config": backbone,
            "aux_hidden_state_layer_ids": [i + 1 for i in dflash_config["target_layer_ids"]],
            "mask_token_id": dflash_config["mask_token_id"],
            **config,
        }
        if anchor_first:
            config["sample_from_anchor"] = True
    else:
        raise ValueError(f"schema must be 'deepspec' or 'speculators', got {schema!r}")
    config.update(extra_config or {})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


# --- the reference forward ---------------------------------------------------------------------------


@dataclass
class Weights:
    """A DSpark checkpoint's tensors (float64), plus the target's embeddings and head it borrows."""

    t: dict[str, np.ndarray]
    embed: np.ndarray  # (V, H) target token embeddings
    head: np.ndarray  # (V, H) target output head (SmolLM2 ties it to the embeddings)

    @classmethod
    def load(cls, directory: Path, embed: np.ndarray, head: np.ndarray) -> "Weights":
        raw = load_file(Path(directory) / "model.safetensors")
        t = {k.removeprefix("model."): (v.to(torch.float64).numpy() if v.is_floating_point() else v.numpy()) for k, v in raw.items()}
        return cls(t, embed.astype(np.float64), head.astype(np.float64))


def _rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + RMS_NORM_EPS) * w


def _rope(x: np.ndarray, pos: np.ndarray) -> np.ndarray:
    """NeoX rotation (rotate_half) over the head dim; x (n, heads, d)."""
    half = HEAD_DIM // 2
    inv = ROPE_THETA ** (-np.arange(half) / half)
    ang = pos[:, None] * inv[None]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def backbone(w: Weights, features: np.ndarray, block_ids: Sequence[int], p0: int) -> np.ndarray:
    """Post-norm hidden states of the block tokens at positions p0.., context = features at 0..p0-1."""
    t = w.t
    ctx = _rms(features.astype(np.float64) @ t["fc.weight"].T, t["hidden_norm.weight"])
    h = w.embed[list(block_ids)]
    n_ctx, n = ctx.shape[0], h.shape[0]
    pos_ctx, pos_blk = np.arange(n_ctx, dtype=np.float64), p0 + np.arange(n, dtype=np.float64)
    groups = NUM_HEADS // NUM_KV_HEADS
    L = "layers.0."
    x = _rms(h, t[L + "input_layernorm.weight"])
    q = (x @ t[L + "self_attn.q_proj.weight"].T).reshape(n, NUM_HEADS, HEAD_DIM)
    q = _rope(_rms(q, t[L + "self_attn.q_norm.weight"]), pos_blk)
    kv_in = np.concatenate([ctx, x])
    k = (kv_in @ t[L + "self_attn.k_proj.weight"].T).reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    k = _rope(_rms(k, t[L + "self_attn.k_norm.weight"]), np.concatenate([pos_ctx, pos_blk]))
    v = (kv_in @ t[L + "self_attn.v_proj.weight"].T).reshape(-1, NUM_KV_HEADS, HEAD_DIM)
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(HEAD_DIM)  # non-causal: every block token sees all
    scores -= scores.max(-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(-1, keepdims=True)
    attn = np.einsum("hqk,khd->qhd", p, v).reshape(n, NUM_HEADS * HEAD_DIM)
    h = h + attn @ t[L + "self_attn.o_proj.weight"].T
    y = _rms(h, t[L + "post_attention_layernorm.weight"])
    gate, up = y @ t[L + "mlp.gate_proj.weight"].T, y @ t[L + "mlp.up_proj.weight"].T
    h = h + (gate / (1 + np.exp(-gate)) * up) @ t[L + "mlp.down_proj.weight"].T
    return _rms(h, t["norm.weight"])


def base_logits(w: Weights, hidden: np.ndarray) -> np.ndarray:
    """Unbiased logits over the target vocabulary (-inf outside a reduced draft vocabulary)."""
    t = w.t
    if "d2t" not in t:
        return hidden @ w.head.T
    ids = t["d2t"].astype(np.int64) + np.arange(t["d2t"].size)
    out = np.full((hidden.shape[0], w.head.shape[0]), -np.inf)
    out[:, ids] = hidden @ t["lm_head.weight"].T
    return out


def markov_bias(w: Weights, prev: int) -> np.ndarray:
    t = w.t
    b = t["markov_head.markov_w2.weight"] @ t["markov_head.markov_w1.weight"][prev]
    if "d2t" not in t:
        return b
    full = np.zeros(w.head.shape[0])
    full[t["d2t"].astype(np.int64) + np.arange(t["d2t"].size)] = b
    return full


def reference_block(
    w: Weights, features: np.ndarray, last: int, p0: int, n_draft: int, *, anchor_first: bool,
    mask_token_id: int = MASK_TOKEN_ID, tokens: Sequence[int] | None = None,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(biased logits (n_draft, V), confidences (n_draft,) or None, drafted tokens) of one block.

    The chain conditions each slot on the previous drafted token: `tokens` when given (a sampled draft),
    else each slot's argmax (greedy).
    """
    lead = 0 if anchor_first else 1
    ids = [last] + [mask_token_id] * (n_draft + lead - 1)
    hidden = backbone(w, features, ids, p0)[lead:]
    base = base_logits(w, hidden)
    t = w.t
    logits, confs, drafted = [], [], []
    prev = last
    for i in range(n_draft):
        row = base[i] + markov_bias(w, prev)
        logits.append(row)
        if "confidence_head.proj.weight" in t:
            feat = np.concatenate([hidden[i], t["markov_head.markov_w1.weight"][prev]])
            z = float(t["confidence_head.proj.weight"][0] @ feat + t["confidence_head.proj.bias"][0])
            confs.append(1 / (1 + np.exp(-z)))
        tok = int(row.argmax()) if tokens is None else int(tokens[i])
        drafted.append(tok)
        prev = tok
    return np.array(logits), (np.array(confs) if confs else None), np.array(drafted)
