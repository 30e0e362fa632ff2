"""Value checks shared by every setting, and the error that names the setting it is about.

A check takes a value and returns it (normalised where that is natural: a stop string becomes a tuple),
or raises ValueError / TypeError saying what is wrong without naming the setting; the config classes
(config.py) and SamplingParams add the name. Callers catch one `SettingError` and read `.field`.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Callable, Sequence

import numpy as np

Check = Callable[[Any], Any]


class SettingError(ValueError):
    """A bad setting, named: str(e) is "temperature: must be a finite number >= 0 (0 = greedy), got -1"."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class SettingTypeError(SettingError, TypeError):
    """A setting of the wrong type (also a TypeError, as Python's own argument errors are)."""


def checked(field: str, check: Check, value: Any) -> Any:
    """check(value), its ValueError or TypeError re-raised as a SettingError naming `field`."""
    try:
        return check(value)
    except SettingError:
        raise
    except TypeError as e:
        raise SettingTypeError(field, str(e)) from None
    except ValueError as e:
        raise SettingError(field, str(e)) from None


def is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def is_integer(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def integer(minimum: int, note: str = "") -> Check:
    """An integer >= minimum (a bool is not an integer here)."""
    def check(value: Any) -> int:
        if not is_integer(value) or value < minimum:
            raise ValueError(f"must be an integer >= {minimum}{note}, got {value!r}")
        return int(value)

    return check


def real(low: float, high: float = math.inf, *, low_open: bool = False, note: str = "") -> Check:
    """A finite number in [low, high] ((low, high] with low_open)."""
    def check(value: Any) -> float:
        ok = is_real(value) and math.isfinite(value) and (low < value if low_open else low <= value) and value <= high
        if not ok:
            span = (f"in {'(' if low_open else '['}{low:g}, {high:g}]" if math.isfinite(high)
                    else f"{'>' if low_open else '>='} {low:g}")
            raise ValueError(f"must be a finite number {span}{note}, got {value!r}")
        return float(value)

    return check


def optional(check: Check, meaning: str) -> Check:
    """None (which means `meaning`) or a value that passes `check`."""
    def check_optional(value: Any) -> Any:
        if value is None:
            return None
        try:
            return check(value)
        except ValueError as e:
            raise ValueError(f"must be None ({meaning}) or {str(e).removeprefix('must be ')}") from None

    return check_optional


def boolean(value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"must be True or False, got {value!r}")
    return bool(value)


def optional_boolean(meaning: str) -> Check:
    def check(value: Any) -> bool | None:
        if value is not None and not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"must be None ({meaning}), True or False, got {value!r}")
        return None if value is None else bool(value)

    return check


def strings(value: Any) -> tuple[str, ...]:
    """None, one string or a list/tuple of strings, as a tuple of non-empty strings."""
    if value is None:
        return ()
    items: Sequence[Any] = (value,) if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(s, str) for s in items):
        raise TypeError(f"must be a string or a list of strings, got {value!r}")
    if not all(items):
        raise ValueError(f"must be non-empty strings, got {value!r}")
    return tuple(items)


def nesting_depth(value: Any) -> int:
    """How deep dicts and lists nest in `value` (a scalar: 0), counted without recursion: a request may nest
    deeper than Python's recursion allows."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, (list, tuple)) else None
        if items is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((item, depth + 1) for item in items)
    return deepest
