"""A drafter GGUF checked against everything libllama would assert on, before libllama sees it.

libllama refuses most bad GGUFs by throwing (the load returns NULL: a clean ValueError), but
some values reach a GGML_ASSERT or a bad index instead, and abort the process. They are
derived from the `dflash` architecture's code in the llama.cpp bundled with
llama-cpp-python 0.3.36 (reading is all this module does; it never calls libllama):

- `llama_model_base::load_hparams` (src/llama-model.cpp): `block_count` in 1..LLAMA_MAX_LAYERS (512),
  `nextn_predict_layers` <= `block_count`, the expert-count chain, a known `rope.scaling.type`;
- `llama_model_dflash::load_arch_hparams` (src/models/dflash.cpp): required `target_layers`,
  the rms epsilon, DFlash2's conv/selector sizes;
- `llama_model_loader` (src/llama-model-loader.cpp): every tensor dimension >= 1;
- ggml's CPU kernels: norm weights F32 (an F16 one aborts), weight matrices of a float or quantized
  type (an I32 / I64 one segfaults in mul_mat);
- the graph (dflash.cpp): key length == value length, `d2t` is I64 with one entry per row of
  the drafter's own `output.weight` (without it the target's full-vocabulary head is used and the
  assert fails), `d2t` ids inside the vocabulary (ggml_set_rows), top-k <= vocabulary (ggml_top_k),
  grouped-query heads (n_head a multiple of n_head_kv), rms eps >= 0 (ggml's rms_norm kernel);
  DSpark's Markov head reads `dflash.block_size` with std::stoi and asserts it is > 0.

Silent corruption is refused too: NaN or infinite scales, duplicate `d2t` ids (two draft rows
scattered onto one target token), wrong-typed keys the Python side parses from their text.

The checks are tables: `KEYS` (metadata key -> GGUF type, range, whether required), `TENSORS`
(tensor name -> GGUF shape and storage types) and `RULES` (checks relating several values), for what
every drafter has; each kind (`kinds.DrafterKind`) brings its own rows, and which kind a file is,
`kinds.kind_of_file` decides once (`read_drafter`, `check_drafter_gguf`).
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import gguf
import numpy as np

# the registry's own module: kinds/__init__ registers the built-in kinds, whose DSpark head reads a GGUF here
from .kinds.base import MAX_BLOCK_SIZE, MAX_LAYERS, DrafterKind, Hparams, KindError, MetaKey, TensorSpec, kind_of_file
from .schema import ARCH, DEFAULT_BLOCK_SIZE, Keys, Tensors

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType

MAX_EXPERTS = 1024  # LLAMA_MAX_EXPERTS
U32_MAX = 2**32 - 1
ROPE_SCALING_TYPES = ("none", "linear", "yarn", "longrope")
HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")


class DrafterGGUFError(ValueError):
    """A drafter GGUF libllama would abort on (or silently misread); the message names the file and the field."""


# ---------------------------------------------------------------------------------------------------------------
# metadata


def _a(suffix: str) -> str:
    return "{arch}." + suffix


_U32 = (V.UINT32,)
_F32 = (V.FLOAT32,)
_INT_ARRAY = (V.INT32, V.UINT32, V.INT64, V.UINT64, V.INT16, V.UINT16, V.INT8, V.UINT8)

KEYS: tuple[MetaKey, ...] = (
    MetaKey("general.architecture", (V.STRING,), required=True, choices=(ARCH,)),
    MetaKey(Keys.BLOCK_COUNT, _U32, required=True, min=1, max=MAX_LAYERS, note="GGML_ASSERT in load_hparams"),
    MetaKey(_a("nextn_predict_layers"), _U32, min=0, max=MAX_LAYERS),
    MetaKey(Keys.CONTEXT_LENGTH, _U32, min=0, max=U32_MAX),
    MetaKey(Keys.EMBEDDING_LENGTH, _U32, required=True, min=1, max=2**20),
    MetaKey(Keys.FEED_FORWARD_LENGTH, _U32 + (V.ARRAY,), array_of=_U32, min=1, max=2**24, per_layer=True),
    MetaKey(Keys.HEAD_COUNT, _U32 + (V.ARRAY,), array_of=_U32, min=1, max=2**16, per_layer=True),
    MetaKey(Keys.HEAD_COUNT_KV, _U32 + (V.ARRAY,), array_of=_U32, min=1, max=2**16, per_layer=True),
    MetaKey(Keys.KEY_LENGTH, _U32, min=1, max=2**16),
    MetaKey(Keys.VALUE_LENGTH, _U32, min=1, max=2**16),
    MetaKey(Keys.RMS_EPS, _F32, required=True, min=0.0, min_exclusive=True, max=1.0),
    MetaKey(Keys.CAUSAL, (V.BOOL,)),
    MetaKey(_a("attention.scale"), _F32),
    MetaKey(Keys.VALUE_SCALE, _F32),
    MetaKey(Keys.SLIDING_WINDOW, _U32, min=0, max=U32_MAX),
    MetaKey(Keys.SLIDING_WINDOW_PATTERN, (V.ARRAY,), array_of=(V.BOOL,)),
    MetaKey(Keys.ROPE_FREQ_BASE, _F32, min=0.0, min_exclusive=True),
    MetaKey(Keys.ROPE_DIMENSION_COUNT, _U32, min=2, max=2**16),
    MetaKey(Keys.ROPE_DIMENSION_SECTIONS, (V.ARRAY,), array_of=_INT_ARRAY),
    MetaKey(_a("rope.scaling.type"), (V.STRING,), choices=ROPE_SCALING_TYPES, note="GGML_ASSERT on an unknown name"),
    MetaKey(_a("rope.scaling.factor"), _F32, min=0.0),
    MetaKey(Keys.HIDDEN_ACT, (V.STRING,), choices=HIDDEN_ACTS),
    MetaKey(Keys.EMBEDDING_SCALE, _F32),
    MetaKey(Keys.LOGIT_SCALE, _F32),
    MetaKey(Keys.FINAL_LOGIT_SOFTCAPPING, _F32, min=0.0),
    MetaKey(_a("expert_count"), _U32, min=0, max=MAX_EXPERTS),
    MetaKey(_a("expert_used_count"), _U32 + (V.ARRAY,), array_of=_U32, min=0, max=MAX_EXPERTS, per_layer=True),
    MetaKey(_a("expert_group_count"), _U32, min=0, max=MAX_EXPERTS),
    MetaKey(_a("expert_group_used_count"), _U32, min=0, max=MAX_EXPERTS),
    MetaKey(Keys.TARGET_LAYERS, (V.ARRAY,), array_of=_INT_ARRAY, required=True, note="required by load_arch_hparams"),
    MetaKey(Keys.BLOCK_SIZE, _U32, min=2, max=MAX_BLOCK_SIZE, note="a block is the last token plus >= 1 draft"),
    MetaKey(Keys.VOCAB_SIZE, _U32, min=1, max=2**31 - 1),
    # tokenizer
    MetaKey(Keys.TOKENIZER_MODEL, (V.STRING,)),
    MetaKey("tokenizer.ggml.tokens", (V.ARRAY,), array_of=(V.STRING,)),
    MetaKey("tokenizer.ggml.scores", (V.ARRAY,), array_of=(V.FLOAT32,)),
    MetaKey("tokenizer.ggml.token_type", (V.ARRAY,), array_of=(V.INT32,)),
    MetaKey(Keys.MASK_TOKEN_ID, _U32, min=0, max=2**31 - 1),
)


# ---------------------------------------------------------------------------------------------------------------
# tensors


TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec(Tensors.FC, lambda h: (h.n_targets * h.n_embd, h.n_embd)),
    TensorSpec("fc.scale", lambda h: (1,), required=False, storage="f32"),
    TensorSpec("rope_freqs.weight", lambda h: (h.head_k // 2,), required=False, storage="f32"),
    TensorSpec(Tensors.HIDDEN_NORM, lambda h: (h.n_embd,), storage="f32"),
    TensorSpec(Tensors.OUTPUT_NORM, lambda h: (h.n_embd,), storage="f32"),
    TensorSpec(Tensors.TOKEN_EMBD, lambda h: (h.n_embd, h.n_vocab), required=False),
    TensorSpec(Tensors.OUTPUT, lambda h: (h.n_embd, h.n_draft), required=False),
    TensorSpec(Tensors.D2T, lambda h: (h.n_draft,), required=False, storage="i64"),
    TensorSpec(Tensors.ATTN_NORM, lambda h: (h.n_embd,), storage="f32"),
    TensorSpec(Tensors.ATTN_Q, lambda h: (h.n_embd, h.head_k * h.n_head)),
    TensorSpec(Tensors.ATTN_K, lambda h: (h.n_embd, h.head_k * h.n_head_kv)),
    TensorSpec(Tensors.ATTN_V, lambda h: (h.n_embd, h.head_v * h.n_head_kv), required=False),
    TensorSpec(Tensors.ATTN_OUT, lambda h: (h.head_k * h.n_head, h.n_embd)),
    TensorSpec(Tensors.ATTN_Q_NORM, lambda h: (h.head_k,), storage="f32"),
    TensorSpec(Tensors.ATTN_K_NORM, lambda h: (h.head_k,), storage="f32"),
    TensorSpec("blk.{bid}.post_attention_norm.weight", lambda h: (h.n_embd,), required=False, storage="f32"),
    TensorSpec("blk.{bid}.post_ffw_norm.weight", lambda h: (h.n_embd,), required=False, storage="f32"),
    TensorSpec("blk.{bid}.layer_output_scale.weight", lambda h: (1,), required=False, storage="f32"),
    TensorSpec(Tensors.ATTN_SINKS, lambda h: (h.n_head,), required=False, storage="f32"),
    TensorSpec(Tensors.FFN_NORM, lambda h: (h.n_embd,), storage="f32"),
    TensorSpec(Tensors.FFN_GATE, lambda h: (h.n_embd, h.n_ff)),
    TensorSpec(Tensors.FFN_UP, lambda h: (h.n_embd, h.n_ff)),
    TensorSpec(Tensors.FFN_DOWN, lambda h: (h.n_ff, h.n_embd)),
)

_NORM_TYPES = (Q.F32,)
_I64 = (Q.I64,)
_NOT_MATRIX = frozenset({Q.I8, Q.I16, Q.I32, Q.I64, Q.F64})
"""Types a matrix may not have: ggml's mul_mat has no kernel for them (an I32 or I64 weight segfaults on CPU)."""



