"""A drafter kind is added by registering one (issue 21, item 3), with no edit outside this file.

`TOY` below is DFlash plus a tensor and a key of its own, with DSpark's anchor-first block layout.
Registered, it is what the one parse of a drafter file (`kinds.kind_of_file`, through
`drafter_gguf.read_drafter` / `check_drafter_gguf`, `target_gguf.drafter_verify_tokens` and
`dflash-convert --info`) makes of a real converted drafter given its marker tensor; its own GGUF rows
and rules are checked like the built-in kinds'; the converter maps its config.json architecture to it
and checks its config rows. Unregistered, the same file is a plain DFlash drafter again.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from checkpoints import HIDDEN_SIZE
from dflash_gguf import kinds
from dflash_gguf.convert import ConversionError, drafter_info, format_info
from dflash_gguf.convert.checkpoint import read_config
from dflash_gguf.drafter_gguf import DrafterGGUFError, check_drafter_gguf, read_drafter
from dflash_gguf.kinds import ConfigKey, DrafterKind, MetaKey, TensorSpec
from dflash_gguf.schema import Keys, Tensors
from dflash_gguf.target_gguf import FastGGUFReader, _field_value, drafter_verify_tokens

V = gguf.GGUFValueType

WIDTH_KEY = "dflash.toy_width"
GATE = "toy_gate.weight"
WIDTH = 8


def _divides(width: int, hidden: int, what: str) -> str | None:
    return None if hidden % width == 0 else f"{what} {hidden} is not divisible by toy_width {width}"


TOY = DrafterKind(
    name="toy",
    label="ToyFlash",
    architectures=("ToyFlashDraftModel",),
    marker=GATE,
    anchor_key="dflash.toy_anchor_first",
    gguf_keys=(MetaKey(WIDTH_KEY, (V.UINT32,), required=True, min=1, max=64),),
    gguf_tensors=(TensorSpec(GATE, lambda h: (h.n_embd, int(h.get("toy_width")))),),
    gguf_rules=(lambda h: _divides(int(h.get("toy_width")), h.n_embd, "embedding_length"),),
    config_keys=(ConfigKey("toy_width", "int", where="draft", min=1, max=64, required=True),),
    config_rules=(lambda v: _divides(v["toy_width"], v["hidden_size"], "hidden_size"),),
)


@pytest.fixture
def toy():
    kinds.register(TOY)
    try:
        yield TOY
    finally:
        kinds.unregister(TOY)


def rewrite(src: Path, dst: Path, *, keys: dict[str, tuple[Any, V]] | None = None,
            tensors: dict[str, np.ndarray] | None = None) -> Path:
    """A copy of a drafter GGUF with keys and (f32) tensors added or replaced."""
    keys, tensors = keys or {}, tensors or {}
    reader = FastGGUFReader(src)
    writer = gguf.GGUFWriter(dst, "dflash")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == Keys.ARCHITECTURE or key in keys:
            continue
        writer.add_key_value(key, *_field_value(field))
    for key, (value, vtype) in keys.items():
        writer.add_key_value(key, value, vtype)
    for t in reader.tensors:
        if t.name not in tensors:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, data in tensors.items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _gate(width: int = WIDTH) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((width, HIDDEN_SIZE)).astype(np.float32)  # ggml {n_embd, width}


@pytest.fixture
def toy_gguf(dflash_gguf_path, tmp_path) -> Path:
    """The real converted DFlash drafter with the toy kind's key and marker tensor added."""
    return rewrite(dflash_gguf_path, tmp_path / "toy.gguf", keys={WIDTH_KEY: (WIDTH, V.UINT32)}, tensors={GATE: _gate()})


def test_the_shared_parse_finds_a_registered_kind(toy, toy_gguf, dflash_gguf_path):
    block = read_drafter(dflash_gguf_path).block_size
    checked = check_drafter_gguf(toy_gguf)
    assert checked == read_drafter(toy_gguf)
    assert checked.kind is toy
    # its layout: anchor-first (toy_anchor_first absent), so slot 0 drafts and a verify holds one more token
    assert (checked.lead, checked.max_draft, checked.verify_tokens) == (0, block, block + 1)
    assert drafter_verify_tokens(toy_gguf) == block + 1
    info = drafter_info(toy_gguf)
    assert info.kind == "toy"
    assert "architecture:       dflash (ToyFlash)" in format_info(info)


def test_an_unregistered_kind_is_not_decided(toy_gguf, dflash_gguf_path):
    # without the registration the marker is just another tensor: the file is a plain DFlash drafter
    assert "toy" not in kinds.kind_names()
    assert check_drafter_gguf(toy_gguf).kind is kinds.DFLASH
    assert drafter_verify_tokens(toy_gguf) == drafter_verify_tokens(dflash_gguf_path)


