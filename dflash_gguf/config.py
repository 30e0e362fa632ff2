"""Every setting once: `GenerationConfig` (one generation), `SessionOptions` (one Session), `CacheOptions`
(a prompt cache).

Each field carries its default, its check, its help and its command-line flag. Session, the server, the
TUI, dflash-generate and the bench build these classes, and the CLIs take their flags from
`add_arguments`; adding a setting is one field here and the code where it acts.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import Field, dataclass, field, fields, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, TypeVar

from .checks import SettingError, boolean, checked, integer, optional, optional_boolean, real, strings
from .constraints import KINDS as CONSTRAINT_KINDS
from .constraints import ConstraintSpec, compile_grammar, schema_text
from .defaults import FLASH_ATTN
from .prompt_cache import DEFAULT_DISK_BYTES, PromptCache, parse_size
from .rpc import check_endpoints
from .sampling import CHECKS as SAMPLING_CHECKS
from .sampling import SamplingParams
from .target import KV_TYPES, LLAMA_MAX_SEQ, QUANTIZED_KV_TYPES

__all__ = [
    "CacheOptions", "GenerationConfig", "KV_CACHE_SETTINGS", "PROMPT_CACHE_SETTINGS",
    "LLAMA_CHAT_DEFAULTS", "LLAMA_COMPLETION_DEFAULTS", "SessionOptions",
    "SettingError", "add_arguments", "from_arguments",
]

T = TypeVar("T")


def setting(default: Any, check: Callable[[Any], Any], help: str, *, flags: Sequence[str] = (),
            parse: Callable[[str], Any] | None = None) -> Any:
    """A config field: its default, its check, and how a command line spells it (parse=None: no flag)."""
    return field(default=default, metadata={"check": check, "help": help, "flags": tuple(flags), "parse": parse})


def _constraint(kind: str) -> Callable[[Any], Any]:
    """None, or a grammar / JSON schema / regex that compiles (a schema is kept as canonical JSON text)."""
    def check(value: Any) -> str | None:
        if value is None:
            return None
        text = schema_text(value) if kind == "json_schema" else value
        if not isinstance(text, str) or not text.strip():
            raise TypeError(f"must be None or a non-empty string, got {value!r}")
        compile_grammar(kind, text)
        return text

    return check


def _kv_type(optional_meaning: str | None = None) -> Callable[[Any], Any]:
    """One of llama.cpp's KV cache type names (f16, q8_0, q4_0, ...); None too where it means something."""
    def check(value: Any) -> str | None:
        if value is None and optional_meaning is not None:
            return None
        if value not in KV_TYPES:
            none = f"None ({optional_meaning}) or " if optional_meaning is not None else ""
            raise ValueError(f"must be {none}one of {', '.join(KV_TYPES)}, got {value!r}")
        return value

    return check


def _context_size(value: Any) -> int | None:
    """None (the model's trained context, read from its GGUF when the Session opens) or a size of at least 8."""
    return None if value is None else integer(8)(value)


def _check_fields(obj: Any) -> None:
    """Run every field's check, keeping its normalised value; the first bad one raises SettingError."""
    for f in fields(obj):
        object.__setattr__(obj, f.name, checked(f.name, f.metadata["check"], getattr(obj, f.name)))


def _build(cls: type[T], base: T | None, settings: Mapping[str, Any], what: str) -> T:
    unknown = set(settings) - {f.name for f in fields(cls)}
    if unknown:
        raise TypeError(f"unknown {what} argument(s): {', '.join(sorted(unknown))}")
    return replace(base, **settings) if base is not None else cls(**settings)


