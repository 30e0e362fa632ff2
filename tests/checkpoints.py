"""Real DFlash checkpoints for tests, built with z-lab's reference package, and reading conversions back.

`dflash.model.DFlashDraftModel` / `DFlash2DraftModel` with the geometry of the embedded
target (SmolLM2-135M), random weights from a seed, written by `save_pretrained`.
"""

from __future__ import annotations

import ctypes
import functools
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Sequence

import gguf
import llama_cpp
import numpy as np

from dflash_gguf.schema import gguf_tensor_name
from dflash_gguf.target_gguf import FastGGUFReader, MetadataField

if TYPE_CHECKING:  # torch and transformers load only where a checkpoint is built or read (seconds of import)
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
GGUF_LAYERS = [i + 1 for i in TARGET_LAYER_IDS]
"""`dflash.target_layers` for TARGET_LAYER_IDS: layer inputs, HF ids + 1."""
BLOCK_SIZE = 16
MASK_TOKEN_ID = 16
"""`<empty_output>` in SmolLM2's vocabulary: a special token that ordinary text never produces."""

# DFlash2 extras: conv kernel 3 over groups of 64 channels, a rank-16 selector over the top 4
DFLASH2_CONFIG = {"conv_kernel_size": 3, "conv_group_size": 64, "selector_rank": 16, "selector_top_k": 4}


def reference_config(
    *,
    kind: str = "dflash",
    num_layers: int = 1,
    target_layer_ids: Sequence[int] | None = TARGET_LAYER_IDS,
    block_size: int = BLOCK_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
) -> Qwen3Config:
    """A Qwen3Config shaped like z-lab's published drafters, sized for the embedded target.

    `target_layer_ids=None` leaves them out: the reference then derives them from num_target_layers.
    """
    from transformers import Qwen3Config

    dflash_config = {"block_size": block_size, "mask_token_id": mask_token_id}
    if target_layer_ids is not None:
        dflash_config["target_layer_ids"] = list(target_layer_ids)
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
    target_layer_ids: Sequence[int] | None = TARGET_LAYER_IDS,
    block_size: int = BLOCK_SIZE,
    mask_token_id: int = MASK_TOKEN_ID,
    dtype: torch.dtype | None = None,
    max_shard_size: str | None = None,
) -> Path:
    """Save a random-weight reference drafter to `directory` (config.json + safetensors) and return it.

    Every parameter is drawn from the seed (the reference leaves DFlash2's conv bases
    uninitialised): matrices ~ N(0, 0.02), norm weights ~ 1 + N(0, 0.02), saved as `dtype` (bf16 by default).
    `max_shard_size` (e.g. "5MB") makes a sharded checkpoint with an index.
    """
    import torch
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
    model = model.to(torch.bfloat16 if dtype is None else dtype)
    directory = Path(directory)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, **kwargs)
    return directory


# --- metadata-only target GGUFs ------------------------------------------------


def write_metadata_gguf(path: Path, arch: str, *, n_embd: int, n_layer: int, fields: Sequence[MetadataField] = ()) -> Path:
    """A GGUF with a target's geometry keys and `fields`, no tensors: read_target_info reads no more."""
    w = gguf.GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.embedding_length", n_embd)
    w.add_uint32(f"{arch}.block_count", n_layer)
    for field in fields:
        w.add_key_value(field.key, field.value, field.type, field.sub_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    return path


def token_fields(tokens: Sequence[str]) -> tuple[MetadataField, ...]:
    """A gpt2-style tokenizer with just these token texts."""
    V = gguf.GGUFValueType
    return (
        MetadataField("tokenizer.ggml.model", "gpt2", V.STRING),
        MetadataField("tokenizer.ggml.tokens", list(tokens), V.ARRAY, V.STRING),
    )


# --- reading conversions back -------------------------------------------------


@contextmanager
def loaded_model(path: Path) -> Iterator[llama_cpp.llama_model_p]:
    """The GGUF loaded by the bundled libllama (CPU only); fails the test if it does not load."""
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.n_gpu_layers = 0
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"libllama could not load {path}"
    try:
        yield model
    finally:
        llama_cpp.llama_model_free(model)


def meta(model, key: str) -> str:
    """A metadata value as libllama reports it."""
    buf = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_model_meta_val_str(model, key.encode(), buf, len(buf))
    assert n >= 0, f"libllama reports no {key}"
    return buf.value.decode()


def checkpoint_tensors(directory: Path) -> dict[str, np.ndarray]:
    """GGUF name -> float32 values, read with the safetensors library (an independent reader)."""
    import torch
    from safetensors.torch import load_file

    values: dict[str, np.ndarray] = {}
    for file in sorted(directory.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            values[gguf_tensor_name(name)] = tensor.to(torch.float32).numpy()
    return values


@functools.lru_cache(maxsize=8)
def reader(path: Path) -> gguf.GGUFReader:
    """Parse each file once; FastGGUFReader is checked against gguf.GGUFReader in test_target_gguf."""
    return FastGGUFReader(path)


def gguf_tensors(path: Path) -> dict[str, tuple[gguf.GGMLQuantizationType, np.ndarray]]:
    """GGUF name -> (stored type, values dequantized with gguf.quants)."""
    return {
        t.name: (t.tensor_type, gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
        for t in reader(path).tensors
    }


def assert_round_trip(ckpt_dir: Path, gguf_path: Path) -> None:
    """Every checkpoint tensor is in the GGUF, same shape, values equal within the written type's tolerance."""
    expected = checkpoint_tensors(ckpt_dir)
    written = gguf_tensors(gguf_path)
    assert set(written) == set(expected)
    Q = gguf.GGMLQuantizationType
    for name, want in expected.items():
        qtype, got = written[name]
        assert got.shape == want.shape, name
        if want.ndim == 1 or not name.endswith(".weight"):
            assert qtype == Q.F32, name
        if qtype in (Q.F32, Q.BF16):
            # reference checkpoints are bf16: f32 and bf16 hold them exactly
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif qtype == Q.F16:
            np.testing.assert_allclose(got, want, rtol=2**-10, atol=2**-24, err_msg=name)
        else:
            assert qtype == Q.Q8_0, name
            # q8_0: per block of 32, half a step of max|x|/127, plus the f16 rounding of the block scale
            peak = np.abs(want).reshape(-1, 32).max(axis=1, keepdims=True)
            err = np.abs(got - want).reshape(-1, 32)
            assert (err <= peak / 127 * 0.5 + peak * 2**-10).all(), name
