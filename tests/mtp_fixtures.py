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

from hybrid_fixtures import (EMBED_STD, FFN, HEAD_DIM, HEADS, HIDDEN, INIT_STD, KV_HEADS, N_LAYER, VOCAB, convert_target,
                             save_hf_model)

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



# --- step35: an attention-only trunk whose MTP heads are chained (one trained head per draft step) ----------
# No transformers class exists for Step3p5ForCausalLM, but upstream's converter reads only config.json and the
# tensors: they are written here by name, as the released checkpoint names them (the MTP blocks appended at
# model.layers.{N + i}, each a full decoder layer plus eh_proj, enorm, hnorm and a shared head).
STEP35_LAYERS = 2  # trunk: one sliding-window layer, one full-attention layer
STEP35_WINDOW = 4096  # wider than any context the tests make: no cell leaves the window, so rollback is exact


def step35_config(n_heads: int) -> dict:
    """config.json of a tiny Step3p5 with n_heads chained MTP heads (dense MLPs: no experts)."""
    n = STEP35_LAYERS + n_heads
    layer_types = ["sliding_attention"] + ["full_attention"] * (n - 1)
    return dict(
        architectures=["Step3p5ForCausalLM"], model_type="step3p5", vocab_size=VOCAB, hidden_size=HIDDEN,
        intermediate_size=FFN, num_hidden_layers=STEP35_LAYERS, num_attention_heads=HEADS,
        num_attention_groups=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=4096, rms_norm_eps=1e-6,
        rope_theta=10000.0, sliding_window=STEP35_WINDOW, layer_types=layer_types,
        partial_rotary_factors=[1.0 if t == "sliding_attention" else 0.5 for t in layer_types],
        moe_num_experts=0, moe_top_k=0, moe_intermediate_size=FFN, share_expert_dim=FFN,
        num_nextn_predict_layers=n_heads, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )


def step35_tensors(n_heads: int, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights under the checkpoint's names; norms are stored zero-centred (the converter adds 1)."""
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,), "lm_head.weight": (VOCAB, HIDDEN),
    }
    for i in range(STEP35_LAYERS + n_heads):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
            p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN), p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
        })
        if i >= STEP35_LAYERS:
            shapes.update({
                p + "eh_proj.weight": (HIDDEN, 2 * HIDDEN), p + "enorm.weight": (HIDDEN,), p + "hnorm.weight": (HIDDEN,),
                p + "transformer.shared_head.norm.weight": (HIDDEN,),
            })
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(shapes.items()):
        noise = torch.randn(shape, generator=generator)
        std = 0.02 if "norm" in name else EMBED_STD if name in ("model.embed_tokens.weight", "lm_head.weight") else INIT_STD
        tensors[name] = (std * noise).to(torch.bfloat16).contiguous()
    return tensors


def build_step35_target(directory: Path, tokenizer_gguf: Path, *, n_heads: int = 2, seed: int = 0) -> Path:
    """`directory`/step35-mtp{n_heads}.gguf: a tiny random Step3p5 with n_heads chained MTP heads, converted by
    upstream's convert_hf_to_gguf.py from a checkpoint written here by name."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    hf_dir = directory / f"step35-mtp{n_heads}-hf"
    hf_dir.mkdir(parents=True, exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(step35_config(n_heads), indent=1))
    save_file(step35_tensors(n_heads, seed), hf_dir / "model.safetensors", metadata={"format": "pt"})
    return convert_target(hf_dir, directory / f"step35-mtp{n_heads}.gguf", tokenizer_gguf)


# --- gemma4: the shared-memory layout, an assistant model that reads the target's KV ------------------------
GEMMA4_LAYERS = ["sliding_attention", "full_attention"] * 2  # the assistant reads the last of each kind


def build_gemma4_pair(directory: Path, tokenizer_gguf: Path, *, seed: int = 0) -> tuple[Path, Path]:
    """(`directory`/gemma4.gguf, `directory`/gemma4-assistant.gguf): a tiny random Gemma 4 target and a random
    two-layer Gemma 4 assistant (its MTP heads, a model of their own whose attention reads the target's last
    sliding and full layers' KV), both transformers models converted by upstream's converter."""
    import json

    from transformers import (Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4ForCausalLM,
                              Gemma4TextConfig)

    from hybrid_fixtures import _seed_weights

    directory = Path(directory)
    common = dict(vocab_size=VOCAB, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                  global_head_dim=2 * HEAD_DIM, max_position_embeddings=4096, rms_norm_eps=1e-6,
                  sliding_window=STEP35_WINDOW, hidden_size_per_layer_input=0, bos_token_id=1, eos_token_id=2,
                  pad_token_id=0, tie_word_embeddings=True)
    target = Gemma4TextConfig(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=len(GEMMA4_LAYERS),
                              layer_types=GEMMA4_LAYERS, vocab_size_per_layer_input=VOCAB, **common)
    assistant = Gemma4AssistantConfig(backbone_hidden_size=HIDDEN, text_config=dict(
        hidden_size=HIDDEN // 2, intermediate_size=FFN // 2, num_hidden_layers=2, layer_types=GEMMA4_LAYERS[:2],
        vocab_size_per_layer_input=0, num_kv_shared_layers=2, **common))
    out = []
    for name, cls, config, model_seed in (("gemma4", Gemma4ForCausalLM, target, seed),
                                          ("gemma4-assistant", Gemma4AssistantForCausalLM, assistant, seed + MTP_SEED)):
        torch.manual_seed(model_seed)
        model = cls(config)
        _seed_weights(model, model_seed)
        model.config.architectures = [cls.__name__]
        hf_dir = directory / f"{name}-hf"
        model.save_pretrained(hf_dir)
        # the converter trims the embedding to tokenizer.json's count; the vocabulary itself is replaced
        (hf_dir / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"t{i}": i for i in range(VOCAB)}},
                                                           "added_tokens": []}))
        out.append(convert_target(hf_dir, directory / f"{name}.gguf", tokenizer_gguf))
    return out[0], out[1]

if __name__ == "__main__":  # build it into a folder, for scripts/mtp_oracle.sh and the benchmark
    import argparse

    from dflash_gguf.defaults import embedded_target

    p = argparse.ArgumentParser(description="build the MTP fixture target (a tiny random Qwen3.5 with one MTP head)")
    p.add_argument("out", type=Path, nargs="?", default=Path("/tmp/mtp-fixture"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(build_mtp_target(args.out, embedded_target()))