# ---------------------------------------------------------------------------------------------------------------
# a bounded GGUF header reader
#
# gguf-py's GGUFReader builds a numpy view per token and merge (over a second for a 49k-token tokenizer)
# and trusts every count it reads. This one reads the same format with every count and offset checked
# against the file, keeps long string arrays as their length only, and reads no tensor data but d2t's.

_SCALAR = {
    V.UINT8: "<u1", V.INT8: "<i1", V.UINT16: "<u2", V.INT16: "<i2", V.UINT32: "<u4", V.INT32: "<i4",
    V.FLOAT32: "<f4", V.BOOL: "<u1", V.UINT64: "<u8", V.INT64: "<i8", V.FLOAT64: "<f8",
}
_KEEP_STRINGS = 4096  # string arrays longer than this keep their length only (tokens, merges)
GGML_MAX_DIMS = 4


@dataclass
class GGUFField:
    type: V
    sub: V | None  # element type of an array
    value: Any  # scalar, str, list; None for a long string array
    count: int = 1  # array length


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # ggml order, ne0 first
    tensor_type: Q
    offset: int  # absolute file offset of its data
    nbytes: int


@dataclass
class GGUFHeader:
    path: Path
    fields: dict[str, GGUFField]
    tensors: dict[str, GGUFTensor]
    buffer: Any  # the mapped file

    def value(self, key: str, default: Any = None) -> Any:
        f = self.fields.get(key)
        return default if f is None else f.value


