"""Tiny random-weight hybrid targets (qwen35, lfm2, qwen3next) and DFlash drafters paired with them.

Route: a transformers model class with a tiny config and seeded random weights, `save_pretrained`,
then upstream's `convert_hf_to_gguf.py` (llama-cpp-python 0.3.36 sdist) in a subprocess, with its
vocabulary step replaced by a copy of the embedded SmolLM2 target's tokenizer fields. The drafters
are z-lab reference checkpoints with the same hidden size, converted by dflash-convert against the
hybrid GGUF (so they pair by vocabulary and fingerprint).

Each target GGUF is ~7 MB (49,152-token f16 embedding tied to the output head, hidden size 64).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Sequence

import torch

from upstream import LLAMA_CPP_SRC  # noqa: E402  (the upstream sources whose converter builds the fixtures)

HIDDEN = 64
N_LAYER = 4
VOCAB = 49152
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
FFN = 128
INIT_STD = 0.1  # larger than the usual 0.02 so the random model's next-token distribution is peaked
EMBED_STD = 0.25  # the tied embedding / output head: peaked next-token logits, output still varied

# HF target_layer_ids of the drafters: GGUF ids 1 and 3 (layer inputs), both valid on a 4-layer target
DRAFT_TARGET_LAYERS = (0, 2)
DRAFT_BLOCK = 16
MASK_TOKEN_ID = 16  # <empty_output> in SmolLM2's vocabulary (as tests/checkpoints.py)

ARCHS = ("qwen35", "lfm2", "qwen3next")
RS_ROLLBACK_ARCHS = frozenset({"qwen35", "lfm2"})  # llm_arch_supports_rs_rollback; qwen3next needs checkpoints


def _common() -> dict:
    return dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=N_LAYER,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        initializer_range=INIT_STD,
    )


def hf_model(arch: str) -> torch.nn.Module:
    """An untrained transformers model of this llama.cpp architecture (weights not yet seeded)."""
    linear = ["linear_attention"] * (N_LAYER - 1) + ["full_attention"]
    if arch == "qwen35":
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        config = Qwen3_5TextConfig(
            **_common(),
            head_dim=HEAD_DIM,
            layer_types=linear,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        )
        return Qwen3_5ForCausalLM(config)
    if arch == "lfm2":
        from transformers import Lfm2Config, Lfm2ForCausalLM

        layer_types = ["full_attention" if i % 2 else "conv" for i in range(N_LAYER)]  # conv, attention, ...
        config = Lfm2Config(
            **_common(),
            block_auto_adjust_ff_dim=False,
            conv_L_cache=3,
            layer_types=layer_types,
            full_attn_idxs=[i for i, kind in enumerate(layer_types) if kind == "full_attention"],
        )
        return Lfm2ForCausalLM(config)
    if arch == "qwen3next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        config = Qwen3NextConfig(
            **_common(),
            head_dim=HEAD_DIM,
            layer_types=linear,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            partial_rotary_factor=0.5,
        )
        return Qwen3NextForCausalLM(config)
    raise ValueError(f"no fixture recipe for {arch!r} (have {', '.join(ARCHS)})")


def _seed_weights(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from the seed: matrices ~ N(0, INIT_STD), norm weights ~ 1 + N(0, 0.02)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("embed_tokens.weight"):
                param.copy_(EMBED_STD * noise)
            elif "norm" in name:
                param.copy_(1.0 + 0.02 * noise)
            elif name.endswith("A_log"):
                param.copy_(torch.log(torch.rand(param.shape, generator=generator) * 15 + 1))
            elif name.endswith("dt_bias") or name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(INIT_STD * noise)


_DRIVER = r"""
import sys
from pathlib import Path
src, tokenizer_gguf = Path(sys.argv[1]), sys.argv[2]
sys.path.insert(0, str(src))
sys.path.insert(1, str(src / "gguf-py"))
import gguf
import conversion
import convert_hf_to_gguf

reader = gguf.GGUFReader(tokenizer_gguf)
fields = []
for key, field in reader.fields.items():
    if not key.startswith("tokenizer."):
        continue
    main = field.types[0]
    if main == gguf.GGUFValueType.ARRAY:
        sub = field.types[-1]
        if sub == gguf.GGUFValueType.STRING:
            value = [bytes(field.parts[i]) for i in field.data]
        else:
            value = [v for i in field.data for v in field.parts[i].tolist()]
        fields.append((key, value, main, sub))
    elif main == gguf.GGUFValueType.STRING:
        fields.append((key, bytes(field.parts[-1]), main, None))
    else:
        fields.append((key, field.parts[-1].tolist()[0], main, None))

def set_vocab(self):
    for key, value, main, sub in fields:
        self.gguf_writer.add_key_value(key, value, main, sub)

original = convert_hf_to_gguf.get_model_class
def get_model_class(name, mmproj=False):
    cls = original(name, mmproj=mmproj)
    return type(cls.__name__, (cls,), {"set_vocab": set_vocab, "model_arch": cls.model_arch})
