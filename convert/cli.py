"""`dflash-convert`: the command line. Bad input is one line on stderr and exit code 2."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

from dflash_gguf.cli_parser import EXIT_BAD_INPUT, OneLineParser
from dflash_gguf.convert.converter import convert_checkpoint
from dflash_gguf.convert.errors import ConversionError
from dflash_gguf.convert.info import drafter_info, format_info
from dflash_gguf.convert.safetensors_reader import check_regular_file
from dflash_gguf.convert.writer import OUTTYPES

PROG = "dflash-convert"


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(
        prog=PROG,
        description="Convert a DFlash / DFlash2 / DSpark safetensors checkpoint into a `dflash` GGUF drafter.",
        epilog="SRC may be model.safetensors (config.json beside it), a model.safetensors.index.json, or the checkpoint directory.",
    )
    p.add_argument("src", nargs="?", type=Path, metavar="SRC", help="checkpoint: .safetensors file, shard index or directory")
    p.add_argument("out", nargs="?", type=Path, metavar="OUT", help="output .gguf")
    p.add_argument("--target", type=Path, metavar="TARGET.gguf",
                   help="the target model GGUF: its tokenizer is copied in and the pair is validated")
    p.add_argument("--outtype", choices=list(OUTTYPES), help="tensor type of the matrices (default: keep the checkpoint's)")
    p.add_argument("--name", help="general.name of the drafter GGUF (default: OUT's file name without .gguf)")
    p.add_argument("--force", action="store_true", help="overwrite OUT if it exists")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (none is drawn when stderr is not a terminal)")
    p.add_argument("--info", type=Path, metavar="FILE.gguf", help="print what a drafter GGUF holds, and exit")
    return p


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return code


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived: unwinds like KeyboardInterrupt, so the temp file is removed on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_CLEANUP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextmanager
def _signals_unwind() -> Iterator[None]:
    """SIGTERM / SIGHUP raise Terminated once (later ones are ignored, so the clean-up itself is not cut short)."""

    def handler(signum: int, frame: object) -> None:
        for s in _CLEANUP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)
        raise Terminated(signum)

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread; an embedding program owns them there
        return
    previous = {s: signal.signal(s, handler) for s in _CLEANUP_SIGNALS}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _one_line(message: str) -> str:
    return " ".join(message.split("\n"))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code: 0 ok, 2 any failure (bad input, write failure),
    130 on SIGINT, 128 + signal on SIGTERM / SIGHUP; never a traceback, never a half-written OUT."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.info is not None:
        if args.src is not None or args.target is not None or args.outtype is not None or args.name is not None:
            parser.error("--info takes only the GGUF to inspect")
        try:
            check_regular_file(args.info, "drafter GGUF")
            print(format_info(drafter_info(args.info)))
        except ConversionError as e:
            return _fail(_one_line(str(e)))
        return 0
    if args.src is None or args.out is None:
        parser.error("SRC and OUT are required (or --info FILE.gguf)")
    try:
        with _signals_unwind():
            if args.target is not None:
                check_regular_file(args.target, "target GGUF")
            out = convert_checkpoint(
                args.src, args.out, target=args.target, outtype=args.outtype, name=args.name,
                force=args.force, progress=not args.no_progress and sys.stderr.isatty(),
            )
    except ConversionError as e:
        return _fail(_one_line(str(e)))
    except KeyboardInterrupt:
        return _fail("interrupted; no output written", 130)
    except Terminated as e:
        return _fail(f"terminated by {signal.Signals(e.signum).name}; no output written", 128 + e.signum)
    except OSError as e:
        return _fail(f"{args.out}: write failed ({e.strerror or e}); no output written")
    except (RecursionError, MemoryError) as e:
        return _fail(f"{args.src}: input too deeply nested or too large ({type(e).__name__}); no output written")
    print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    if args.target is None:
        print(
            f"note: {out} carries no tokenizer: dflash-gguf runs it given its target; for llama-server "
            f"--spec-type draft-dflash, reconvert with --target TARGET.gguf (the target model's GGUF)",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
