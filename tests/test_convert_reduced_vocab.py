"""Reduced draft vocabularies: checkpoint `d2t` offsets become upstream's absolute I64 ids."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import torch

from checkpoints import HIDDEN_SIZE, VOCAB_SIZE, loaded_model, reader
from dflash_gguf.convert import convert_checkpoint
from dflash_gguf.schema import Tensors
from test_convert_bad_input import reduce_vocabulary


def test_reduced_vocabulary_converts_and_loads(reference_checkpoint, embedded_target, tmp_path):
    ckpt = Path(shutil.copytree(reference_checkpoint, tmp_path / "ckpt"))
    ids = torch.randperm(VOCAB_SIZE, generator=torch.Generator().manual_seed(0))[:512].sort().values
    reduce_vocabulary(ckpt, ids)
    out = convert_checkpoint(ckpt, tmp_path / "reduced.gguf", target=embedded_target, progress=False)

    tensors = {t.name: t for t in reader(out).tensors}
    d2t = tensors[Tensors.D2T]
    assert d2t.tensor_type == gguf.GGMLQuantizationType.I64
    np.testing.assert_array_equal(np.asarray(d2t.data), ids.numpy())
    head = tensors[Tensors.OUTPUT]
    assert tuple(int(x) for x in head.shape) == (HIDDEN_SIZE, 512)
    with loaded_model(out) as model:
        assert model  # dflash.cpp asserts d2t is I64 and sized like the head: a wrong file aborts here