class _Cursor:
    def __init__(self, buf: Any, path: Path) -> None:
        self.buf, self.pos, self.path, self.size = buf, 0, path, len(buf)

    def need(self, n: int, what: str) -> None:
        if n < 0 or self.pos > self.size or self.pos + n > self.size:
            raise DrafterGGUFError(f"{self.path}: could not load: truncated or corrupt GGUF ({what} runs past the end of the file)")

    def scalar(self, t: V, what: str) -> Any:
        dt = np.dtype(_SCALAR[t])
        self.need(dt.itemsize, what)
        v = np.frombuffer(self.buf, dtype=dt, count=1, offset=self.pos)[0]
        self.pos += dt.itemsize
        return bool(v) if t == V.BOOL else v.item()

    def u64(self, what: str) -> int:
        return int(self.scalar(V.UINT64, what))

    def string(self, what: str) -> str:
        n = self.u64(what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def skip_string(self, what: str) -> None:
        n = self.u64(what)
        self.need(n, what)
        self.pos += n

    def skip_strings(self, count: int, what: str) -> None:
        """Skip `count` strings (a tokenizer's 100k tokens and merges in tens of milliseconds)."""
        unpack, buf, pos, size = struct.Struct("<Q").unpack_from, self.buf, self.pos, self.size
        for _ in range(count):
            if pos + 8 > size:
                self.pos = pos
                self.need(8, what)
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos
        self.need(0, what)

    def value_type(self, what: str) -> V:
        raw = int(self.scalar(V.UINT32, what))
        try:
            return V(raw)
        except ValueError:
            raise DrafterGGUFError(f"{self.path}: {what}: unknown GGUF value type {raw}") from None


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file, bounded by the file; DrafterGGUFError on anything malformed."""
    import mmap

    path = Path(path)
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise DrafterGGUFError(f"{path}: truncated GGUF ({size} bytes)")
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except OSError as e:
        raise DrafterGGUFError(f"{path}: cannot read ({e.strerror or e})") from None
    c = _Cursor(buf, path)
    c.need(4, "magic")
    if bytes(buf[:4]) != b"GGUF":
        raise DrafterGGUFError(f"{path}: not a GGUF file (it does not start with the GGUF magic)")
    c.pos = 4
    version = int(c.scalar(V.UINT32, "version"))
    if version not in (2, 3):
        raise DrafterGGUFError(f"{path}: GGUF version {version} is not supported (2 or 3; a big-endian file reads as another number)")
    n_tensors, n_kv = c.u64("tensor count"), c.u64("key count")
    if n_tensors > size // 24 or n_kv > size // 12:
        raise DrafterGGUFError(f"{path}: corrupt GGUF header ({n_tensors} tensors, {n_kv} keys in {size} bytes)")
    fields: dict[str, GGUFField] = {}
    for _ in range(n_kv):
        key = c.string("a key name")
        if key in fields:
            raise DrafterGGUFError(f"{path}: {key}: key appears twice")
        t = c.value_type(key)
        if t == V.ARRAY:
            sub = c.value_type(key)
            count = c.u64(key)
            if sub == V.ARRAY:
                raise DrafterGGUFError(f"{path}: {key}: nested arrays are not GGUF")
            if sub == V.STRING:
                c.need(8 * count, key)
                if count <= _KEEP_STRINGS:
                    value: Any = [c.string(key) for _ in range(count)]
                else:
                    c.skip_strings(count, key)
                    value = None
            else:
                dt = np.dtype(_SCALAR[sub])
                c.need(dt.itemsize * count, key)
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=c.pos)
                c.pos += dt.itemsize * count
                value = [bool(x) for x in arr] if sub == V.BOOL else arr.tolist()
            fields[key] = GGUFField(t, sub, value, count)
        elif t == V.STRING:
            fields[key] = GGUFField(t, None, c.string(key))
        else:
            fields[key] = GGUFField(t, None, c.scalar(t, key))
    infos = []
    for _ in range(n_tensors):
        name = c.string("a tensor name")
        n_dims = int(c.scalar(V.UINT32, name))
        if not 1 <= n_dims <= GGML_MAX_DIMS:
            raise DrafterGGUFError(f"{path}: {name}: tensor has {n_dims} dimensions (ggml allows 1..{GGML_MAX_DIMS})")
        shape = tuple(c.u64(name) for _ in range(n_dims))
        raw_type = int(c.scalar(V.UINT32, name))
        offset = c.u64(name)
        infos.append((name, shape, raw_type, offset))
    alignment = fields.get("general.alignment")
    align = int(alignment.value) if alignment is not None and alignment.type == V.UINT32 else 32
    if align <= 0 or align & (align - 1):
        raise DrafterGGUFError(f"{path}: general.alignment {align} is not a power of two")
    data_start = (c.pos + align - 1) // align * align
    tensors: dict[str, GGUFTensor] = {}
    for name, shape, raw_type, offset in infos:
        if name in tensors:
            raise DrafterGGUFError(f"{path}: {name}: tensor appears twice")
        try:
            qtype = Q(raw_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise DrafterGGUFError(f"{path}: {name}: unknown tensor type {raw_type}") from None
        if min(shape) < 1:
            raise DrafterGGUFError(f"{path}: {name}: tensor shape {list(shape)} has an empty dimension (the loader asserts every dimension >= 1)")
        if shape[0] % block:
            raise DrafterGGUFError(f"{path}: {name}: row of {shape[0]} is not a multiple of {qtype.name}'s block of {block}")
        nbytes = math.prod(shape[1:]) * (shape[0] // block) * type_size
        if offset % align or data_start + offset + nbytes > size:
            raise DrafterGGUFError(f"{path}: {name}: tensor data [{offset}, {offset + nbytes}) lies outside the file's data section")
        tensors[name] = GGUFTensor(name, shape, qtype, data_start + offset, nbytes)
    return GGUFHeader(path, fields, tensors, buf)

# ---------------------------------------------------------------------------------------------------------------
# the checks


class _Fail:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __call__(self, fieldname: str, message: str) -> DrafterGGUFError:
        return DrafterGGUFError(f"{self.path}: {fieldname}: {message}")


def _scalar_ok(value: Any, key: MetaKey) -> str | None:
    if isinstance(value, (bytes, str)):
        if key.choices is not None:
            text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
            if text not in key.choices:
                return f"{text!r} is not one of {', '.join(key.choices)}"
        return None
    if isinstance(value, bool):
        return None
    x = float(value)
    if key.finite and not math.isfinite(x):
        return f"{value} is not a finite number"
    if key.min is not None and (x <= key.min if key.min_exclusive else x < key.min):
        return f"{value} is {'<=' if key.min_exclusive else '<'} {key.min:g}"
    if key.max is not None and x > key.max:
        return f"{value} exceeds {key.max:g}"
    return None


def _type_name(t: V) -> str:
    return t.name


def _read_keys(header: GGUFHeader, kind: DrafterKind, fail: _Fail) -> dict[str, Any]:
    values: dict[str, Any] = {}
    fields = header.fields
    n_layer = None
    for key in (*KEYS, *kind.gguf_keys):
        name = key.key.format(arch=ARCH)
        f = fields.get(name)
        if f is None:
            if key.required:
                raise fail(name, "missing (libllama requires it)")
            continue
        main = f.type
        if main not in key.types:
            raise fail(name, f"stored as {_type_name(main)}, libllama reads it as {'/'.join(map(_type_name, key.types))}")
        if main == V.ARRAY:
            sub = f.sub
            if sub not in key.array_of:
                raise fail(name, f"an array of {sub.name if sub else 'nothing'}, expected {'/'.join(map(_type_name, key.array_of))}")
            value = f.value
            if key.per_layer and n_layer is not None and f.count != n_layer:
                raise fail(name, f"has {f.count} entries for {n_layer} layers")
            if sub not in (V.STRING, V.BOOL):
                for item in value:
                    problem = _scalar_ok(item, key)
                    if problem:
                        raise fail(name, f"entry {problem}")
        else:
            value = f.value
            problem = _scalar_ok(value, key)
            if problem:
                raise fail(name, problem)
        values[name] = value
        if name == Keys.BLOCK_COUNT:
            n_layer = int(value)
    return values


def _per_layer_max(value: Any) -> int:
    return max(int(v) for v in value) if isinstance(value, list) else int(value)


def _uniform(value: Any, name: str, fail: _Fail) -> int:
    if isinstance(value, list):
        if len(set(int(v) for v in value)) > 1:
            raise fail(name, f"per-layer values {value[:8]} differ; a dflash drafter has one geometry for all layers")
        return int(value[0])
    return int(value)


def _hparams(header: GGUFHeader, values: dict[str, Any], fail: _Fail) -> Hparams:
    tensors = header.tensors
    g = lambda suffix, default=None: values.get(f"{ARCH}.{suffix}", default)  # noqa: E731
    n_embd = int(g("embedding_length"))
    n_layer = int(g("block_count"))
    if g("attention.head_count") is None:
        raise fail(Keys.HEAD_COUNT, "missing: a dflash drafter is a transformer and needs attention heads")
    n_head = _uniform(g("attention.head_count"), Keys.HEAD_COUNT, fail)
    n_head_kv = _uniform(g("attention.head_count_kv", n_head), Keys.HEAD_COUNT_KV, fail)
    if g("feed_forward_length") is None:
        raise fail(Keys.FEED_FORWARD_LENGTH, "missing")
    n_ff = _uniform(g("feed_forward_length"), Keys.FEED_FORWARD_LENGTH, fail)
    head_k = int(g("attention.key_length", n_embd // n_head))
    head_v = int(g("attention.value_length", n_embd // n_head))
    n_rot = int(g("rope.dimension_count", head_k))
    tokens = header.fields.get("tokenizer.ggml.tokens")
    # libllama's n_vocab for the drafter: its own tokenizer's, else dflash.vocab_size (tokenizer model "none")
    n_vocab: int | None = tokens.count if tokens is not None else g("vocab_size")
    d2t = tensors.get(Tensors.D2T)
    n_draft = int(d2t.shape[0]) if d2t is not None and len(d2t.shape) >= 1 else n_vocab
    layers = g("target_layers") or []
    return Hparams(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, head_k=head_k, head_v=head_v,
        n_ff=n_ff, n_rot=n_rot, n_vocab=n_vocab, n_draft=n_draft, n_targets=len(layers), values=values,
        counts={k: f.count for k, f in header.fields.items() if f.type == V.ARRAY},
        shapes={name: tuple(int(d) for d in t.shape) for name, t in tensors.items()},
    )


# rules relating several values: check(h) -> problem or None
def _r_heads(h: Hparams) -> str | None:
    if h.n_head % h.n_head_kv:
        return f"head_count {h.n_head} is not a multiple of head_count_kv {h.n_head_kv} (grouped-query attention)"
    return None


def _r_head_dims(h: Hparams) -> str | None:
    if h.head_k < 1 or h.head_v < 1:
        return f"head size {h.head_k} (embedding_length / head_count or key_length) must be >= 1"
    if h.head_k != h.head_v:
        return f"key_length {h.head_k} != value_length {h.head_v} (GGML_ASSERT in the dflash graph)"
    return None


def _r_rope(h: Hparams) -> str | None:
    if h.n_rot > h.head_k or h.n_rot % 2:
        return f"rope.dimension_count {h.n_rot} must be even and <= the head size {h.head_k}"
    return None


def _r_nextn(h: Hparams) -> str | None:
    n = h.get("nextn_predict_layers", 0)
    if n > h.n_layer:
        return f"nextn_predict_layers {n} exceeds block_count {h.n_layer}"
    return None


def _r_experts(h: Hparams) -> str | None:
    n_expert = int(h.get("expert_count", 0))
    used = _per_layer_max(h.get("expert_used_count", 0))
    groups, group_used = int(h.get("expert_group_count", 0)), int(h.get("expert_group_used_count", 0))
    if used > n_expert:
        return f"expert_used_count {used} exceeds expert_count {n_expert}"
    if n_expert > 0:
        if used == 0:
            return "expert_count > 0 needs expert_used_count > 0"
        if groups >= n_expert:
            return f"expert_group_count {groups} must be < expert_count {n_expert}"
        if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
            return f"expert groups {groups} / used {group_used} do not divide expert_count {n_expert}"
    elif groups:
        return "expert_group_count without experts"
    return None


def _r_target_layers(h: Hparams) -> str | None:
    layers = h.get("target_layers") or []
    if not layers:
        return "target_layers is empty: the drafter reads no target features"
    if min(layers) < 0:
        return f"target_layers {layers} has a negative layer id"
    return None


def _r_vocab(h: Hparams) -> str | None:
    model = h.values.get(Keys.TOKENIZER_MODEL)
    tokens = h.counts.get("tokenizer.ggml.tokens")
    if model not in (None, "none") and tokens is None:
        return f"tokenizer.ggml.model is {model!r} but the GGUF has no tokenizer.ggml.tokens"
    if model in (None, "none") and h.get("vocab_size") is None and tokens is None:
        return f"no vocabulary: neither tokenizer.ggml.tokens nor {Keys.VOCAB_SIZE}"
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        n_entries = h.counts.get(key)
        if n_entries is not None and tokens is not None and n_entries != tokens:
            return f"{key} has {n_entries} entries for {tokens} tokens"
    mask = h.values.get(Keys.MASK_TOKEN_ID)
    if mask is not None and h.n_vocab is not None and not 0 <= mask < h.n_vocab:
        return f"{Keys.MASK_TOKEN_ID} {mask} is outside the vocabulary of {h.n_vocab}"
    return None


def _r_window(h: Hparams) -> str | None:
    window = h.get("attention.sliding_window", 0)
    pattern = h.get("attention.sliding_window_pattern")
    if window and pattern is None:
        return "attention.sliding_window is set but attention.sliding_window_pattern is missing"
    if pattern is not None and len(pattern) > h.n_layer:
        return f"attention.sliding_window_pattern has {len(pattern)} entries for {h.n_layer} layers"
    return None


RULES: tuple[Callable[[Hparams], str | None], ...] = (
    _r_heads, _r_head_dims, _r_rope, _r_nextn, _r_experts, _r_target_layers, _r_vocab, _r_window,
)


def _check_tensors(h: Hparams, tensors: dict[str, Any], kind: DrafterKind, fail: _Fail) -> None:
    for name, t in tensors.items():
        shape = tuple(int(d) for d in t.shape)
        if not shape or min(shape) < 1:
            raise fail(name, f"tensor shape {list(shape)} has an empty dimension (the loader asserts every dimension >= 1)")
    for spec in (*TENSORS, *kind.gguf_tensors):
        names = [spec.name.format(bid=i) for i in range(h.n_layer)] if "{bid}" in spec.name else [spec.name]
        for name in names:
            t = tensors.get(name)
            if t is None:
                if spec.required:
                    raise fail(name, "missing tensor")
                continue
            want = spec.shape(h)
            got = tuple(int(d) for d in t.shape)
            if None not in want and got != want:
                raise fail(name, f"tensor shape {list(got)}, the metadata implies {list(want)}")
            if spec.storage == "matrix" and t.tensor_type in _NOT_MATRIX:
                raise fail(name, f"stored as {t.tensor_type.name}; a weight matrix must be a float or quantized type")
            if spec.storage == "f32" and t.tensor_type not in _NORM_TYPES:
                raise fail(name, f"stored as {t.tensor_type.name}, must be F32")
            if spec.storage == "i64" and t.tensor_type not in _I64:
                raise fail(name, f"stored as {t.tensor_type.name}, libllama asserts I64")
    # tensors of layers past block_count, or of no known name: libllama counts them and refuses the file
    layer_ids = {int(n.split(".")[1]) for n in tensors if n.startswith("blk.") and n.split(".")[1].isdigit()}
    if layer_ids and max(layer_ids) >= h.n_layer:
        raise fail(Keys.BLOCK_COUNT, f"{h.n_layer} layers, but the file has tensors of layer {max(layer_ids)}")


def _check_d2t(h: Hparams, header: GGUFHeader, fail: _Fail) -> None:
    tensors = header.tensors
    d2t = tensors.get(Tensors.D2T)
    if d2t is None:
        return
    if len(d2t.shape) != 1:
        raise fail(Tensors.D2T, f"must be 1-D, has shape {list(d2t.shape)}")
    if Tensors.OUTPUT not in tensors:
        raise fail(Tensors.D2T, f"a reduced vocabulary needs the drafter's own {Tensors.OUTPUT} (the target's head has the full vocabulary)")
    ids = np.frombuffer(header.buffer, dtype="<i8", count=math.prod(d2t.shape), offset=d2t.offset).copy()
    if h.n_vocab is not None and h.n_draft is not None and h.n_draft > h.n_vocab:
        raise fail(Tensors.D2T, f"{h.n_draft} draft rows for a vocabulary of {h.n_vocab}")
    if ids.size:
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or (h.n_vocab is not None and hi >= h.n_vocab):
            bad = lo if lo < 0 else hi
            raise fail(Tensors.D2T, f"maps a draft row to token {bad}, outside the vocabulary of {h.n_vocab}")
        if np.unique(ids).size != ids.size:
            raise fail(Tensors.D2T, "maps two draft rows to the same target token")


@dataclass(frozen=True)
class DrafterFile:
    """What a drafter GGUF is, read once from its header: its kind and the block layout the kind gives it."""

    path: Path
    kind: DrafterKind
    block_size: int  # `dflash.block_size`, llama.cpp's default when absent
    anchor_first: bool  # slot 0 of a block predicts (DSpark's default layout); else it holds the last token

    @property
    def lead(self) -> int:
        """Block slots before the first draft: 1 when slot 0 holds the last committed token."""
        return 0 if self.anchor_first else 1

    @property
    def max_draft(self) -> int:
        return self.block_size - self.lead

    @property
    def verify_tokens(self) -> int:
        """The longest verify batch its blocks make: the last committed token and `max_draft` drafts."""
        return self.max_draft + 1


def _kind(header: GGUFHeader) -> DrafterKind:
    """The one decision of a `dflash` GGUF's kind: by its tensors and keys, `kinds.kind_of_file`."""
    try:
        return kind_of_file([*header.tensors, *header.fields])
    except KindError as e:
        raise DrafterGGUFError(f"{header.path}: {e}") from None


def _drafter_file(header: GGUFHeader, kind: DrafterKind, fail: _Fail) -> DrafterFile:
    """The block layout `kind` gives this file (its keys' types are checked by `_read_keys` where it matters)."""
    block = header.value(Keys.BLOCK_SIZE, DEFAULT_BLOCK_SIZE)
    if isinstance(block, bool) or not isinstance(block, int):
        raise fail(Keys.BLOCK_SIZE, f"{block!r} is not an integer")
    anchor = None if kind.anchor_key is None else header.value(kind.anchor_key)
    return DrafterFile(header.path, kind, block, kind.anchor_key is not None and (anchor is None or bool(anchor)))


def _with_header(path: str | Path, read: Callable[[GGUFHeader, _Fail], Any]) -> Any:
    path = Path(path)
    header = read_gguf_header(path)
    try:
        return read(header, _Fail(path))
    finally:
        try:
            header.buffer.close()
        except BufferError:  # a view still referenced (by a traceback's frame): the map closes when it is collected
            pass


def read_drafter(path: str | Path) -> DrafterFile | None:
    """A drafter GGUF's kind and layout from its header, unchecked (`check_drafter_gguf` checks it too);
    None for a GGUF of another architecture. DrafterGGUFError for an unreadable file."""

    def read(header: GGUFHeader, fail: _Fail) -> DrafterFile | None:
        return _drafter_file(header, _kind(header), fail) if header.value(Keys.ARCHITECTURE) == ARCH else None

    return _with_header(path, read)


def check_drafter_gguf(path: str | Path) -> DrafterFile | None:
    """Raise DrafterGGUFError (naming the file and the field) for a drafter GGUF libllama would abort on.

    Reads metadata and the tensor table with `read_gguf_header` (memory-mapped; only `d2t`'s data is read).
    Returns what the drafter is; None for a GGUF of another architecture, which this does not check
    (libllama loads it as that model; `drafter.check_pairing` refuses it, and the target-dependent facts
    such as hidden size, vocabulary and layer ids, after the load, which is safe for them).
    """
    return _with_header(path, _check)


def _check(header: GGUFHeader, fail: _Fail) -> DrafterFile | None:
    if header.value(Keys.ARCHITECTURE) != ARCH:
        return None  # another architecture: libllama loads it as that model, and check_pairing refuses it
    kind, tensors = _kind(header), header.tensors
    values = _read_keys(header, kind, fail)
    h = _hparams(header, values, fail)
    for rule in (*RULES, *kind.gguf_rules):
        problem = rule(h)
        if problem:
            raise DrafterGGUFError(f"{header.path}: {problem}")
    _check_tensors(h, tensors, kind, fail)
    for rule in kind.gguf_tensor_rules:
        problem = rule(h)
        if problem:
            raise DrafterGGUFError(f"{header.path}: {problem}")
    _check_d2t(h, header, fail)
    return _drafter_file(header, kind, fail)
