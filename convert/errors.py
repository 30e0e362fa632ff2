"""The converter's one error type."""

from __future__ import annotations


class ConversionError(ValueError):
    """Bad input: its message is one line naming the problem and the file."""
