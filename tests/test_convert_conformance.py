"""Conformance with upstream: dflash-convert from the GGUF target writes what llama.cpp's own converter writes.

For every drafter format upstream's `convert_hf_to_gguf.py` accepts (DFlash, DFlash2, DSpark in its schemas and
architectures, and each optional variant: mask_embedding.pt, interleaved rope, attention sinks, own embed_tokens /
lm_head, partial rotary factor and its aliases, the Gemma-4 scale keys, SWA layer patterns, causal drafters), a
reference-built checkpoint is converted twice: by dflash-convert against the embedded target's GGUF, and by
upstream (llama-cpp-python 0.3.36's sdist) with `--target-model-dir` pointing at an HF folder rebuilt from that
GGUF (config.json, a tokenizer.json made with `tokenizers` from the GGUF's tokens and merges, and the embedding
table as safetensors). Both GGUFs must hold the same tensors (names, shapes, types, bytes) and the same drafter
keys; INTENDED_DIFFERENCES lists what may differ, and why. Each converted file must also load in libllama.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import HIDDEN_SIZE, NUM_HEADS, VOCAB_SIZE, loaded_model, make_reference_checkpoint
from dspark_reference import make_dspark_checkpoint
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.schema import ARCH, Keys
from dflash_gguf.target_gguf import FastGGUFReader, field_value
from upstream import LLAMA_CPP_SRC

UPSTREAM_CONVERTER = LLAMA_CPP_SRC / "convert_hf_to_gguf.py"
pytestmark = pytest.mark.skipif(
    not UPSTREAM_CONVERTER.is_file(),
    reason=f"upstream llama.cpp sources absent ({UPSTREAM_CONVERTER}); scripts/test.sh unpacks them",
)

INTENDED_DIFFERENCES = {
    "dflash_gguf.*": "our provenance keys (target fingerprint and geometry, converter version); upstream has none",
    "general.* except architecture and file_type": "model-card metadata: upstream names the file after the "
    "checkpoint folder and adds size label / type / tags; ours names it after OUT",
    "tokenizer.* except tokens, merges and mask_token_id": "ours copies every tokenizer field of the target GGUF; "
    "upstream rebuilds them from the HF folder, which this test writes with only tokenizer.json and a minimal "
    "tokenizer_config.json (no chat template, no special-token flags)",
}
"""What may differ between the two files, with the reason. Everything else must be equal."""

COMPARED_TOKENIZER_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", Keys.MASK_TOKEN_ID)
"""Compared to show that the HF folder's vocabulary is the target's (the premise of comparing the rest)."""


def _compared_keys(reader: gguf.GGUFReader) -> dict[str, Any]:
    keys = {}
    for key in reader.fields:
        if key.startswith(f"{ARCH}.") or key in COMPARED_TOKENIZER_KEYS or key in (Keys.ARCHITECTURE, Keys.FILE_TYPE):
            keys[key] = field_value(reader, key)
    return keys


def _tensors(reader: gguf.GGUFReader) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {t.name: (t.tensor_type.name, tuple(int(n) for n in t.shape), bytes(t.data.tobytes())) for t in reader.tensors}


# --- the HF target folder rebuilt from the embedded GGUF -------------------------------------------------------


def write_hf_target(gguf_path: Path, directory: Path) -> Path:
    """config.json, tokenizer.json (+ tokenizer_config.json) and model.safetensors (the embedding table) of a GGUF."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    reader = FastGGUFReader(gguf_path)
    arch = field_value(reader, Keys.ARCHITECTURE)
    assert arch == "llama", "the embedded target is SmolLM2 (llama)"

    def hp(suffix: str) -> Any:
        return field_value(reader, f"{arch}.{suffix}")

    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in field_value(reader, "tokenizer.ggml.merges")]
    types = field_value(reader, "tokenizer.ggml.token_type")
    bos, eos = field_value(reader, "tokenizer.ggml.bos_token_id"), field_value(reader, "tokenizer.ggml.eos_token_id")
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(  # SmolLM's: single digits, then GPT-2 byte level
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t, ty in zip(tokens, types) if ty == gguf.TokenType.CONTROL])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "bos_token": tokens[bos], "eos_token": tokens[eos], "add_prefix_space": False}
    ))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": hp("embedding_length"), "intermediate_size": hp("feed_forward_length"),
        "num_hidden_layers": hp("block_count"), "num_attention_heads": hp("attention.head_count"),
        "num_key_value_heads": hp("attention.head_count_kv"), "rms_norm_eps": hp("attention.layer_norm_rms_epsilon"),
        "rope_theta": hp("rope.freq_base"), "max_position_embeddings": hp("context_length"),
        "vocab_size": len(tokens), "tie_word_embeddings": "output.weight" not in {t.name for t in reader.tensors},
        "bos_token_id": bos, "eos_token_id": eos, "hidden_act": "silu",
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    table = gguf.quants.dequantize(embd.data, embd.tensor_type).astype(np.float32)
    save_file({"model.embed_tokens.weight": torch.from_numpy(np.ascontiguousarray(table))}, directory / "model.safetensors")
    return directory


