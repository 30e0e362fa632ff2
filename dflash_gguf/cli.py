"""`dflash-generate`: one generation from the command line, optionally against plain decoding.

The text streams to stdout as cycles commit; the figures (τ, tokens/s and, with --compare, the
speedup over plain decoding of the same target measured in the same run, by dflash_gguf.stats'
one definition: loop tok/s over loop tok/s) go to stderr.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

from .cli_parser import EXIT_BAD_INPUT, OneLineParser
from .config import KV_CACHE_SETTINGS, GenerationConfig, SessionOptions, add_arguments, from_arguments
from .steps import Step
from .session import Session
from .stats import GenerationStats, generation_speedup


GENERATION = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "seed", "block_size")
SESSION = ("n_ctx", "n_gpu_layers", "n_gpu_layers_draft", "n_threads", "lookup", "recalibrate", *KV_CACHE_SETTINGS,
           "rpc_servers")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dflash-generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt", help="the user message (or the raw prompt with --raw); '-' reads stdin")
    p.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help="dflash drafter GGUF (default: the one shipped for the embedded target)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", help="system message for the chat template")
    add_arguments(p, GenerationConfig, GENERATION, max_tokens=256)
    add_arguments(p, SessionOptions, SESSION)
    p.add_argument("--compare", action="store_true", help="then decode the same prompt plainly and report the speedup")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[GenerationConfig, SessionOptions]:
    """Refuse what would otherwise fail deep inside the Session, in one line; the settings the flags make."""
    if a.drafter is not None and a.target is None:
        p.error("--drafter needs --target: the embedded drafter belongs to the embedded target")
    for flag, path in (("--target", a.target), ("--drafter", a.drafter)):
        if path is not None and not path.is_file():
            p.error(f"{flag} {path}: no such file")
    if a.raw and a.system:
        p.error("--system has no place in a --raw prompt")
    return from_arguments(p, GenerationConfig, a, GENERATION), from_arguments(p, SessionOptions, a, SESSION)


def _steps(session: Session, a: argparse.Namespace, prompt: str, config: GenerationConfig) -> Iterator[Step]:
    if a.raw:
        return session.stream(prompt, config)
    messages = ([{"role": "system", "content": a.system}] if a.system else []) + [{"role": "user", "content": prompt}]
    return session.stream_chat(messages, config)


def _run(
    session: Session, a: argparse.Namespace, prompt: str, config: GenerationConfig, *, echo: bool
) -> tuple[list[int], GenerationStats]:
    """One generation; prints its summary line to stderr and returns its tokens and stats."""
    tokens: list[int] = []
    for step in _steps(session, a, prompt, config):
        tokens += step.tokens
        if echo:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    if echo:
        sys.stdout.write("\n")
        sys.stdout.flush()
    stats = session.last_stats
    mode = f"dflash: τ {stats.acceptance_length:.2f} over {stats.cycles} cycles" if stats.speculative else "plain"
    loop = f"{stats.loop_tokens_per_s:.1f}" if stats.loop_tokens_per_s else "—"
    print(f"{mode}, {len(tokens)} tokens, {stats.decode_tokens_per_s:.1f} tok/s decode, {loop} tok/s in the loop "
          f"({step.finish_reason})", file=sys.stderr)
    return tokens, stats


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    config, options = _check_args(p, a)
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    try:
        with Session(a.target, a.drafter, options) as session:
            tokens, fast = _run(session, a, prompt, config, echo=True)
            if a.compare:
                session.reset()  # the same cold start as the first run: same prompt split, same kernels
                plain_tokens, slow = _run(session, a, prompt, replace(config, speculative=False), echo=False)
                same = "identical" if tokens == plain_tokens else "different (see README: batched kernels)"
                ratio = generation_speedup(fast, slow)
                figure = "not measured (no decoding cycle)" if ratio is None else f"{ratio:.2f}x"
                print(f"speedup {figure} over plain decoding of the same target, measured now (loop tok/s); "
                      f"outputs {same}", file=sys.stderr)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"dflash-generate: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