@dataclass(frozen=True)
class GenerationConfig:
    """How one generation runs; validated on construction, so an instance in hand is always usable."""

    max_tokens: int | None = setting(128, optional(integer(1), "up to the end of the context"),
                                     "tokens to generate at most", parse=int)
    temperature: float = setting(0.0, SAMPLING_CHECKS["temperature"], "sampling temperature; 0 = greedy", parse=float)
    top_p: float = setting(1.0, SAMPLING_CHECKS["top_p"], "nucleus: the smallest set of tokens with this mass",
                           parse=float)
    top_k: int = setting(0, SAMPLING_CHECKS["top_k"], "sample among the k likeliest tokens; 0 = off", parse=int)
    min_p: float = setting(0.0, SAMPLING_CHECKS["min_p"],
                           "drop tokens less likely than this fraction of the likeliest; 0 = off", parse=float)
    repeat_penalty: float = setting(1.0, SAMPLING_CHECKS["repeat_penalty"],
                                    "divide the logit of a token in the last repeat_last_n of the reply; 1 = off",
                                    parse=float)
    repeat_last_n: int = setting(64, SAMPLING_CHECKS["repeat_last_n"],
                                 "reply tokens the penalties look back over; -1 = all, 0 = off", parse=int)
    presence_penalty: float = setting(0.0, SAMPLING_CHECKS["presence_penalty"],
                                      "lower the logit of a token in that window by this", parse=float)
    frequency_penalty: float = setting(0.0, SAMPLING_CHECKS["frequency_penalty"],
                                       "lower the logit of a token by this times its count in that window", parse=float)
    logit_bias: tuple[tuple[int, float], ...] = setting((), SAMPLING_CHECKS["logit_bias"],
                                                        "{token id: bias} added to the logits (-inf bans a token)")
    seed: int | None = setting(None, SAMPLING_CHECKS["seed"], "sampling seed (default: fresh entropy)", parse=int)
    logprobs: int | None = setting(None, optional(integer(0), "none reported"),
                                   "report each token's log-probability under the target and its n likeliest "
                                   "alternatives", parse=int)
    stop: tuple[str, ...] = setting((), strings, "strings that end the reply (not included in it)")
    speculative: bool = setting(True, boolean, "draft and verify (off: decode plainly)", parse=bool)
    block_size: int | None = setting(None, optional(integer(1), "adaptive"),
                                     "fixed block size, drafts + 1 (default: adaptive, chosen per cycle)", parse=int)
    confidence_threshold: float | None = setting(
        None, optional(real(0.0, 1.0), "no cut"),
        "cut a draft at the first predicted acceptance below this (DSpark drafters)", parse=float)
    # at most one constraint; every token of the reply, drafted or not, is chosen under it
    grammar: str | None = setting(None, _constraint("grammar"), "a GBNF grammar (llama.cpp's) or a Lark grammar")
    json_schema: str | None = setting(None, _constraint("json_schema"), "a JSON schema the reply follows")
    regex: str | None = setting(None, _constraint("regex"), "a regular expression the reply matches")
    forced_drafts: bool = setting(True, boolean, "draft the tokens a constraint leaves no choice about, for free "
                                  "(off: only the other sources draft, to measure what the forced ones add)", parse=bool)

    def __post_init__(self) -> None:
        _check_fields(self)
        given = [kind for kind in CONSTRAINT_KINDS if getattr(self, kind) is not None]
        if len(given) > 1:
            raise SettingError(given[1], f"give one constraint, not {' and '.join(given)}")

    @classmethod
    def build(cls, base: GenerationConfig | None = None, /, **settings: Any) -> GenerationConfig:
        """`base` (or the defaults) with `settings` applied; an unknown name is a TypeError."""
        return _build(cls, base, settings, "generation")

    @cached_property
    def sampling(self) -> SamplingParams:
        return SamplingParams(**{name: getattr(self, name) for name in SAMPLING_CHECKS})

    @cached_property
    def constraint(self) -> ConstraintSpec | None:
        """The compiled constraint, if the config carries one."""
        for kind in CONSTRAINT_KINDS:
            source = getattr(self, kind)
            if source is not None:
                return ConstraintSpec(kind, compile_grammar(kind, source))
        return None

    def with_stops(self, stops: Sequence[str]) -> GenerationConfig:
        """The same config with more stop strings (a chat template's), after the caller's."""
        return replace(self, stop=self.stop + tuple(s for s in stops if s not in self.stop)) if stops else self


# llama_cpp.Llama's defaults, for the Session methods shaped like its create_completion / create_chat_completion
LLAMA_COMPLETION_DEFAULTS = GenerationConfig(max_tokens=16, temperature=0.8, top_p=0.95, top_k=40, min_p=0.05)
# the KV cache types of target and drafter: every command that opens a Session takes them
KV_CACHE_SETTINGS = ("type_k", "type_v", "type_k_draft", "type_v_draft")
LLAMA_CHAT_DEFAULTS = GenerationConfig(max_tokens=None, temperature=0.2, top_p=0.95, top_k=40, min_p=0.05)


