"""dflash-convert pairs drafters with hybrid targets; dflash-train accepts them (issue 10)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.convert.cli import main as convert_main
from dflash_gguf.schema import Keys
from dflash_gguf.target import Target
from dflash_gguf.target_gguf import field_value, open_gguf, read_target_info
from dflash_gguf.train.target_spec import read_target_spec

from hybrid_fixtures import HIDDEN, N_LAYER, build_drafter_checkpoint, draft_config

pytestmark = pytest.mark.slow  # every test runs on the hybrid targets (tests/hybrid_fixtures.py builds them with upstream's converter)


@pytest.mark.parametrize("arch", ["qwen35", "lfm2", "qwen3next"])
def test_convert_pairs_with_a_hybrid_target(hybrid_models, arch):
    target, drafter = hybrid_models.target(arch), hybrid_models.drafter(arch)
    info = read_target_info(target)
    assert info.recurrent
    reader = open_gguf(Path(drafter))
    assert field_value(reader, Keys.TARGET_FINGERPRINT) == info.fingerprint
    assert field_value(reader, Keys.TARGET_ARCH) == arch
    assert field_value(reader, "tokenizer.ggml.tokens")[:20] == field_value(open_gguf(Path(target)), "tokenizer.ggml.tokens")[:20]
    with Target.open(target, n_ctx=64, n_batch=16) as t:
        assert t.fingerprint() == info.fingerprint


def test_convert_refuses_layers_a_hybrid_target_lacks(hybrid_models, tmp_path, capsys):
    target = hybrid_models.target("qwen35")
    ckpt = build_drafter_checkpoint(tmp_path / "ckpt")
    config = (ckpt / "config.json").read_text().replace('"target_layer_ids": [\n      0,\n      2\n    ]', '"target_layer_ids": [0, 3]')
    (ckpt / "config.json").write_text(config)
    assert '"target_layer_ids": [0, 3]' in config
    capsys.readouterr()  # save_pretrained's own progress output
    out = tmp_path / "d.gguf"
    code = convert_main([str(ckpt), str(out), "--target", str(target)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and not out.exists()
    assert len(err.splitlines()) == 1 and "[0, 3]" in err and f"{N_LAYER}-layer" in err and "0..3" in err


@pytest.mark.parametrize("arch", ["qwen35", "lfm2", "qwen3next"])
def test_train_accepts_a_hybrid_target(hybrid_models, arch):
    spec = read_target_spec(hybrid_models.target(arch))
    assert spec.info.recurrent and spec.info.n_embd == HIDDEN
    assert (spec.n_head, spec.n_head_kv, spec.head_dim) == (4, 2, 16)  # lfm2's per-layer kv heads: the attention layers'
    assert spec.mask_token_text == "<empty_output>"
    assert draft_config().dflash_config["target_layer_ids"] == [0, 2]