convert_hf_to_gguf.get_model_class = get_model_class
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[3:]
convert_hf_to_gguf.main()
"""


def convert_target(
    model_dir: Path, out: Path, tokenizer_gguf: Path, *, outtype: str = "f16", extra: Sequence[str] = ()
) -> Path:
    """Upstream convert_hf_to_gguf.py on `model_dir`, vocabulary copied from `tokenizer_gguf`."""
    cmd = [sys.executable, "-c", _DRIVER, str(LLAMA_CPP_SRC), str(tokenizer_gguf),
           str(model_dir), "--outfile", str(out), "--outtype", outtype, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0 or not out.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {model_dir}:\n{done.stderr[-4000:]}")
    return out


def save_hf_model(arch: str, hf_dir: Path, *, seed: int = 0, **config: object) -> Path:
    """A seeded random `arch` model saved in transformers' layout, its config naming the causal-LM class
    upstream's converter registers; `config` adds keys to config.json."""
    torch.manual_seed(seed)
    model = hf_model(arch)
    _seed_weights(model, seed)
    model.save_pretrained(hf_dir)
    cfg_path = hf_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = [type(model).__name__]
    cfg.update(config)
    cfg_path.write_text(json.dumps(cfg, indent=2))
    return hf_dir


def build_target(arch: str, directory: Path, tokenizer_gguf: Path, *, seed: int = 0) -> Path:
    """`directory`/<arch>.gguf: a seeded random `arch` model converted by upstream's converter."""
    directory = Path(directory)
    hf_dir = save_hf_model(arch, directory / f"{arch}-hf", seed=seed)
    extra = ["--no-mtp"] if arch in ("qwen35", "qwen3next") else []  # these random models have no MTP head
    return convert_target(hf_dir, directory / f"{arch}.gguf", tokenizer_gguf, extra=extra)


def draft_config(*, kind: str = "dflash", target_layer_ids: Sequence[int] = DRAFT_TARGET_LAYERS, block_size: int = DRAFT_BLOCK):
    """A one-layer reference drafter config sized for the hybrid fixtures."""
    from transformers import Qwen3Config

    dflash_config = {"block_size": block_size, "mask_token_id": MASK_TOKEN_ID, "target_layer_ids": list(target_layer_ids)}
    if kind == "dflash2":
        dflash_config.update({"conv_kernel_size": 3, "conv_group_size": 32, "selector_rank": 8, "selector_top_k": 4})
    elif kind != "dflash":
        raise ValueError(f"kind must be 'dflash' or 'dflash2', got {kind!r}")
    config = Qwen3Config(
        hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=1, num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=VOCAB, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=4096, tie_word_embeddings=False,
    )
    config.num_target_layers = N_LAYER
    config.dflash_config = dflash_config
    return config


def build_drafter_checkpoint(directory: Path, *, kind: str = "dflash", seed: int = 0) -> Path:
    """A random reference checkpoint (bf16) for the hybrid fixtures' geometry: DFlash/DFlash2 from z-lab's
    package; "dspark": the DFlash one with DeepSpec's Markov head added (anchor-first, no confidence head)."""
    from dflash.model import DFlash2DraftModel, DFlashDraftModel

    if kind not in ("dflash", "dflash2", "dspark"):
        raise ValueError(f"kind must be 'dflash', 'dflash2' or 'dspark', got {kind!r}")
    model = (DFlash2DraftModel if kind == "dflash2" else DFlashDraftModel)(draft_config(kind=kind if kind == "dflash2" else "dflash"))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.02
            param.copy_(1.0 + noise if "norm" in name else noise)
    model.to(torch.bfloat16).save_pretrained(directory)
    if kind == "dspark":
        from dspark_reference import add_dspark_heads

        add_dspark_heads(Path(directory), vocab_size=VOCAB, hidden_size=HIDDEN, confidence=False, seed=seed)
    return Path(directory)


def build_drafter(target_gguf: Path, directory: Path, *, kind: str = "dflash", seed: int = 0) -> Path:
    """A drafter GGUF converted by dflash-convert against `target_gguf`."""
    from dflash_gguf.convert import convert_checkpoint

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    ckpt = build_drafter_checkpoint(directory / f"{kind}-ckpt", kind=kind, seed=seed)
    return convert_checkpoint(ckpt, directory / f"{Path(target_gguf).stem}-{kind}.gguf", target=target_gguf, progress=False)


class HybridModels:
    """The fixtures of one pytest run, each built on first use into `directory` and then reused."""

    def __init__(self, directory: Path, tokenizer_gguf: Path) -> None:
        self.directory = Path(directory)
        self.tokenizer_gguf = Path(tokenizer_gguf)
        self._built: dict[tuple[str, str], Path] = {}

    def target(self, arch: str) -> Path:
        key = (arch, "target")
        if key not in self._built:
            self._built[key] = build_target(arch, self.directory, self.tokenizer_gguf)
        return self._built[key]

    def drafter(self, arch: str, kind: str = "dflash") -> Path:
        key = (arch, kind)
        if key not in self._built:
            self._built[key] = build_drafter(self.target(arch), self.directory / f"{arch}-{kind}", kind=kind)
        return self._built[key]


if __name__ == "__main__":  # build the fixtures into a folder, for the scripts and the benchmark
    import argparse

    from dflash_gguf.defaults import embedded_target

    p = argparse.ArgumentParser(description="build the hybrid fixture targets and their DFlash drafters")
    p.add_argument("out", type=Path, nargs="?", default=Path("/tmp/hybrid-fixtures"))
    p.add_argument("--bench", action="store_true", help="larger targets (hidden 256, 8 layers) for dflash-bench")
    p.add_argument("--archs", nargs="+", default=list(ARCHS))
    args = p.parse_args()
    if args.bench:
        HIDDEN, N_LAYER, FFN = 256, 8, 1024
    args.out.mkdir(parents=True, exist_ok=True)
    for arch in args.archs:
        target = build_target(arch, args.out, embedded_target())
        drafter = build_drafter(target, args.out / f"{arch}-drafters")
        print(target, target.stat().st_size, drafter)
