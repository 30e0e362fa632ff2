"""The DFlash drafter in plain torch, with the z-lab parameter names, for training.

One forward drafts many blocks of one sequence at once under a block-sparse mask (see recipe.py).
The target's token embedding and LM head are frozen buffers (SmolLM2-style targets tie them); a
reduced draft vocabulary keeps its own frozen head of the kept rows plus the `d2t` map.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

CHECKPOINT_WEIGHTS = "model.safetensors"
CHECKPOINT_CONFIG = "config.json"


@dataclass
class DrafterConfig:
    """Geometry of the drafter and of the target it serves (z-lab `config.json` fields)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    block_size: int
    mask_token_id: int
    max_position_embeddings: int = 8192
    draft_vocab_size: int | None = None  # None = the full target vocabulary
    extra: dict = field(default_factory=dict)  # provenance recorded in config.json

    def to_hf(self) -> dict:
        """config.json that `dflash.model.DFlashDraftModel.from_pretrained` reads (a Qwen3Config)."""
        cfg = {
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "num_target_layers": self.num_target_layers,
            "block_size": self.block_size,
            "dflash_config": {
                "block_size": self.block_size,
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
            "torch_dtype": "float32",
            "dflash_gguf": self.extra,
        }
        if self.draft_vocab_size is not None:
            cfg["draft_vocab_size"] = self.draft_vocab_size
        return cfg

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        dcfg = cfg.get("dflash_config", {})
        rope = cfg.get("rope_parameters") or {}
        return cls(
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg["num_key_value_heads"],
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
            rms_norm_eps=cfg["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
            vocab_size=cfg["vocab_size"],
            num_target_layers=cfg["num_target_layers"],
            target_layer_ids=list(dcfg["target_layer_ids"]),
            block_size=int(dcfg.get("block_size", cfg.get("block_size", 16))),
            mask_token_id=int(dcfg["mask_token_id"]),
            max_position_embeddings=cfg.get("max_position_embeddings", 8192),
            draft_vocab_size=cfg.get("draft_vocab_size"),
            extra=cfg.get("dflash_gguf", {}),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """NeoX-style rotary embedding of x (batch, heads, seq, head_dim) at integer positions (batch, seq)."""
    dim = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=x.device) / dim))
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)[:, None]
    return (x * emb.cos().to(x.dtype)) + (rotate_half(x) * emb.sin().to(x.dtype))


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_head, self.n_kv, self.head_dim, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(h, self.n_head * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_head * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, x_pos: torch.Tensor, ctx_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """x: block tokens (b, q, h); ctx: projected target features (b, c, h); keys are [ctx ; x]."""
        b, q_len, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)
        kv_pos = torch.cat([ctx_pos, x_pos], dim=1)
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.n_head, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, -1, self.n_kv, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, -1, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = rope(q, x_pos, self.theta), rope(k, kv_pos, self.theta)
        groups = self.n_head // self.n_kv
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, ctx, x_pos, ctx_pos, mask):
        # as in z-lab's layer: the context features enter K/V un-normalised by input_layernorm
        x = x + self.self_attn(self.input_layernorm(x), ctx, x_pos, ctx_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Drafter(nn.Module):
    """DFlash drafter: fc + hidden_norm over the target features, Qwen3-style layers, final norm.

    `embed` (target token embedding) and `head` (target LM head, default: tied to `embed`) are
    frozen buffers; `d2t` (absolute target ids) keeps only those rows of the head.
    """

    def __init__(self, cfg: DrafterConfig, embed: torch.Tensor, head: torch.Tensor | None = None, d2t: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(len(cfg.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.register_buffer("embed", embed.float(), persistent=False)
        head = self.embed if head is None else head.float()
        if d2t is None:
            self.d2t = None
            self.register_buffer("lm_head_weight", head, persistent=False)
        else:
            self.register_buffer("d2t", d2t.long(), persistent=False)
            self.register_buffer("lm_head_weight", head[d2t.long()].clone(), persistent=False)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, 0.02) for linear layers, as Qwen3's `initializer_range`."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    def hidden(self, features: torch.Tensor, ctx_pos: torch.Tensor, block_ids: torch.Tensor, block_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Final-normed hidden states of the block slots (b, q, h).

        features (b, c, n_feat*h) target layers concatenated; ctx_pos (b, c); block_ids/block_pos (b, q).
        """
        ctx = self.hidden_norm(self.fc(features))
        x = F.embedding(block_ids, self.embed)
        for layer in self.layers:
            x = layer(x, ctx, block_pos, ctx_pos, mask)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (its rows are `d2t`, or the target vocabulary)."""
        return hidden @ self.lm_head_weight.T

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """The weights a z-lab checkpoint holds (frozen target tensors excluded)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def save_checkpoint(self, directory: Path) -> Path:
        """Write `config.json` + `model.safetensors` in the z-lab layout, atomically per file.

        A reduced vocabulary adds `lm_head.weight` (the kept rows), `d2t` as offsets
        (target id - draft row, the SpecForge/z-lab convention that llama.cpp's converter reads)
        and the boolean `t2d`.
        """
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = self.trainable_state()
        if self.d2t is not None:
            tensors["lm_head.weight"] = self.lm_head_weight.contiguous()
            tensors["d2t"] = (self.d2t - torch.arange(len(self.d2t))).contiguous()
            t2d = torch.zeros(self.cfg.vocab_size, dtype=torch.bool)
            t2d[self.d2t] = True
            tensors["t2d"] = t2d
        tmp = directory / (CHECKPOINT_WEIGHTS + ".tmp")
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        tmp.replace(directory / CHECKPOINT_WEIGHTS)
        tmp = directory / (CHECKPOINT_CONFIG + ".tmp")
        tmp.write_text(json.dumps(self.cfg.to_hf(), indent=2) + "\n")
        tmp.replace(directory / CHECKPOINT_CONFIG)
        return directory

    @classmethod
    def load_checkpoint(cls, directory: Path, embed: torch.Tensor, head: torch.Tensor | None = None) -> "Drafter":
        """A Drafter from a checkpoint written by `save_checkpoint` (the frozen embedding passed in)."""
        from safetensors.torch import load_file

        directory = Path(directory)
        cfg = DrafterConfig.from_hf(json.loads((directory / CHECKPOINT_CONFIG).read_text()))
        tensors = load_file(str(directory / CHECKPOINT_WEIGHTS))
        d2t = tensors.pop("d2t", None)
        tensors.pop("t2d", None)
        own_head = tensors.pop("lm_head.weight", None)
        model = cls(cfg, embed, head, d2t=None if d2t is None else checkpoint_d2t(d2t))
        model.load_state_dict(tensors)
        if own_head is not None:
            model.lm_head_weight.copy_(own_head)
        return model


def checkpoint_d2t(offsets: torch.Tensor) -> torch.Tensor:
    """Absolute target ids from checkpoint `d2t` offsets (row i maps to `i + offsets[i]`)."""
    return offsets.long() + torch.arange(len(offsets))
