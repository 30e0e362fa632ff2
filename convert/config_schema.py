"""config.json, checked against one declarative table before any value is used.

Every key the converter reads is a row of `SCHEMA`: where it is looked up, its type, its range.
`check_config` walks the table once, so a wrong type or an out-of-range value is one
ConversionError naming the key and the file, never a traceback at its point of use.
`RULES` holds the few checks that relate two keys. A drafter kind's own keys and rules are its
`kinds.DrafterKind.config_keys` / `config_rules`, checked after these for a checkpoint of that kind.

Where a key is looked up (`where`):
- "top": the top level of config.json;
- "dflash": inside `dflash_config` only;
- "draft": z-lab's order, `dflash_config` first, then the top level (`checkpoint.draft_value`);
- "rope": `rope_parameters` / `rope_scaling` first, then the top level (transformers 5 moved rope keys there).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.safetensors_reader import _Duplicate, _no_constant, _no_duplicates, read_regular_text
from dflash_gguf.kinds import MAX_BLOCK_SIZE, MAX_LAYERS, DrafterKind
from dflash_gguf.kinds import ConfigKey as Key

U32_MAX = 2**32 - 1
I32_MAX = 2**31 - 1
F32_MAX = 3.4028234663852886e38
MAX_CONFIG_BYTES = 16 * 2**20

HIDDEN_ACTS = ("silu", "gelu", "gelu_pytorch_tanh")  # what llama.cpp's dflash loader accepts
LAYER_TYPES = ("full_attention", "sliding_attention")


def _k(name: str, type: str, **kw: Any) -> Key:
    return Key(name, type, **kw)


# The table. Ranges are what libllama and the GGUF's integer widths accept (uint32 keys, LLAMA_MAX_LAYERS),
# and what the drafter needs to run (a block of at least 2).
SCHEMA: tuple[Key, ...] = (
    # containers
    _k("architectures", "str_list", required=True, note="non-empty list of class names"),
    _k("dflash_config", "object"),
    _k("rope_parameters", "object", where="top"),
    _k("rope_scaling", "object", where="top"),
    # geometry
    _k("hidden_size", "int", min=1, max=2**20, required=True),
    _k("intermediate_size", "int", min=1, max=2**24, required=True),
    _k("num_hidden_layers", "int", min=1, max=MAX_LAYERS, required=True),
    _k("num_attention_heads", "int", min=1, max=2**16, required=True),
    _k("num_key_value_heads", "int", min=1, max=2**16, required=True),
    _k("head_dim", "int", min=1, max=2**16),
    _k("vocab_size", "int", min=1, max=I32_MAX, required=True),
    _k("draft_vocab_size", "int", min=1, max=I32_MAX),
    _k("rms_norm_eps", "float", where="draft", min=0.0, min_exclusive=True, max=1.0, required=True),
    _k("max_position_embeddings", "int", min=1, max=I32_MAX),
    _k("hidden_act", "str", choices=HIDDEN_ACTS, default="silu"),
    # rope
    _k("rope_theta", "float", where="rope", min=0.0, min_exclusive=True, max=F32_MAX),
    _k("partial_rotary_factor", "float", where="rope", min=0.0, min_exclusive=True, max=1.0),
    _k("rope_pct", "float", min=0.0, min_exclusive=True, max=1.0, note="alias of partial_rotary_factor"),
    _k("rope_percent", "float", min=0.0, min_exclusive=True, max=1.0, note="alias of partial_rotary_factor"),
    _k("rope_type", "str", where="rope"),
    _k("rope_is_neox_style", "bool", default=True),
    # DFlash proper
    _k("block_size", "int", where="draft", min=2, max=MAX_BLOCK_SIZE, note="the drafted block: last token + drafts"),
    _k("mask_token_id", "int", where="draft", min=0, max=I32_MAX, required=True),
    _k("target_layer_ids", "int_list", where="draft", min=0, max=MAX_LAYERS),
    _k("num_target_layers", "int", where="draft", min=1, max=MAX_LAYERS),
    # optional transforms (z-lab scale keys), written as float32
    _k("attention_value_scale", "float", where="draft", min=-F32_MAX, max=F32_MAX),
    _k("output_multiplier", "float", where="draft", min=-F32_MAX, max=F32_MAX),
    _k("final_logit_softcapping", "float", where="draft", min=0.0, max=F32_MAX),
    _k("input_embedding_scale", "float", where="draft", min=-F32_MAX, max=F32_MAX),
    # attention pattern
    _k("use_sliding_window", "bool", default=False),
    _k("sliding_window", "int", min=1, max=U32_MAX),
    _k("layer_types", "str_list"),
    _k("use_swa", "bool", where="dflash", default=False),
    _k("swa_window_size", "int", where="dflash", min=1, max=U32_MAX),
    _k("is_causal", "bool"),
    _k("causal", "bool", where="dflash"),
)


def _type_ok(value: Any, type_: str) -> bool:
    if type_ == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if type_ == "bool":
        return isinstance(value, bool)
    if type_ == "str":
        return isinstance(value, str)
    if type_ == "object":
        return isinstance(value, dict)
    if type_ == "int_list":
        return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    if type_ == "str_list":
        return isinstance(value, list) and all(isinstance(v, str) for v in value)
    raise AssertionError(f"unknown schema type {type_}")


_TYPE_NAMES = {
    "int": "an integer", "float": "a number", "bool": "true or false", "str": "a string", "object": "a JSON object",
    "int_list": "a list of integers", "str_list": "a list of strings",
}


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _in_range(key: Key, x: float) -> bool:
    if key.min is not None and (x <= key.min if key.min_exclusive else x < key.min):
        return False
    return key.max is None or x <= key.max


def _range_text(key: Key) -> str:
    low = "" if key.min is None else f"{'>' if key.min_exclusive else '>='} {key.min:g}"
    high = "" if key.max is None else f"<= {key.max:g}"
    return " and ".join(p for p in (low, high) if p)


def check_value(key: Key, value: Any, path: Path, where: str) -> None:
    """ConversionError unless `value` fits the row."""
    label = f"{where}{key.name}"
    if not _type_ok(value, key.type):
        raise ConversionError(f"{path}: {label} must be {_TYPE_NAMES[key.type]}, got {_short(value)}")
    if key.type == "float":
        try:
            x = float(value)
        except OverflowError:
            x = math.inf
        if not math.isfinite(x) or not _in_range(key, x):
            raise ConversionError(f"{path}: {label} must be a finite number {_range_text(key)}, got {_short(value)}")
        if key.min_exclusive and key.min == 0.0 and not _f32_positive(x):
            raise ConversionError(f"{path}: {label} {value!r} is 0 in float32, where the GGUF stores it")
    elif key.type == "int":
        if not _in_range(key, value):
            raise ConversionError(f"{path}: {label} must be an integer {_range_text(key)}, got {_short(value)}")
    elif key.type == "int_list":
        if not value:
            raise ConversionError(f"{path}: {label} must be a non-empty list of integers")
        bad = [v for v in value if not _in_range(key, v)]
        if bad:
            raise ConversionError(f"{path}: {label} must hold integers {_range_text(key)}, got {_short(bad[0])}")
    if key.choices is not None:
        items = value if key.type.endswith("_list") else [value]
        bad = [v for v in items if v not in key.choices]
        if bad:
            raise ConversionError(
                f"{path}: {label} {_short(bad[0])} is not supported (use {', '.join(map(str, key.choices))})"
            )
    if key.type == "str_list" and key.required and not value:
        raise ConversionError(f"{path}: {label} must be a non-empty list")


def _f32_positive(x: float) -> bool:
    import numpy as np

    return float(np.float32(x)) > 0.0


def lookup(hparams: dict[str, Any], key: Key) -> tuple[Any, str]:
    """(value, where it was found as a message prefix); value None when absent."""
    dflash_config = hparams.get("dflash_config")
    if not isinstance(dflash_config, dict):  # its own row reports it
        dflash_config = {}
    if key.where == "dflash":
        return dflash_config.get(key.name), "dflash_config."
    if key.where == "draft" and dflash_config.get(key.name) is not None:
        return dflash_config[key.name], "dflash_config."
    if key.where == "rope":
        for container in ("rope_parameters", "rope_scaling"):
            rope = hparams.get(container)
            if isinstance(rope, dict) and rope.get(key.name) is not None:
                return rope[key.name], f"{container}."
    return hparams.get(key.name), ""


def _rows(kind: DrafterKind | None) -> tuple[Key, ...]:
    """The rows a checkpoint of `kind` is checked against: every kind's, then its own."""
    return SCHEMA if kind is None else (*SCHEMA, *kind.config_keys)


