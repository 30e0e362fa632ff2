"""Writing a validated checkpoint as a `dflash` GGUF, streamed tensor by tensor and atomically.

Metadata follows upstream's `conversion/qwen.py` DFlashModel / DSparkModel key for key (proven by
tests/test_convert_conformance.py), so that llama.cpp's `src/models/dflash.cpp` and
`llama-server --spec-type draft-dflash` read it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

import gguf
import numpy as np
from tqdm import tqdm

from dflash_gguf.convert.checkpoint import SHARD_INDEX, Checkpoint, DraftConfig, d2t_target_ids
from dflash_gguf.convert.config_schema import rotary_fraction
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.kinds.converting import draft_value
from dflash_gguf.schema import ARCH, Keys, Tensors, hf_layer_to_gguf
from dflash_gguf.target_gguf import TargetInfo

Q = gguf.GGMLQuantizationType
OUTTYPES: dict[str, Q] = {"f32": Q.F32, "f16": Q.F16, "bf16": Q.BF16, "q8_0": Q.Q8_0}
_SOURCE_TYPES = {"F32": Q.F32, "F16": Q.F16, "BF16": Q.BF16}
_FILE_TYPES = {
    Q.F32: gguf.LlamaFileType.ALL_F32,
    Q.F16: gguf.LlamaFileType.MOSTLY_F16,
    Q.BF16: gguf.LlamaFileType.MOSTLY_BF16,
    Q.Q8_0: gguf.LlamaFileType.MOSTLY_Q8_0,
}
NO_VOCAB = "none"
"""`tokenizer.ggml.model` for a drafter converted without --target: llama.cpp then sizes
the vocabulary from `dflash.vocab_size` and the drafter loads (it borrows the target's tokens)."""

_ROPE_PERMUTED = ("attn_q.weight", "attn_k.weight", "attn_q_norm.weight", "attn_k_norm.weight")


def tensor_type(name: str, shape: tuple[int, ...], source_dtype: str, outtype: str | None) -> Q:
    """Upstream's rule: 1-D tensors, norms and non-`.weight` tensors (conv bases, d2t) stay f32;
    the rest take --outtype, or keep their checkpoint precision; q8_0 rows not divisible by 32 fall back to f16."""
    if name == Tensors.D2T:
        return Q.I64  # dflash.cpp asserts I64 before scattering draft logits with it
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return Q.F32
    if outtype is None:
        return _SOURCE_TYPES.get(source_dtype, Q.F32)
    qtype = OUTTYPES[outtype]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if shape[-1] % block:
        return Q.F16
    return qtype


def tensor_nbytes(shape: tuple[int, ...], qtype: Q) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape[:-1], dtype=np.int64)) * (shape[-1] // block) * size


def _file_type(types: list[Q], outtype: str | None) -> gguf.LlamaFileType:
    if outtype is not None:
        return _FILE_TYPES[OUTTYPES[outtype]]
    matrices = [t for t in types if t != Q.F32] or [Q.F32]
    return _FILE_TYPES[max(set(matrices), key=matrices.count)]


def _add_metadata(
    writer: gguf.GGUFWriter, ckpt: Checkpoint, target: TargetInfo | None, file_type: gguf.LlamaFileType, name: str
) -> None:
    cfg: DraftConfig = ckpt.config
    hp = cfg.hparams
    w = writer
    w.add_string(Keys.NAME, name)
    w.add_uint32(Keys.BLOCK_COUNT, cfg.num_layers)
    if (n_ctx := hp.get("max_position_embeddings")) is not None:
        w.add_uint32(Keys.CONTEXT_LENGTH, int(n_ctx))
    w.add_uint32(Keys.EMBEDDING_LENGTH, cfg.hidden_size)
    w.add_uint32(Keys.FEED_FORWARD_LENGTH, cfg.intermediate_size)
    w.add_uint32(Keys.HEAD_COUNT, cfg.num_heads)
    w.add_uint32(Keys.HEAD_COUNT_KV, cfg.num_kv_heads)
    if hp.get("head_dim") is not None:
        w.add_uint32(Keys.KEY_LENGTH, cfg.head_dim)
        w.add_uint32(Keys.VALUE_LENGTH, cfg.head_dim)
    rope = hp.get("rope_parameters") or hp.get("rope_scaling") or {}
    rope_theta = rope.get("rope_theta", hp.get("rope_theta"))
    if rope_theta is not None:
        w.add_float32(Keys.ROPE_FREQ_BASE, float(rope_theta))
    if (partial := rotary_fraction(hp)) is not None:
        w.add_uint32(Keys.ROPE_DIMENSION_COUNT, int(cfg.head_dim * partial))
    w.add_float32(Keys.RMS_EPS, cfg.rms_norm_eps)
    if hp.get("hidden_act", "silu") != "silu":
        w.add_string(Keys.HIDDEN_ACT, hp["hidden_act"])
    w.add_uint32(Keys.FILE_TYPE, int(file_type))
    w.add_uint32(Keys.QUANTIZATION_VERSION, gguf.GGML_QUANT_VERSION)

    if (value_scale := draft_value(hp, "attention_value_scale")) is not None:
        w.add_float32(Keys.VALUE_SCALE, float(value_scale))
    w.add_uint32(Keys.BLOCK_SIZE, cfg.block_size)
    for key, value, vtype in cfg.kind.converter.metadata(cfg, set(ckpt.tensors)):  # the kind's own keys
        w.add_key_value(key, value, vtype)
    if (multiplier := draft_value(hp, "output_multiplier")) is not None:
        w.add_float32(Keys.LOGIT_SCALE, float(multiplier))
    if (softcap := draft_value(hp, "final_logit_softcapping")) is not None and float(softcap) > 0:
        w.add_float32(Keys.FINAL_LOGIT_SOFTCAPPING, float(softcap))
    if (embedding_scale := draft_value(hp, "input_embedding_scale")) is not None:
        w.add_float32(Keys.EMBEDDING_SCALE, float(embedding_scale))
    w.add_array(Keys.TARGET_LAYERS, hf_layer_to_gguf(list(cfg.target_layer_ids)))

    dflash_config = hp.get("dflash_config") or {}
    use_swa = bool(dflash_config.get("use_swa", False))
    window = dflash_config.get("swa_window_size") or hp.get("sliding_window")
    if (hp.get("use_sliding_window", False) or use_swa) and window:
        pattern = [True] * cfg.num_layers if use_swa else [t == "sliding_attention" for t in hp.get("layer_types") or []]
        w.add_uint32(Keys.SLIDING_WINDOW, int(window))
        w.add_array(Keys.SLIDING_WINDOW_PATTERN, pattern)
    causal = hp.get("is_causal")
    if causal is None:
        causal = dflash_config.get("causal")
    if causal is not None:
        w.add_bool(Keys.CAUSAL, bool(causal))

    if target is None:
        w.add_string(Keys.TOKENIZER_MODEL, NO_VOCAB)
        w.add_uint32(Keys.VOCAB_SIZE, cfg.vocab_size)
    else:
        if target.mrope:
            w.add_array(Keys.ROPE_DIMENSION_SECTIONS, [cfg.head_dim // 2, 0, 0, 0])
        for field in target.tokenizer_fields:
            w.add_key_value(field.key, field.value, field.type, field.sub_type)
        w.add_string(Keys.TARGET_FINGERPRINT, target.fingerprint)
        w.add_string(Keys.TARGET_ARCH, target.architecture)
        w.add_uint32(Keys.TARGET_N_EMBD, target.n_embd)
        w.add_uint32(Keys.TARGET_N_LAYER, target.n_layer)
        w.add_uint32(Keys.TARGET_N_VOCAB, target.n_vocab)
    w.add_uint32(Keys.MASK_TOKEN_ID, cfg.mask_token_id)
    w.add_string(Keys.CONVERTER_VERSION, importlib.metadata.version("dflash-gguf"))


def _prepare(name: str, data: np.ndarray, cfg: DraftConfig) -> np.ndarray:
    """Upstream's one layout change: interleaved-rope checkpoints are permuted to NeoX order."""
    if not cfg.hparams.get("rope_is_neox_style", True) and name.endswith(_ROPE_PERMUTED):
        shape = data.shape
        data = data.reshape(-1, cfg.head_dim // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    return data


def input_paths(ckpt: Checkpoint, target: TargetInfo | None) -> list[Path]:
    """Every file a conversion reads: config.json, the shard index, each safetensors shard, the target GGUF."""
    paths = [ckpt.config_path, ckpt.source, ckpt.config_path.parent / SHARD_INDEX]
    paths += sorted({t.file for t in ckpt.tensors.values()})
    if target is not None:
        paths.append(Path(target.path))
    return [p for p in paths if os.path.lexists(p)]


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)  # through symlinks: a link to an input is that input
    except OSError:
        return None
    return st.st_dev, st.st_ino


def refuse_input_as_output(out: Path, inputs: Sequence[Path]) -> None:
    """OUT may never name one of the inputs, by path, through a symlink or as another hard link of it.

    Checked even with --force: replacing the target or the checkpoint with the drafter destroys it.
    """
    out_id = _identity(out)
    out_real = os.path.realpath(out)
    for p in inputs:
        if os.path.realpath(p) == out_real or (out_id is not None and _identity(p) == out_id):
            raise ConversionError(f"{out}: output is one of the inputs ({p}); choose another OUT (even --force never overwrites an input)")


@contextmanager
def atomic_output(out: Path, *, force: bool, inputs: Sequence[Path] = ()) -> Iterator[Path]:
    """A temp file beside `out`, renamed over it only when the body succeeds; removed otherwise.

    `inputs` are the files being read: `out` may be none of them (see refuse_input_as_output).
    """
    refuse_input_as_output(out, inputs)
    if out.is_dir():
        raise ConversionError(f"{out}: output is a directory")
    if out.exists() and not force:
        raise ConversionError(f"{out}: output exists (pass --force to overwrite)")
    if not out.parent.is_dir():
        raise ConversionError(f"{out}: output directory {out.parent} does not exist")
    # the name is chosen before the file exists, so whatever unwinds the body (an error, Ctrl-C, or the
    # SIGTERM / SIGHUP the CLI turns into an exception: Python runs those handlers in the main thread between any two
    # bytecodes, even while another thread has the signal delivered) finds it to remove; masking signals cannot
    # promise that once numpy's BLAS threads exist
    tmp = out.parent / f".{out.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp"
    try:
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))  # the umask applies, as for any output
        except OSError as e:
            raise ConversionError(f"{out}: cannot write in {out.parent} ({e.strerror or e})") from None
        yield tmp
        os.replace(tmp, out)
    finally:
        with contextlib.suppress(OSError):  # gone once renamed; never made where the folder refused it
            tmp.unlink()


def write_drafter_gguf(
    ckpt: Checkpoint,
    out: Path,
    *,
    target: TargetInfo | None,
    outtype: str | None,
    force: bool,
    progress: bool,
    name: str | None = None,
) -> Path:
    """Stream `ckpt` into `out` (atomically): metadata and tensor infos first, then each tensor's data.

    `general.name` is `name`, else the output file's stem: checkpoint folders are often just "best".
    """
    cfg = ckpt.config
    plan = [(name, t, tensor_type(name, t.shape, t.dtype, outtype)) for name, t in ckpt.tensors.items()]
    with atomic_output(out, force=force, inputs=input_paths(ckpt, target)) as tmp:
        writer = gguf.GGUFWriter(tmp, ARCH)
        try:
            _add_metadata(writer, ckpt, target, _file_type([q for _, _, q in plan], outtype), name or out.stem)
            for name, t, qtype in plan:
                writer.add_tensor_info(name, t.shape, np.dtype(np.float32), tensor_nbytes(t.shape, qtype), raw_dtype=qtype)
            writer.write_header_to_file(tmp)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            total = sum(t.nbytes for _, t, _ in plan)
            with tqdm(total=total, unit="B", unit_scale=True, desc=out.name, disable=not progress) as bar:
                for name, t, qtype in plan:
                    if name == Tensors.D2T:
                        data = d2t_target_ids(t)
                    else:
                        data = gguf.quants.quantize(_prepare(name, t.read(), cfg), qtype)
                    writer.write_tensor_data(data)
                    bar.update(t.nbytes)
            for fout in writer.fout or []:
                fout.flush()
                os.fsync(fout.fileno())
        finally:
            writer.close()
    return out
