"""`dflash-generate`: one generation from the command line, optionally against plain decoding.

The text streams to stdout as cycles commit; the figures (τ, tokens/s and, with --compare, the
speedup over plain decoding of the same target, by dflash_gguf.stats' one definition: loop tok/s over
loop tok/s) go to stderr. --compare runs the two in lockstep, as dflash-bench does (dflash_gguf.lockstep:
one cycle each in turn, plain on a fork of the Session), several times, and prints the median ratio with
its range: one pair run one after the other spread 0.75-1.50x on a shared CPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Iterator, Sequence

from .cli_parser import DRAFTER_HELP, EXIT_BAD_INPUT, OneLineParser, positive_int
from .config import KV_CACHE_SETTINGS, GenerationConfig, SessionOptions, add_arguments, from_arguments
from .lockstep import lockstep, order
from .steps import Step
from .session import Session
from .stats import GenerationStats, generation_speedup


GENERATION = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "repeat_last_n", "presence_penalty",
              "frequency_penalty", "seed", "block_size")
COMPARE_RUNS = 3
SESSION = ("n_ctx", "n_gpu_layers", "n_gpu_layers_draft", "n_threads", "lookup", "mtp", "recalibrate", *KV_CACHE_SETTINGS,
           "rpc_servers")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="dflash-generate", description=__doc__.splitlines()[0])
    p.add_argument("prompt", help="the user message (or the raw prompt with --raw); '-' reads stdin")
    p.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help=DRAFTER_HELP)
    p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    p.add_argument("--system", help="system message for the chat template")
    add_arguments(p, GenerationConfig, GENERATION, max_tokens=256)
    add_arguments(p, SessionOptions, SESSION)
    p.add_argument("--compare", action="store_true",
                   help="also decode the same prompt plainly, in lockstep, and report the speedup")
    p.add_argument("--compare-runs", type=positive_int, default=COMPARE_RUNS, metavar="N",
                   help=f"pairs of runs --compare times (default {COMPARE_RUNS}): the median and the range are shown")
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


def _echo(step: Step) -> None:
    sys.stdout.write(step.text)
    sys.stdout.flush()


def _summary(tokens: list[int], stats: GenerationStats, finish: str | None) -> None:
    """One generation's summary line, to stderr."""
    mode = f"dflash: τ {stats.acceptance_length:.2f} over {stats.cycles} cycles" if stats.speculative else "plain"
    loop = f"{stats.loop_tokens_per_s:.1f}" if stats.loop_tokens_per_s else "—"
    print(f"{mode}, {len(tokens)} tokens, {stats.decode_tokens_per_s:.1f} tok/s decode, {loop} tok/s in the loop "
          f"({finish})", file=sys.stderr)


def _run(session: Session, a: argparse.Namespace, prompt: str, config: GenerationConfig) -> None:
    """One generation, streamed to stdout, and its summary line."""
    tokens: list[int] = []
    step = None
    for step in _steps(session, a, prompt, config):
        tokens += step.tokens
        _echo(step)
    sys.stdout.write("\n")
    _summary(tokens, session.last_stats, step.finish_reason if step else None)


def compare(session: Session, a: argparse.Namespace, prompt: str, config: GenerationConfig,
            runs: int) -> list[float | None]:
    """`runs` pairs, DFlash on `session` and plain decoding on a fork of it, each pair in lockstep from a
    cold cache, the turn order alternating; the first pair's DFlash text is streamed, both its summaries
    printed. Returns each pair's speedup (stats.generation_speedup; None: no decoding cycle)."""
    ratios: list[float | None] = []
    with session.fork() as plain:
        sessions = {"dflash": session, "plain": plain}
        configs = {"dflash": config, "plain": replace(config, speculative=False)}
        for r in range(runs):
            streams = {}
            for name in order(("dflash", "plain"), r):
                sessions[name].reset()  # the same cold start for both: same prompt split, same kernels
                streams[name] = iter(_steps(sessions[name], a, prompt, configs[name]))
            echo = (lambda name, step: _echo(step) if name == "dflash" else None) if r == 0 else None
            done = lockstep(streams, echo)
            stats = {name: sessions[name].last_stats for name in sessions}
            if r == 0:
                sys.stdout.write("\n")
                for name in ("dflash", "plain"):
                    _summary(done[name].tokens, stats[name], done[name].steps[-1].finish_reason)
                same = done["dflash"].tokens == done["plain"].tokens
            ratios.append(generation_speedup(stats["dflash"], stats["plain"]))
    measured = [x for x in ratios if x is not None]
    if len(measured) < len(ratios):
        line = "speedup not measured (no decoding cycle)"
    else:
        how = "one pair run in lockstep" if runs == 1 else \
            f"the median of {runs} pairs run in lockstep, {min(measured):.2f}-{max(measured):.2f}x"
        line = (f"speedup {statistics.median(measured):.2f}x over plain decoding of the same target "
                f"({how}; loop tok/s, measured now)")
    print(f"{line}; outputs {'identical' if same else 'different (see README: batched kernels)'}", file=sys.stderr)
    return ratios


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    config, options = _check_args(p, a)
    prompt = sys.stdin.read() if a.prompt == "-" else a.prompt
    try:
        with Session(a.target, a.drafter, options) as session:
            if a.compare:
                compare(session, a, prompt, config, a.compare_runs)
            else:
                _run(session, a, prompt, config)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        print(f"dflash-generate: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