def test_the_anchor_key_sets_the_block_layout(toy, dflash_gguf_path, tmp_path):
    bonus = rewrite(dflash_gguf_path, tmp_path / "bonus.gguf", tensors={GATE: _gate()},
                    keys={WIDTH_KEY: (WIDTH, V.UINT32), TOY.anchor_key: (False, V.BOOL)})
    drafter = check_drafter_gguf(bonus)
    assert (drafter.kind, drafter.lead, drafter.verify_tokens) == (toy, 1, drafter.block_size)


@pytest.mark.parametrize(
    "keys, tensors, words",
    [
        ({}, {GATE: _gate()}, [WIDTH_KEY, "missing"]),
        ({WIDTH_KEY: (0, V.UINT32)}, {GATE: _gate()}, [WIDTH_KEY, "< 1"]),
        ({WIDTH_KEY: (WIDTH, V.FLOAT32)}, {GATE: _gate()}, [WIDTH_KEY, "FLOAT32"]),
        ({WIDTH_KEY: (7, V.UINT32)}, {GATE: _gate(7)}, ["not divisible by toy_width 7"]),
        ({WIDTH_KEY: (WIDTH, V.UINT32)}, {GATE: _gate(WIDTH * 2)}, [GATE, f"[{HIDDEN_SIZE}, {WIDTH}]"]),
    ],
    ids=["key-missing", "key-range", "key-type", "rule", "tensor-shape"],
)
def test_its_own_rows_are_checked(toy, dflash_gguf_path, tmp_path, keys, tensors, words):
    bad = rewrite(dflash_gguf_path, tmp_path / "bad.gguf", keys=keys, tensors=tensors)
    with pytest.raises(DrafterGGUFError) as e:
        check_drafter_gguf(bad)
    assert str(bad) in str(e.value) and all(w in str(e.value) for w in words), e.value


def test_two_kinds_markers_in_one_file_are_refused(toy, toy_gguf, tmp_path):
    both = rewrite(toy_gguf, tmp_path / "both.gguf", tensors={Tensors.SELECTOR_HIDDEN: np.zeros((64, HIDDEN_SIZE))})
    markers = f"marker tensors of 2 drafter kinds ({Tensors.SELECTOR_HIDDEN} (DFlash2), {GATE} (ToyFlash))"
    for read in (read_drafter, check_drafter_gguf):
        with pytest.raises(DrafterGGUFError) as e:
            read(both)
        assert str(both) in str(e.value) and markers in str(e.value), e.value
    with pytest.raises(ConversionError, match="a drafter is one kind"):
        drafter_info(both)


def _toy_config(reference_checkpoint: Path, tmp_path: Path, **changes: Any) -> Path:
    """The reference checkpoint's config.json, naming the toy architecture, with `changes` in its dflash_config."""
    config = json.loads((reference_checkpoint / "config.json").read_text())
    config["architectures"] = list(TOY.architectures)
    config["dflash_config"].update(changes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_the_converter_reads_its_architecture_and_rows(toy, reference_checkpoint, tmp_path):
    assert read_config(_toy_config(reference_checkpoint, tmp_path, toy_width=WIDTH)).kind is toy
    for changes, words in [
        ({}, "missing toy_width"),
        ({"toy_width": 100}, "dflash_config.toy_width must be an integer >= 1 and <= 64, got 100"),
        ({"toy_width": 7}, f"hidden_size {HIDDEN_SIZE} is not divisible by toy_width 7"),
    ]:
        with pytest.raises(ConversionError, match=words):
            read_config(_toy_config(reference_checkpoint, tmp_path, **changes))


def test_an_unregistered_architecture_is_unknown_to_the_converter(reference_checkpoint, tmp_path):
    with pytest.raises(ConversionError, match="unknown architecture 'ToyFlashDraftModel'"):
        read_config(_toy_config(reference_checkpoint, tmp_path, toy_width=WIDTH))


def test_a_kind_that_collides_is_not_registered(toy):
    for clash, words in [
        (DrafterKind(name="toy", label="again"), "already registered"),
        (DrafterKind(name="toy2", label="x", architectures=("DFlash2DraftModel",), marker="toy2.weight"),
         "already converts as 'dflash2'"),
        (DrafterKind(name="toy3", label="x", marker=GATE), "already makes a drafter 'toy'"),
        (DrafterKind(name="toy4", label="x"), "the base kind"),
    ]:
        with pytest.raises(kinds.KindError, match=words):
            kinds.register(clash)
    assert kinds.kind_names() == ("dflash", "dflash2", "dspark", "toy")
