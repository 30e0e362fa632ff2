"""dflash-bench: plain decoding against DFlash on this machine, or (--kernels) target batch costs per quantization.

Bad input ends in one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from dflash_gguf.cli_parser import EXIT_BAD_INPUT, OneLineParser, positive_int
from dflash_gguf.config import KV_CACHE_SETTINGS, GenerationConfig, SessionOptions, add_arguments, from_arguments

from .peers import PEERS
from .runner import ALL_MODES


GENERATION = ("max_tokens", "block_size", "forced_drafts")  # greedy always: outputs are compared token for token
SESSION = ("n_ctx", "n_gpu_layers", "n_gpu_layers_draft", "n_threads", "recalibrate", *KV_CACHE_SETTINGS,
           "rpc_servers")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog="dflash-bench",
        description="Benchmark DFlash speculative decoding against plain decoding on the same target and prompts.",
    )
    p.add_argument("--prompts", type=Path, help="prompts JSONL ({id, category, prompt}); default: the built-in suite")
    p.add_argument("--categories", nargs="+", default=[], help="only these categories")
    p.add_argument("--limit", type=positive_int, help="at most N prompts per category")
    p.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--drafter", type=Path,
                   help="dflash drafter GGUF (default: the shipped drafter; not MTP heads); with --kernels, also time its passes")
    add_arguments(p, GenerationConfig, GENERATION, max_tokens=128)
    add_arguments(p, SessionOptions, SESSION, n_ctx=2048)
    p.add_argument("--repeats", type=positive_int, default=2,
                   help="timed runs per mode and prompt, interleaved (default 2)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    p.add_argument("--modes", nargs="+", default=["plain", "dflash"], choices=list(ALL_MODES),
                   help="decoding modes, interleaved per prompt (default: plain dflash); lookup = n-gram lookup drafts "
                        "only, both = lookup and DFlash in one loop, mtp = the target's own MTP heads only (a target "
                        "that ships them), tree = DFlash whose cycles may verify draft trees; dflash, lookup, both "
                        "and tree never load the heads")
    p.add_argument("--tree-nodes", type=positive_int, default=16,
                   help="the tree mode's trees: up to N rows, the anchor included (default 16); adaptive, the controller "
                        "chooses blocks or trees per cycle, with --block-size every drafting cycle verifies N rows")
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="output directory (default ./bench-results)")
    p.add_argument("--name", default="dflash-bench", help="base name of the output files (default dflash-bench)")
    p.add_argument("--peers", nargs="*", default=[], choices=list(PEERS),
                   help="peers to run on the same prompts")
    p.add_argument("--llama-server", type=Path, help="upstream llama-server binary (run with --spec-type draft-dflash)")
    p.add_argument("--reference-drafter", type=Path,
                   help="z-lab checkpoint directory of the drafter, for the reference peer's τ")
    p.add_argument("--kernels", action="store_true",
                   help="instead: time target batches of 1..16 tokens for the target and its Q4_0/Q8_0 requantizations")
    p.add_argument("--requant-dir", type=Path, help="with --kernels: keep requantized files here (default: a temp dir)")
    p.add_argument("--no-flash-attn", action="store_true",
                   help="with --kernels: measure with flash attention off (the Session turns it on)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.generation = from_arguments(parser, GenerationConfig, args, GENERATION)
    args.session = from_arguments(parser, SessionOptions, args, SESSION)
    try:
        if args.kernels:
            return _kernels(args)
        return _bench(args)
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"dflash-bench: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("dflash-bench: interrupted", file=sys.stderr)
        return 130


def _check_out(args: argparse.Namespace) -> Path:
    out = args.out
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out}: output path exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _kernels(args: argparse.Namespace) -> int:
    from dflash_gguf.convert.writer import atomic_output
    from dflash_gguf.defaults import embedded_target

    from . import kernels

    source = args.target or embedded_target()
    out = _check_out(args)
    threads = args.n_threads or 2
    if args.requant_dir is not None and not args.requant_dir.is_dir():
        raise ValueError(f"{args.requant_dir}: --requant-dir must be an existing directory")
    with tempfile.TemporaryDirectory(prefix="dflash-requant-") as tmp:
        workdir = Path(tmp) if args.requant_dir is None else args.requant_dir
        variants = kernels.prepare_variants(source, workdir, n_threads=threads)
        report = kernels.measure(
            variants, repeats=args.repeats, n_threads=threads, flash_attn=not args.no_flash_attn, drafter=args.drafter
        )
    table = kernels.to_markdown(report)
    with atomic_output(out / f"{args.name}-kernels.json", force=True) as tmp:
        tmp.write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    with atomic_output(out / f"{args.name}-kernels.md", force=True) as tmp:
        tmp.write_text(table, encoding="utf-8")
    print(table, end="")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from . import report
    from ..mtp import is_heads_file
    from .runner import BenchConfig, run_benchmark
    from .suite import load_suite

    prompts = load_suite(args.prompts, categories=args.categories, limit=args.limit)
    if args.llama_server is not None and "llama-server" not in args.peers:
        args.peers.append("llama-server")
    if "llama-server" in args.peers and args.llama_server is None:
        raise ValueError("the llama-server peer needs --llama-server PATH (an upstream llama-server binary)")
    if args.llama_server is not None and not args.llama_server.is_file():
        raise ValueError(f"{args.llama_server}: --llama-server is not a file")
    if args.drafter is not None and is_heads_file(args.drafter):
        raise ValueError(f"--drafter {args.drafter} holds MTP heads: dflash-bench times a DFlash drafter against plain "
                         "decoding (--modes mtp times the target's own heads)")
    out = _check_out(args)
    config = BenchConfig(
        prompts=prompts,
        target=args.target,
        drafter=args.drafter,
        generation=args.generation,
        session=args.session,
        repeats=args.repeats,
        warmup=not args.no_warmup,
        peers=tuple(args.peers),
        llama_server=args.llama_server,
        reference_drafter=args.reference_drafter,
        modes=tuple(dict.fromkeys(["plain"] + list(args.modes))),
        tree_nodes=args.tree_nodes,
    )
    result = run_benchmark(config, progress=lambda line: print(line, file=sys.stderr))
    paths = [
        report.write_json(result, out / f"{args.name}.json"),
        report.write_markdown(result, out / f"{args.name}.md"),
        report.write_plot(result, out / f"{args.name}.png"),
    ]
    print(report.to_markdown(result), end="")
    if set(config.modes) - {"plain", "dflash"}:
        print(report.modes_markdown(result), end="")
    print("wrote " + ", ".join(str(p) for p in paths), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
