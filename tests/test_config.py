"""GenerationConfig and SessionOptions: every setting once, checked with its name, and the CLIs' flags made from it."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import pytest

from dflash_gguf.checks import SettingError, integer
from dflash_gguf.cli_parser import OneLineParser
from dflash_gguf.config import (
    LLAMA_CHAT_DEFAULTS, GenerationConfig, SessionOptions, add_arguments, from_arguments, setting,
)
from dflash_gguf.sampling import SamplingParams


@pytest.mark.parametrize("cls", [GenerationConfig, SessionOptions])
def test_the_defaults_pass_their_own_checks(cls):
    config = cls()
    assert all(getattr(config, f.name) == f.default for f in fields(cls))


@pytest.mark.parametrize(
    "kwargs, field, error",
    [
        (dict(temperature=-1), "temperature", ValueError),
        (dict(temperature=float("inf")), "temperature", ValueError),
        (dict(top_p=0.0), "top_p", ValueError),
        (dict(top_k=1.5), "top_k", ValueError),
        (dict(seed=-1), "seed", ValueError),
        (dict(max_tokens=0), "max_tokens", ValueError),
        (dict(max_tokens=True), "max_tokens", ValueError),
        (dict(stop=[""]), "stop", ValueError),
        (dict(stop=[1]), "stop", TypeError),
        (dict(speculative="yes"), "speculative", TypeError),
        (dict(block_size=0), "block_size", ValueError),
        (dict(confidence_threshold=1.5), "confidence_threshold", ValueError),
    ],
)
def test_a_bad_generation_setting_is_named(kwargs, field, error):
    with pytest.raises(SettingError) as raised:
        GenerationConfig(**kwargs)
    assert raised.value.field == field and str(raised.value).startswith(f"{field}: ")
    assert isinstance(raised.value, error)


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(n_ctx=4), "n_ctx"), (dict(n_gpu_layers=-2), "n_gpu_layers"), (dict(n_threads=0), "n_threads"),
     (dict(lookup="on"), "lookup"), (dict(wait=None), "wait"), (dict(n_rs_seq=-1), "n_rs_seq")],
)
def test_a_bad_session_option_is_named(kwargs, field):
    with pytest.raises(SettingError) as raised:
        SessionOptions(**kwargs)
    assert raised.value.field == field


def test_values_are_normalised_and_sampling_is_derived():
    config = GenerationConfig(stop="###", temperature=1, seed=7)
    assert config.stop == ("###",) and isinstance(config.temperature, float)
    assert config.sampling == SamplingParams(temperature=1.0, seed=7)
    assert config.with_stops(["</s>", "###"]).stop == ("###", "</s>")


def test_build_applies_settings_over_a_base_and_refuses_unknown_names():
    assert GenerationConfig.build(LLAMA_CHAT_DEFAULTS, temperature=0.0).top_k == LLAMA_CHAT_DEFAULTS.top_k
    with pytest.raises(TypeError, match="unknown generation argument.*max_token"):
        GenerationConfig.build(max_token=4)
    with pytest.raises(TypeError, match="unknown Session argument.*ctx"):
        SessionOptions.build(ctx=4)


def _parse(cls, names, argv, **defaults):
    parser = OneLineParser(prog="t")
    add_arguments(parser, cls, names, **defaults)
    return from_arguments(parser, cls, parser.parse_args(argv), names)


def test_flags_come_from_the_fields():
    config = _parse(GenerationConfig, ("max_tokens", "temperature", "block_size"),
                    ["--temperature", "0.5", "--block-size", "4"], max_tokens=256)
    assert config == GenerationConfig(max_tokens=256, temperature=0.5, block_size=4)
    options = _parse(SessionOptions, ("n_threads", "lookup"), ["--n-threads", "3", "--no-lookup"])
    assert options == SessionOptions(n_threads=3, lookup=False)
    assert _parse(SessionOptions, ("n_threads",), ["--threads", "2"]).n_threads == 2  # both spellings
    assert _parse(SessionOptions, ("n_gpu_layers_draft",), ["-ngld", "0"]).n_gpu_layers_draft == 0  # upstream's


def test_a_bad_flag_value_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as raised:
        _parse(GenerationConfig, ("top_p",), ["--top-p", "1.5"])
    assert raised.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument --top-p: must be a finite number in (0, 1]" in err[0]


def test_a_new_setting_is_one_field():
    """What adding a setting takes: the field, with its check and help; flags, checks and names follow."""

    @dataclass(frozen=True)
    class WithMinTokens(GenerationConfig):
        min_tokens: int = setting(0, integer(0), "tokens before an end-of-generation token may end the reply",
                                  parse=int)

    assert _parse(WithMinTokens, ("min_tokens",), ["--min-tokens", "3"]).min_tokens == 3
    assert WithMinTokens.build(min_tokens=2, temperature=0.3).sampling.temperature == 0.3
    with pytest.raises(SettingError, match="^min_tokens: must be an integer >= 0"):
        WithMinTokens(min_tokens=-1)
    parser = argparse.ArgumentParser()
    add_arguments(parser, WithMinTokens, ("min_tokens",))
    assert "--min-tokens" in parser.format_help()


def test_upstreams_ngl_sets_the_targets_layers_not_the_drafters():
    """`-ngl` was read by argparse as an abbreviation of `-ngld` (the drafter's layers)."""
    import argparse

    from dflash_gguf.config import SessionOptions, add_arguments, from_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser, SessionOptions, ("n_gpu_layers", "n_gpu_layers_draft"))
    options = from_arguments(parser, SessionOptions, parser.parse_args(["-ngl", "-1"]), ("n_gpu_layers", "n_gpu_layers_draft"))
    assert (options.n_gpu_layers, options.n_gpu_layers_draft) == (-1, None)