@dataclass(frozen=True)
class SessionOptions:
    """How a Session opens its target and drafter and serves its callers."""

    n_ctx: int | None = setting(4096, _context_size, "context size in tokens (none given: the model's trained "
                                "context, where a command defaults to that)", parse=int)
    n_gpu_layers: int = setting(0, integer(-1, " (-1 = all)"),
                                "target layers to offload to the GPU; -1 = all (CUDA/Metal/Vulkan builds)",
                                flags=("--n-gpu-layers", "-ngl"), parse=int)  # -ngl: upstream's; never -ngld's prefix
    n_gpu_layers_draft: int | None = setting(None, optional(integer(-1, " (-1 = all)"), "as the target"),
                                             "drafter layers to offload to the GPU (default: as the target; "
                                             "upstream's -ngld)", flags=("--n-gpu-layers-draft", "-ngld"), parse=int)
    n_threads: int | None = setting(None, optional(integer(1), "llama.cpp's choice"),
                                    "CPU threads (default: llama.cpp's choice)", flags=("--threads", "--n-threads"),
                                    parse=int)
    n_batch: int = setting(512, integer(1), "tokens per decode batch", parse=int)
    flash_attn: bool = setting(FLASH_ATTN, boolean, "flash attention (on: batched and single decodes agree bit for bit)")
    verbose: bool = setting(False, boolean, "libllama's own log on stderr")
    wait: bool = setting(True, boolean, "a second caller waits for the running generation (False: SessionBusyError)")
    n_rs_seq: int | None = setting(None, optional(integer(0), "sized for the drafter"),
                                   "recurrent-state snapshots per sequence on hybrid targets")
    recalibrate: bool = setting(False, boolean, "measure the verify and draft costs again instead of reusing the "
                                "ones saved for this build, device, models and settings", parse=bool)
    lookup: bool | None = setting(None, optional_boolean("on only without a drafter"),
                                  "n-gram lookup drafts (copies from prompt and reply) next to the drafter "
                                  "(default: on only without a drafter)", parse=bool)
    mtp: bool = setting(True, boolean, "the target's own MTP heads draft, where its GGUF has them, beside lookup and "
                        "the drafter (off: they are not even loaded)", parse=bool)
    # the KV cache's element type; a quantized cache holds more context in less memory (llama.cpp's -ctk/-ctv)
    type_k: str = setting("f16", _kv_type(), "target KV cache type for K", flags=("--cache-type-k", "-ctk"),
                          parse=str)
    type_v: str = setting("f16", _kv_type(), "target KV cache type for V (quantized: needs flash attention)",
                          flags=("--cache-type-v", "-ctv"), parse=str)
    type_k_draft: str | None = setting(None, _kv_type("as the target"),
                                       "drafter KV cache type for K (default: as the target)",
                                       flags=("--cache-type-k-draft", "-ctkd"), parse=str)
    type_v_draft: str | None = setting(None, _kv_type("as the target"),
                                       "drafter KV cache type for V (default: as the target)",
                                       flags=("--cache-type-v-draft", "-ctvd"), parse=str)
    # llama.cpp's RPC backend (upstream's --rpc): other machines' devices take the target's offloaded layers
    rpc_servers: tuple[str, ...] = setting((), check_endpoints,
                                           "rpc-servers lending their devices to the target's offloaded layers, "
                                           "host:port[,host:port...] (needs an RPC build: scripts/build_rpc.sh; "
                                           "the drafter stays local; default: none)", flags=("--rpc",), parse=str)
    # a cycle verifies a tree of the drafter's (any kind) or lookup's candidates instead of one block (issue 36)
    tree_nodes: int = setting(0, integer(0, " (0 = linear blocks)"),
                              "the most rows of a draft tree, the anchor included (0: linear blocks; 2..257, at most "
                              "n_batch); adaptive, the controller chooses blocks or trees per cycle from the measured "
                              "costs, a fixed block verifies trees of this many rows; the target's KV cache is then "
                              "unified, one sequence per leaf; lookup's trees (continuations that part) have the rows of its block",
                              parse=int)

    # one target context for several Sessions (a server's slots): concurrent generations decode in one batch (issue 37)
    sequences: int = setting(1, integer(1),
                             "sequences sharing one target context: Session.fork() hands out the others, and the "
                             "decodes of generations running at once go out as one batch (1: a context of its own)",
                             parse=int)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.sequences > LLAMA_MAX_SEQ:
            raise SettingError("sequences", f"must be at most {LLAMA_MAX_SEQ} (libllama's LLAMA_MAX_SEQ), "
                               f"got {self.sequences}")
        if self.sequences > 1 and self.tree_nodes:
            raise SettingError("tree_nodes", "a draft tree's branches are sequences of the target context: it "
                               f"cannot also be shared by {self.sequences} sequences; set tree_nodes 0 or sequences 1")
        if self.rpc_servers and self.n_gpu_layers == 0:  # only offloaded layers go to a device, remote or not
            raise SettingError("rpc_servers", "needs n_gpu_layers -1 (all) or how many layers the devices take; "
                               "with 0 no layer reaches the RPC servers")
        if self.tree_nodes and not 2 <= self.tree_nodes <= min(self.n_batch, LLAMA_MAX_SEQ + 1):
            raise SettingError("tree_nodes", f"must be 0 or in [2, {min(self.n_batch, LLAMA_MAX_SEQ + 1)}] "
                               f"(n_batch, and one sequence per leaf), got {self.tree_nodes}")
        if not self.flash_attn:  # libllama reads a V cache transposed without it, which quantized blocks cannot be
            for name in ("type_v", "type_v_draft"):
                if getattr(self, name) in QUANTIZED_KV_TYPES:
                    raise SettingError(name, f"a quantized V cache ({getattr(self, name)}) needs flash_attn=True")

    @classmethod
    def build(cls, base: SessionOptions | None = None, /, **settings: Any) -> SessionOptions:
        """`base` (or the defaults) with `settings` applied; an unknown name is a TypeError."""
        return _build(cls, base, settings, "Session")


