"""Strict reading of numbers from user files (schedule JSON, MSCCL XML, topology JSON).

Python's own conversions are generous: ``int("1_0") == 10``, ``int("١٠") == 10``
(Arabic-Indic digits), ``int(8.7) == 8``, ``True == 1``, ``float("inf")``. A
file that says any of those is malformed, and these helpers say so with the
caller's error type and a message naming the field.

Example:
    >>> from jaxccl.errors import ScheduleError
    >>> integer(8, "num_ranks", ScheduleError)
    8
    >>> integer(True, "num_ranks", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: num_ranks must be an integer, got True
    >>> integer_text("1_0", "cnt", ScheduleError)
    Traceback (most recent call last):
    ...
    jaxccl.errors.ScheduleError: cnt must be an integer written in ASCII digits, got '1_0'
    >>> real(400e9, "algbw", ScheduleError, positive=True)
    400000000000.0
"""

from __future__ import annotations

import math
import numbers
import re
from typing import Any

__all__ = ["integer", "integer_text", "real", "real_text"]

_INTEGER = re.compile(r"[+-]?[0-9]+")
_REAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def integer(value: Any, what: str, error: type[Exception], *, minimum: int | None = None) -> int:
    """``value`` if it is an integer (not a bool, not a float), else ``error`` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise error(f"{what} must be an integer, got {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise error(f"{what} must be >= {minimum}, got {value}")
    return value


def integer_text(text: str, what: str, error: type[Exception], *, minimum: int | None = None) -> int:
    """The integer ``text`` spells in ASCII digits (optional sign, surrounding blanks allowed)."""
    stripped = text.strip(" \t\r\n")
    if not _INTEGER.fullmatch(stripped):
        raise error(f"{what} must be an integer written in ASCII digits, got {text!r}")
    return integer(int(stripped), what, error, minimum=minimum)


def real(value: Any, what: str, error: type[Exception], *, positive: bool = False) -> float:
    """``value`` as a finite float (an int or float, not a bool); ``positive`` also requires > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{what} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise error(f"{what} must be finite, got {value!r}")
    if positive and not value > 0:
        raise error(f"{what} must be positive, got {value!r}")
    return value


def real_text(text: str, what: str, error: type[Exception], *, positive: bool = False) -> float:
    """The finite number ``text`` spells in ASCII (decimal or exponent notation)."""
    stripped = text.strip(" \t\r\n")
    if not _REAL.fullmatch(stripped):
        raise error(f"{what} must be a number written in ASCII, got {text!r}")
    return real(float(stripped), what, error, positive=positive)