# --- upstream's converter, driven in one subprocess for every variant ----------------------------------------------

_DRIVER = r"""
import json, sys, traceback
from pathlib import Path
src, jobs_file, results_file = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
sys.path.insert(0, str(src))
sys.path.insert(1, str(src / "gguf-py"))
import convert_hf_to_gguf
try:
    import sentencepiece
except ImportError:
    # not a dependency of ours: the SmolLM2 target has no tokenizer.model, so upstream's SentencePiece attempt
    # only needs the import, then finds no file and takes the tokenizer.json (GPT-2 BPE) path.
    # Set after transformers has looked for the real package (it stays "not installed" there).
    import types
    sys.modules["sentencepiece"] = types.SimpleNamespace(SentencePieceProcessor=None)
results = {}
for name, argv in json.loads(Path(jobs_file).read_text()).items():
    sys.argv = ["convert_hf_to_gguf.py", *argv]
    try:
        convert_hf_to_gguf.main()
        results[name] = None
    except BaseException as e:
        results[name] = "".join(traceback.format_exception_only(type(e), e)).strip()[-600:] or type(e).__name__
Path(results_file).write_text(json.dumps(results))
"""


def convert_upstream(jobs: dict[str, tuple[Path, Path]], hf_target: Path, work: Path) -> dict[str, str | None]:
    """name -> None (converted) or upstream's error, for each (checkpoint dir, out) job."""
    argv = {name: [str(ckpt), "--outfile", str(out), "--target-model-dir", str(hf_target)] for name, (ckpt, out) in jobs.items()}
    (work / "jobs.json").write_text(json.dumps(argv))
    (work / "results.json").unlink(missing_ok=True)
    cmd = [sys.executable, "-c", _DRIVER, str(LLAMA_CPP_SRC), str(work / "jobs.json"), str(work / "results.json")]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1200)
    if not (work / "results.json").is_file():
        raise RuntimeError(f"upstream's converter driver failed:\n{done.stderr[-4000:]}")
    return json.loads((work / "results.json").read_text())


# --- the variants: reference-built checkpoints, edited as the published formats are ---------------------------------


def _edit(directory: Path, *, config: dict | None = None, drop: tuple[str, ...] = (), tensors: dict | None = None) -> Path:
    cfg = json.loads((directory / "config.json").read_text())
    for key in drop:
        cfg.pop(key, None)
    cfg.update(config or {})
    (directory / "config.json").write_text(json.dumps(cfg, indent=1))
    if tensors:
        state = load_file(directory / "model.safetensors")
        state.update(tensors)
        save_file({k: v.contiguous() for k, v in state.items()}, directory / "model.safetensors")
    return directory


def _randn(*shape: int, seed: int, scale: float = 0.02) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(torch.bfloat16)


def _mask_file(directory: Path, mask_id: int = 16) -> Path:
    torch.save({"mask_token_id": mask_id, "embedding": _randn(HIDDEN_SIZE, seed=7, scale=1.0)}, directory / "mask_embedding.pt")
    return directory


def _dflash(d: Path, **kw: Any) -> Path:
    return make_reference_checkpoint(d, kind="dflash", **kw)


def _dflash_config(d: Path, **extra: Any) -> dict:
    return {**json.loads((d / "config.json").read_text())["dflash_config"], **extra}


