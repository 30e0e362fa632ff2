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
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

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
pytestmark = [
    pytest.mark.skipif(
        not UPSTREAM_CONVERTER.is_file(),
        reason=f"upstream llama.cpp sources absent ({UPSTREAM_CONVERTER}); scripts/test.sh unpacks them",
    ),
    pytest.mark.slow,  # 23 checkpoints built and converted twice
]

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


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
"""GGUF value type -> struct format, for every fixed-size type (8 is string, 9 array)."""


class GGUFContents:
    """A GGUF's metadata (strings decoded, arrays as lists, scalars as Python values) and its tensors
    (name -> (type name, shape, bytes as a read-only view)), parsed straight from the format.

    gguf.GGUFReader takes seconds per file on a 49k-token vocabulary (a numpy view per string); this reads
    the same file in a fraction of that, and is a second, independent reader of what both converters wrote.
    """

    def __init__(self, path: Path) -> None:
        self.data = np.memmap(path, dtype=np.uint8, mode="r")
        self._buf, self._pos = memoryview(self.data), 4
        assert bytes(self._buf[:4]) == b"GGUF", path
        version, n_tensors, n_kv = self._unpack("<I"), self._unpack("<Q"), self._unpack("<Q")
        assert version == 3, (path, version)
        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.fields[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            shape = tuple(self._unpack("<Q") for _ in range(self._unpack("<I")))
            infos.append((name, shape, gguf.GGMLQuantizationType(self._unpack("<I")), self._unpack("<Q")))
        alignment = self.fields.get("general.alignment", 32)
        start = -(-self._pos // alignment) * alignment
        self.tensors: dict[str, tuple[str, tuple[int, ...], np.ndarray]] = {}
        for name, shape, qtype, offset in infos:
            block, size = gguf.GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(shape)) // block * size
            self.tensors[name] = (qtype.name, shape, self.data[start + offset : start + offset + n_bytes])

    def _unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._unpack("<Q")
        self._pos += n
        return bytes(self._buf[self._pos - n : self._pos]).decode("utf-8", errors="replace")

    def _value(self, vtype: int) -> Any:
        if vtype == 8:
            return self._string()
        if vtype == 9:
            item, n = self._unpack("<I"), self._unpack("<Q")
            return [self._value(item) for _ in range(n)]
        return self._unpack(_SCALARS[vtype])


def _compared_keys(contents: GGUFContents) -> dict[str, Any]:
    return {
        key: value for key, value in contents.fields.items()
        if key.startswith(f"{ARCH}.") or key in COMPARED_TOKENIZER_KEYS or key in (Keys.ARCHITECTURE, Keys.FILE_TYPE)
    }


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


@contextmanager
def upstream_converting(
    jobs: dict[str, tuple[Path, Path]], hf_target: Path, work: Path
) -> Iterator[Callable[[], dict[str, str | None]]]:
    """Upstream's converter on the (checkpoint dir, out) jobs, in up to MAX_DRIVERS subprocesses side by side.

    Yields the wait: name -> None (converted) or upstream's error. Meanwhile the caller converts with ours, so the
    two converters share the machine's cores instead of taking turns (each conversion is seconds of Python).
    Drivers still running when the block ends (a failure in ours) are killed.
    """
    names = list(jobs)
    n_drivers = max(1, min(MAX_DRIVERS, os.cpu_count() or 1, len(names)))
    drivers = []
    try:
        for i in range(n_drivers):
            part = {name: [str(jobs[name][0]), "--outfile", str(jobs[name][1]), "--target-model-dir", str(hf_target)]
                    for name in names[i::n_drivers]}
            jobs_file, results_file, log = work / f"jobs{i}.json", work / f"results{i}.json", work / f"driver{i}.log"
            jobs_file.write_text(json.dumps(part))
            results_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-c", _DRIVER, str(LLAMA_CPP_SRC), str(jobs_file), str(results_file)]
            with log.open("w") as err:  # a file, not a pipe: upstream logs every tensor, and nobody reads until the end
                env = {**os.environ, "OMP_NUM_THREADS": "1"}
                proc = subprocess.Popen(cmd, stdout=err, stderr=subprocess.STDOUT, env=env)
            drivers.append((proc, results_file, log))

        def wait() -> dict[str, str | None]:
            results: dict[str, str | None] = {}
            for proc, results_file, log in drivers:
                proc.wait(timeout=1200)
                if not results_file.is_file():
                    raise RuntimeError(f"upstream's converter driver failed:\n{log.read_text()[-4000:]}")
                results.update(json.loads(results_file.read_text()))
            return results

        yield wait
    finally:
        for proc, _, _ in drivers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


MAX_DRIVERS = 4
"""Upstream driver processes at most: each imports transformers once, then converts its share of the variants."""


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
    jobs = {name: (build(work / name), work / f"{name}.upstream.gguf") for name, build in VARIANTS.items()}
    with upstream_converting(jobs, hf_target, work) as wait_upstream:
        ours = {name: convert_checkpoint(ckpt, work / f"{name}.ours.gguf", target=embedded_target, progress=False)
                for name, (ckpt, _) in jobs.items()}
        errors = wait_upstream()
    return {name: (ours[name], jobs[name][1], errors.get(name, "not run")) for name in VARIANTS}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_matches_upstream(conversions, variant):
    ours, theirs, error = conversions[variant]
    assert error is None, f"upstream's converter refused the {variant} checkpoint: {error}"
    a, b = GGUFContents(ours), GGUFContents(theirs)
    ours_keys, their_keys = _compared_keys(a), _compared_keys(b)
    assert ours_keys == their_keys, {
        k: (ours_keys.get(k), their_keys.get(k)) for k in set(ours_keys) | set(their_keys)
        if k not in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges") and ours_keys.get(k) != their_keys.get(k)
    }
    assert sorted(a.tensors) == sorted(b.tensors)
    for name, (qtype, shape, data) in a.tensors.items():
        assert (qtype, shape) == b.tensors[name][:2], name
        assert np.array_equal(data, b.tensors[name][2]), f"{name}: values differ"


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
