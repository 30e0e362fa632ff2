"""A drafter kind with its own head is one package plus its registry line (issue 34, item 7).

`TOY_PACKAGE` below is written to a folder of its own and imported from there: a kind whose graph is the base
kind's (libllama computes DFlash's) and whose head, what the host computes over the drafter's output rows,
never drafts one banned token. It is marked by a metadata key its converter writes (no tensor libllama would
refuse). Registered, a checkpoint naming its architecture converts as it, the converted GGUF is read as it, and
a Drafter on that file drafts through its head; nothing outside the package was edited.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys

import numpy as np
import pytest

from dflash_gguf import kinds
from dflash_gguf.convert import convert_checkpoint, drafter_info
from dflash_gguf.drafter import Drafter
from dflash_gguf.drafter_gguf import check_drafter_gguf
from dflash_gguf.sampling import SamplingParams
from dflash_gguf.target import Target

TOY_PACKAGE = {
    "__init__.py": '''
"""ToyBan: DFlash's graph; its head never drafts the token its file bans."""

import gguf

from dflash_gguf.kinds.base import ConfigKey, DrafterKind, MetaKey

from .convert import BANNED_KEY, ToyConverter
from .head import ToyHead

KIND = DrafterKind(
    name="toyban",
    label="ToyBan",
    architectures=("ToyBanDraftModel",),
    marker=BANNED_KEY,
    gguf_keys=(MetaKey(BANNED_KEY, (gguf.GGUFValueType.UINT32,), required=True, min=0, max=2**31),),
    config_keys=(ConfigKey("banned_token", "int", where="draft", min=0, required=True),),
    head=ToyHead,
    converter=ToyConverter(),
)
''',
    "convert.py": '''
import gguf

from dflash_gguf.kinds.converting import Converter, draft_value

BANNED_KEY = "dflash.toy_banned_token"


class ToyConverter(Converter):
    def metadata(self, cfg, tensor_names):
        return [(BANNED_KEY, int(draft_value(cfg.hparams, "banned_token")), gguf.GGUFValueType.UINT32)]
''',
    "head.py": '''
import numpy as np

from dflash_gguf.kinds.head import HeadSource, LogitsHead

from .convert import BANNED_KEY


class ToyHead(LogitsHead):
    def __init__(self, source: HeadSource) -> None:
        super().__init__(source)
        self.banned = int(source.meta(BANNED_KEY))

    def rows(self, logits, nextn):
        rows, _ = super().rows(logits, nextn)
        rows = np.array(rows, copy=True)
        rows[:, self.banned] = -np.inf
        return rows, None
''',
}


@pytest.fixture
def toy_package(tmp_path, monkeypatch):
    """The package, written to tmp_path/toyban and imported from there, and its registry line."""
    folder = tmp_path / "toyban"
    folder.mkdir()
    for name, text in TOY_PACKAGE.items():
        (folder / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    package = importlib.import_module("toyban")
    kinds.register(package.KIND)  # the registry line
    try:
        yield package.KIND
    finally:
        kinds.unregister(package.KIND)
        for name in [m for m in sys.modules if m == "toyban" or m.startswith("toyban.")]:
            del sys.modules[name]


@pytest.fixture(scope="module")
def target(embedded_target):
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as t:
        yield t


def _drafted(drafter: Drafter, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the rows of one block drafted after the features, its greedy proposal)."""
    drafter.clear()
    drafter.inject(feats, 0)
    rows = np.array(drafter.draft(321, len(feats), drafter.max_draft))
    return rows, drafter.propose(321, len(feats), drafter.max_draft, SamplingParams(), None).tokens


def test_a_drafter_kind_with_its_own_head_is_one_package_and_one_registry_line(
        toy_package, reference_checkpoint, dflash_gguf_path, embedded_target, target, tmp_path):
    # the same weights as DFlash: what the base kind drafts, and the token the toy's head will ban
    with Drafter(dflash_gguf_path, target) as plain:
        feats = np.random.default_rng(0).standard_normal((7, plain.n_features)).astype(np.float32)
        plain_rows, plain_tokens = _drafted(plain, feats)
    banned = int(plain_tokens[0])

    # converted: its architecture picks the kind, its config row is read and its converter writes its key
    checkpoint = shutil.copytree(reference_checkpoint, tmp_path / "checkpoint")
    config = json.loads((checkpoint / "config.json").read_text())
    config["architectures"] = ["ToyBanDraftModel"]
    config["dflash_config"]["banned_token"] = banned
    (checkpoint / "config.json").write_text(json.dumps(config))
    out = convert_checkpoint(checkpoint, tmp_path / "toy.gguf", target=embedded_target, progress=False)

    # picked up: the one parse of a drafter file reads it as the toy kind
    assert check_drafter_gguf(out).kind is toy_package
    assert drafter_info(out).kind == "toyban"

    # run through its head: libllama computed DFlash's graph, the host banned the token
    with Drafter(out, target) as toy:
        assert toy.kind == "toyban"
        rows, tokens = _drafted(toy, feats)
    want = plain_rows.copy()
    want[:, banned] = -np.inf
    np.testing.assert_array_equal(rows, want)
    np.testing.assert_array_equal(tokens, want.argmax(axis=1))
    assert banned not in tokens.tolist() and tokens[0] != plain_tokens[0]