VARIANTS: dict[str, Callable[[Path], Path]] = {
    "dflash": lambda d: _dflash(d),
    "dflash2": lambda d: make_reference_checkpoint(d, kind="dflash2"),
    "dspark_deepspec": lambda d: make_dspark_checkpoint(d),
    "dspark_speculators_bonus_anchor": lambda d: make_dspark_checkpoint(d, schema="speculators", anchor_first=False, confidence=False),
    "dspark_speculators_anchor_first": lambda d: make_dspark_checkpoint(d, schema="speculators", anchor_first=True),
    "dspark_reduced_vocab": lambda d: make_dspark_checkpoint(d, draft_vocab=4096),
    "dspark_full_vocab_lm_head": lambda d: _edit(
        make_dspark_checkpoint(d), tensors={"lm_head.weight": _randn(VOCAB_SIZE, HIDDEN_SIZE, seed=3)}
    ),
    "lfm2_dspark": lambda d: _edit(make_dspark_checkpoint(d), config={"architectures": ["Lfm2DSparkDraftModel"]}),
    "ling_dspark": lambda d: _edit(make_dspark_checkpoint(d, confidence=False), config={"architectures": ["LingDSparkModel"]}),
    "mask_embedding": lambda d: _mask_file(_dflash(d)),
    "mask_embedding_own_tables": lambda d: _mask_file(_edit(_dflash(d), tensors={
        "embed_tokens.weight": _randn(VOCAB_SIZE, HIDDEN_SIZE, seed=4), "lm_head.weight": _randn(VOCAB_SIZE, HIDDEN_SIZE, seed=5),
    })),
    "mask_embedding_dspark": lambda d: _mask_file(make_dspark_checkpoint(d, confidence=False)),
    "interleaved_rope": lambda d: _edit(_dflash(d), config={"rope_is_neox_style": False}),
    "attention_sinks": lambda d: _edit(_dflash(d), tensors={"layers.0.self_attn.sinks": _randn(NUM_HEADS, seed=6, scale=1.0)}),
    "own_embed_tokens_and_lm_head": lambda d: _edit(_dflash(d), tensors={
        "embed_tokens.weight": _randn(VOCAB_SIZE, HIDDEN_SIZE, seed=8), "lm_head.weight": _randn(VOCAB_SIZE, HIDDEN_SIZE, seed=9),
    }),
    "partial_rotary_factor": lambda d: _edit(_dflash(d), config={"partial_rotary_factor": 0.5}),
    "rope_pct": lambda d: _edit(_dflash(d), config={"rope_pct": 0.25}),
    "rope_percent": lambda d: _edit(_dflash(d), config={"rope_percent": 0.5}),
    "gemma4_scales": lambda d: _edit(_dflash(d), config={
        "dflash_config": _dflash_config(d, attention_value_scale=0.5, input_embedding_scale=24.0),
        "output_multiplier": 0.75, "final_logit_softcapping": 30.0,
    }),
    "swa_layer_types": lambda d: _edit(_dflash(d, num_layers=2), config={
        "use_sliding_window": True, "sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"],
    }),
    "swa_dflash_config": lambda d: _edit(_dflash(d, num_layers=2), config={
        "dflash_config": _dflash_config(d, use_swa=True, swa_window_size=32),
    }),
    "causal": lambda d: _edit(_dflash(d), config={"is_causal": True}),
    "causal_dflash_config": lambda d: _edit(_dflash(d), config={"dflash_config": _dflash_config(d, causal=False)}),
}


@pytest.fixture(scope="module")
def conversions(tmp_path_factory, embedded_target) -> dict[str, tuple[Path, Path, str | None]]:
    """name -> (ours, upstream's, upstream's error or None); every checkpoint built and converted once."""
    work = tmp_path_factory.mktemp("conformance")
    hf_target = write_hf_target(embedded_target, work / "target-hf")
    jobs, ours = {}, {}
    for name, build in VARIANTS.items():
        ckpt = build(work / name)
        ours[name] = convert_checkpoint(ckpt, work / f"{name}.ours.gguf", target=embedded_target, progress=False)
        jobs[name] = (ckpt, work / f"{name}.upstream.gguf")
    errors = convert_upstream(jobs, hf_target, work)
    return {name: (ours[name], jobs[name][1], errors.get(name, "not run")) for name in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_upstream(conversions, variant):
    ours, theirs, error = conversions[variant]
    assert error is None, f"upstream's converter refused the {variant} checkpoint: {error}"
    a, b = FastGGUFReader(ours), FastGGUFReader(theirs)
    ours_keys, their_keys = _compared_keys(a), _compared_keys(b)
    assert ours_keys == their_keys, {
        k: (ours_keys.get(k), their_keys.get(k)) for k in set(ours_keys) | set(their_keys)
        if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") and ours_keys.get(k) != their_keys.get(k)
    }
    ours_t, their_t = _tensors(a), _tensors(b)
    assert sorted(ours_t) == sorted(their_t)
    for name in ours_t:
        assert ours_t[name][:2] == their_t[name][:2], name
        assert ours_t[name][2] == their_t[name][2], f"{name}: values differ"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_converted_variant_loads_in_libllama(conversions, variant):
    ours, _, _ = conversions[variant]
    with loaded_model(ours):
        pass


def test_mask_row_is_the_drafters_own(conversions, tmp_path):
    """The patched row is mask_embedding.pt's vector; every other row is the target's (Q4_1 dequantized, bf16)."""
    ours, _, _ = conversions["mask_embedding"]
    embd = next(t for t in FastGGUFReader(ours).tensors if t.name == "token_embd.weight")
    table = gguf.quants.dequantize(embd.data, embd.tensor_type)
    mask = torch.load(ours.parent / "mask_embedding" / "mask_embedding.pt", weights_only=True)
    np.testing.assert_array_equal(table[16], mask["embedding"].to(torch.float32).numpy())
    assert not np.array_equal(table[15], table[16])
