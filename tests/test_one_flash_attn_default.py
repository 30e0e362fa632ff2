"""One flash-attention default (issue 34): defaults.FLASH_ATTN, read by every place a context is made.

It used to be off in target.new_context and Target() and on in Target.open and SessionOptions, so a context
made through the lower door decoded with other kernels than the Session's (and its greedy tokens differed).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from dflash_gguf import defaults
from dflash_gguf.bench import kernels
from dflash_gguf.config import SessionOptions
from dflash_gguf.session import Session
from dflash_gguf.target import Target, new_context
from dflash_gguf.train.config import TrainConfig

ROOT = Path(__file__).resolve().parent.parent


def _default(function, name: str):
    return inspect.signature(function).parameters[name].default


def test_every_entry_point_defaults_to_the_one_setting():
    assert isinstance(defaults.FLASH_ATTN, bool)
    assert _default(new_context, "flash_attn") is defaults.FLASH_ATTN
    assert _default(Target.open, "flash_attn") is defaults.FLASH_ATTN
    assert SessionOptions().flash_attn is defaults.FLASH_ATTN
    assert TrainConfig.__dataclass_fields__["flash_attn"].default is defaults.FLASH_ATTN
    assert _default(kernels.measure, "flash_attn") is defaults.FLASH_ATTN
    # a Target describes the context it was handed: it says how that was made, it has no default of its own
    assert _default(Target.__init__, "flash_attn") is inspect.Parameter.empty


def test_no_module_spells_a_default_of_its_own():
    """Any `flash_attn=True/False` default (an argument's or a field's) in the product is a second default."""
    found = []
    for base in (ROOT / "dflash_gguf", ROOT / "tui", ROOT / "convert"):
        for path in base.rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.arguments):
                    named = node.posonlyargs + node.args
                    pairs = list(zip(named[len(named) - len(node.defaults):], node.defaults))
                    pairs += [(a, d) for a, d in zip(node.kwonlyargs, node.kw_defaults) if d is not None]
                    found += [f"{path.name}:{a.lineno}" for a, d in pairs
                              if a.arg == "flash_attn" and isinstance(d, ast.Constant)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    if node.target.id == "flash_attn" and isinstance(node.value, ast.Constant):
                        found.append(f"{path.name}:{node.lineno}")
    assert found == []


def test_the_contexts_made_agree(embedded_target):
    """Opened by the Session, by Target.open and as a fork of either: the same setting, in the contexts themselves."""
    with Target.open(embedded_target, n_ctx=64, n_batch=8, n_threads=1) as t, t.fork() as forked:
        assert t.flash_attn is forked.flash_attn is defaults.FLASH_ATTN
    with Session(embedded_target, drafter=None, lookup=False, n_ctx=64, n_batch=8, n_threads=1) as s:
        assert s.target.flash_attn is defaults.FLASH_ATTN
