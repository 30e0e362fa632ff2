"""The argument parser every dflash-* command uses: a usage error is one line, like every other bad input."""

from __future__ import annotations

import argparse
from typing import NoReturn

EXIT_BAD_INPUT = 2
# --drafter's help in every command: a file told apart by its header (mtp.is_heads_file), not its name
DRAFTER_HELP = ("dflash drafter GGUF, or MTP heads shipped apart from the target (upstream's mtp-*.gguf, gemma4's "
                "assistant), which then draft instead of the target's own (default: the one shipped for the embedded target)")


class OneLineParser(argparse.ArgumentParser):
    """argparse without the usage block on errors: `prog: error: message (see --help)`, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see --help)\n")


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