def _size(value: Any) -> int:
    """A byte count: an integer >= 0, or a size such as 512MiB / 2GiB."""
    if isinstance(value, str):
        return parse_size(value)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"must be a size such as 512MiB or 2GiB, or an integer >= 0, got {value!r}")
    return value


def _directory(value: Any) -> Path | None:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not str(value):
        raise TypeError(f"must be None or a directory path, got {value!r}")
    path = Path(value)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    return path


@dataclass(frozen=True)
class CacheOptions:
    """The prompt cache a command opens (llama-server's --cache-ram; a disk tier that survives a restart):
    dflash-serve shares one between its slots, dflash-chat gives one to its Session."""

    cache_ram: int = setting(0, _size, "RAM for the prompt cache, e.g. 2GiB (0: no RAM tier)", parse=str)
    cache_dir: Path | None = setting(None, _directory, "directory of the prompt cache's disk tier (kept across "
                                     "restarts; default: none)", parse=str)
    cache_disk: int = setting(DEFAULT_DISK_BYTES, _size, "disk budget of --cache-dir, e.g. 20GiB (default: 8GiB)",
                              parse=str)

    def __post_init__(self) -> None:
        _check_fields(self)

    @property
    def enabled(self) -> bool:
        return self.cache_ram > 0 or self.cache_dir is not None

    def open(self) -> PromptCache | None:
        """The PromptCache these settings make (None: no tier asked for); built where the Session runs."""
        return PromptCache(self.cache_ram, self.cache_dir, self.cache_disk) if self.enabled else None


# the prompt cache's flags: every command that keeps prompts across generations takes them
PROMPT_CACHE_SETTINGS = ("cache_ram", "cache_dir", "cache_disk")


# -- command lines ------------------------------------------------------------------------------
def _field(cls: type, name: str) -> Field:
    return next(f for f in fields(cls) if f.name == name)


def flag(cls: type, name: str) -> str:
    """The command-line flag of a setting: its first spelling."""
    return (_field(cls, name).metadata["flags"] or (f"--{name.replace('_', '-')}",))[0]


def add_arguments(parser: argparse.ArgumentParser, cls: type, names: Sequence[str], **defaults: Any) -> None:
    """Add the flags of these settings of `cls`; `defaults` overrides a field's default for this command."""
    for name in names:
        f = _field(cls, name)
        meta = f.metadata
        if meta["parse"] is None:
            raise ValueError(f"{cls.__name__}.{name} has no command-line form")
        default = defaults.get(name, f.default)
        spell = meta["flags"] or (flag(cls, name),)
        help_text = meta["help"] + ("" if default is None or "default" in meta["help"] else " (default: %(default)s)")
        if meta["parse"] is bool:
            parser.add_argument(*spell, dest=name, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            parser.add_argument(*spell, dest=name, type=meta["parse"], default=default, help=help_text)


def from_arguments(parser: argparse.ArgumentParser, cls: type[T], args: argparse.Namespace, names: Sequence[str],
                   **extra: Any) -> T:
    """The config these parsed flags (and `extra` settings) make; a bad value is parser.error naming the flag."""
    try:
        return cls(**{name: getattr(args, name) for name in names}, **extra)
    except SettingError as e:
        where = f"argument {flag(cls, e.field)}" if e.field in names else e.field
        parser.error(f"{where}: {e.problem}")
        raise  # parser.error exits; this keeps type checkers sure nothing is returned