# cross-key rules: predicate(values) -> message or None
def _heads(v: dict[str, Any]) -> str | None:
    if v["num_attention_heads"] % v["num_key_value_heads"]:
        return f"num_attention_heads {v['num_attention_heads']} is not a multiple of num_key_value_heads {v['num_key_value_heads']}"
    if v.get("head_dim") is None and v["hidden_size"] < v["num_attention_heads"]:
        return f"hidden_size {v['hidden_size']} is smaller than num_attention_heads {v['num_attention_heads']} (set head_dim)"
    return None


ROTARY_FRACTION_KEYS = ("partial_rotary_factor", "rope_pct", "rope_percent")
"""Upstream's find_hparam order for the rotary fraction (the first present wins)."""


def rotary_fraction(hparams: dict[str, Any]) -> float | None:
    """partial_rotary_factor as upstream reads it: `rope_parameters` / `rope_scaling` first, then the top-level aliases."""
    rope = hparams.get("rope_parameters") or hparams.get("rope_scaling") or {}
    if rope.get("partial_rotary_factor") is not None:
        return float(rope["partial_rotary_factor"])
    return next((float(hparams[k]) for k in ROTARY_FRACTION_KEYS if hparams.get(k) is not None), None)


def _rope_dims(v: dict[str, Any]) -> str | None:
    partial = next((v[k] for k in ROTARY_FRACTION_KEYS if v.get(k) is not None), None)
    if partial is None:
        return None
    head_dim = v.get("head_dim") or v["hidden_size"] // v["num_attention_heads"]
    n_rot = int(head_dim * float(partial))
    if n_rot < 2 or n_rot % 2:
        return f"partial_rotary_factor {partial} gives {n_rot} rotary dimensions of {head_dim}; rope needs an even count >= 2"
    return None


