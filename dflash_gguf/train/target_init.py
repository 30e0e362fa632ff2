"""Initialising a drafter from its target: the top layer(s) where shapes match, the final norm.

The draft layers have the target's geometry, so the target's last `n` decoder layers fit them
tensor for tensor (dequantized from the GGUF). llama-architecture GGUFs store Q and K permuted
for llama.cpp's rope layout; they are permuted back to the Hugging Face (NeoX) layout the drafter
uses. The target's output norm becomes the drafter's final norm, so the frozen head sees
activations at the target's scale from step 0. Tensors the target lacks (q/k norms of a Llama)
keep their fresh values.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import torch

from ..target_gguf import open_gguf
from .errors import TrainError

# drafter layer parameter -> target GGUF tensor
LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _read(reader: gguf.GGUFReader, name: str) -> np.ndarray | None:
    for t in reader.tensors:
        if t.name == name:
            shape = [int(x) for x in reversed(t.shape)]  # GGUF lists ne0 first
            return gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    return None


def unpermute_llama(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo convert_hf_to_gguf's llama Q/K permutation (rows regrouped per head for interleaved rope)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def init_from_target(model, target_path: Path) -> list[str]:
    """Copy the target's top layers and output norm into `model` (a train.model.Drafter); returns
    the parameter names set."""
    reader = open_gguf(Path(target_path))
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    n_target = int(model.cfg.num_target_layers)
    n_draft = len(model.layers)
    if n_draft > n_target:
        raise TrainError(f"{n_draft} draft layers but the target has only {n_target}")
    cfg = model.cfg
    params = dict(model.named_parameters())
    done = []
    with torch.no_grad():
        for i in range(n_draft):
            src = n_target - n_draft + i
            for ours, theirs in LAYER_TENSORS.items():
                w = _read(reader, f"blk.{src}.{theirs}")
                name = f"layers.{i}.{ours}"
                if w is None or name not in params:
                    continue
                if arch == "llama" and ours == "self_attn.q_proj.weight":
                    w = unpermute_llama(w, cfg.num_attention_heads)
                if arch == "llama" and ours == "self_attn.k_proj.weight":
                    w = unpermute_llama(w, cfg.num_key_value_heads)
                if tuple(w.shape) != tuple(params[name].shape):
                    continue
                params[name].copy_(torch.from_numpy(w))
                done.append(name)
        w = _read(reader, "output_norm.weight")
        if w is not None and tuple(w.shape) == tuple(model.norm.weight.shape):
            model.norm.weight.copy_(torch.from_numpy(w))
            done.append("norm.weight")
    return done
