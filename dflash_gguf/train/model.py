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

from ..kinds import DFLASH, kind_named, kind_of_architecture
from ..kinds.training import Training

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
    kind: str = DFLASH.name  # a kinds.DrafterKind name: dflash | dflash2 | dspark
    # read by the kinds' training hooks (kinds/<kind>/training.py): DFlash 2 (z-lab `DFlash2DraftModel`)
    conv_kernel_size: int = 2
    conv_group_size: int = 64
    selector_rank: int = 64
    selector_top_k: int = 16
    # DSpark (DeepSpec vanilla Markov head + confidence head)
    markov_rank: int = 64

    def to_hf(self) -> dict:
        """config.json that `dflash.model.DFlashDraftModel.from_pretrained` reads (a Qwen3Config)."""
        arch = kind_named(self.kind).architectures[0]
        cfg = {
            "architectures": [arch],
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
        self.training().hf_config(self, cfg)
        return cfg

    def training(self) -> Training:
        """Its kind's training hooks (kinds/<kind>/training.py)."""
        return kind_named(self.kind).training()

    @classmethod
    def from_hf(cls, cfg: dict) -> "DrafterConfig":
        dcfg = cfg.get("dflash_config", {})
        rope = cfg.get("rope_parameters") or {}
        arch = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
        kind = (kind_of_architecture(arch) or DFLASH).name
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
            kind=kind,
            conv_kernel_size=int(dcfg.get("conv_kernel_size", 2)),
            conv_group_size=int(dcfg.get("conv_group_size", 64)),
            selector_rank=int(dcfg.get("selector_rank", 64)),
            selector_top_k=int(dcfg.get("selector_top_k", 16)),
            markov_rank=int(cfg.get("markov_rank", 64)),
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
        self.attention_conv, self.mlp_conv = cfg.training().layer_convs(cfg)  # DFlash 2: its block convolutions

    def forward(self, x, ctx, x_pos, ctx_pos, mask):
        # as in z-lab's layer: the context features enter K/V un-normalised by input_layernorm
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, ctx, x_pos, ctx_pos, mask)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, dyn = self.attention_conv.prepare(h)
        x = x + self.attention_conv.finish(self.self_attn(h, ctx, x_pos, ctx_pos, mask), dyn)
        h, dyn = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), dyn)


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
        # the kind's own modules (DFlash 2's candidate_selector, DSpark's markov_head and confidence_head)
        self.kind_training = cfg.training()
        for name, module in self.kind_training.modules(cfg, cfg.vocab_size if d2t is None else len(d2t)).items():
            self.add_module(name, module)
        self._init_weights()

    def _init_weights(self) -> None:
        """Normal(0, 0.02) for linear and embedding layers, as Qwen3's `initializer_range`; zero biases."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

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

    def step_logits(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """Logits of slots whose previous token (target id) is `prev`: DSpark adds its Markov bias."""
        return self.kind_training.step_logits(self, hidden, prev)

    def confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """DSpark: acceptance logit of each slot (sigmoid = predicted acceptance)."""
        return self.kind_training.confidence(self, hidden, prev)

    def draft(self, hidden: torch.Tensor, anchor: torch.Tensor) -> torch.Tensor:
        """Greedy draft of each block as the runtime makes it: (n_blocks, m) draft rows (target ids
        for full-vocabulary drafters) from the hidden states of the predicting slots (n_blocks, m, h)
        and the anchor tokens (n_blocks,). DFlash: argmax per slot; DFlash 2: the selector's path;
        DSpark: argmax of each slot with the Markov bias of the previous pick."""
        return self.kind_training.draft(self, hidden, anchor)

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
        tensors = state_to_checkpoint(self.trainable_state())
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
        tensors = checkpoint_to_state(load_file(str(directory / CHECKPOINT_WEIGHTS)))
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


# z-lab's DFlash 2 checkpoints name the selector codebooks without `.weight` (its from_pretrained
# maps them onto the Embedding weights); the torch modules here carry the suffix.
_CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def state_to_checkpoint(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k.removesuffix(".weight") if k.removesuffix(".weight") in _CODEBOOKS else k): v for k, v in tensors.items()}


def checkpoint_to_state(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k + ".weight" if k in _CODEBOOKS else k): v for k, v in tensors.items()}
