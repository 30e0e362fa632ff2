"""A tiny random-weight Qwen3.5 target with one MTP head, converted by upstream's converter.

transformers' Qwen3.5 has no MTP module, so the head's tensors are added by name to the saved
checkpoint (`mtp.fc`, `mtp.pre_fc_norm_*`, `mtp.norm`, and `mtp.layers.0.*` shaped like a full-attention
decoder layer of the trunk), with `mtp_num_hidden_layers: 1` in config.json; upstream's
convert_hf_to_gguf.py maps them to the nextn tensors of block n_layer, as it does for released
Qwen3.5 checkpoints. The trunk is the hybrid fixture's qwen35 (tests/hybrid_fixtures.py), seeded alike.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hybrid_fixtures import HIDDEN, INIT_STD, N_LAYER, convert_target, save_hf_model

MTP_SEED = 1  # the head's weights, drawn apart from the trunk's
FULL_ATTENTION_LAYER = N_LAYER - 1  # the hybrid fixture's only full-attention layer: the head copies its shapes


def add_mtp_head(hf_dir: Path, *, seed: int = MTP_SEED) -> None:
    """Add random `mtp.*` tensors to the checkpoint in hf_dir (one safetensors file, as save_pretrained writes)."""
    from safetensors.torch import load_file, save_file

    path = hf_dir / "model.safetensors"
    tensors = load_file(path)
    layer = f"model.layers.{FULL_ATTENTION_LAYER}."
    shapes = {f"mtp.layers.0.{k[len(layer):]}": v.shape for k, v in tensors.items() if k.startswith(layer)}
    shapes.update({
        "mtp.fc.weight": (HIDDEN, 2 * HIDDEN),
        "mtp.pre_fc_norm_embedding.weight": (HIDDEN,),
        "mtp.pre_fc_norm_hidden.weight": (HIDDEN,),
        "mtp.norm.weight": (HIDDEN,),
    })
    generator = torch.Generator().manual_seed(seed)
    dtype = next(iter(tensors.values())).dtype
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        value = 1.0 + 0.02 * noise if "norm" in name else INIT_STD * noise
        tensors[name] = value.to(dtype).contiguous()
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.replace(path)


def build_mtp_target(directory: Path, tokenizer_gguf: Path, *, seed: int = 0, heads: bool = False) -> Path:
    """`directory`/qwen35-mtp.gguf: the qwen35 fixture with one random MTP head (nextn tensors of block N_LAYER).
    heads: also `directory`/mtp-qwen35.gguf, the head alone as upstream's converter ships it (--mtp), for the
    trunk converted without it (hybrid_fixtures' qwen35: the same seed, --no-mtp)."""
    directory = Path(directory)
    hf_dir = save_hf_model("qwen35", directory / "qwen35-mtp-hf", seed=seed, mtp_num_hidden_layers=1)
    add_mtp_head(hf_dir)
    if heads:
        convert_target(hf_dir, directory / "mtp-qwen35.gguf", tokenizer_gguf, extra=["--mtp"])
    return convert_target(hf_dir, directory / "qwen35-mtp.gguf", tokenizer_gguf)


if __name__ == "__main__":  # build it into a folder, for scripts/mtp_oracle.sh and the benchmark
    import argparse

    from dflash_gguf.defaults import embedded_target

    p = argparse.ArgumentParser(description="build the MTP fixture target (a tiny random Qwen3.5 with one MTP head)")
    p.add_argument("out", type=Path, nargs="?", default=Path("/tmp/mtp-fixture"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(build_mtp_target(args.out, embedded_target()))
