"""`dflash-chat`: parse and check every flag and open both models before the UI takes the terminal.

A bad flag or a bad file is a one-line error and exit status 2, printed to a normal terminal; once the
Session is open the Textual app starts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

from dflash_gguf.cli_parser import DRAFTER_HELP, EXIT_BAD_INPUT, OneLineParser
from dflash_gguf.config import (KV_CACHE_SETTINGS, PROMPT_CACHE_SETTINGS, CacheOptions, GenerationConfig, SessionOptions,
                                add_arguments, flag, from_arguments)
from dflash_gguf.tui.options import CHAT_GENERATION, ChatOptions

PROG = "dflash-chat"
# below this the chat template and a short prompt no longer fit
MIN_N_CTX = 64
WORKERS = ("process", "thread")
GENERATION = ("block_size", "temperature", "top_p", "top_k", "seed", "max_tokens")
SESSION = ("n_gpu_layers", "n_gpu_layers_draft", "n_ctx", "n_threads", "lookup", "mtp", "recalibrate", *KV_CACHE_SETTINGS,
           "rpc_servers")
# chosen by measurement: docs/TUI.md, "What the UI costs the decoder"
DEFAULT_WORKER = "process"


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog=PROG,
        description="Chat with a GGUF model through DFlash speculative decoding and watch it work.",
    )
    parser.add_argument("--target", type=Path, help="target model GGUF (default: the embedded SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", type=Path, help=DRAFTER_HELP)
    add_arguments(parser, SessionOptions, SESSION)
    add_arguments(parser, GenerationConfig, GENERATION, max_tokens=CHAT_GENERATION.max_tokens)
    add_arguments(parser, CacheOptions, PROMPT_CACHE_SETTINGS)  # a reply's prompt state, kept for the next chat
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--tools", type=Path, default=None,
                        help="a JSON file with a list of OpenAI-shaped function tools the model may call; each call is "
                             "shown as a call, and the next line you send is its result")
    parser.add_argument("--tool-choice", choices=("auto", "required", "none"), default="auto",
                        help="whether the model may (auto), must (required) or must not (none) call a tool")
    parser.add_argument("--worker", choices=WORKERS, default=DEFAULT_WORKER,
                        help=f"where the Session runs: its own process, or a thread of the UI's (default: {DEFAULT_WORKER})")
    return parser


def _check_file(parser: OneLineParser, flag: str, path: Path | None) -> None:
    if path is not None and not path.is_file():
        parser.error(f"{flag} {path}: no such file")


def parse_options(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, ChatOptions]:
    """Parse and validate the command line; exits with status 2 and one line on any bad value."""
    parser = build_parser()
    args = parser.parse_args(argv)
    generation = from_arguments(parser, GenerationConfig, args, GENERATION)
    args.session = from_arguments(parser, SessionOptions, args, SESSION)
    args.cache = from_arguments(parser, CacheOptions, args, PROMPT_CACHE_SETTINGS)
    if args.n_ctx < MIN_N_CTX:
        parser.error(f"argument {flag(SessionOptions, 'n_ctx')}: must be >= {MIN_N_CTX} for a chat, got {args.n_ctx}")
    _check_file(parser, "--target", args.target)
    _check_file(parser, "--drafter", args.drafter)
    _check_file(parser, "--tools", args.tools)
    tools: list = []
    if args.tools is not None:
        try:
            tools = json.loads(args.tools.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            parser.error(f"--tools {args.tools}: not a JSON file ({e})")
        if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
            parser.error(f"--tools {args.tools}: must hold a JSON list of tools")
    return args, ChatOptions(generation=generation, system=args.system, tools=tuple(tools), tool_choice=args.tool_choice)


def _fail(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def _open_worker(args: argparse.Namespace):
    """The reply worker with its Session open, so a bad file fails before the UI takes the terminal."""
    from dflash_gguf.tui.process_worker import ProcessWorker, SessionSpec

    spec = SessionSpec(args.target, args.drafter, args.session, args.cache)
    if args.worker == "process":
        return ProcessWorker(spec), None
    from dflash_gguf.tui.worker import ThreadWorker

    session = spec.open()
    return ThreadWorker(session), session


def main(argv: Sequence[str] | None = None) -> int:
    args, options = parse_options(argv)
    print(f"{PROG}: loading models…", file=sys.stderr, flush=True)
    try:
        worker, session = _open_worker(args)
    except (ValueError, OSError, RuntimeError) as error:  # files that are not a usable target/drafter pair
        lines = str(error).strip().splitlines()
        return _fail(lines[0] if lines else type(error).__name__)
    try:
        info = worker.info
        if not info.sources():
            print(f"{PROG}: no drafter and no lookup, every reply is plain decoding (--drafter FILE adds one)",
                  file=sys.stderr)
        elif info.drafter_kind is None:
            only = " and ".join(["n-gram lookup"] * info.lookup + ["the target's MTP heads"] * info.mtp)
            print(f"{PROG}: no drafter: replies speculate with {only} only (--drafter FILE adds one)", file=sys.stderr)
        if args.block_size is not None and info.drafter_block_size is not None and args.block_size > info.drafter_block_size:
            return _fail(f"argument --block-size: {args.block_size} exceeds the drafter's block size {info.drafter_block_size}")
        if options.tools:
            from dflash_gguf.chat.tool_calls import ToolError, plan_tools

            try:  # against the model's template: a template without tool support is one line here
                plan_tools(info.chat_template, list(options.tools), options.tool_choice)
            except ToolError as e:
                return _fail(f"--tools {args.tools}: {e}")
        # imported late: `--help` and flag errors stay instant
        from dflash_gguf.tui.app import ChatApp

        ChatApp(worker, options).run()
    finally:
        worker.close()
        if session is not None:
            session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