def _layers(v: dict[str, Any]) -> str | None:
    ids, n = v.get("target_layer_ids"), v.get("num_target_layers")
    if ids is not None and n is not None and max(ids) >= n:
        return f"target_layer_ids {ids} name a layer past num_target_layers {n}"
    return None


def _window(v: dict[str, Any]) -> str | None:
    types = v.get("layer_types")
    uses = v.get("use_sliding_window") and not v.get("use_swa")
    if uses and types is not None and len(types) != v["num_hidden_layers"]:
        return f"layer_types has {len(types)} entries for {v['num_hidden_layers']} layers"
    return None


def _mask(v: dict[str, Any]) -> str | None:
    if v["mask_token_id"] >= v["vocab_size"]:
        return f"mask_token_id {v['mask_token_id']} is outside the vocabulary of {v['vocab_size']}"
    if v.get("draft_vocab_size") is not None and v["draft_vocab_size"] > v["vocab_size"]:
        return f"draft_vocab_size {v['draft_vocab_size']} exceeds vocab_size {v['vocab_size']}"
    return None


RULES: tuple[Callable[[dict[str, Any]], str | None], ...] = (_heads, _rope_dims, _layers, _window, _mask)

def check_named(hparams: dict[str, Any], path: Path, kind: DrafterKind, names: Sequence[str], prefix: str = "") -> None:
    """Type and range of the rows of these names (`kind`'s and every kind's) that are present in `hparams`:
    what a kind's converter checks before it reads its own schema (DSpark's nested transformer)."""
    by_name = {k.name: k for k in _rows(kind)}
    check_keys(hparams, path, [by_name[name] for name in names], prefix=prefix)


def check_keys(hparams: dict[str, Any], path: Path, keys: Sequence[Key], prefix: str = "") -> None:
    """Type and range of each of `keys` that is present (a container that is not an object is skipped by lookup)."""
    for key in keys:
        value, where = lookup(hparams, key)
        if value is not None:
            check_value(key, value, path, prefix + where)


def _apply_rules(values: dict[str, Any], path: Path, kind: DrafterKind | None) -> None:
    for rule in RULES if kind is None else (*RULES, *kind.config_rules):
        try:
            message = rule(values)
        except (KeyError, TypeError):  # a key the rule needs is absent: reported by the caller's own required-key check
            continue
        if message:
            raise ConversionError(f"{path}: {message}")


def check_config(hparams: dict[str, Any], path: Path, kind: DrafterKind | None = None) -> dict[str, Any]:
    """Check every row of SCHEMA (and RULES) against a parsed config.json; returns name -> value (defaults filled).

    `kind` adds its own rows and rules; None checks the rows every kind reads.
    """
    values: dict[str, Any] = {}
    for key in _rows(kind):
        value, where = lookup(hparams, key)
        if value is None:
            if key.required and key.name not in _REQUIRED_ELSEWHERE:
                raise ConversionError(f"{path}: missing {key.name}")
            values[key.name] = key.default
            continue
        check_value(key, value, path, where)
        values[key.name] = value
    _apply_rules(values, path, kind)
    return values


# required keys whose "missing" message read_config words itself (kept stable for its callers)
_REQUIRED_ELSEWHERE = frozenset({"architectures", "mask_token_id", "rms_norm_eps"})


def load_config_json(path: Path, what: str = "config.json") -> Any:
    """Parse a JSON file that must be a regular file: one ConversionError for every way it can be wrong.

    Duplicate keys are refused (which value is meant is ambiguous); so are NaN / Infinity and nesting
    deep enough to exhaust Python's recursion limit.
    """
    text = read_regular_text_checked(path, what)
    try:
        return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except _Duplicate as e:
        raise ConversionError(f"{path}: invalid {what} (key {str(e)!r} appears twice)") from None
    except RecursionError:
        raise ConversionError(f"{path}: invalid {what} (JSON nested too deeply)") from None
    except ValueError as e:
        raise ConversionError(f"{path}: invalid {what} ({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read_regular_text_checked(path: Path, what: str) -> str:
    import os

    try:
        size = os.stat(path).st_size
    except OSError:
        size = 0
    if size > MAX_CONFIG_BYTES:
        raise ConversionError(f"{path}: invalid {what} ({size} bytes; a config is a few kB)")
    try:
        return read_regular_text(path, what)
    except UnicodeDecodeError as e:
        raise ConversionError(f"{path}: invalid {what} (not UTF-8: {e.reason})") from None
    except OSError as e:
        raise ConversionError(f"{path}: cannot read ({e.strerror or e})") from None
